//! The settings an embedding reads from its configuration file beside a
//! `PolicyConfig`: by name, with defaults, refusing what they do not know.

use ratewarden_core::{FailurePolicy, KeyHash, MemoryOptions, PolicyConfig, PolicyKind};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    policy: PolicyConfig,
    failure_policy: FailurePolicy,
    key_hash: KeyHash,
    #[serde(default)]
    memory: MemoryOptions,
}

#[test]
fn settings_read_by_their_configuration_names() {
    let text = r#"{
        "policy": {"policy": "gcra", "limit": 10, "window_ms": 1000},
        "failure_policy": "local",
        "key_hash": "xxh3-64",
        "memory": {"max_keys": 5000}
    }"#;
    let s: Settings = serde_json::from_str(text).unwrap();
    assert_eq!(s.policy, PolicyConfig::new(PolicyKind::Gcra, 10, 1000));
    assert_eq!(s.failure_policy, FailurePolicy::Local);
    assert_eq!(s.key_hash, KeyHash::Xxh3_64);
    // A field left out takes its default.
    assert_eq!(
        s.memory,
        MemoryOptions {
            max_keys: 5000,
            ..MemoryOptions::default()
        }
    );
}

#[test]
fn every_name_round_trips_as_display_writes_it() {
    for policy in [
        FailurePolicy::FailOpen,
        FailurePolicy::FailClosed,
        FailurePolicy::Local,
    ] {
        let json = serde_json::to_string(&policy).unwrap();
        assert_eq!(json, format!("\"{policy}\""));
        assert_eq!(
            serde_json::from_str::<FailurePolicy>(&json).unwrap(),
            policy
        );
    }
    for hash in [KeyHash::Mix32, KeyHash::Xxh3_64] {
        let json = serde_json::to_string(&hash).unwrap();
        assert_eq!(json, format!("\"{hash}\""));
        assert_eq!(serde_json::from_str::<KeyHash>(&json).unwrap(), hash);
    }
    let options = MemoryOptions {
        max_keys: 7,
        shards: 2,
    };
    let json = serde_json::to_string(&options).unwrap();
    assert_eq!(json, r#"{"max_keys":7,"shards":2}"#);
    assert_eq!(
        serde_json::from_str::<MemoryOptions>(&json).unwrap(),
        options
    );
}

#[test]
fn unknown_names_and_fields_are_refused_naming_the_choices() {
    let e = serde_json::from_str::<FailurePolicy>(r#""fail-open""#).unwrap_err();
    assert!(e.to_string().contains("`open`, `closed`, `local`"), "{e}");
    let e = serde_json::from_str::<KeyHash>(r#""xxh3""#).unwrap_err();
    assert!(
        e.to_string().contains("expected `mix32` or `xxh3-64`"),
        "{e}"
    );
    let e = serde_json::from_str::<MemoryOptions>(r#"{"max_key": 5}"#).unwrap_err();
    assert!(e.to_string().contains("unknown field `max_key`"), "{e}");
}
