//! TLS (`rediss://`) on a real `redis-server` with a TLS port: decisions
//! as over a plain connection, the server's certificate checked against
//! the CA given (or the system's roots), a client certificate shown when
//! Redis asks for one, and every mistake refused saying what to change.

mod common;

use std::path::PathBuf;

use ratewarden_core::{Limiter, StoreError, StoreErrorKind, REFERENCE};
use ratewarden_redis::test_support::{RedisCluster, RedisServer, TestCerts};
use ratewarden_redis::{RedisOptions, RedisStore};

/// Options trusting `ca` (if any), with a long connect time: connecting
/// is checked here, not its speed.
fn options(prefix: &str, ca: Option<PathBuf>) -> RedisOptions {
    RedisOptions {
        prefix: prefix.to_owned(),
        timeout_ms: 5_000,
        connect_timeout_ms: 10_000,
        tls_ca_file: ca,
        ..RedisOptions::default()
    }
}

/// Connects on a runtime of its own, dropped on return: for checking
/// whether connecting succeeds, not for calls (whose connection tasks
/// died with that runtime).
fn connect(url: &str, options: RedisOptions) -> Result<RedisStore, StoreError> {
    common::runtime().block_on(RedisStore::connect(url, REFERENCE, options))
}

#[test]
fn decisions_over_tls_share_the_counts_of_plain_ones() {
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, false);
    let prefix = common::fresh_prefix("tls");
    let rt = common::runtime();
    let tls_url = server.tls_url().expect("a TLS port");
    let secure = rt
        .block_on(RedisStore::connect(
            &tls_url,
            REFERENCE,
            options(&prefix, Some(certs.ca_file())),
        ))
        .expect("connect over TLS");
    let plain = rt
        .block_on(RedisStore::connect(
            &server.url(),
            REFERENCE,
            options(&prefix, None),
        ))
        .expect("connect");
    rt.block_on(async {
        for n in 1..=3 {
            let d = secure.check(7, 1).await.expect("a decision over TLS");
            assert!(d.allowed);
            assert_eq!(d.remaining, REFERENCE.limit - n);
        }
        let d = plain.check(7, 1).await.expect("a decision");
        assert_eq!(d.remaining, REFERENCE.limit - 4, "one count for both");
        secure.ping().await.expect("ping over TLS");
    });
    // The name in the certificate is checked: `localhost` is in it too.
    let by_name = format!("rediss://localhost:{}", server.tls_port().unwrap());
    connect(&by_name, options(&prefix, Some(certs.ca_file()))).expect("connect by name");
}

#[test]
fn a_server_certificate_the_client_does_not_trust_is_refused_saying_so() {
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, false);
    let url = server.tls_url().unwrap();
    let other = TestCerts::new();
    // Another CA, and the system's roots: neither signed the server's.
    let e = connect(&url, options("untrusted", Some(other.ca_file()))).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(
        e.detail()
            .contains("is not signed by the CA in tls_ca_file"),
        "{e}"
    );
    let e = connect(&url, options("untrusted", None)).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.detail().contains("is not trusted"), "{e}");
    assert!(e.detail().contains("tls_ca_file"), "{e}");
    assert!(e.detail().contains("SSL_CERT_FILE"), "{e}");

    // A certificate for another host, and one out of its dates, each
    // said as such (the CA is trusted either way).
    for (refused, says) in [
        (
            TestCerts::with_server(&["redis.example.com"], false),
            "is not for that host",
        ),
        (
            TestCerts::with_server(&["127.0.0.1"], true),
            "out of its dates",
        ),
    ] {
        let server = RedisServer::start_tls(&refused, false);
        let e = connect(
            &server.tls_url().unwrap(),
            options("refused", Some(refused.ca_file())),
        )
        .unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
        assert!(e.detail().contains(says), "{e}");
    }
}

#[test]
fn a_client_certificate_is_shown_when_redis_asks_for_one() {
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, true);
    let url = server.tls_url().unwrap();
    let e = connect(&url, options("client-cert", Some(certs.ca_file()))).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.detail().contains("tls_cert_file"), "{e}");
    let with_cert = RedisOptions {
        tls_cert_file: Some(certs.client_cert_file()),
        tls_key_file: Some(certs.client_key_file()),
        ..options("client-cert", Some(certs.ca_file()))
    };
    let rt = common::runtime();
    let d = rt
        .block_on(async {
            let store = RedisStore::connect(&url, REFERENCE, with_cert).await?;
            store.check(1, 1).await
        })
        .expect("a decision with a client certificate");
    assert!(d.allowed);
    // A certificate its CA did not sign is refused by Redis.
    let other = TestCerts::new();
    let foreign = RedisOptions {
        tls_cert_file: Some(other.client_cert_file()),
        tls_key_file: Some(other.client_key_file()),
        ..options("client-cert", Some(certs.ca_file()))
    };
    let e = connect(&url, foreign).unwrap_err();
    assert!(e.detail().contains("refused the client certificate"), "{e}");
}

