//! TLS (`rediss://`) on a real `redis-server` with a TLS port: decisions
//! as over a plain connection, the server's certificate checked against
//! the CA given (or the system's roots), a client certificate shown when
//! Redis asks for one, and every mistake refused saying what to change.

mod common;

use std::path::PathBuf;

use ratewarden_core::{Limiter, StoreError, StoreErrorKind, REFERENCE};
use ratewarden_redis::test_support::{CertFlaw, RedisCluster, RedisServer, TestCerts};
use ratewarden_redis::{RedisOptions, RedisStore};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

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
    // At one instant: decisions on Redis's clock could straddle a window's
    // edge on a loaded machine, and the count carried over is weighed
    // down there.
    let now_ms = Some(1_000_000);
    rt.block_on(async {
        for n in 1..=3 {
            let d = secure
                .decide(7, now_ms, 1)
                .await
                .expect("a decision over TLS");
            assert!(d.allowed);
            assert_eq!(d.remaining, REFERENCE.limit - n);
        }
        let d = plain.decide(7, now_ms, 1).await.expect("a decision");
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

    // A certificate for another host, one out of its dates, and one whose
    // address is in its CN alone, each said as such (the CA is trusted
    // each time).
    for (refused, says) in [
        (
            TestCerts::with_server(&["redis.example.com"], false),
            "is not for that host",
        ),
        (
            TestCerts::with_server(&["127.0.0.1"], true),
            "out of its dates",
        ),
        (
            TestCerts::with_flaw(CertFlaw::ServerWithoutNames),
            "holds no subjectAltName",
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
    // Certificates Redis refuses for what they are: each refusal is said
    // to be of the client's certificate, never of Redis's own.
    for (flaw, says) in [
        (CertFlaw::ClientExpired, "out of its dates"),
        (
            CertFlaw::ClientForServersOnly,
            "extendedKeyUsage = clientAuth",
        ),
    ] {
        let flawed = TestCerts::with_flaw(flaw);
        let server = RedisServer::start_tls(&flawed, true);
        let options = RedisOptions {
            tls_cert_file: Some(flawed.client_cert_file()),
            tls_key_file: Some(flawed.client_key_file()),
            ..options("client-cert", Some(flawed.ca_file()))
        };
        let e = connect(&server.tls_url().unwrap(), options).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
        assert!(e.detail().contains("refused the client certificate"), "{e}");
        assert!(e.detail().contains(says), "{flaw:?}: {e}");
        assert!(!e.detail().contains("Redis's side"), "{e}");
    }
}

/// Redis restarted with a certificate of another CA: the store's calls
/// fail (the failure policy's to answer), each saying why as connecting
/// would, and succeed again once the certificate is trusted.
#[test]
fn a_certificate_replaced_on_redis_s_side_is_named_in_the_call_s_error() {
    let certs = TestCerts::new();
    let mut server = RedisServer::start_tls(&certs, false);
    let url = server.tls_url().unwrap();
    let rt = common::runtime();
    let store = rt
        .block_on(RedisStore::connect(
            &url,
            REFERENCE,
            options("rotated", Some(certs.ca_file())),
        ))
        .expect("connect over TLS");
    rt.block_on(store.check(1, 1)).expect("a decision");
    // Redis reads its certificate files at start: they are replaced, and
    // it restarts.
    let files = [certs.server_cert_file(), certs.server_key_file()];
    let original: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    let stranger = TestCerts::new();
    for (file, from) in files
        .iter()
        .zip([stranger.server_cert_file(), stranger.server_key_file()])
    {
        std::fs::copy(from, file).unwrap();
    }
    server.restart();
    let e = rt.block_on(async {
        // The first call may find the old connection closed, and the
        // store's one retry reconnects: at most a few calls.
        let mut last = None;
        for _ in 0..5 {
            match store.check(1, 1).await {
                Err(e) if e.detail().contains("TLS certificate") => return e,
                other => last = Some(other),
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("no call said why: {last:?}")
    });
    assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
    assert!(
        e.detail().contains("not signed by the CA in tls_ca_file"),
        "{e}"
    );
    for (file, bytes) in files.iter().zip(&original) {
        std::fs::write(file, bytes).unwrap();
    }
    server.restart();
    let decided = rt.block_on(async {
        for _ in 0..50 {
            if let Ok(d) = store.check(1, 1).await {
                return Some(d);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        None
    });
    assert!(
        decided.is_some(),
        "no decision once the certificate is trusted again"
    );
}

/// A store on `url` with `options`, connected on `rt`, on which its
/// calls are then made.
fn connect_on(rt: &tokio::runtime::Runtime, url: &str, options: &RedisOptions) -> RedisStore {
    rt.block_on(RedisStore::connect(url, REFERENCE, options.clone()))
        .unwrap_or_else(|e| panic!("connect over TLS to {url}: {e}"))
}

/// A store's own copies of `certs`' CA, client certificate and key, in a
/// folder of their own (kept while the returned folder lives), and options
/// naming them.
fn own_copies(certs: &TestCerts, prefix: &str) -> (tempfile::TempDir, RedisOptions) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut options = options(prefix, Some(dir.path().join("ca.crt")));
    options.tls_cert_file = Some(dir.path().join("client.crt"));
    options.tls_key_file = Some(dir.path().join("client.key"));
    copy_certificates(certs, &options);
    (dir, options)
}

/// Writes `certs`' CA, client certificate and key over the files that
/// `options` names.
fn copy_certificates(certs: &TestCerts, options: &RedisOptions) {
    for (from, to) in [
        (certs.ca_file(), &options.tls_ca_file),
        (certs.client_cert_file(), &options.tls_cert_file),
        (certs.client_key_file(), &options.tls_key_file),
    ] {
        std::fs::copy(from, to.as_ref().expect("a file")).expect("copy a PEM file");
    }
}

/// Writes `to`'s server files (the CA Redis checks clients with, its
/// certificate and key) with `from`'s, for Redis to read at its restart.
fn replace_server_certificates(to: &TestCerts, from: &TestCerts) {
    for (from, to) in [
        (from.ca_file(), to.ca_file()),
        (from.server_cert_file(), to.server_cert_file()),
        (from.server_key_file(), to.server_key_file()),
    ] {
        std::fs::copy(from, to).expect("copy a PEM file");
    }
}

/// `attempt`, tried again every 100 ms for about `seconds` until it
/// succeeds; its last error otherwise.
async fn within<F: std::future::Future<Output = Result<(), StoreError>>>(
    seconds: u64,
    mut attempt: impl FnMut() -> F,
) -> Result<(), StoreError> {
    let mut last = Ok(());
    for _ in 0..seconds * 10 {
        last = attempt().await;
        if last.is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    last
}

/// Decisions on keys 0 to `keys` until one round decides them all, for
/// about `seconds` (see [`within`]).
async fn decided_within(store: &RedisStore, keys: u64, seconds: u64) -> Result<(), StoreError> {
    within(seconds, || async {
        for key in 0..keys {
            store.check(key, 1).await?;
        }
        Ok(())
    })
    .await
}

/// A new CA, with new certificates for Redis and the client, replaced on
/// disk on Redis's side first: once Redis restarts with its new files, the
/// store's calls fail saying why, and once its own files are replaced too
/// the store's next connection reads them and decides, with no restart of
/// the store (the client used to reconnect with the certificates read at
/// start, refused for good).
#[test]
fn certificates_replaced_on_disk_are_read_by_the_next_connection() {
    let certs = TestCerts::new();
    let mut server = RedisServer::start_tls(&certs, true);
    let (_dir, options) = own_copies(&certs, "rotated-files");
    let rt = common::runtime();
    let store = connect_on(&rt, &server.tls_url().unwrap(), &options);
    rt.block_on(store.check(1, 1)).expect("a decision");
    // A store that is only pinged, as `serve`'s readiness store is: its
    // connection is renewed by its pings alone.
    let pinged = connect_on(&rt, &server.tls_url().unwrap(), &options);
    rt.block_on(pinged.ping()).expect("ready");
    let rotated = TestCerts::new();
    replace_server_certificates(&certs, &rotated);
    server.restart();
    let untrusted = "not signed by the CA in tls_ca_file";
    let e = rt
        .block_on(decided_within(&store, 1, 2))
        .expect_err("Redis's new certificate is not trusted yet");
    assert!(e.detail().contains(untrusted), "{e}");
    let e = rt
        .block_on(within(2, || pinged.ping()))
        .expect_err("Redis's new certificate is not trusted yet");
    assert!(e.detail().contains(untrusted), "{e}");
    copy_certificates(&rotated, &options);
    rt.block_on(decided_within(&store, 1, 10))
        .expect("decided with the certificates on disk");
    rt.block_on(within(10, || pinged.ping()))
        .expect("ready with the certificates on disk");
}

/// As [`certificates_replaced_on_disk_are_read_by_the_next_connection`],
/// on a cluster whose nodes all restart with a new CA's certificates.
#[test]
fn a_cluster_s_next_connection_reads_certificates_replaced_on_disk() {
    let certs = TestCerts::new();
    let mut cluster = RedisCluster::start_tls(&certs);
    let (_dir, mut options) = own_copies(&certs, "rotated-cluster");
    // Redis's tls-auth-clients is off here: the CA alone is rotated.
    options.tls_cert_file = None;
    options.tls_key_file = None;
    let rt = common::runtime();
    let store = connect_on(&rt, &cluster.tls_url().unwrap(), &options);
    // A hundred keys land on every master's slots.
    rt.block_on(decided_within(&store, 100, 10))
        .expect("a healthy cluster decides");
    let pinged = connect_on(&rt, &cluster.tls_url().unwrap(), &options);
    rt.block_on(pinged.ping()).expect("ready");
    let rotated = TestCerts::new();
    replace_server_certificates(&certs, &rotated);
    for node in 0..3 {
        cluster.restart_node(node);
    }
    let unfit = "the nodes' certificates and the store's files";
    let e = rt
        .block_on(decided_within(&store, 100, 2))
        .expect_err("the nodes' new certificates are not trusted yet");
    assert!(e.detail().contains(unfit), "{e}");
    let e = rt
        .block_on(within(2, || pinged.ping()))
        .expect_err("the nodes' new certificates are not trusted yet");
    // As a call's error says it.
    assert!(
        e.detail()
            .contains("no node of the cluster accepts a connection")
            && e.detail().contains(unfit),
        "{e}"
    );
    std::fs::copy(rotated.ca_file(), options.tls_ca_file.as_ref().unwrap()).unwrap();
    rt.block_on(decided_within(&store, 100, 10))
        .expect("every master decides with the certificates on disk");
    rt.block_on(within(10, || pinged.ping()))
        .expect("ready with the certificates on disk");
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
    // The CA's certificate in DER, as openssl x509 -outform DER writes it.
    let der = certs.ca_file().with_file_name("ca.der");
    let ca_der = CertificateDer::from_pem_file(certs.ca_file()).unwrap();
    std::fs::write(&der, &ca_der).unwrap();
    let v1 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/x509-v1");
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
            [
                "no readable PEM certificate",
                "it holds a private key, where tls_ca_file takes a certificate",
            ],
        ),
        // A home folder written as ~, and a certificate in DER.
        (
            tls_url.clone(),
            files(Some(PathBuf::from("~/ca.crt")), None, None),
            ["tls_ca_file", "~ is not read as the home folder"],
        ),
        (
            tls_url.clone(),
            files(Some(der.clone()), None, None),
            ["tls_ca_file", "looks like DER"],
        ),
        // A key where the certificate goes, and a certificate for the key.
        (
            tls_url.clone(),
            files(ca(), key(), cert()),
            ["client.key", "are tls_cert_file and tls_key_file swapped"],
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
        // An X.509 version 1 certificate with its own key: not a mismatch.
        (
            tls_url.clone(),
            files(
                ca(),
                Some(v1.join("client.crt")),
                Some(v1.join("client.key")),
            ),
            ["client.crt", "X.509 version 1"],
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

/// Nodes whose certificates hold a name, reached by that name as seeds,
/// but announcing their IP in `CLUSTER SLOTS`: the seeds connect and the
/// slot map's nodes cannot. Said as such, and not as a Redis to start.
#[test]
fn a_cluster_whose_certificates_lack_the_announced_addresses_says_so() {
    let certs = TestCerts::with_server(&["localhost"], false);
    let cluster = RedisCluster::start_tls(&certs);
    let port = cluster.nodes()[0].tls_port().unwrap();
    let url = format!("rediss-cluster://localhost:{port}");
    let e = connect(&url, options("announced", Some(certs.ca_file()))).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Backend, "{e}");
    assert!(
        e.detail()
            .contains("each node's certificate must hold the address it announces"),
        "{e}"
    );
}
