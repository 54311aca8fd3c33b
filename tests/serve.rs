//! End-to-end tests of `ratewarden serve`: the real binary on loopback
//! ports, a real HTTP client and a real gRPC client.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ratewarden_server::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use ratewarden_server::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use ratewarden_server::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use ratewarden_server::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use ratewarden_server::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use ratewarden_server::proto::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use serde_json::{json, Value};

mod common;

use common::{grpc_message, raw_rls_head, raw_should, ConfigFile, Server, BIN};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    body: Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let response = client.post(url).json(&body).send().await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body: Value = response.json().await.unwrap();
    (status, headers, body)
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

async fn should(
    client: &mut RateLimitServiceClient<tonic::transport::Channel>,
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
    hits: u32,
) -> RateLimitResponse {
    client
        .should_rate_limit(RateLimitRequest {
            domain: domain.into(),
            descriptors,
            hits_addend: hits,
        })
        .await
        .unwrap()
        .into_inner()
}

/// Sends `n` requests for one key from `clients` concurrent clients and
/// counts the admitted ones; every answer must be 200 or 429.
async fn admitted(url: &str, key: &str, n: usize, clients: usize) -> usize {
    let client = client();
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (client, url, key, next) = (
            client.clone(),
            url.to_owned(),
            key.to_owned(),
            Arc::clone(&next),
        );
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            while next.fetch_add(1, Ordering::Relaxed) < n as u64 {
                let r = client
                    .post(&url)
                    .json(&json!({"key": key}))
                    .send()
                    .await
                    .unwrap();
                match r.status().as_u16() {
                    200 => ok += 1,
                    429 => {}
                    other => panic!("unexpected status {other}"),
                }
            }
            ok
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total
}

const LONG_WINDOW: &str = r#"
[keys]
limit = 100
window_ms = 3600000

[[domains]]
domain = "edge"

[[domains.descriptors]]
key = "remote_address"
name = "per-address"
limit = 100
window_ms = 3600000

[[domains.descriptors]]
key = "path"
value = "/login"
name = "login"
limit = 2
window_ms = 3600000

[[domains.descriptors.descriptors]]
key = "user"
name = "login-per-user"
policy = "token-bucket"
limit = 1
window_ms = 3600000
burst = 3

[[domains.descriptors]]
key = "path"
name = "any-path"
policy = "fixed-window"
limit = 7
window_ms = 3600000