#[test]
fn tls_and_plain_ports_mixed_up_say_which_to_use() {
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, false);
    // rediss:// to the plain port.
    let url = format!("rediss://127.0.0.1:{}", server.port());
    let e = connect(&url, options("mixed", Some(certs.ca_file()))).unwrap_err();
    assert!(e.detail().contains("redis://"), "{e}");
    assert!(e.detail().contains("TLS"), "{e}");
    // redis:// to the TLS port.
    let url = format!("redis://127.0.0.1:{}", server.tls_port().unwrap());
    let e = connect(&url, options("mixed", None)).unwrap_err();
    assert!(e.detail().contains("rediss://"), "{e}");
}

#[test]
fn tls_files_that_cannot_be_used_are_refused_before_connecting() {
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, false);
    let tls_url = server.tls_url().unwrap();
    let files = |ca: Option<PathBuf>, cert: Option<PathBuf>, key: Option<PathBuf>| RedisOptions {
        tls_cert_file: cert,
        tls_key_file: key,
        ..options("files", ca)
    };
    let (ca, cert, key) = (
        || Some(certs.ca_file()),
        || Some(certs.client_cert_file()),
        || Some(certs.client_key_file()),
    );
    let missing = Some(certs.ca_file().with_file_name("missing.crt"));
    let stranger = TestCerts::new();
    // (URL, options, words the refusal holds)
    let cases = [
        // TLS files for a plain URL would be ignored, the link left plain.
        (
            server.url(),
            files(ca(), None, None),
            ["tls_ca_file", "rediss://"],
        ),
        // A certificate without its key, and the other way round.
        (
            tls_url.clone(),
            files(ca(), cert(), None),
            ["tls_cert_file", "tls_key_file"],
        ),
        (
            tls_url.clone(),
            files(ca(), None, key()),
            ["tls_key_file", "tls_cert_file"],
        ),
        // A file that is not there, and one that holds no certificate.
        (
            tls_url.clone(),
            files(missing, None, None),
            ["tls_ca_file", "missing.crt"],
        ),
        (
            tls_url.clone(),
            files(key(), None, None),
            ["tls_ca_file", "no readable PEM certificate"],
        ),
        // A key where the certificate goes, and a certificate for the key.
        (
            tls_url.clone(),
            files(ca(), key(), cert()),
            ["tls_cert_file", "client.key"],
        ),
        (
            tls_url.clone(),
            files(ca(), cert(), cert()),
            ["tls_key_file", "private key"],
        ),
        // Another certificate's key.
        (
            tls_url.clone(),
            files(ca(), cert(), Some(stranger.client_key_file())),
            ["is not the private key of the certificate", "client.crt"],
        ),
    ];
    for (url, options, words) in cases {
        let e = connect(&url, options).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
        for word in words {
            assert!(e.detail().contains(word), "`{word}` not in: {e}");
        }
    }
}

#[test]
fn a_cluster_over_tls_decides_on_every_master() {
    let certs = TestCerts::new();
    let cluster = RedisCluster::start_tls(&certs);
    let url = cluster.tls_url().expect("TLS ports");
    let rt = common::runtime();
    rt.block_on(async {
        let store = RedisStore::connect(
            &url,
            REFERENCE,
            options("tls-cluster", Some(certs.ca_file())),
        )
        .await
        .expect("connect to the cluster over TLS");
        // A hundred keys land on every master's slots.
        for key in 0..100 {
            let d = store.check(key, 1).await.expect("a decision over TLS");
            assert_eq!(d.remaining, REFERENCE.limit - 1, "key {key}");
        }
        store.ping().await.expect("every master answers over TLS");
    });
    let keys: Vec<usize> = cluster
        .nodes()
        .iter()
        .map(|n| n.cli(&["DBSIZE"]).trim().parse().unwrap())
        .collect();
    assert!(
        keys.iter().all(|&n| n > 0),
        "a master with no key: {keys:?}"
    );
    assert_eq!(keys.iter().sum::<usize>(), 100);
    // The seeds' certificates are checked as a single node's are.
    let other = TestCerts::new();
    let e = connect(&url, options("tls-cluster", Some(other.ca_file()))).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(
        e.detail().contains("not signed by the CA in tls_ca_file"),
        "{e}"
    );
    // The plain cluster URL on the TLS ports says which form to use.
    let plain = url.replacen("rediss-cluster://", "redis-cluster://", 1);
    let e = connect(&plain, options("tls-cluster", None)).unwrap_err();
    assert!(e.detail().contains("rediss-cluster://"), "{e}");
}