[[domains.descriptors]]
key = "plan"
value = "trial"
name = "trial"
limit = 1
window_ms = 3600000
shadow = true
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_rule_admits_exactly_100_of_150_within_one_window() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    // Both counts are exact only within one window.
    common::clear_of_window_edge(3_600_000, Duration::from_secs(30)).await;
    assert_eq!(admitted(&server.url(), "user:42", 150, 8).await, 100);
    // The same over gRPC, on a descriptor with the same numbers.
    let mut grpc = server.grpc().await;
    let mut ok = 0;
    for _ in 0..150 {
        let r = should(
            &mut grpc,
            "edge",
            vec![descriptor(&[("remote_address", "10.0.0.1")])],
            0,
        )
        .await;
        if r.overall_code == Code::Ok as i32 {
            ok += 1;
        }
    }
    assert_eq!(ok, 100);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_arguments_every_key_gets_the_reference_configuration() {
    let server = Server::start(&[]);
    let client = client();
    // The default window is 1000 ms, aligned to the clock: start just after
    // a window begins so 150 quick requests fit in one window. A run that
    // still crosses a window edge (a very slow machine) is repeated on a new
    // key, a bounded number of times.
    let mut verdict = None;
    for attempt in 0..5 {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        tokio::time::sleep(Duration::from_millis(1000 - now_ms % 1000 + 5)).await;
        let window = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
            / 1000;
        let n = admitted(&server.url(), &format!("default:{attempt}"), 150, 8).await;
        let after = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
            / 1000;
        if window == after {
            verdict = Some(n);
            break;
        }
    }
    assert_eq!(
        verdict,
        Some(100),
        "150 requests never fitted in one 1000 ms window"
    );
    // Descriptors of any domain are limited the same way.
    let (status, headers, body) = post(
        &client,
        &server.url(),
        json!({"domain": "any", "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["rule"], "fallback");
    assert_eq!(body["limit"], 100);
    assert_eq!(body["policy"], "sliding-window-counter");
    assert_eq!(headers["ratelimit-policy"], "\"fallback\";q=100;w=1");
    let mut grpc = server.grpc().await;
    let r = should(&mut grpc, "other", vec![descriptor(&[("a", "b")])], 0).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        100
    );
    assert_eq!(r.statuses[0].limit_remaining, 99);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_answers_carry_the_decision_and_the_ratelimit_headers() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let (status, headers, body) =
        post(&client, &server.url(), json!({"key": "h", "cost": 60})).await;
    assert_eq!(status, 200);
    assert_eq!(body["allowed"], true);
    assert_eq!(body["remaining"], 40);
    assert_eq!(body["retry_after_ms"], 0);
    assert_eq!(body["rule"], "keys");
    assert_eq!(headers["ratelimit-policy"], "\"keys\";q=100;w=3600");
    assert_eq!(headers["ratelimit"], "\"keys\";r=40");
    assert!(headers.get("retry-after").is_none());

    let (status, headers, body) =
        post(&client, &server.url(), json!({"key": "h", "cost": 41})).await;
    assert_eq!(status, 429);
    assert_eq!(body["allowed"], false);
    assert_eq!(body["remaining"], 40);
    let retry_ms = body["retry_after_ms"].as_u64().unwrap();
    assert!(retry_ms > 0);
    let retry_s = retry_ms.div_ceil(1000).to_string();
    assert_eq!(headers["retry-after"], retry_s.as_str());
    assert_eq!(
        headers["ratelimit"],
        format!("\"keys\";r=40;t={retry_s}").as_str()
    );

    // A cost above the limit can never be admitted: no wait is given.
    let (status, headers, body) =
        post(&client, &server.url(), json!({"key": "h2", "cost": 101})).await;
    assert_eq!(status, 429);
    assert_eq!(body["retry_after_ms"], Value::Null);
    assert!(headers.get("retry-after").is_none());

    let health = client
        .get(format!("http://{}/healthz", server.http))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200);
    // The embedded store is always ready.
    let ready = client
        .get(format!("http://{}/readyz", server.http))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status().as_u16(), 200);
    assert_eq!(ready.text().await.unwrap(), "ready\n");
    let metrics = common::metrics(&client, server.http).await;
    assert!(
        metrics.contains("ratewarden_decisions_total{rule=\"keys\",outcome=\"allowed\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ratewarden_decisions_total{rule=\"keys\",outcome=\"refused\"} 2\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ratewarden_request_duration_seconds_count{api=\"http\"} 3\n"),
        "{metrics}"
    );
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_match_as_configured() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let mut grpc = server.grpc().await;
    let name = |r: &RateLimitResponse, i: usize| {
        r.statuses[i].current_limit.as_ref().map(|l| l.name.clone())
    };

    let r = should(
        &mut grpc,
        "edge",
        vec![
            descriptor(&[("remote_address", "10.1.1.1")]),
            descriptor(&[("path", "/login")]),
            descriptor(&[("path", "/login"), ("user", "ann")]),
            descriptor(&[("path", "/docs")]),
            descriptor(&[("unconfigured", "x")]),
            descriptor(&[("path", "/docs"), ("user", "ann")]),
        ],
        1,
    )
    .await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(name(&r, 0).as_deref(), Some("per-address"));
    assert_eq!(name(&r, 1).as_deref(), Some("login"));
    assert_eq!(name(&r, 2).as_deref(), Some("login-per-user"));
    assert_eq!(name(&r, 3).as_deref(), Some("any-path"));
    assert_eq!(
        name(&r, 4),
        None,
        "a descriptor no rule matches is unlimited"
    );
    assert_eq!(
        name(&r, 5),
        None,
        "nested entries under the any-value path have no rule"
    );
    assert_eq!(r.statuses[1].limit_remaining, 1);
    assert_eq!(r.statuses[2].limit_remaining, 2);
    assert_eq!(r.statuses[3].limit_remaining, 6);
    // An admitted fixed window says when its count starts again: the end
    // of its aligned hour, as envoyproxy/ratelimit says it. The other
    // policies have no such moment.
    let reset = r.statuses[3]
        .duration_until_reset
        .expect("a fixed window's reset");
    let reset_ms = reset.seconds as u64 * 1000 + reset.nanos as u64 / 1_000_000;
    let wall_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let expected = 3_600_000 - wall_ms % 3_600_000;
    assert!(
        reset_ms.abs_diff(expected) < 5_000 || expected.abs_diff(reset_ms) > 3_590_000,
        "{reset_ms} ms to the hour's end, where the clock says {expected}"
    );
    assert!((1..=3_600_000).contains(&reset_ms), "{reset_ms}");
    for i in [0, 1, 2, 4] {
        assert_eq!(r.statuses[i].duration_until_reset, None, "status {i}");
    }
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        100
    );

    // Each value of an any-value node has its own count.
    let r = should(&mut grpc, "edge", vec![descriptor(&[("path", "/a")])], 7).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    let r = should(&mut grpc, "edge", vec![descriptor(&[("path", "/a")])], 1).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert!(r.statuses[0].duration_until_reset.is_some());
    let r = should(&mut grpc, "edge", vec![descriptor(&[("path", "/b")])], 7).await;
    assert_eq!(r.overall_code, Code::Ok as i32);

    // Refused on one descriptor, the request takes nothing from the other:
    // "login" has 1 left; asking 2 is refused and "per-address" keeps its 99.
    let both = vec![
        descriptor(&[("remote_address", "10.1.1.1")]),
        descriptor(&[("path", "/login")]),
    ];
    let r = should(&mut grpc, "edge", both.clone(), 2).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::Ok as i32);
    assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
    let r = should(
        &mut grpc,
        "edge",
        vec![descriptor(&[("remote_address", "10.1.1.1")])],
        1,
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 98);

    // A descriptor's own hits_addend overrides the request's.
    let mut d = descriptor(&[("remote_address", "10.9.9.9")]);
    d.hits_addend = Some(10);
    let r = should(&mut grpc, "edge", vec![d], 1).await;
    assert_eq!(r.statuses[0].limit_remaining, 90);

    // The HTTP interface matches the same way.
    let (status, _, body) = post(
        &client(),
        &server.url(),
        json!({"domain": "edge", "descriptors": [{"entries": [{"key": "path", "value": "/login"}, {"key": "user", "value": "bob"}]}]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["rule"], "login-per-user");
    assert_eq!(body["policy"], "token-bucket");
    assert_eq!(body["remaining"], 2);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_rules_count_but_never_refuse() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let mut grpc = server.grpc().await;
    for _ in 0..5 {
        let r = should(&mut grpc, "edge", vec![descriptor(&[("plan", "trial")])], 1).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
    }
    let client = client();
    let body = json!({"domain": "edge", "descriptors": [{"entries": [{"key": "plan", "value": "trial"}]}]});
    let (status, headers, body) = post(&client, &server.url(), body).await;
    assert_eq!(status, 200);
    assert_eq!(body["allowed"], true);
    assert_eq!(body["shadow"], true);
    assert_eq!(
        body["would_allow"], false,
        "the rule's own decision: {body}"
    );
    assert!(
        headers.get("ratelimit").is_none(),
        "shadow rules are not advertised"
    );
    // An entry's value may be left out, as in Envoy's protobuf: it is "",
    // which an any-value node matches.
    let body = json!({"domain": "edge", "descriptors": [{"entries": [{"key": "remote_address"}]}]});
    let (status, _, body) = post(&client, &server.url(), body).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["rule"], "per-address", "{body}");
    let metrics = common::metrics(&client, server.http).await;
    assert!(
        metrics.contains("ratewarden_decisions_total{rule=\"trial\",outcome=\"allowed\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("ratewarden_decisions_total{rule=\"trial\",outcome=\"shadow_refused\"} 5\n"),
        "{metrics}"
    );
    // The shadow rule speaks for the request wherever it stands: the top
    // level is `null` only when no descriptor had a rule.
    let trial = json!({"entries": [{"key": "plan", "value": "trial"}]});
    let unmatched = json!({"entries": [{"key": "nothing", "value": "here"}]});
    for descriptors in [json!([trial, unmatched]), json!([unmatched, trial])] {
        let body = json!({"domain": "edge", "descriptors": descriptors});
        let (status, _, body) = post(&client, &server.url(), body).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            (&body["rule"], &body["shadow"]),
            (&json!("trial"), &json!(true)),
            "{body}"
        );
    }
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_request_gets_a_4xx_that_says_what_is_wrong() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let url = server.url();
    let raw = |body: &'static str| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let r = client
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.text().await.unwrap())
        }
    };
    let cases: &[(&str, u16, &str)] = &[
        ("{\"key\": ", 400, "malformed JSON"),
        ("not json", 400, "malformed JSON"),
        // A syntax error before a member's name is read says the place
        // known so far, or none: no `?` for the rest.
        (
            "{",
            400,
            "malformed JSON: EOF while parsing an object at line 1 column 1;",
        ),
        (
            "{\"key\": \"k\",}",
            400,
            "malformed JSON: trailing comma at line 1 column 13;",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [{\"key\": \"k\", \"value\": \"v\",}]}]}",
            400,
            "malformed JSON: descriptors[0].entries[0]: trailing comma at line 1 column",
        ),
        ("{}", 400, "key is missing"),
        ("{\"cost\": 1}", 400, "key is missing"),
        ("{\"key\": \"k\", \"cost\": -1}", 400, "cost is -1"),
        ("{\"key\": \"k\", \"cost\": 1.5}", 400, "cost is 1.5"),
        (
            "{\"key\": \"k\", \"cost\": null}",
            400,
            "cost is null: leave `cost` out for a cost of 1",
        ),
        (
            "{\"key\": \"k\", \"cost\": 9007199254740992}",
            400,
            "cost is 9007199254740992",
        ),
        (
            "{\"key\": \"k\", \"cost\": \"1\"}",
            400,
            "cost is a string: it must be a JSON number",
        ),
        (
            "{\"key\": \"k\", \"cost\": {\"n\": 1}}",
            400,
            "cost is an object: it must be a JSON number",
        ),
        ("{\"key\": \"k\", \"kost\": 1}", 400, "unknown field `kost`"),
        // A dot in an unknown field's name is no part of where it is.
        (
            "{\"key\": \"k\", \"a.b\": 1}",
            400,
            "malformed JSON: unknown field `a.b`",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [{\"k.e\": \"k\"}]}]}",
            400,
            "malformed JSON: descriptors[0].entries[0]: unknown field `k.e`",
        ),
        // Descriptors and entries are objects: arrays of their fields are
        // refused, saying so, rather than read in order.
        (
            "{\"domain\": \"edge\", \"descriptors\": [[[[\"k\", \"v\"]]]]}",
            400,
            "invalid type: sequence, expected a JSON object at line 1 column 35",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [[\"k\", \"v\", \"x\"]]}]}",
            400,
            "invalid type: sequence, expected a JSON object",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [{\"kee\": \"k\"}]}]}",
            400,
            "unknown field `kee`, expected `key` or `value` at line 1 column",
        ),
        ("{\"domain\": \"edge\"}", 400, "descriptors is missing"),
        (
            "{\"domain\": \"edge\", \"descriptors\": []}",
            400,
            "descriptors is empty",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": []}]}",
            400,
            "no entries",
        ),
        // No `entries` at all is no entries, named by index too.
        (
            "{\"domain\": \"edge\", \"descriptors\": [{}]}",
            400,
            "descriptors[0] has no entries",
        ),
        (
            "{\"key\": \"k\", \"domain\": \"edge\"}",
            400,
            "either a key or a domain",
        ),
        ("{\"key\": \"\"}", 400, "key is empty"),
        // Sent, but no string: said so, not "missing" or a serde type error.
        (
            "{\"key\": null}",
            400,
            "key is null: it must be a JSON string, such as",
        ),
        ("{\"key\": 42}", 400, "key is 42: it must be a JSON string"),
        (
            "{\"key\": [\"a\"]}",
            400,
            "key is an array: it must be a JSON string",
        ),
        (
            "{\"domain\": null, \"descriptors\": []}",
            400,
            "domain is null: it must be a JSON string, such as {\\\"domain\\\": \\\"api\\\"}",
        ),
        // Null descriptors are refused as a null key is: not read as
        // absent, which decided a key request with them and said a
        // domain had no descriptors.
        (
            "{\"key\": \"k\", \"descriptors\": null}",
            400,
            "descriptors is null: send a list of descriptors with a domain, such as",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": null}",
            400,
            "descriptors is null: send a list",
        ),
        ("[1]", 400, "malformed JSON: the body must be a JSON object"),
        // A wrong type is named by its place, not only its line and column.
        (
            "{\"domain\": 5, \"descriptors\": []}",
            400,
            "domain is 5: it must be a JSON string",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [{\"key\": \"k\", \"value\": 7}]}]}",
            400,
            "malformed JSON: descriptors[0].entries[0].value: invalid type: integer `7`",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [{\"key\": \"k\"}], \"limit\": {\"requests_per_unit\": 5, \"unit\": 5}}]}",
            400,
            "descriptors[0].limit.unit: invalid type: integer `5`, expected a string",
        ),
        // A member given twice in a limit is refused, as in any other
        // object, not read as the last one (a limit of 700 per minute).
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [{\"key\": \"k\"}], \"limit\": {\"requests_per_unit\": 5, \"unit\": \"second\", \"unit\": \"minute\", \"requests_per_unit\": 700}}]}",
            400,
            "descriptors[0].limit: duplicate field `unit`",
        ),
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [{\"key\": \"k\"}], \"limit\": {\"requests_per_unit\": 5,\n\"requests_per_unit\": 700, \"unit\": \"second\"}}]}",
            400,
            // Its place alone: the line and column of the limit's own
            // text would point elsewhere in the body.
            "descriptors[0].limit: duplicate field `requests_per_unit`\"",
        ),
        // A trailing comma in a limit is said to be one.
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"entries\": [{\"key\": \"k\"}], \"limit\": {\"requests_per_unit\": 5,\n\"unit\": \"second\", }}]}",
            400,
            "malformed JSON at line 2 column 19 in descriptors[0].limit: a comma is followed \
             by no member",
        ),
        // Envoy's name for the cost is pointed to its HTTP one.
        (
            "{\"domain\": \"edge\", \"descriptors\": [{\"hits_addend\": 2, \"entries\": [{\"key\": \"k\"}]}]}",
            400,
            "descriptors[0]: unknown field `hits_addend`, expected `entries` or `limit` at line 1 \
             column 49; over HTTP a request's cost is \\\"cost\\\"",
        ),
        // An empty body is said to be one, not JSON ending early.
        ("", 400, "the request body is empty; send"),
        (" \n", 400, "the request body is empty; send"),
        (
            "{key: \"k\"}",
            400,
            "line 1 column 2: a member name must be a string in double quotes",
        ),
    ];
    for (body, status, needle) in cases {
        let (got, text) = raw(body).await;
        assert_eq!(got, *status, "{body} -> {text}");
        assert!(text.contains(needle), "{body} -> {text}");
    }
    // A byte order mark before the JSON is ignored, as RFC 8259 allows.
    let (got, text) = raw("\u{feff}{\"key\": \"bom\"}").await;
    assert_eq!(got, 200, "{text}");
    let huge = format!("{{\"key\": \"{}\"}}", "x".repeat(100_000));
    let r = client.post(&url).body(huge).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 413);
    assert!(r.text().await.unwrap().contains("larger than 65536 bytes"));
    // A compressed body is said to be one, not read as malformed JSON; a
    // body said to be in the identity coding is read as it is.
    for (coding, status) in [("gzip", 415), ("identity", 200), ("identity, br", 415)] {
        let r = client
            .post(&url)
            .header("content-encoding", coding)
            .body("{\"key\": \"coded\"}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{coding}");
        if status == 415 {
            assert_eq!(r.headers()["accept-encoding"], "identity");
            let body = r.json::<Value>().await.unwrap();
            let text = body["error"].as_str().unwrap();
            assert!(
                text.contains(&format!(
                    "sent with Content-Encoding {coding:?}, which this service does not \
                     decode; send the JSON uncompressed"
                )),
                "{text}"
            );
        }
    }
    // A long coding, path or method is not echoed whole: the answer to a
    // client's mistake stays short (a 400 KB header came back 1.6 MB, in
    // memory per connection until read).
    let short_answer = |request: reqwest::RequestBuilder, status: u16| async move {
        let r = request.send().await.unwrap();
        assert_eq!(r.status().as_u16(), status);
        let text = r.text().await.unwrap();
        assert!(text.len() < 1_000, "{} bytes", text.len());
        text
    };
    let long = "\"".repeat(20_000);
    let coding = client
        .post(&url)
        .header("content-encoding", format!("x{long}"))
        .body("{}");
    let text = short_answer(coding, 415).await;
    assert!(text.contains("(20001 characters)"), "{text}");
    let base = url.trim_end_matches("/v1/check");
    let path = client.get(format!("{base}/{}", "p".repeat(20_000)));
    let text = short_answer(path, 404).await;
    assert!(text.contains("(20001 characters)"), "{text}");
    let method = reqwest::Method::from_bytes(&[b'M'; 20_000]).unwrap();
    let text = short_answer(client.request(method, &url), 405).await;
    assert!(text.contains("(20000 characters)"), "{text}");
    // A long string of the wrong type is not echoed whole either.
    let body = format!(
        "{{\"domain\": \"edge\", \"descriptors\": [{{\"entries\": \"{}\"}}]}}",
        "\\\"".repeat(10_000)
    );
    let text = short_answer(client.post(&url).body(body), 400).await;
    assert!(
        text.contains("malformed JSON: descriptors[0].entries: invalid type: string"),
        "{text}"
    );
    // Cut on its own, so that what serde expected is still said.
    assert!(
        text.contains("characters)\\\", expected a sequence at line 1 column"),
        "{text}"
    );
    // Nor a long member name, in the place (one of 60,000 characters came
    // back whole) or in the message, nor a place of many parts.
    let name = "A".repeat(60_000);
    let body = format!("{{\"key\": {{\"{name}\": 01}}}}");
    let text = short_answer(client.post(&url).body(body), 400).await;
    assert!(
        text.contains(&format!(
            "malformed JSON: key.{}... (60000 characters): invalid number at line 1 column",
            &name[..24]
        )),
        "{text}"
    );
    let body = format!(
        "{{\"key\": {}01{}}}",
        format!("{{\"{}\": ", &name[..40]).repeat(100),
        "}".repeat(100)
    );
    let text = short_answer(client.post(&url).body(body), 400).await;
    assert!(
        text.contains("characters): invalid number at line 1 column"),
        "{text}"
    );
    let body = format!(
        "{{\"domain\": \"edge\", \"descriptors\": [{{\"entries\": [{{\"key\": \"k\"}}], \"limit\": {{\"{name}\": 1}}}}]}}"
    );
    let text = short_answer(client.post(&url).body(body), 400).await;
    // The name is cut, and the fields the limit takes are still said.
    assert!(
        text.contains(&format!(
            "descriptors[0].limit: unknown field `{}... (60000 characters)`, expected \
             `requests_per_unit` or `unit`",
            &name[..24]
        )),
        "{text}"
    );

    // Only the body's size is bounded: a long key within it is a key.
    let long_key = format!("{{\"key\": \"{}\"}}", "x".repeat(60_000));
    let r = client.post(&url).body(long_key).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);

    // Wrong paths and methods are answered in JSON too, naming the endpoints.
    let r = client
        .post(format!("{base}/v1/chek"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let text = r.text().await.unwrap();
    assert!(text.contains("no endpoint POST /v1/chek"), "{text}");
    assert!(text.contains("POST /v1/check"), "{text}");
    let r = client.get(&url).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(r.headers()["allow"], "POST");
    let text = r.text().await.unwrap();
    assert!(text.contains("/v1/check does not take GET"), "{text}");
    // A CONNECT's target is an authority, not a path: named as sent.
    let addr = server.http;
    let text = tokio::task::spawn_blocking(move || {
        let head = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\
                     Connection: close\r\n\r\n";
        exchange(addr, head, Duration::from_secs(5))
    })
    .await
    .unwrap();
    assert!(
        text.contains("no endpoint CONNECT example.com:443; the endpoints"),
        "{text}"
    );

    let mut grpc = server.grpc().await;
    let bad = [
        RateLimitRequest {
            domain: String::new(),
            descriptors: vec![descriptor(&[("a", "b")])],
            hits_addend: 1,
        },
        RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![],
            hits_addend: 1,
        },
        RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![descriptor(&[])],
            hits_addend: 1,
        },
    ];
    for request in bad {
        let status = grpc.should_rate_limit(request.clone()).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{request:?}");
        assert!(!status.message().is_empty());
    }
    // An unknown domain, or an empty entry key, is no error: no limit (as
    // envoyproxy/ratelimit answers), so a typo in Envoy's domain does not
    // make failure_mode_deny refuse all traffic.
    let r = should(&mut grpc, "nowhere", vec![descriptor(&[("a", "b")])], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].current_limit, None);
    let r = should(&mut grpc, "edge", vec![descriptor(&[("", "b")])], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].current_limit, None);
    let metrics = common::metrics(&client, server.http).await;
    assert!(
        metrics.contains("\nratewarden_unknown_domain_total 1\n"),
        "{metrics}"
    );
    // The server is still well after all of that.
    let (status, _, _) = post(&client, &url, json!({"key": "fine"})).await;
    assert_eq!(status, 200);
    server.stop();
}

/// A lone UTF-16 surrogate escape, which `JSON.stringify` and Python's
/// `json.dumps` write from a client's string, was refused as malformed
/// JSON: a caller that fails open let such a request through unlimited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_surrogate_escape_is_read_as_a_replacement_character() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let url = server.url();
    let send = |body: &'static str| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let r = client.post(&url).body(body).send().await.unwrap();
            let status = r.status().as_u16();
            let text = r.text().await.unwrap();
            assert_eq!(status, 200, "{body} -> {text}");
            serde_json::from_str::<Value>(&text).unwrap()
        }
    };
    // Lone ones, leading or trailing, and U+FFFD itself share one budget.
    for (body, remaining) in [
        (r#"{"key": "\ud800"}"#, 99),
        (r#"{"key": "\ufffd"}"#, 98),
        (r#"{"key": "\uDC00"}"#, 97),
    ] {
        let answer = send(body).await;
        assert_eq!(answer["rule"], "keys", "{body}: {answer}");
        assert_eq!(answer["remaining"], remaining, "{body}: {answer}");
    }
    // A leading one before another escape: that escape is kept.
    assert_eq!(send(r#"{"key": "\ud800\u0041"}"#).await["remaining"], 99);
    let (_, _, answer) = post(&client, &url, json!({"key": "\u{fffd}A"})).await;
    assert_eq!(answer["remaining"], 98);
    // A pair is the character it encodes.
    assert_eq!(send(r#"{"key": "\ud83d\ude00"}"#).await["remaining"], 99);
    let (_, _, answer) = post(&client, &url, json!({"key": "\u{1f600}"})).await;
    assert_eq!(answer["remaining"], 98);
    // An escaped backslash before `u` is six characters, not an escape.
    assert_eq!(send(r#"{"key": "\\ud800"}"#).await["remaining"], 99);
    let (_, _, answer) = post(&client, &url, json!({"key": "\\ud800"})).await;
    assert_eq!(answer["remaining"], 98);
    // In a descriptor's value and a domain too.
    for body in [
        r#"{"domain": "edge", "descriptors": [{"entries": [{"key": "remote_address", "value": "\udfff"}]}]}"#,
        r#"{"domain": "edge", "descriptors": [{"entries": [{"key": "remote_address", "value": "\ufffd"}]}]}"#,
    ] {
        let answer = send(body).await;
        assert_eq!(answer["rule"], "per-address", "{body}: {answer}");
    }
    let (_, _, answer) = post(
        &client,
        &url,
        json!({"domain": "edge", "descriptors": [{"entries": [{"key": "remote_address", "value": "\u{fffd}"}]}]}),
    )
    .await;
    assert_eq!(answer["remaining"], 97, "{answer}");
    let answer =
        send(r#"{"domain": "\ud800", "descriptors": [{"entries": [{"key": "k"}]}]}"#).await;
    assert_eq!(answer["allowed"], true, "{answer}");
    // Bytes that are not UTF-8 in a string, as the gRPC API reads them: a
    // bad sequence is one U+FFFD, and shares its count.
    for (bytes, remaining) in [
        (&b"{\"key\": \"x\xff\"}"[..], 99),
        (&b"{\"key\": \"x\xc3\"}"[..], 98),
    ] {
        let r = client.post(&url).body(bytes).send().await.unwrap();
        let status = r.status().as_u16();
        let answer: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        assert_eq!(
            (status, &answer["remaining"]),
            (200, &json!(remaining)),
            "{answer}"
        );
    }
    let (_, _, answer) = post(&client, &url, json!({"key": "x\u{fffd}"})).await;
    assert_eq!(answer["remaining"], 97, "{answer}");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_under_load_loses_no_request_and_resets_no_count() {
    let rules = |extra_limit: u64| {
        format!(
            "[keys]\nlimit = 300\nwindow_ms = 3600000\n\n[[domains]]\ndomain = \"d\"\n\
             [[domains.descriptors]]\nkey = \"k\"\nlimit = {extra_limit}\nwindow_ms = 3600000\n"
        )
    };
    let file = ConfigFile::new(&rules(1));
    let server = Server::start(&["--config", file.path()]);
    let url = server.url();
    // The total is exact only within one window; the load and its six
    // reloads take seconds, many more on a busy machine.
    common::clear_of_window_edge(3_600_000, Duration::from_secs(60)).await;
    // The load runs until the reloads are done (and at most 100,000
    // requests), so every reload happens while requests are in flight.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut load = Vec::new();
    for _ in 0..16 {
        let (client, url, stop, sent) =
            (client(), url.clone(), Arc::clone(&stop), Arc::clone(&sent));
        load.push(tokio::spawn(async move {
            let mut ok = 0;
            while !stop.load(Ordering::Relaxed) && sent.fetch_add(1, Ordering::Relaxed) < 100_000 {
                let r = client
                    .post(&url)
                    .json(&json!({"key": "steady"}))
                    .send()
                    .await
                    .unwrap();
                match r.status().as_u16() {
                    200 => ok += 1,
                    429 => {}
                    other => panic!("unexpected status {other}"),
                }
            }
            ok
        }));
    }
    // Until the load has begun (bounded), so that the reloads meet
    // requests in flight.
    let until_sent = |at_least: u64| {
        let sent = Arc::clone(&sent);
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while sent.load(Ordering::Relaxed) < at_least {
                assert!(
                    Instant::now() < deadline,
                    "the load sent under {at_least} in 30 s"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    until_sent(16).await;
    // Reload repeatedly while the load runs: a changed rule beside the
    // steady one, a broken file (kept out), and the first file again.
    let client = client();
    let reloads = |client: reqwest::Client, http: SocketAddr| async move {
        let text = common::metrics(&client, http).await;
        let count = |result: &str| {
            common::metric_value(
                &text,
                &format!("ratewarden_config_reloads_total{{result=\"{result}\"}}"),
            )
        };
        (count("ok"), count("failed"))
    };
    for i in 0..6u64 {
        if i == 3 {
            file.write("[keys]\nlimit = \"many\"\n");
        } else {
            file.write(&rules(2 + i));
        }
        let before = reloads(client.clone(), server.http).await;
        server.signal("HUP");
        // Signals sent close together may merge into one: wait for this
        // reload to be done before the next (bounded).
        let deadline = Instant::now() + Duration::from_secs(10);
        while reloads(client.clone(), server.http).await == before {
            assert!(Instant::now() < deadline, "no reload within 10 s of SIGHUP");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // The load goes on past the limit however fast the reloads were: the
    // count is only shown exact by requests beyond it.
    until_sent(600).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for task in load {
        total += tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .unwrap()
            .unwrap();
    }
    assert!(
        sent.load(Ordering::Relaxed) > 300,
        "the load outlasted the limit"
    );
    assert_eq!(
        total, 300,
        "reloads must neither lose requests nor reset the count"
    );
    assert_eq!(reloads(client.clone(), server.http).await, (5, 1));
    let (status, _, body) = post(&client, &url, json!({"key": "steady"})).await;
    assert_eq!((status, body["remaining"].as_u64()), (429, Some(0)));
    server.stop();
}

#[test]
fn bad_configurations_and_stores_stop_serve_with_a_message() {
    // `serve` with only `args`, and with free ports besides.
    let bare = |args: &[&str]| {
        let out = Command::new(BIN).arg("serve").args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let run =
        |args: &[&str]| bare(&[&["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"], args].concat());
    let file = ConfigFile::new("[keys]\nlimit = 10\nwindow_ms = 0\n");
    let (ok, stderr) = run(&["--config", file.path()]);
    assert!(!ok);
    assert!(
        stderr.contains(&format!("{}:3:13: keys.window_ms", file.path())),
        "{stderr}"
    );
    // Nothing listens on port 1: a store that cannot be reached at start is
    // an error, not a server that refuses everything.
    let (ok, stderr) = run(&["--store", "redis://127.0.0.1:1"]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "cannot make the limiter of rule \"keys\": Redis at 127.0.0.1:1 cannot be used: \
             connection refused; start redis-server there or change --store (or RATEWARDEN_STORE) \
             to where it runs"
        ),
        "{stderr}"
    );
    assert_eq!(stderr.matches("connection").count(), 1, "{stderr}");
    let (ok, stderr) = run(&["--store", "mongodb://x"]);
    assert!(!ok);
    assert!(stderr.contains("unknown store \"mongodb://x\""), "{stderr}");
    assert!(!stderr.contains("environment variable"), "{stderr}");
    // Text that may be a password is said to be hidden, not quoted as
    // "***", which reads as what was typed.
    let (ok, stderr) = run(&["--store", "Secret pass"]);
    assert!(!ok);
    assert!(
        stderr.contains("unknown store (not shown: text that does not read as a URL")
            && !stderr.contains("Secret")
            && !stderr.contains("***"),
        "{stderr}"
    );
    // A store from the environment is said to come from there.
    let from_env = |store: &str| {
        let out = Command::new(BIN)
            .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .env("RATEWARDEN_STORE", store)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        stderr
    };
    let stderr = from_env("mongodb://x");
    assert!(
        stderr.contains(
            "invalid value for '--store <STORE>' (from the environment variable \
             RATEWARDEN_STORE): unknown store"
        ),
        "{stderr}"
    );
    // An empty one (a template's empty substitution) is said to be empty,
    // not hidden as text that may hold a password.
    let stderr = from_env("");
    assert!(
        stderr.contains(
            "(from the environment variable RATEWARDEN_STORE): the store is empty; use memory \
             or a Redis URL"
        ),
        "{stderr}"
    );
    let (ok, stderr) = run(&["--store", "MEMORY"]);
    assert!(!ok);
    assert!(
        stderr.contains("unknown store \"MEMORY\"; write memory in lower case"),
        "{stderr}"
    );
    let (ok, stderr) = bare(&["--http", "127.0.0.1:18099", "--grpc", "127.0.0.1:18099"]);
    assert!(!ok);
    assert!(
        stderr.contains("--http and --grpc are both 127.0.0.1:18099"),
        "{stderr}"
    );
    let (ok, stderr) = bare(&[
        "--http",
        "127.0.0.1:0",
        "--grpc",
        "127.0.0.1:18099",
        "--metrics",
        "127.0.0.1:18099",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--grpc and --metrics are both 127.0.0.1:18099"),
        "{stderr}"
    );
    let (ok, stderr) = bare(&["--http", "nowhere"]);
    assert!(!ok);
    assert!(
        stderr.contains("write HOST:PORT, such as 127.0.0.1:8080"),
        "{stderr}"
    );
    // What a start refuses, --check refuses too: a URL that names no
    // address, interfaces sharing a port.
    for (store, said) in [
        ("redis://", "is not a Redis address"),
        ("redis-cluster://", "names no node"),
        ("redis-cluster://127.0.0.1", "needs a host and a port"),
        (
            "redis-cluster://,127.0.0.1:7000",
            "seed 1 of the URL is empty",
        ),
        (
            "redis-cluster://:pw1,,pw2@127.0.0.1:7000",
            "seed 2 of the URL is empty",
        ),
        (
            "redis-cluster://:pw1@127.0.0.1:7000,:pw2@127.0.0.1:7001",
            "seed 2 of the URL carries a user or password other than the first seed's",
        ),
    ] {
        let (ok, stderr) = run(&["--check", "--store", store]);
        assert!(!ok, "{store}");
        assert!(stderr.contains(said), "{store}: {stderr}");
        assert!(
            !stderr.contains("pw1") && !stderr.contains("pw2"),
            "{stderr}"
        );
    }
    // A URL read from a secret file ending with a newline is the URL.
    let (ok, stderr) = run(&["--check", "--store", "redis://127.0.0.1:7000/0\n"]);
    assert!(ok, "{stderr}");
    let (ok, stderr) = bare(&[
        "--check",
        "--http",
        "127.0.0.1:18099",
        "--grpc",
        "127.0.0.1:18099",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--http and --grpc are both 127.0.0.1:18099"),
        "{stderr}"
    );
    let (ok, stderr) = bare(&[
        "--check",
        "--http",
        "0.0.0.0:18099",
        "--grpc",
        "127.0.0.1:18099",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--http and --grpc share port 18099 (0.0.0.0:18099 and 127.0.0.1:18099"),
        "{stderr}"
    );
    // The system's certificates unreadable, with no [redis] table: the
    // table is not blamed.
    let out = Command::new(BIN)
        .args(["serve", "--check", "--store", "rediss://127.0.0.1:1"])
        .env("SSL_CERT_FILE", "/nonexistent/ca.pem")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("serve: TLS: the system's CA certificates cannot be loaded"),
        "{stderr}"
    );
    // A port taken says what to change.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let (ok, stderr) = bare(&["--http", "127.0.0.1:0", "--grpc", &port]);
    assert!(!ok);
    assert!(
        stderr.contains(&format!("cannot listen for gRPC on {port}"))
            && stderr.contains("give --grpc another port, or port 0 for a free one"),
        "{stderr}"
    );
}

/// `--metrics ADDR` moves `/metrics` to a port of its own, which answers
/// no checks: the operator's port can be kept from the clients'. Each
/// port's wrong requests say where the endpoint is, and are counted under
/// their own interface.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_may_have_a_port_of_their_own() {
    use std::io::Read;
    let (server, log) = Server::start_logged(&["--metrics", "127.0.0.1:0"]);
    let metrics = server.metrics.expect("serve names the metrics port");
    let client = client();
    let (status, _, body) = post(&client, &server.url(), json!({"key": "k", "cost": 1})).await;
    assert_eq!(status, 200, "{body}");

    let text = common::metrics(&client, metrics).await;
    assert_eq!(
        common::metric_value(
            &text,
            "ratewarden_decisions_total{rule=\"keys\",outcome=\"allowed\"}"
        ),
        1
    );
    for path in ["healthz", "readyz"] {
        let answer = client
            .get(format!("http://{metrics}/{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "{path} on the metrics port");
        let answer = client
            .get(format!("http://{}/{path}", server.http))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "{path} on the HTTP port");
    }

    // Neither port serves the other's endpoint, and each says where it is.
    let answer = client
        .get(format!("http://{}/metrics", server.http))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 404);
    let said = answer.text().await.unwrap();
    assert!(
        said.contains("GET /metrics is served on the address given by --metrics"),
        "{said}"
    );
    let (status, _, body) = post(
        &client,
        &format!("http://{metrics}/v1/check"),
        json!({"key": "k", "cost": 1}),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("POST /v1/check is served on the address given by --http"),
        "{body}"
    );
    // The check on the metrics port decided nothing.
    let text = common::metrics(&client, metrics).await;
    assert_eq!(
        common::metric_value(
            &text,
            "ratewarden_decisions_total{rule=\"keys\",outcome=\"allowed\"}"
        ),
        1
    );
    let bad = |api| format!("ratewarden_bad_requests_total{{api=\"{api}\"}}");
    assert_eq!(common::metric_value(&text, &bad("http")), 1, "{text}");
    assert_eq!(common::metric_value(&text, &bad("metrics")), 1, "{text}");

    // Its connections have a bound of their own: the HTTP port's
    // `max_connections` is not the operator's to spend. (The client's
    // connection is closed first, and given a second to be seen closed.)
    drop(client);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let held: Vec<_> = (0..ratewarden_server::METRICS_MAX_CONNECTIONS)
        .map(|_| std::net::TcpStream::connect(metrics).unwrap())
        .collect();
    // Accepted in order: give the server a moment to take them all (a
    // second, for a busy machine).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut one_more = std::net::TcpStream::connect(metrics).unwrap();
    one_more
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut sink = Vec::new();
    let closed = match one_more.read_to_end(&mut sink) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    assert!(closed, "a connection past the bound is closed unserved");
    // The warning names that bound, not max_connections, which does not
    // move it.
    let line = log.next_containing("closed unserved");
    assert!(
        line.contains("64 connections are open on the metrics port, its own fixed bound"),
        "{line}"
    );
    assert!(!line.contains("max_connections"), "{line}");
    drop(held);
    // And to see them closed, freeing their places.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let text = common::metrics(&reqwest::Client::new(), metrics).await;
    let refused = |api| format!("ratewarden_connections_refused_total{{api=\"{api}\"}}");
    assert_eq!(
        common::metric_value(&text, &refused("metrics")),
        1,
        "{text}"
    );
    assert_eq!(common::metric_value(&text, &refused("http")), 0, "{text}");
    server.stop();
}

/// `serve --check` reads and compiles the file as a start would and says
/// how many rules it holds (exit 0) or what is wrong, with the file, line
/// and field (exit 1), listening nowhere and connecting to no store.
#[test]
fn check_says_whether_a_configuration_loads_and_starts_nothing() {
    // A port already taken and a Redis that is not there: a start would
    // fail on either.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let check = |file: &ConfigFile| {
        Command::new(BIN)
            .args(["serve", "--check", "--config", file.path()])
            .args(["--http", &port, "--store", "redis://127.0.0.1:1"])
            .output()
            .unwrap()
    };
    let good = ConfigFile::new(
        "[keys]\nlimit = 5\nwindow_ms = 1000\n\n[fallback]\nlimit = 7\nwindow_ms = 1000\n",
    );
    let out = check(&good);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("ratewarden serve: {} loads: 2 rules\n", good.path())
    );
    let bad = ConfigFile::new("[keys]\nlimit = \"many\"\nwindow_ms = 1000\n");
    let out = check(&bad);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!("{}:2:9: keys.limit: invalid type", bad.path())),
        "{said}"
    );
    // A file whose read blocks is given up after a reload's 10 s.
    blocking_pipe(bad.path());
    let mut child = Command::new(BIN)
        .args(["serve", "--check", "--config", bad.path()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = common::exit_within(&mut child, Duration::from_secs(30))
        .expect("serve --check gives up a blocked read within 30 s");
    assert_eq!(status.code(), Some(1), "{status}");
    let mut said = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut said).unwrap();
    assert!(said.contains("did not finish within 10 s"), "{said}");
}

/// `--http localhost:PORT`, as the README's examples spell the host.
#[test]
fn addresses_may_name_a_host() {
    let mut child = Command::new(BIN)
        .args(["serve", "--http", "localhost:0", "--grpc", "localhost:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let line = common::first_line(&mut child);
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("serve prints where it listens");
    assert!(
        line.starts_with("ratewarden serve: HTTP on http://"),
        "{line}"
    );
    let http: SocketAddr = line
        .split("http://")
        .nth(1)
        .and_then(|s| s.split('/').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(http.ip().is_loopback(), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_configuration_serves() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/ratewarden.toml");
    let server = Server::start(&["--config", example.to_str().unwrap()]);
    let client = client();
    let (status, _, body) = post(&client, &server.url(), json!({"key": "user:1"})).await;
    assert_eq!(status, 200);
    assert_eq!(body["remaining"], 99);
    assert!(body.get("burst").is_none(), "no bucket: {body}");
    let login = json!({"domain": "api", "descriptors": [{"entries": [
        {"key": "path", "value": "/login"}, {"key": "user", "value": "ann"}]}]});
    let (status, headers, body) = post(&client, &server.url(), login).await;
    assert_eq!(status, 200);
    assert_eq!(body["rule"], "login-per-user");
    assert_eq!((&body["limit"], &body["burst"]), (&json!(5), &json!(10)));
    assert_eq!(
        body["remaining"], 9,
        "a bucket's remaining can pass its limit"
    );
    // The headers cannot say so: `r` never exceeds the advertised `q`.
    let policy = headers["ratelimit-policy"].to_str().unwrap();
    let state = headers["ratelimit"].to_str().unwrap();
    assert!(policy.contains("\"login-per-user\";q=5;w="), "{policy}");
    assert!(state.contains("\"login-per-user\";r=5"), "{state}");
    server.stop();
}

#[test]
fn a_client_that_never_finishes_its_headers_is_disconnected() {
    use std::io::{Read, Write};
    let server = Server::start(&[]);
    let mut stream = std::net::TcpStream::connect(server.http).unwrap();
    stream
        .write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    // The server closes the connection after its 10 s header-read timeout;
    // the read below is bounded well past that.
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let started = Instant::now();
    let mut buf = Vec::new();
    let result = stream.read_to_end(&mut buf);
    assert!(
        result.is_ok(),
        "the server closed the connection: {result:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_answers_list_every_descriptor_and_key_answers_none() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let body = json!({"domain": "edge", "descriptors": [
        {"entries": [{"key": "unconfigured", "value": "x"}]},
        {"entries": [{"key": "path", "value": "/login"}]},
    ]});
    let (status, headers, body) = post(&client, &server.url(), body).await;
    assert_eq!(status, 200);
    assert_eq!(
        body["rule"], "login",
        "the limited descriptor speaks for the request"
    );
    let listed = body["descriptors"].as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0]["rule"], Value::Null);
    assert_eq!(listed[0]["allowed"], true);
    assert_eq!(listed[1]["remaining"], 1);
    assert_eq!(headers["ratelimit-policy"], "\"login\";q=2;w=3600");
    let body = json!({"domain": "edge", "descriptors": [{"entries": [{"key": "unconfigured", "value": "x"}]}]});
    let (status, headers, body) = post(&client, &server.url(), body).await;
    assert_eq!(status, 200);
    assert_eq!(body["rule"], Value::Null);
    assert_eq!(body["descriptors"].as_array().unwrap().len(), 1);
    assert!(headers.get("ratelimit").is_none());
    let (_, _, body) = post(&client, &server.url(), json!({"key": "k"})).await;
    assert!(body.get("descriptors").is_none());
    server.stop();
}

/// A bucket whose wait passes 2^64 ms answers it exactly in the JSON; the
/// headers, in whole seconds, carry it clamped to the largest
/// structured-field integer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_past_2_pow_64_ms_is_exact_in_the_json() {
    const HUGE_BUCKET: &str = r#"
[keys]
policy = "token-bucket"
limit = 1
window_ms = 9007199254740991
burst = 9007199254740991
"#;
    let file = ConfigFile::new(HUGE_BUCKET);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let url = server.url();
    let all = json!({"key": "k", "cost": 9_007_199_254_740_991_u64});
    let (status, _, _) = post(&client, &url, all.clone()).await;
    assert_eq!(status, 200);
    let (status, headers, body) = post(&client, &url, all).await;
    assert_eq!(status, 429, "{body}");
    // The bucket refills 1 per 2^53 - 1 ms, so the whole burst takes
    // (2^53 - 1)^2 ms less what the wall clock refilled meanwhile.
    let full = 9_007_199_254_740_991_u128 * 9_007_199_254_740_991;
    let wait = match &body["retry_after_ms"] {
        Value::Number(n) => n.as_u128().expect("a whole number"),
        other => panic!("retry_after_ms is {other}"),
    };
    assert!(wait > u128::from(u64::MAX) && wait <= full, "{body}");
    assert_eq!(headers["retry-after"], "999999999999999");
    assert_eq!(headers["ratelimit"], "\"keys\";r=0;t=999999999999999");
    server.stop();
}

/// A request refused by several descriptors waits for the longest of their
/// waits: it is admitted only once all of them admit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_refusals_answer_the_longest_wait() {
    const TWO_WINDOWS: &str = r#"
[[domains]]
domain = "api"

[[domains.descriptors]]
key = "short"
policy = "fixed-window"
limit = 1
window_ms = 5000

[[domains.descriptors]]
key = "long"
policy = "fixed-window"
limit = 1
unit = "hour"
"#;
    let file = ConfigFile::new(TWO_WINDOWS);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let body = json!({"domain": "api", "descriptors": [
        {"entries": [{"key": "short", "value": "x"}]},
        {"entries": [{"key": "long", "value": "x"}]},
    ]});
    let (status, _, _) = post(&client, &server.url(), body.clone()).await;
    assert_eq!(status, 200);
    let (status, headers, body) = post(&client, &server.url(), body).await;
    assert_eq!(status, 429, "{body}");
    let listed = body["descriptors"].as_array().unwrap();
    let short = listed[0]["retry_after_ms"].as_u64().unwrap();
    let long = listed[1]["retry_after_ms"].as_u64().unwrap();
    assert!(short <= 5000 && long > 5000, "{body}");
    assert_eq!(body["retry_after_ms"], long, "{body}");
    assert_eq!(body["rule"], "api.long", "{body}");
    assert_eq!(headers["retry-after"], long.div_ceil(1000).to_string());
    server.stop();
}

/// `ratewarden_bad_requests_total` counts invalid requests, wherever they
/// are sent, and never a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_not_counted_as_bad_requests() {
    const ONE: &str = "[keys]\nlimit = 1\nwindow_ms = 3600000\n";
    let file = ConfigFile::new(ONE);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let bad = r#"ratewarden_bad_requests_total{api="http"}"#;
    for expected in [200, 429, 429] {
        let (status, _, _) = post(&client, &server.url(), json!({"key": "k"})).await;
        assert_eq!(status, expected);
    }
    assert_eq!(common::metric(&client, server.http, bad).await, 0);
    let (status, _, _) = post(&client, &server.url(), json!({"key": 1})).await;
    assert_eq!(status, 400);
    let base = format!("http://{}", server.http);
    let missing = client.get(format!("{base}/v2/check")).send().await.unwrap();
    assert_eq!(missing.status(), 404);
    let wrong_method = client.get(server.url()).send().await.unwrap();
    assert_eq!(wrong_method.status(), 405);
    assert_eq!(common::metric(&client, server.http, bad).await, 3);
    // Requests the HTTP layer cannot read, answered before the router
    // sees them, are counted too.
    let unreadable: [&[u8]; 3] = [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        &[
            b"GET /".as_slice(),
            &[b'a'; 70_000],
            b" HTTP/1.1\r\nHost: x\r\n\r\n",
        ]
        .concat(),
    ];
    for request in unreadable {
        let answer = tokio::task::spawn_blocking({
            let (addr, request) = (server.http, request.to_vec());
            move || exchange(addr, &request, Duration::from_secs(10))
        })
        .await
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 4"), "{answer}");
    }
    assert_eq!(common::metric(&client, server.http, bad).await, 6);
    server.stop();
}

/// A client that goes away before its whole body came sent nothing
/// invalid: it is answered, should it still read, but not counted as a
/// bad request. A malformed chunked body still is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_short_by_the_client_is_no_bad_request() {
    let server = Server::start(&[]);
    let addr = server.http;
    let cut_short = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream
            .write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"key\"")
            .unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    })
    .await
    .unwrap();
    assert!(
        cut_short.starts_with("HTTP/1.1 400") && cut_short.contains("could not be read"),
        "{cut_short}"
    );
    let client = client();
    let bad = r#"ratewarden_bad_requests_total{api="http"}"#;
    assert_eq!(common::metric(&client, server.http, bad).await, 0);
    let malformed = tokio::task::spawn_blocking(move || {
        exchange(
            addr,
            b"POST /v1/check HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            Duration::from_secs(10),
        )
    })
    .await
    .unwrap();
    assert!(malformed.starts_with("HTTP/1.1 400"), "{malformed}");
    assert_eq!(common::metric(&client, server.http, bad).await, 1);
    server.stop();
}

/// A body that trickles in is answered 408 after the body timeout, so it
/// cannot hold its connection or delay shutdown for long; the listening
/// socket closes as soon as shutdown begins, and the log says that the
/// stop waits.
#[test]
fn a_body_that_never_arrives_neither_holds_the_connection_nor_delays_shutdown() {
    use std::io::{Read, Write};
    let (server, log) = Server::start_logged(&[]);
    let addr = server.http;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"key\":")
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let reader = std::thread::spawn(move || {
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    });
    // Shutdown starts while the body is awaited: 2 s for the server to
    // take the request head even on a busy machine, well inside the 10 s
    // it waits for the body.
    std::thread::sleep(Duration::from_secs(2));
    server.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "new connections are still accepted 5 s into shutdown"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let waiting = log.through_containing("waiting for the requests in flight to finish");
    assert!(
        waiting.iter().any(|l| l.contains("SIGTERM: shutting down")),
        "{waiting:#?}"
    );
    assert!(
        waiting.last().unwrap().contains("(at most 27000 ms more)"),
        "{waiting:#?}"
    );
    let answer = reader.join().unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 10 s"), "{answer}");
    // Waits (bounded) for a clean exit, well before the 30 s drain bound.
    server.stop();
}

/// A second SIGTERM (or SIGINT) during the stop, once the stop has said
/// that it waits, ends the wait for requests in flight at once: the log
/// says what was cut short, as a log line, and the exit is not a clean
/// one. One sent at once after the first (a service manager's stop
/// sequence) does not.
#[test]
fn a_second_signal_stops_without_waiting_for_requests_in_flight() {
    use std::io::{Read, Write};
    for (first, second) in [("TERM", "TERM"), ("TERM", "INT")] {
        let (mut server, log) = Server::start_logged(&[]);
        let mut stream = std::net::TcpStream::connect(server.http).unwrap();
        // A body that will not arrive: the stop would wait for it 10 s.
        stream
            .write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            .unwrap();
        // 2 s for the server to take the request head on a busy machine.
        std::thread::sleep(Duration::from_secs(2));
        server.signal(first);
        log.next_containing(&format!("SIG{first}: shutting down"));
        // At once, as a service manager's stop sequence may send it: the
        // stop goes on.
        server.signal(second);
        log.next_containing(&format!(
            "SIG{second} again while stopping: the stop goes on"
        ));
        assert!(server.child.try_wait().unwrap().is_none(), "stopped early");
        // Once the stop has said that it waits, a second signal is an
        // operator's, and stops at once.
        log.next_containing("waiting for the requests in flight to finish");
        server.signal(second);
        let status = common::exit_within(&mut server.child, Duration::from_secs(5))
            .unwrap_or_else(|| panic!("serve still waits 5 s after a second SIG{second}"));
        assert_eq!(status.code(), Some(1), "{status}");
        let rest = log.to_the_end();
        let cut = format!(
            "SIG{second} again: stopping now, closing the connections of requests still in \
             flight unanswered"
        );
        let line = rest.iter().find(|l| l.contains(&cut)).unwrap_or_else(|| {
            panic!("{rest:#?}");
        });
        assert!(line.contains("ERROR"), "{line}");
        assert!(!rest.iter().any(|l| l.contains("stopped")), "{rest:#?}");
        // The request's connection is closed, unanswered.
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    }
}

/// Sends `request` on a new connection to `addr` and reads the answer,
/// as text, until the server closes the connection or `read_timeout`
/// passes. A failed write is no error: the server may answer and close
/// before the last byte.
fn exchange(addr: SocketAddr, request: &[u8], read_timeout: Duration) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(read_timeout)).unwrap();
    let _ = stream.write_all(request);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// A body declared over 64 KiB is refused before it is read, with no `100
/// Continue` inviting it; one sent in chunks, with no declared length, is
/// refused once 64 KiB have arrived.
#[test]
fn a_body_over_the_bound_is_refused_whether_declared_or_chunked() {
    let server = Server::start(&[]);
    let answer = |request: &[u8]| exchange(server.http, request, Duration::from_secs(5));
    let declared = answer(
        b"POST /v1/check HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\
          Content-Length: 99999999999\r\n\r\n",
    );
    assert!(declared.starts_with("HTTP/1.1 413"), "{declared}");
    assert!(declared.contains("larger than 65536 bytes"), "{declared}");
    let mut chunked =
        b"POST /v1/check HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..70 {
        chunked.extend_from_slice(b"400\r\n");
        chunked.extend_from_slice(&[b' '; 1024]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let chunked = answer(&chunked);
    assert!(chunked.starts_with("HTTP/1.1 413"), "{chunked}");
    // The connection closes, and says so, however long the body.
    assert!(
        chunked
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{chunked}"
    );
    // A transfer coding beside `chunked` is refused as one, not passed on
    // still coded to be read as malformed JSON.
    let gzipped = answer(
        b"POST /v1/check HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n\
          5\r\nhello\r\n0\r\n\r\n",
    );
    assert!(gzipped.starts_with("HTTP/1.1 501"), "{gzipped}");
    assert!(
        gzipped.contains("sent with Transfer-Encoding \\\"gzip, chunked\\\", which this service"),
        "{gzipped}"
    );
    // So is `chunked` applied twice (RFC 9112 forbids it), in one header
    // or two: hyper undoes it once.
    for head in [
        "Transfer-Encoding: chunked, chunked",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
    ] {
        let twice = answer(
            format!(
                "POST /v1/check HTTP/1.1\r\nHost: x\r\n{head}\r\n\r\n\
                 b\r\n{{\"key\":\"a\"}}\r\n0\r\n\r\n"
            )
            .as_bytes(),
        );
        assert!(twice.starts_with("HTTP/1.1 501"), "{head}: {twice}");
        assert!(twice.contains("chunked, chunked"), "{head}: {twice}");
    }
    server.stop();
}

/// What RFC 9112 (section 3.2) says a server must answer 400 is answered
/// 400 and counted as a bad request: an HTTP/1.1 request without `Host`,
/// and any request with two, or with a value that is no `host[:port]`.
/// An HTTP/1.0 request needs none, and an empty value is allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_need_one_valid_host_as_rfc_9112_says() {
    let server = Server::start(&[]);
    let client = client();
    let bad = r#"ratewarden_bad_requests_total{api="http"}"#;
    let answer = |head: &str| {
        let request =
            format!("{head}\r\nContent-Length: 11\r\nConnection: close\r\n\r\n{{\"key\":\"k\"}}");
        let addr = server.http;
        tokio::task::spawn_blocking(move || {
            exchange(addr, request.as_bytes(), Duration::from_secs(5))
        })
    };
    let refused = [
        (
            "POST /v1/check HTTP/1.1",
            "has no Host header; an HTTP/1.1 request must carry one",
        ),
        (
            "GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b",
            "has 2 Host headers",
        ),
        (
            "POST /v1/check HTTP/1.0\r\nHost: a\r\nHost: b",
            "has 2 Host headers",
        ),
        (
            "POST /v1/check HTTP/1.1\r\nHost: a b, c",
            "has a Host header that is no host[:port]",
        ),
        (
            "POST /v1/check HTTP/1.1\r\nHost: a/b",
            "has a Host header that is no host[:port]",
        ),
        (
            "POST /v1/check HTTP/1.1\r\nHost: user@a",
            "has a Host header that is no host[:port]",
        ),
        (
            "POST /v1/check HTTP/1.1\r\nHost: a:99999",
            "has a Host header that is no host[:port]",
        ),
    ];
    for (head, says) in refused {
        let got = answer(head).await.unwrap();
        assert!(got.contains(" 400 Bad Request\r\n"), "{head}: {got}");
        assert!(
            got.contains(&format!(r#"{{"error":"the request {says}"#)),
            "{head}: {got}"
        );
    }
    assert_eq!(common::metric(&client, server.http, bad).await, 7);
    // None was decided: the key's first decision is still to come.
    let admitted = [
        ("POST /v1/check HTTP/1.1\r\nHost: [::1]:8080", 99),
        ("POST /v1/check HTTP/1.1\r\nHost: ", 98),
        ("POST /v1/check HTTP/1.0", 97),
    ];
    for (head, remaining) in admitted {
        let got = answer(head).await.unwrap();
        assert!(got.contains(" 200 OK\r\n"), "{head}: {got}");
        assert!(
            got.contains(&format!(r#""remaining":{remaining}"#)),
            "{head}: {got}"
        );
    }
    assert_eq!(common::metric(&client, server.http, bad).await, 7);
    server.stop();
}

/// A connection to `server` on which `/metrics` requests were pipelined,
/// none of their answers read, until the client's own writes blocked: the
/// server stopped reading, since its answers no longer fit the buffers.
fn pipelined_until_the_server_stalls(server: &Server) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(server.http).unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let requests = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(100);
    // A bound, in case some system's buffers took all of it.
    for _ in 0..100_000 {
        if stream.write_all(&requests).is_err() {
            return stream;
        }
    }
    panic!("the server kept reading 370 MB of unanswered requests");
}

/// A client that sends requests and never reads the answers stalls the
/// server's writes once the socket buffers fill: the connection is closed
/// 10 s after the last write that made progress, so it can neither hold
/// the connection nor keep shutdown waiting for the 30 s drain bound.
#[test]
fn a_client_that_never_reads_neither_holds_the_connection_nor_delays_shutdown() {
    let server = Server::start(&[]);
    let stream = pipelined_until_the_server_stalls(&server);
    let stopping = Instant::now();
    // Exits cleanly within 20 s (`stop`'s bound): before the drain bound.
    server.stop();
    assert!(stopping.elapsed() < Duration::from_secs(20));
    drop(stream);
}

/// A client that reads its answers slowly but steadily (about 40 KB/s
/// here, four times the least the docs promise) is not cut by the write
/// timeout, however long it takes: the send buffer is bounded, so each
/// little it reads wakes the server's blocked write.
#[test]
fn a_client_that_reads_slowly_but_steadily_keeps_its_connection() {
    use std::io::Read;
    let server = Server::start(&[]);
    let mut stream = pipelined_until_the_server_stalls(&server);
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    let mut read = 0;
    // Past the 10 s write timeout, with a margin.
    while started.elapsed() < Duration::from_secs(14) {
        match stream.read(&mut buf) {
            Ok(0) => panic!("closed after {:?}, {read} bytes read", started.elapsed()),
            Ok(n) => read += n,
            Err(e) => panic!("{e} after {:?}, {read} bytes read", started.elapsed()),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(stream);
    server.stop();
}

/// A client controls descriptor values (paths, headers) and Envoy lets a
/// descriptor carry its own hits_addend: neither a long value nor a huge
/// cost may turn the call into an error, which Envoy would answer by
/// letting the request through unlimited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_values_and_huge_costs_never_void_the_other_limits() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let mut grpc = server.grpc().await;
    let long = "x".repeat(60_000);
    // "login" allows 2: the third is refused, however long the other value.
    for (i, expected) in [Code::Ok, Code::Ok, Code::OverLimit]
        .into_iter()
        .enumerate()
    {
        let r = should(
            &mut grpc,
            "edge",
            vec![
                descriptor(&[("remote_address", &long)]),
                descriptor(&[("path", "/login")]),
            ],
            1,
        )
        .await;
        assert_eq!(r.overall_code, expected as i32, "request {i}");
        assert_eq!(r.statuses[1].code, expected as i32, "request {i}");
    }
    // Envoy's default header budget (60 KiB) in every one of the 64
    // descriptors a request may carry: a message of nearly 4 MB.
    let mut many: Vec<_> = (0..63)
        .map(|i| descriptor(&[(format!("header{i}").as_str(), long.as_str())]))
        .collect();
    many.push(descriptor(&[("path", "/login")]));
    let r = should(&mut grpc, "edge", many, 1).await;
    assert_eq!(r.statuses.len(), 64);
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[63].code, Code::OverLimit as i32);
    for huge in [(1u64 << 53), u64::MAX] {
        let mut costly = descriptor(&[("remote_address", "10.8.8.8")]);
        costly.hits_addend = Some(huge);
        let r = should(
            &mut grpc,
            "edge",
            vec![costly, descriptor(&[("path", "/x")])],
            1,
        )
        .await;
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
        // It never fits: no wait is given, and the budget it left alone
        // is reported whole.
        assert_eq!(r.statuses[0].duration_until_reset, None);
        assert_eq!(r.statuses[0].limit_remaining, 100);
        assert_eq!(r.statuses[1].code, Code::Ok as i32);
    }
    // The refused requests consumed nothing from the other descriptors.
    let mut peek = descriptor(&[("path", "/x")]);
    peek.hits_addend = Some(0);
    let r = should(&mut grpc, "edge", vec![peek], 1).await;
    assert_eq!(r.statuses[0].limit_remaining, 7);
    server.stop();
}

/// Envoy sends one descriptor twice when, say, route and virtual host both
/// rate-limit on remote_address: the two are one count at twice the cost,
/// and a refusal consumes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_sent_twice_is_decided_once_at_twice_the_cost() {
    let file = ConfigFile::new(
        "[[domains]]\ndomain = \"d\"\n[[domains.descriptors]]\nkey = \"remote_address\"\nlimit = 3\nwindow_ms = 3600000\n",
    );
    let server = Server::start(&["--config", file.path()]);
    let mut grpc = server.grpc().await;
    let one = descriptor(&[("remote_address", "10.0.0.1")]);
    let r = should(&mut grpc, "d", vec![one.clone()], 2).await;
    assert_eq!(r.statuses[0].limit_remaining, 1);
    let r = should(&mut grpc, "d", vec![one.clone(), one.clone()], 1).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    for s in &r.statuses {
        assert_eq!(s.code, Code::OverLimit as i32);
        assert_eq!(s.limit_remaining, 1);
    }
    let r = should(&mut grpc, "d", vec![one], 1).await;
    assert_eq!(
        r.overall_code,
        Code::Ok as i32,
        "the refusal consumed nothing"
    );
    assert_eq!(r.statuses[0].limit_remaining, 0);
    server.stop();
}

/// grpc.health.v1.Health: SERVING for the server and the rate-limit
/// service (under envoyproxy/ratelimit's name too) while it runs,
/// NOT_SERVING once SIGTERM starts the shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_serves_then_turns_not_serving_on_sigterm() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    const RLS: &str = "envoy.service.ratelimit.v3.RateLimitService";
    let server = Server::start(&[]);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let ask = |service: &str| HealthCheckRequest {
        service: service.into(),
    };
    for service in ["", RLS, "ratelimit"] {
        let r = health.check(ask(service)).await.unwrap().into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let unknown = health.check(ask("no.such.Service")).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    let mut watches = Vec::new();
    for service in [RLS, "ratelimit"] {
        let mut watch = health.watch(ask(service)).await.unwrap().into_inner();
        let first = tokio::time::timeout(Duration::from_secs(10), watch.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(first.status, ServingStatus::Serving as i32, "{service}");
        watches.push((service, watch));
    }
    server.signal("TERM");
    for (service, watch) in &mut watches {
        let next = tokio::time::timeout(Duration::from_secs(10), watch.message())
            .await
            .expect("a status change within 10 s of SIGTERM")
            .unwrap()
            .unwrap();
        assert_eq!(next.status, ServingStatus::NotServing as i32, "{service}");
    }
    drop(watches);
    drop(health);
    server.stop();
}

/// Shutdown waits for calls, not for connections: gRPC peers that hold a
/// connection open with nothing to finish (one that never sends its
/// preface, one that stops after it, one watching health) neither delay
/// the exit to the 30 s drain bound nor make it a failure, nor are they
/// logged as requests the stop waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_grpc_peers_and_health_watches_do_not_hold_up_shutdown() {
    use std::io::Write;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let (server, log) = Server::start_logged(&[]);
    let silent = std::net::TcpStream::connect(server.grpc).unwrap();
    let mut preface_only = std::net::TcpStream::connect(server.grpc).unwrap();
    preface_only
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), watch.message()).await;
    assert!(matches!(first, Ok(Ok(Some(_)))), "{first:?}");
    // A call answered just before the signal is answered in full.
    let mut grpc = server.grpc().await;
    let r = should(&mut grpc, "any", vec![descriptor(&[("k", "v")])], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);

    let started = Instant::now();
    // Stops on its own thread: `stop` blocks, and the watch needs this
    // runtime to answer the server's GOAWAY.
    let stopped = tokio::task::spawn_blocking(move || server.stop());
    stopped.await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "shutdown took {:?}",
        started.elapsed()
    );
    let lines = log.to_the_end();
    assert!(lines.iter().any(|l| l.contains("stopped")), "{lines:#?}");
    assert!(
        !lines.iter().any(|l| l.contains("waiting for the requests")),
        "{lines:#?}"
    );
    drop((silent, preface_only, watch, health));
}

/// A gRPC peer is bounded in streams per connection (the server's HTTP/2
/// settings say how many, as configured), in the bytes its calls can make the server hold
/// (a stream past that is refused with `RESOURCE_EXHAUSTED`), and in how
/// long a message may take to arrive (`DEADLINE_EXCEEDED` after 2 s); what
/// the failed streams held is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_peer_cannot_make_the_server_hold_unbounded_streams_or_bytes() {
    let file = ConfigFile::new(
        "[server]\ngrpc_max_streams_per_connection = 5\n[keys]\nlimit = 100\nwindow_ms = 1000\n",
    );
    let server = Server::start(&["--config", file.path()]);
    let tcp = tokio::net::TcpStream::connect(server.grpc).await.unwrap();
    let (client, mut connection) = h2::client::handshake(tcp).await.unwrap();
    // Driven here, so that the stream bound the server's settings announce
    // can be read as it arrives.
    let announced = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = std::sync::Arc::clone(&announced);
    let driver = tokio::spawn(std::future::poll_fn(move |cx| {
        let polled = std::future::Future::poll(std::pin::Pin::new(&mut connection), cx);
        seen.store(
            connection.max_concurrent_send_streams(),
            std::sync::atomic::Ordering::Relaxed,
        );
        polled.map(|_| ())
    }));
    let mut client = client.ready().await.unwrap();
    let request = || raw_rls_head(server.grpc, None);
    // Streams announcing a 4 MiB message and sending 3 MiB of it, never
    // the rest: the connection's bound (two whole messages) holds two, and
    // a stream whose data passes it is answered at once.
    let part = bytes::Bytes::from(vec![0u8; 3 << 20]);
    let (answered, mut answers) = tokio::sync::mpsc::channel(3);
    let mut held = Vec::new();
    for _ in 0..3 {
        let (response, mut stream) = client.send_request(request(), false).unwrap();
        let mut message = vec![0u8];
        message.extend_from_slice(&(4u32 << 20).to_be_bytes());
        stream.send_data(message.into(), false).unwrap();
        stream.send_data(part.clone(), false).unwrap();
        let answered = answered.clone();
        held.push((
            tokio::spawn(async move {
                let _ = answered.send(response.await).await;
            }),
            stream,
        ));
        client = client.ready().await.unwrap();
    }
    let answer = tokio::time::timeout(Duration::from_secs(8), answers.recv())
        .await
        .expect("a stream is answered at once, not at the 10 s deadline")
        .unwrap()
        .unwrap();
    assert_eq!(
        announced.load(std::sync::atomic::Ordering::Relaxed),
        5,
        "the stream bound the server's settings announce"
    );
    let status = answer
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(status.as_deref(), Some("8"), "{answer:?}");
    // Percent-encoded, as gRPC sends it.
    let message = answer.headers()["grpc-message"]
        .to_str()
        .unwrap()
        .replace("%20", " ");
    assert!(
        message.contains("this connection's calls would hold more than"),
        "{message}"
    );
    // The others: refused the same way (frames interleave, so a second
    // stream can pass the bound before the first refused one gives its
    // bytes back), or failed once their message is not whole by its
    // deadline, which gives their bytes back too.
    for _ in 1..3 {
        let more = tokio::time::timeout(Duration::from_secs(8), answers.recv())
            .await
            .expect("every stream is answered by the message deadline")
            .unwrap()
            .unwrap();
        let code = more.headers()["grpc-status"].to_str().unwrap().to_owned();
        assert!(code == "8" || code == "4", "{more:?}");
    }
    // A message that stops short is failed at its deadline, not held to
    // the call's 10 s.
    let started = Instant::now();
    let (response, mut stream) = client.send_request(request(), false).unwrap();
    let mut message = vec![0u8];
    message.extend_from_slice(&100u32.to_be_bytes());
    message.extend_from_slice(&[0u8; 10]);
    stream.send_data(message.into(), false).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(8), response)
        .await
        .expect("answered at the message deadline")
        .unwrap();
    assert_eq!(answer.headers()["grpc-status"], "4", "{answer:?}");
    assert!(
        started.elapsed() >= ratewarden_server::request_bytes::MESSAGE_DEADLINE,
        "{:?}",
        started.elapsed()
    );
    drop(stream);
    for (waiting, stream) in held {
        waiting.abort();
        drop(stream);
    }
    drop(client);
    driver.abort();
    let mut grpc = server.grpc().await;
    let r = should(&mut grpc, "any", vec![descriptor(&[("k", "v")])], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    server.stop();
}

/// A call whose message is still arriving when shutdown begins is waited
/// for, and answered, like a call being decided: only connections with no
/// work left are dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_call_whose_message_is_still_arriving() {
    use prost::Message;
    let server = Server::start(&[]);
    let tcp = tokio::net::TcpStream::connect(server.grpc).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let message = grpc_message(&RateLimitRequest {
        domain: "any".into(),
        descriptors: vec![descriptor(&[("k", "v")])],
        hits_addend: 1,
    });
    let (response, mut stream) = client
        .send_request(raw_rls_head(server.grpc, None), false)
        .unwrap();
    let half = message.len() / 2;
    stream
        .send_data(bytes::Bytes::copy_from_slice(&message[..half]), false)
        .unwrap();
    // Shutdown begins with half the message sent. The rest comes after the
    // time shutdown gives connections once no call is open, and before
    // the message's deadline: 200 ms past the first, which leaves 600 ms
    // before the second for a busy machine to be late in (late is what a
    // busy machine is; early it cannot be).
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.signal("TERM");
    tokio::time::sleep(ratewarden_server::GRPC_GOAWAY_GRACE + Duration::from_millis(200)).await;
    assert!(
        ratewarden_server::GRPC_GOAWAY_GRACE + Duration::from_millis(400)
            < ratewarden_server::request_bytes::MESSAGE_DEADLINE
    );
    stream
        .send_data(bytes::Bytes::copy_from_slice(&message[half..]), true)
        .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("answered within 5 s")
        .expect("the call is answered, not cut by the shutdown");
    let mut body = answer.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = body.data().await {
        data.extend_from_slice(&chunk.unwrap());
    }
    let trailers = body.trailers().await.unwrap().unwrap();
    assert_eq!(trailers["grpc-status"], "0", "{trailers:?}");
    let answer = RateLimitResponse::decode(&data[5..]).unwrap();
    assert_eq!(answer.overall_code, Code::Ok as i32);
    driver.abort();
    tokio::task::spawn_blocking(move || server.stop())
        .await
        .unwrap();
}

/// A call's deadline is the client's `grpc-timeout` (or the server's 10 s
/// bound): a call not answered by then is answered `DEADLINE_EXCEEDED`, and
/// a call already past it is not decided, so it spends none of the budget.
/// A `grpc-timeout` of zero is none; one that is not a timeout is refused,
/// saying how to write it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_grpc_timeout_is_answered_deadline_exceeded_and_not_decided() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    // `login`: 2 an hour.
    let login = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![descriptor(&[("path", "/login")])],
        hits_addend: 1,
    };
    // A nanosecond has passed by the time the call is first polled.
    let (status, message, _) = raw_should(server.grpc, "1n", &login, true).await;
    assert_eq!(status, "4", "{message}");
    assert_eq!(
        message,
        "the call was not answered within its deadline, 1ns (the client's grpc-timeout)"
    );
    let (status, message, _) = raw_should(server.grpc, "20ms", &login, true).await;
    assert_eq!(status, "3", "{message}");
    assert!(
        message.contains("\"20ms\" is not a gRPC timeout: write 1 to 8 digits and a unit"),
        "{message}"
    );
    // Zero is no deadline (Envoy's `timeout: 0s`): decided, and answered
    // (see serve_redis.rs for a store that takes its time).
    let (status, message, _) = raw_should(server.grpc, "0m", &login, true).await;
    assert_eq!(status, "0", "{message}");
    // Neither of the first two spent any of the budget: one more is
    // admitted, then refused.
    let mut grpc = server.grpc().await;
    for expected in [Code::Ok, Code::OverLimit] {
        let r = should(&mut grpc, "edge", login.descriptors.clone(), 1).await;
        assert_eq!(r.overall_code, expected as i32);
    }
    // A call whose message has not arrived by its deadline.
    let started = Instant::now();
    let (status, message, answered) = raw_should(server.grpc, "300m", &login, false).await;
    assert_eq!(status, "4", "{message}");
    assert_eq!(
        message,
        "the call was not answered within its deadline, 300ms (the client's grpc-timeout)"
    );
    let took = answered - started;
    assert!(
        took >= Duration::from_millis(300)
            && took < ratewarden_server::request_bytes::MESSAGE_DEADLINE,
        "{took:?}"
    );
    // A timeout in time is answered as usual.
    let (status, message, _) = raw_should(server.grpc, "5S", &login, true).await;
    assert_eq!(status, "0", "{message}");
    let client = client();
    let metric = |series| common::metric(&client, server.http, series);
    assert_eq!(metric("ratewarden_grpc_deadlines_exceeded_total").await, 2);
    assert_eq!(
        metric("ratewarden_bad_requests_total{api=\"grpc\"}").await,
        1
    );
    // Every call is timed, however it ended: the two past their deadline
    // (one at 300 ms or more) and the refused one among them.
    assert_eq!(
        metric("ratewarden_request_duration_seconds_count{api=\"grpc\"}").await,
        7
    );
    assert!(
        metric("ratewarden_request_duration_seconds_bucket{api=\"grpc\",le=\"0.25\"}").await <= 6
    );
    server.stop();
}

fn with_override(entries: &[(&str, &str)], limit: u32, unit: Unit) -> RateLimitDescriptor {
    let mut d = descriptor(entries);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: limit,
        unit: unit as i32,
    });
    d
}

const OVERRIDDEN: &str = r#"
[[domains]]
domain = "api"

[[domains.descriptors]]
key = "user"
name = "per-user"
policy = "sliding-log"
limit = 3
unit = "minute"

[[domains.descriptors]]
key = "bucket"
policy = "token-bucket"
limit = 3
unit = "minute"
burst = 10

[[domains.descriptors]]
key = "trial"
policy = "sliding-log"
limit = 3
unit = "minute"
shadow = true

[[domains.descriptors]]
key = "internal"
unlimited = true
"#;

/// Over HTTP a descriptor may carry a limit override too, as Envoy's
/// `RateLimitDescriptor.limit` writes it; it shares its count with the
/// same override over gRPC. A malformed one is refused, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_descriptor_may_carry_a_limit_override() {
    let file = ConfigFile::new(OVERRIDDEN);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let ask = |limit: Value| {
        let (client, url) = (client.clone(), server.url());
        let mut d = json!({"entries": [{"key": "user", "value": "cy"}]});
        if limit != json!("none") {
            d["limit"] = limit;
        }
        async move {
            let r = client
                .post(&url)
                .json(&json!({"domain": "api", "descriptors": [d]}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let hourly = json!({"requests_per_unit": 2, "unit": "HOUR"});
    let (status, body) = ask(hourly.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (&body["rule"], &body["limit"], &body["window_ms"]),
        (&json!("per-user.override"), &json!(2), &json!(3_600_000)),
        "{body}"
    );
    // Without it, the rule's own 3 a minute, untouched.
    let (status, body) = ask(json!("none")).await;
    assert_eq!((status, &body["rule"]), (200, &json!("per-user")), "{body}");
    assert_eq!(body["remaining"], 2, "{body}");
    // The same override over gRPC takes the last of its count.
    let mut grpc = server.grpc().await;
    let cy = with_override(&[("user", "cy")], 2, Unit::Hour);
    let r = should(&mut grpc, "api", vec![cy], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    let (status, body) = ask(hourly).await;
    assert_eq!(status, 429, "{body}");

    for (limit, message) in [
        (
            json!({"requests_per_unit": 2, "unit": "fortnight"}),
            "descriptors[0].limit.unit \"fortnight\" is no unit; use second, minute, hour, day, \
             week, month (30 days) or year (365 days)",
        ),
        (
            json!({"requests_per_unit": "2", "unit": "hour"}),
            "descriptors[0].limit.requests_per_unit is a string: it must be a JSON number",
        ),
        (
            json!({"requests_per_unit": 2.5, "unit": "hour"}),
            "descriptors[0].limit.requests_per_unit is 2.5: it must be a whole number",
        ),
        (
            json!({"requests_per_unit": 2}),
            "descriptors[0].limit needs both requests_per_unit and unit, such as",
        ),
        (
            json!({"requests_per_unit": 2, "unit": "hour", "window_ms": 10}),
            "descriptors[0].limit: unknown field `window_ms`",
        ),
        (
            json!(null),
            "descriptors[0].limit is null: leave it out for the configured rule's limit",
        ),
        (json!(5), "descriptors[0].limit is 5: leave it out"),
        (json!("x".repeat(1000)), "descriptors[0].limit is a string: leave it out"),
        (
            json!({"requests_per_unit": 2, "unit": "y".repeat(1000)}),
            "descriptors[0].limit.unit \"yyyyyyyyyyyyyyyyyyyyyyyy... (1000 characters)\" is no unit",
        ),
    ] {
        let (status, body) = ask(limit).await;
        assert_eq!(status, 400, "{body}");
        let error = body["error"].as_str().unwrap();
        assert!(error.contains(message), "{error}");
    }
}

/// Over HTTP a descriptor that reached an `unlimited = true` node says so,
/// as gRPC's `limit_remaining` 2^32 - 1 does: a client checking its rules
/// with curl can tell it from a descriptor that matched no rule (a typo).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_descriptor_says_when_an_unlimited_node_matched() {
    let file = ConfigFile::new(OVERRIDDEN);
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let ask = |descriptors: Value| {
        let (client, url) = (client.clone(), server.url());
        async move {
            let r = client
                .post(&url)
                .json(&json!({"domain": "api", "descriptors": descriptors}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let internal = json!({"entries": [{"key": "internal", "value": "backup"}]});
    let typo = json!({"entries": [{"key": "internl", "value": "backup"}]});
    let user = json!({"entries": [{"key": "user", "value": "dee"}]});

    let (status, body) = ask(json!([internal])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (&body["unlimited"], &body["descriptors"][0]["unlimited"]),
        (&json!(true), &json!(true)),
        "{body}"
    );
    assert_eq!(
        (&body["rule"], &body["limit"]),
        (&Value::Null, &Value::Null)
    );
    // No rule matched: nothing says unlimited.
    let (status, body) = ask(json!([typo])).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.get("unlimited").is_none(), "{body}");
    assert!(body["descriptors"][0].get("unlimited").is_none(), "{body}");
    // Beside a rule, the rule speaks for the request; the list says which
    // descriptor was unlimited.
    let (status, body) = ask(json!([internal, user, typo])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["rule"], "per-user", "{body}");
    assert!(body.get("unlimited").is_none(), "{body}");
    let unlimited: Vec<_> = (0..3)
        .map(|i| body["descriptors"][i].get("unlimited").cloned())
        .collect();
    assert_eq!(unlimited, [Some(json!(true)), None, None], "{body}");
}

/// A descriptor's limit override replaces the configured limit and window,
/// with counts of its own, as envoyproxy/ratelimit applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_override_is_applied_with_counts_of_its_own() {
    let file = ConfigFile::new(OVERRIDDEN);
    let server = Server::start(&["--config", file.path()]);
    let mut grpc = server.grpc().await;
    let limit = |r: &RateLimitResponse| {
        let l = r.statuses[0].current_limit.clone().unwrap();
        (l.name, l.requests_per_unit, l.unit)
    };

    // 1 an hour on a rule of 3 a minute: refused on the second request.
    let ann = with_override(&[("user", "ann")], 1, Unit::Hour);
    let r = should(&mut grpc, "api", vec![ann.clone()], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(
        limit(&r),
        ("per-user.override".to_owned(), 1, Unit::Hour as i32)
    );
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let r = should(&mut grpc, "api", vec![ann.clone()], 1).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert!(r.statuses[0].duration_until_reset.is_some());
    // The same descriptor without the override still has the rule's 3.
    let r = should(&mut grpc, "api", vec![descriptor(&[("user", "ann")])], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(limit(&r), ("per-user".to_owned(), 3, Unit::Minute as i32));
    assert_eq!(r.statuses[0].limit_remaining, 2);

    // Different overrides of one descriptor keep different counts.
    let two = with_override(&[("user", "bob")], 2, Unit::Hour);
    for expected in [Code::Ok, Code::Ok, Code::OverLimit] {
        let r = should(&mut grpc, "api", vec![two.clone()], 1).await;
        assert_eq!(r.overall_code, expected as i32);
    }
    let r = should(
        &mut grpc,
        "api",
        vec![with_override(&[("user", "bob")], 5, Unit::Hour)],
        1,
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 4);
    let r = should(
        &mut grpc,
        "api",
        vec![with_override(&[("user", "bob")], 2, Unit::Day)],
        1,
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 1);
    // And different values of one override keep different counts.
    let r = should(
        &mut grpc,
        "api",
        vec![with_override(&[("user", "cy")], 2, Unit::Hour)],
        1,
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 1);

    // Without an override, an unlimited node has all there is left, and a
    // descriptor no rule matches nothing, as envoyproxy/ratelimit answers:
    // a client can tell the two apart.
    let r = should(
        &mut grpc,
        "api",
        vec![
            descriptor(&[("internal", "x")]),
            descriptor(&[("nothing", "x")]),
        ],
        1,
    )
    .await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert!(r.statuses.iter().all(|s| s.current_limit.is_none()));
    assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
    assert_eq!(r.statuses[1].limit_remaining, 0);

    // No rule matches, or the node is unlimited: the override still
    // limits, under the reference policy.
    for entries in [[("nothing", "x")], [("internal", "x")]] {
        let d = with_override(&entries, 1, Unit::Day);
        let r = should(&mut grpc, "api", vec![d.clone()], 1).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(limit(&r), ("api.override".to_owned(), 1, Unit::Day as i32));
        let r = should(&mut grpc, "api", vec![d], 1).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32, "{entries:?}");
    }
    // An unknown domain stays unlimited.
    for _ in 0..2 {
        let d = with_override(&[("user", "ann")], 1, Unit::Day);
        let r = should(&mut grpc, "nowhere", vec![d], 1).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(r.statuses[0].current_limit.is_none());
    }

    // A bucket's burst is the override's limit, not the rule's.
    let d = with_override(&[("bucket", "x")], 2, Unit::Hour);
    let r = should(&mut grpc, "api", vec![d.clone()], 1).await;
    assert_eq!(r.statuses[0].limit_remaining, 1);
    let r = should(&mut grpc, "api", vec![d.clone()], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    let r = should(&mut grpc, "api", vec![d], 1).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);

    // A shadow rule's override counts but never refuses.
    let d = with_override(&[("trial", "x")], 1, Unit::Hour);
    for _ in 0..2 {
        let r = should(&mut grpc, "api", vec![d.clone()], 1).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
    }

    // With and without the override in one request: two counts. The
    // override refuses, and the rule's count consumes nothing.
    let both = vec![
        with_override(&[("user", "dee")], 1, Unit::Hour),
        descriptor(&[("user", "dee")]),
    ];
    let r = should(&mut grpc, "api", both.clone(), 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(
        (r.statuses[0].limit_remaining, r.statuses[1].limit_remaining),
        (0, 2)
    );
    let r = should(&mut grpc, "api", both, 1).await;
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(r.statuses[1].code, Code::Ok as i32);
    // 2 were left: this one takes 1.
    let r = should(&mut grpc, "api", vec![descriptor(&[("user", "dee")])], 1).await;
    assert_eq!(r.statuses[0].limit_remaining, 1);

    let client = client();
    let refused = r#"ratewarden_decisions_total{rule="per-user.override",outcome="refused"}"#;
    assert_eq!(common::metric(&client, server.http, refused).await, 3);
    let shadow =
        r#"ratewarden_decisions_total{rule="api.trial.override",outcome="shadow_refused"}"#;
    assert_eq!(common::metric(&client, server.http, shadow).await, 1);
    // Keys of every override of a rule, summed: ann, bob (three
    // overrides), cy and dee.
    let keys = r#"ratewarden_keys_tracked{rule="per-user.override"}"#;
    assert_eq!(common::metric(&client, server.http, keys).await, 6);
    let ignored = "ratewarden_limit_overrides_ignored_total";
    assert_eq!(common::metric(&client, server.http, ignored).await, 0);
    server.stop();
}

/// TLS files for Redis with the embedded store are not used, and the
/// start-up log says so rather than leaving them silently ignored.
#[test]
fn redis_tls_files_with_the_embedded_store_are_warned_about() {
    let file =
        ConfigFile::new("[redis]\ntls_ca_file = \"ca.crt\"\n[keys]\nlimit = 1\nwindow_ms = 1000\n");
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let line = log.next_containing("[redis] table names TLS files");
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("rediss://"), "{line}");
    server.stop();
}

/// Each distinct override is a limiter of its own, so their number is
/// bounded: beyond 256, the configured rule applies, and the override is
/// counted as ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_beyond_the_bound_are_ignored() {
    let file = ConfigFile::new(OVERRIDDEN);
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let mut grpc = server.grpc().await;
    let name = |r: &RateLimitResponse| r.statuses[0].current_limit.clone().unwrap().name;
    for limit in 1..=256 {
        let d = with_override(&[("user", "ann")], limit, Unit::Hour);
        let r = should(&mut grpc, "api", vec![d], 1).await;
        assert_eq!(name(&r), "per-user.override");
    }
    let d = with_override(&[("user", "ann")], 1000, Unit::Hour);
    let r = should(&mut grpc, "api", vec![d], 1).await;
    assert_eq!(name(&r), "per-user");
    assert_eq!(r.statuses[0].limit_remaining, 2);
    // Overrides already made still apply.
    let d = with_override(&[("user", "ann")], 1, Unit::Hour);
    let r = should(&mut grpc, "api", vec![d], 1).await;
    assert_eq!(name(&r), "per-user.override");
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    let ignored = "ratewarden_limit_overrides_ignored_total";
    assert_eq!(common::metric(&client(), server.http, ignored).await, 1);
    // The warning names the bound and what to change.
    let line = log.next_containing("override");
    assert!(
        line.contains("the bound of 256 distinct overrides")
            && line.contains("configure the limits as descriptors of their own")
            && line.contains("overrides_not_logged=0"),
        "{line}"
    );
    server.stop();
}

/// An override with no unit (`UNKNOWN`) says no window: it is ignored, the
/// configured rule applies, and the override is counted (and logged),
/// never silently lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_without_a_unit_is_ignored_and_counted() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let mut grpc = server.grpc().await;
    let d = with_override(&[("path", "/login")], 1000, Unit::Unknown);
    let r = should(&mut grpc, "edge", vec![d.clone()], 1).await;
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((limit.name.as_str(), limit.requests_per_unit), ("login", 2));
    // A request refused as invalid applied no rule in its place: not
    // counted.
    let refused = grpc
        .should_rate_limit(RateLimitRequest {
            domain: String::new(),
            descriptors: vec![d],
            hits_addend: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    let metrics = common::metrics(&client(), server.http).await;
    assert!(
        metrics.contains("\nratewarden_limit_overrides_ignored_total 1\n"),
        "{metrics}"
    );
    server.stop();
}

/// An override of a `sliding-log` rule whose key's log could hold more
/// than 10,000 entries is ignored and counted, the configured rule
/// applying: a caller choosing 2^53 a year grew one key's log without
/// bound, every decision on it reading and writing it whole. An override
/// within the bound is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_log_override_past_the_log_bound_is_ignored() {
    let file = ConfigFile::new(OVERRIDDEN);
    let server = Server::start(&["--config", file.path()]);
    let ask = |limit: u64, unit: &str| {
        let (client, url) = (client(), server.url());
        let d = json!({"entries": [{"key": "user", "value": "cy"}],
                       "limit": {"requests_per_unit": limit, "unit": unit}});
        async move {
            let r = client
                .post(&url)
                .json(&json!({"domain": "api", "descriptors": [d]}))
                .send()
                .await
                .unwrap();
            r.json::<Value>().await.unwrap()
        }
    };
    let body = ask(9_007_199_254_740_991, "year").await;
    assert_eq!(
        (&body["rule"], &body["limit"]),
        (&json!("per-user"), &json!(3)),
        "{body}"
    );
    let body = ask(10_000, "hour").await;
    assert_eq!(
        (&body["rule"], &body["limit"]),
        (&json!("per-user.override"), &json!(10_000)),
        "{body}"
    );
    let metrics = common::metrics(&client(), server.http).await;
    assert!(
        metrics.contains("\nratewarden_limit_overrides_ignored_total 1\n"),
        "{metrics}"
    );
    server.stop();
}

/// With `limit_overrides = false` a caller cannot choose its own limit:
/// an override, over gRPC or HTTP, is ignored, the configured rule
/// applies, and the override is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_can_be_turned_off() {
    let file = ConfigFile::new(&format!("[server]\nlimit_overrides = false\n{OVERRIDDEN}"));
    let server = Server::start(&["--config", file.path()]);
    let mut grpc = server.grpc().await;
    let d = with_override(&[("user", "cy")], 1_000_000, Unit::Second);
    let r = should(&mut grpc, "api", vec![d], 1).await;
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.name.as_str(), limit.requests_per_unit),
        ("per-user", 3)
    );
    assert_eq!(r.statuses[0].limit_remaining, 2);
    let body: Value = client()
        .post(server.url())
        .json(&json!({"domain": "api", "descriptors": [{
            "entries": [{"key": "user", "value": "cy"}],
            "limit": {"requests_per_unit": 1_000_000, "unit": "second"}}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&body["rule"], &body["limit"], &body["remaining"]),
        (&json!("per-user"), &json!(3), &json!(1)),
        "{body}"
    );
    let metrics = common::metrics(&client(), server.http).await;
    assert!(
        metrics.contains("\nratewarden_limit_overrides_ignored_total 2\n"),
        "{metrics}"
    );
    server.stop();
}

/// A rule that a reload renames leaves `/metrics` with its old name; the
/// new name's series start there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_rule_leaves_no_stale_series() {
    let rules = |name: &str| format!("[keys]\nname = \"{name}\"\nlimit = 5\nwindow_ms = 3600000\n");
    let file = ConfigFile::new(&rules("before"));
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let (status, _, _) = post(&client, &server.url(), json!({"key": "k"})).await;
    assert_eq!(status, 200);
    let text = common::metrics(&client, server.http).await;
    assert!(text.contains("rule=\"before\""), "{text}");
    file.write(&rules("after"));
    server.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = common::metrics(&client, server.http).await;
        if text.contains("ratewarden_config_reloads_total{result=\"ok\"} 1\n") {
            break;
        }
        assert!(Instant::now() < deadline, "no reload within 10 s of SIGHUP");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A rename keeps the counts (the rule's place and numbers are the same).
    let (status, _, body) = post(&client, &server.url(), json!({"key": "k"})).await;
    assert_eq!((status, &body["remaining"]), (200, &json!(3)), "{body}");
    let text = common::metrics(&client, server.http).await;
    assert!(!text.contains("rule=\"before\""), "{text}");
    assert!(
        text.contains("ratewarden_decisions_total{rule=\"after\",outcome=\"allowed\"} 1\n"),
        "{text}"
    );
    server.stop();
}

/// A rule renamed and later named back starts its series afresh, whether
/// or not `/metrics` was read in between: the series of a rule a reload
/// renamed are dropped at the reload, not only at the next scrape (where a
/// server never scraped kept every name it ever had).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_named_back_starts_its_series_afresh_without_a_scrape() {
    let rules = |name: &str| format!("[keys]\nname = \"{name}\"\nlimit = 5\nwindow_ms = 3600000\n");
    let file = ConfigFile::new(&rules("before"));
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let client = client();
    // One decision under each name, then the first name back.
    for next in ["after", "before"] {
        let (status, _, _) = post(&client, &server.url(), json!({"key": "k"})).await;
        assert_eq!(status, 200);
        file.write(&rules(next));
        server.signal("HUP");
        log.next_containing("configuration reloaded");
    }
    let text = common::metrics(&client, server.http).await;
    assert!(
        text.contains("ratewarden_decisions_total{rule=\"before\",outcome=\"allowed\"} 0\n"),
        "{text}"
    );
    server.stop();
}

/// Each interface holds at most `max_connections` open: one past that is
/// closed unserved and counted, and a place comes free when a connection
/// ends. A gRPC peer that never sends the HTTP/2 preface is closed after
/// 10 s, so silent connections cannot keep the places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_connections_are_closed_and_silent_grpc_peers_time_out() {
    use std::io::Read;
    let file =
        ConfigFile::new("[server]\nmax_connections = 2\n\n[keys]\nlimit = 100\nwindow_ms = 1000\n");
    let server = Server::start(&["--config", file.path()]);
    // Whether the server closes the connection within `within` (it may
    // write first: an HTTP/2 server sends its SETTINGS at once).
    let closed_within = |mut stream: std::net::TcpStream, within: Duration| {
        stream.set_read_timeout(Some(within)).unwrap();
        let mut sink = Vec::new();
        match stream.read_to_end(&mut sink) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    };
    for (api, addr) in [("grpc", server.grpc), ("http", server.http)] {
        let held: Vec<_> = (0..2)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        // Accepted in order: give the server a moment to take both (a
        // second, for a busy machine).
        tokio::time::sleep(Duration::from_secs(1)).await;
        let third = std::net::TcpStream::connect(addr).unwrap();
        assert!(
            closed_within(third, Duration::from_secs(5)),
            "{api}: a third connection is closed unserved"
        );
        drop(held);
        // And to see both closed, freeing their places.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The places came free: HTTP and gRPC both answer again.
    let client = reqwest::Client::new();
    let refused = |api| format!("ratewarden_connections_refused_total{{api=\"{api}\"}}");
    assert_eq!(
        common::metric(&client, server.http, &refused("http")).await,
        1
    );
    assert_eq!(
        common::metric(&client, server.http, &refused("grpc")).await,
        1
    );
    drop(client);
    let mut grpc = server.grpc().await;
    let r = should(&mut grpc, "any", vec![descriptor(&[("k", "v")])], 1).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    drop(grpc);

    // A silent gRPC peer is closed after the 10 s preface timeout.
    let silent = std::net::TcpStream::connect(server.grpc).unwrap();
    let started = Instant::now();
    assert!(closed_within(silent, Duration::from_secs(20)));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(15),
        "closed after {waited:?}"
    );
    server.stop();
}

/// Connections refused within the second after a warning are logged when
/// the second is up, not at the next refusal, which may never come: the
/// `refused` counts of the lines add up to every refusal.
#[tokio::test]
async fn every_refused_connection_is_logged_within_a_second_or_so() {
    use std::io::Read;
    let file =
        ConfigFile::new("[server]\nmax_connections = 1\n\n[keys]\nlimit = 100\nwindow_ms = 1000\n");
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let held = std::net::TcpStream::connect(server.http).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..5 {
        let mut refused = std::net::TcpStream::connect(server.http).unwrap();
        refused
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let _ = refused.read_to_end(&mut Vec::new());
    }
    let mut logged = 0;
    while logged < 5 {
        let line = log.next_containing("closed unserved");
        assert!(
            line.contains("1 connection is open on this interface"),
            "{line}"
        );
        logged += common::log_field(&line, "refused");
    }
    assert_eq!(logged, 5);
    drop(held);
}

/// Two descriptors matching one rule (each with a count of its own) give
/// that rule one member in each header, the one that binds most: members
/// of one name could not be told apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_ratelimit_member_per_rule_the_one_that_binds_most() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let client = reqwest::Client::new();
    let address = |a: &str| json!({"entries": [{"key": "remote_address", "value": a}]});
    for _ in 0..3 {
        let (status, _, _) = post(
            &client,
            &server.url(),
            json!({"domain": "edge", "descriptors": [address("192.0.2.1")]}),
        )
        .await;
        assert_eq!(status, 200);
    }
    let (status, headers, body) = post(
        &client,
        &server.url(),
        json!({"domain": "edge", "descriptors": [address("192.0.2.2"), address("192.0.2.1")]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["descriptors"][0]["remaining"], 99);
    assert_eq!(body["descriptors"][1]["remaining"], 96);
    assert_eq!(headers["ratelimit-policy"], "\"per-address\";q=100;w=3600");
    assert_eq!(headers["ratelimit"], "\"per-address\";r=96");
    server.stop();
}

/// `ratewarden serve` on free ports with an open-file limit of 128 set by
/// `ulimit FLAG` (`-Sn` the soft limit, `-n` both), its standard output
/// piped: `ulimit` in a shell that then becomes the server, so the limits
/// are the server's from its first instruction.
#[cfg(target_os = "linux")]
fn serve_with_open_files(flag: &str, stderr: std::process::Stdio) -> std::process::Child {
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit {flag} 128 && exec \"$0\" serve --http 127.0.0.1:0 --grpc 127.0.0.1:0"
        ))
        .arg(BIN)
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

/// `serve` raises its soft open-file limit so that `max_connections` on
/// both interfaces fits (a soft limit of 1,024 is common, the default is
/// 10,000 connections each), and says at start when the hard limit is
/// too low for it.
#[cfg(target_os = "linux")]
#[test]
fn serve_raises_its_open_file_limit_or_says_why_not() {
    use std::io::Read;
    use std::process::Stdio;
    let start = |ulimit: &str| {
        let mut child = serve_with_open_files(ulimit, Stdio::piped());
        let line = common::first_line(&mut child).unwrap();
        assert!(line.contains("ratewarden serve: HTTP on"), "{line}");
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
        let open_files: Vec<u64> = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap()
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        let _ = child.kill();
        let _ = child.wait();
        let mut log = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut log)
            .unwrap();
        (open_files[0], open_files[1], log)
    };
    // A low soft limit is raised, up to what 10,000 connections on each
    // interface need, or to the hard limit.
    let (soft, hard, log) = start("-Sn");
    let wanted = 2 * 10_000 + 256;
    assert_eq!(soft, hard.min(wanted), "{log}");
    // Said only when the hard limit itself is too low.
    assert_eq!(
        log.contains("the open-file limit is"),
        hard < wanted,
        "{log}"
    );
    // A hard limit too low is said at start, with what to change and how
    // many connections each interface then holds (128 files less a half
    // kept for the rest, over two interfaces); for the default
    // max_connections, not chosen, as information rather than a warning.
    let (soft, hard, log) = start("-n");
    assert_eq!((soft, hard), (128, 128));
    assert!(
        log.contains("the open-file limit is 128")
            && log.contains("each interface holds at most 32 connections")
            && log.contains("lower server.max_connections"),
        "{log}"
    );
    let line = log
        .lines()
        .find(|l| l.contains("the open-file limit is 128"))
        .unwrap();
    assert!(line.contains("INFO"), "{line}");
}

/// With a hard open-file limit too low for max_connections, each
/// interface holds what fits, and closes the next connection at once
/// rather than leaving it waiting for a file.
#[cfg(target_os = "linux")]
#[test]
fn connections_past_what_the_open_file_limit_fits_are_closed_at_once() {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = serve_with_open_files("-n", Stdio::null());
    let line = common::first_line(&mut child).unwrap();
    // Killed however the test ends, a failed assertion included.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Killed(child);
    let http: std::net::SocketAddr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("{line}"))
        .parse()
        .unwrap();
    // 32 fit (see serve_raises_its_open_file_limit_or_says_why_not).
    let held: Vec<std::net::TcpStream> = (0..32)
        .map(|_| std::net::TcpStream::connect(http).unwrap())
        .collect();
    let mut over = std::net::TcpStream::connect(http).unwrap();
    over.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    let read = over.read(&mut buf);
    assert!(
        matches!(read, Ok(0))
            || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the 33rd connection was not closed at once: {read:?}"
    );
    drop(held);
}

/// Rules that admit nothing are named in a warning at start, and again at
/// each reload that keeps or adds one.
#[cfg(unix)]
#[test]
fn rules_that_admit_nothing_are_named_at_start_and_at_reload() {
    let file = ConfigFile::new("[keys]\nlimit = 0\nwindow_ms = 1000\n");
    // Stopped when dropped, even when an assertion below fails.
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let next_warning = || log.next_containing("admit no request");
    let line = next_warning();
    assert!(
        line.contains("WARN") && line.contains("rules=keys"),
        "{line}"
    );
    file.write(
        "[keys]\nlimit = 5\nwindow_ms = 1000\n\n\
         [fallback]\npolicy = \"token-bucket\"\nlimit = 5\nburst = 0\nwindow_ms = 1000\n",
    );
    server.signal("HUP");
    let line = next_warning();
    assert!(line.contains("rules=fallback"), "{line}");
}

/// A bucket's default burst written out (`burst = limit`), or taken out
/// again, changes nothing: the rule keeps its counts across the reload, as
/// it does on Redis, whose keys are named by the effective burst.
#[cfg(unix)]
#[tokio::test]
async fn a_default_burst_written_out_keeps_the_counts_at_reload() {
    let rule = "[keys]\npolicy = \"token-bucket\"\nlimit = 5\nwindow_ms = 3600000\n";
    let file = ConfigFile::new(rule);
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let client = client();
    let statuses = |n| {
        let client = client.clone();
        let url = server.url();
        async move {
            let mut got = Vec::new();
            for _ in 0..n {
                got.push(post(&client, &url, json!({"key": "abuser"})).await.0);
            }
            got
        }
    };
    assert_eq!(statuses(6).await, [200, 200, 200, 200, 200, 429]);
    for text in [format!("{rule}burst = 5\n"), rule.to_owned()] {
        file.write(&text);
        server.signal("HUP");
        log.next_containing("configuration reloaded");
        assert_eq!(statuses(1).await, [429], "after reloading:\n{text}");
    }
    server.stop();
}

/// The server's housekeeping timer forgets keys that have gone idle, and
/// `/metrics` counts them and no longer holds them.
#[tokio::test]
async fn idle_keys_are_forgotten_by_the_servers_timer() {
    let file = ConfigFile::new(
        "[server]\nhousekeeping_interval_ms = 20\n\n\
         [keys]\npolicy = \"fixed-window\"\nlimit = 5\nwindow_ms = 10\n",
    );
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    for key in ["a", "b", "c"] {
        let (status, _, body) = post(&client, &server.url(), json!({"key": key})).await;
        assert_eq!(status, 200, "{body}");
    }
    let forgotten = "ratewarden_keys_forgotten_total{by=\"housekeeping\"}";
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = common::metrics(&client, server.http).await;
        if common::metric_value(&text, forgotten) == 3 {
            assert_eq!(
                common::metric_value(&text, "ratewarden_keys_tracked{rule=\"keys\"}"),
                0,
                "{text}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "idle keys not forgotten within 10 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A rule's store full of keys that all still count refuses a new key by
/// the failure policy, and its warning says where the store's size is set
/// and how long a key of the rule counts, which is what that size must
/// cover: not how often housekeeping runs, which a full store does not
/// wait for.
#[tokio::test]
async fn a_full_store_says_how_long_its_keys_count() {
    let file = ConfigFile::new(
        "[server]\nmax_keys = 1\n\n\
         [keys]\npolicy = \"sliding-window-counter\"\nlimit = 5\nwindow_ms = 60000\n",
    );
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let client = client();
    let (status, _, _) = post(&client, &server.url(), json!({"key": "a"})).await;
    assert_eq!(status, 200);
    let (status, _, body) = post(&client, &server.url(), json!({"key": "b"})).await;
    assert_eq!(
        (status, &body["failure_policy"], &body["failure"]),
        (429, &json!(true), &json!("capacity_exhausted")),
        "{body}"
    );
    // A decision by the store has neither field.
    let (_, _, body) = post(&client, &server.url(), json!({"key": "a"})).await;
    assert!(
        body.get("failure_policy").is_none() && body.get("failure").is_none(),
        "{body}"
    );
    let line = log.next_containing("store failed");
    assert!(line.contains("rule=keys"), "{line}");
    assert!(
        line.contains(
            "(in ratewarden serve: [server] max_keys; a key of this rule still counts up to \
             120000 ms after its last request)"
        ),
        "{line}"
    );
    assert!(!line.contains("housekeeping"), "{line}");
}

/// A full store's refusals of new keys are an episode like an outage: the
/// first call to succeed a second after the last of them says so, and
/// counts those the one-a-second lines held back, so the log's counts add
/// up to every failure.
#[tokio::test]
async fn a_full_store_episode_ends_with_a_line_that_counts_its_failures() {
    let file = ConfigFile::new(
        "[server]\nmax_keys = 1\n\n\
         [keys]\npolicy = \"fixed-window\"\nlimit = 5\nwindow_ms = 600000\n",
    );
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let client = client();
    let (status, _, _) = post(&client, &server.url(), json!({"key": "a"})).await;
    assert_eq!(status, 200);
    for key in ["b", "c", "d", "e", "f"] {
        let (_, _, body) = post(&client, &server.url(), json!({"key": key})).await;
        assert_eq!(body["failure"], "capacity_exhausted", "{body}");
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, _, body) = post(&client, &server.url(), json!({"key": "a"})).await;
    assert_eq!(status, 200, "{body}");
    let lines = log.through_containing("succeed again");
    let not_logged = |line: &str| common::log_field(line, "failures_not_logged");
    let failed: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("store failed"))
        .collect();
    assert!(!failed.is_empty(), "{lines:#?}");
    let logged =
        failed.iter().map(|l| 1 + not_logged(l)).sum::<u64>() + not_logged(lines.last().unwrap());
    assert_eq!(logged, 5, "{lines:#?}");
    let series = "ratewarden_store_errors_total{rule=\"keys\",kind=\"capacity_exhausted\"}";
    assert_eq!(common::metric(&client, server.http, series).await, 5);
}

/// A request whose descriptor is a new key of a full store is refused
/// before any other descriptor is charged: the peek that checks it is
/// answered (a peek needs no room), but the take would find none.
#[tokio::test]
async fn a_new_key_of_a_full_store_charges_no_other_descriptor() {
    let file = ConfigFile::new(
        "[server]\nmax_keys = 1\n\n[[domains]]\ndomain = \"d\"\n\
         [[domains.descriptors]]\nkey = \"fw\"\npolicy = \"fixed-window\"\nlimit = 5\n\
         window_ms = 600000\n\
         [[domains.descriptors]]\nkey = \"sl\"\npolicy = \"sliding-log\"\nlimit = 5\n\
         window_ms = 600000\n",
    );
    let server = Server::start(&["--config", file.path()]);
    let client = client();
    let url = server.url();
    let entry = |key: &str, value: &str| json!({"entries": [{"key": key, "value": value}]});
    // The sliding-log rule's store is full with one key; the victim has
    // its whole budget, in a store of its own.
    let (status, _, body) = post(
        &client,
        &url,
        json!({"domain": "d", "descriptors": [entry("sl", "filler")]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for fresh in ["a", "b", "c"] {
        let request =
            json!({"domain": "d", "descriptors": [entry("fw", "victim"), entry("sl", fresh)]});
        let (status, _, body) = post(&client, &url, request).await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(
            body["descriptors"][1]["failure"], "capacity_exhausted",
            "{body}"
        );
    }
    let (_, _, body) = post(
        &client,
        &url,
        json!({"domain": "d", "cost": 0, "descriptors": [entry("fw", "victim")]}),
    )
    .await;
    assert_eq!(body["remaining"], 5, "the victim was charged: {body}");
    let series = "ratewarden_partial_consumptions_total";
    assert_eq!(common::metric(&client, server.http, series).await, 0);
}

/// A rule's name may hold a line break (TOML allows it, and a name
/// defaults to descriptor values): the log lines that name the rule keep it
/// on their one line, escaped, so it cannot forge a line of its own.
#[tokio::test]
async fn a_rule_name_with_a_line_break_stays_on_its_log_line() {
    let file = ConfigFile::new(
        "[server]\nmax_keys = 1\n\n\
         [keys]\nname = \"k\\nFORGED keys\"\npolicy = \"fixed-window\"\nlimit = 5\n\
         window_ms = 600000\n\n\
         [[domains]]\ndomain = \"api\"\n\n\
         [[domains.descriptors]]\nkey = \"zero\"\nname = \"z\\nFORGED zero\"\nlimit = 0\n\
         window_ms = 1000\n",
    );
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    let client = client();
    for (key, status) in [("a", 200), ("b", 429)] {
        let (got, _, body) = post(&client, &server.url(), json!({"key": key})).await;
        assert_eq!(got, status, "{body}");
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, _, body) = post(&client, &server.url(), json!({"key": "a"})).await;
    assert_eq!(status, 200, "{body}");
    let lines = log.through_containing("succeed again");
    let named = |needle: &str| {
        lines
            .iter()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}: {lines:#?}"))
            .clone()
    };
    assert!(
        named("admit no request").contains("z\\nFORGED zero"),
        "{lines:#?}"
    );
    assert!(
        named("store failed").contains("k\\nFORGED keys"),
        "{lines:#?}"
    );
    assert!(
        named("succeed again").contains("k\\nFORGED keys"),
        "{lines:#?}"
    );
    assert!(!lines.iter().any(|l| l.starts_with("FORGED")), "{lines:#?}");
    server.stop();
}

/// Under `ratewarden_server=debug` a request answered with an error is
/// logged with the message its client got.
#[test]
fn bad_requests_are_logged_under_debug() {
    use std::io::{BufRead, BufReader};
    let mut server = Server::start_with_env(
        &[],
        &[("RUST_LOG", "info,ratewarden_server=debug")],
        std::process::Stdio::piped(),
    );
    let answer = exchange(
        server.http,
        b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\nConnection: close\r\n\r\n{\"key\": 5",
        Duration::from_secs(5),
    );
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let stderr = server.child.stderr.take().expect("piped");
    server.stop();
    let lines: Vec<String> = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("HTTP request answered 400 Bad Request: malformed JSON")),
        "{lines:#?}"
    );
}

/// A client's text in such a line (here a JSON field name holding a line
/// break and a forged log line) cannot start a line of its own: control
/// characters are escaped.
#[test]
fn a_bad_request_logged_cannot_forge_a_log_line() {
    use std::io::{BufRead, BufReader};
    let mut server = Server::start_with_env(
        &[],
        &[("RUST_LOG", "info,ratewarden_server=debug")],
        std::process::Stdio::piped(),
    );
    let body = "{\"key\": \"k\", \"z\\r\\nFORGED ERROR line\": 1}";
    let request = format!(
        "POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = exchange(server.http, request.as_bytes(), Duration::from_secs(5));
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let stderr = server.child.stderr.take().expect("piped");
    server.stop();
    let lines: Vec<String> = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .collect();
    let logged: Vec<&String> = lines.iter().filter(|l| l.contains("FORGED")).collect();
    assert_eq!(logged.len(), 1, "{lines:#?}");
    assert!(
        logged[0].contains("HTTP request answered 400") && logged[0].contains("z\\r\\nFORGED"),
        "{lines:#?}"
    );
}

/// A descriptor value that is not UTF-8 (Envoy passes a header's bytes
/// 0x80 to 0xFF on, and its protobuf library only logs that such a string
/// field is invalid) is decided, its bad bytes read as U+FFFD, never
/// failed: an error is what Envoy's default `failure_mode_deny: false`
/// answers by letting the request through unlimited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_value_that_is_not_utf8_is_decided() {
    let file = ConfigFile::new(LONG_WINDOW);
    let server = Server::start(&["--config", file.path()]);
    let request = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "path".into(),
                value: "/login\u{1}\u{1}".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let mut message = common::grpc_message(&request);
    let at = message
        .windows(2)
        .position(|w| w == [1, 1])
        .expect("the placeholder bytes");
    message[at..at + 2].copy_from_slice(&[0xff, 0xfe]);
    let (status, said, _) = common::raw_should_bytes(server.grpc, "5S", message, true).await;
    assert_eq!(status, "0", "{said}");
    server.stop();
}

/// A `RUST_LOG` that does not parse is said at start, not dropped without
/// a word; the server logs at `info` and runs. A valid one gets no word.
#[test]
fn a_rust_log_that_does_not_parse_is_warned_about() {
    use std::io::{BufRead, BufReader};
    for (filter, warned) in [("warn,ratewarden_server=loud", true), ("info", false)] {
        let mut child = Command::new(common::BIN)
            .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .env("RUST_LOG", filter)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the ratewarden binary starts");
        common::first_line(&mut child).expect("serve prints where it listens");
        let _ = child.kill();
        let _ = child.wait();
        let stderr = child.stderr.take().expect("piped");
        let lines: Vec<String> = BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect();
        let warning = lines.iter().any(|l| {
            l.contains(&format!(
                "RUST_LOG={filter:?} is not a filter tracing reads"
            ))
        });
        assert_eq!(warning, warned, "{filter}: {lines:#?}");
        // Logged at info either way: the line that says it listens.
        assert!(
            lines
                .iter()
                .any(|l| l.contains("ratewarden serve is listening")),
            "{filter}: {lines:#?}"
        );
    }
}

/// Makes `path` a named pipe that no one writes to: reading it blocks, as
/// a file on a hung network mount would.
fn blocking_pipe(path: &str) {
    let _ = std::fs::remove_file(path);
    let made = Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {path}");
}

/// A configuration file whose read blocks holds up neither a stop at
/// start nor one while a reload waits on it, nor, past 10 s, the start
/// (which then fails, saying why) or a later reload; requests are answered on the rules in force meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_read_that_blocks_does_not_keep_serve_from_stopping() {
    // At start: nothing listens yet, and SIGTERM stops it.
    let file = ConfigFile::new("");
    blocking_pipe(file.path());
    let start = || {
        Command::new(common::BIN)
            .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .args(["--config", file.path()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the ratewarden binary starts")
    };
    let mut child = start();
    // Signalled before its handler is in place, it would die of the
    // signal rather than stop.
    common::wait_until_it_catches_sigterm(child.id(), Duration::from_secs(10));
    let sent = Command::new("kill")
        .args(["-s", "TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = common::exit_within(&mut child, Duration::from_secs(10))
        .expect("serve stops within 10 s of SIGTERM while its file blocks");
    assert!(status.success(), "{status}");
    // Left alone, the start gives up on the read after 10 s, as a
    // reload does, and says so, rather than hang in silence.
    let mut child = start();
    let status = common::exit_within(&mut child, Duration::from_secs(20))
        .expect("serve gives up on its file within 20 s");
    assert!(!status.success(), "{status}");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        stderr.contains("did not finish within 10 s (a pipe no one writes to"),
        "{stderr}"
    );

    // On reload: the rules in force answer, and SIGTERM stops it.
    let file = ConfigFile::new("[keys]\nlimit = 5\nwindow_ms = 60000\n");
    let (server, log) = Server::start_logged(&["--config", file.path()]);
    blocking_pipe(file.path());
    server.signal("HUP");
    log.next_containing("SIGHUP: reloading the configuration");
    let (status, _, body) = post(&client(), &server.url(), json!({"key": "k"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["remaining"], 4, "{body}");
    // The reload stops waiting, and fails, saying why: a later one, the
    // file readable again, reads it afresh rather than queueing behind it.
    let failed = log.next_containing("configuration reload failed");
    assert!(
        failed.contains("did not finish within 10000 ms (a pipe no one writes to"),
        "{failed}"
    );
    std::fs::remove_file(file.path()).unwrap();
    file.write("[keys]\nlimit = 3\nwindow_ms = 60000\n");
    server.signal("HUP");
    log.next_containing("configuration reloaded");
    let (status, _, body) = post(&client(), &server.url(), json!({"key": "k"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["remaining"], 2, "{body}");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_reader_that_went_away_neither_stops_the_service_nor_drops_answers() {
    // `serve 2>&1 | tee log`, or a log shipper, that exits or restarts:
    // every later log line fails to write. The service must go on
    // answering, reloading and stopping as it would have.
    let file = ConfigFile::new(LONG_WINDOW);
    let mut server =
        Server::start_with_stderr(&["--config", file.path()], std::process::Stdio::piped());
    drop(server.child.stderr.take());
    let client = client();
    let mut grpc = server.grpc().await;
    for _ in 0..3 {
        // An unknown domain is logged at WARN each time.
        let r = should(&mut grpc, "nowhere", vec![descriptor(&[("a", "b")])], 1).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        server.signal("HUP");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(server.child.try_wait().unwrap(), None, "serve still runs");
        let (status, _, body) = post(&client, &server.url(), json!({"key": "k"})).await;
        assert_eq!(status, 200, "{body}");
    }
    server.stop();
}

/// `ratewarden key` says on standard error which rule counts the request,
/// with all of its policy (a token bucket's burst included), and prints the
/// name alone on standard output; it needs no store to be running.
#[test]
fn the_key_command_says_the_whole_rule_that_counts() {
    let file = ConfigFile::new(
        "[keys]\npolicy = \"token-bucket\"\nlimit = 10\nwindow_ms = 1000\nburst = 25\nshadow = true\n",
    );
    let out = Command::new(common::BIN)
        .args(["key", "--config", file.path(), "--key", "user:1"])
        .output()
        .expect("the ratewarden binary runs");
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    );
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert_eq!(
        stderr.trim_end(),
        "rule \"keys\": token-bucket 10 per 1000 ms (burst 25), shadow"
    );
}
