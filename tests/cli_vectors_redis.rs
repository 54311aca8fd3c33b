//! `ratewarden vectors --store redis://...` and `redis-cluster://...`: the
//! project's vectors pass on a real Redis node and a real cluster, and an
//! unreachable store is reported as unusable (exit 2).

use std::path::Path;
use std::process::{Command, Output};

use ratewarden_redis::test_support::{free_port, RedisCluster, RedisServer, TestCerts};

fn vectors(store: &str) -> Output {
    vectors_with(store, &[])
}

/// `vectors` with more environment variables.
fn vectors_with(store: &str, env: &[(&str, &Path)]) -> Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args([
            "vectors",
            "--store",
            store,
            root.join("vectors").to_str().unwrap(),
        ])
        // The machine's own bundle settings would stand beside the test's.
        .env_remove("SSL_CERT_FILE")
        .env_remove("SSL_CERT_DIR")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn assert_all_pass(out: &Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    let passed: usize = last
        .strip_suffix(" passed, 0 failed")
        .expect(last)
        .parse()
        .unwrap();
    assert!(passed > 100, "{last}");
}

/// An hour: every key a run leaves expires within it, as docs/redis.md
/// says, so runs against a shared Redis do not pile keys up.
const HOUR_MS: i64 = 3_600_000;

#[test]
fn vectors_pass_on_a_redis_node() {
    let server = RedisServer::start();
    assert_all_pass(&vectors(&server.url()));
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
    let longest = server.longest_ttl_ms().expect("the run left keys");
    assert!(longest <= HOUR_MS, "a key lives {longest} ms");
}

#[test]
fn vectors_pass_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    assert_all_pass(&vectors(&cluster.url()));
    assert_eq!(cluster.keys_without_ttl(), Vec::<String>::new());
    let longest = cluster.longest_ttl_ms().expect("the run left keys");
    assert!(longest <= HOUR_MS, "a key lives {longest} ms");
}

#[test]
fn an_unreachable_redis_is_an_unusable_store() {
    // A port nothing listens on.
    let out = vectors(&format!("redis://127.0.0.1:{}", free_port(false)));
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("127.0.0.1"), "{stderr}");
    assert!(
        stderr.contains(
            "cannot be used: connection refused; start redis-server there or change --store \
             to where it runs"
        ),
        "{stderr}"
    );
    assert_eq!(stderr.matches("connection").count(), 1, "{stderr}");
}

#[test]
fn a_redis_that_wants_a_password_is_an_unusable_store_saying_so() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let out = vectors(&server.url());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("requires a password"), "{stderr}");
    // Said as the detail alone, as `serve` says it: no error kind before it.
    let url = server.url();
    assert!(
        stderr.starts_with(&format!("{url}: Redis at 127.0.0.1:")),
        "{stderr}"
    );
    // No case ran: the run stopped at start.
    assert!(!String::from_utf8_lossy(&out.stdout).contains("FAIL"));
}

#[test]
fn a_refused_password_is_never_shown() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let out = vectors(&format!(
        "redis://:pw-not-shown@127.0.0.1:{}",
        server.port()
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("redis://:***@127.0.0.1"), "{stderr}");
    assert!(!stderr.contains("pw-not-shown"), "{stderr}");
}

#[test]
fn the_documented_url_forms_are_taken_tls_with_ssl_cert_file() {
    let socket = std::env::temp_dir().join(format!("ratewarden-cli-{}.sock", std::process::id()));
    let path = socket.display().to_string();
    let server = RedisServer::start_with(&["--unixsocket", &path, "--unixsocketperm", "700"]);
    assert_all_pass(&vectors(&format!("redis+unix://{path}")));
    drop(server);
    let _ = std::fs::remove_file(&socket);

    // Over TLS, the server's certificate is checked against the system's
    // roots, or the bundle SSL_CERT_FILE names (the command has no flag
    // for certificate files).
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, false);
    let url = server.tls_url().unwrap();
    assert_all_pass(&vectors_with(&url, &[("SSL_CERT_FILE", &certs.ca_file())]));
    let other = TestCerts::new();
    let out = vectors_with(&url, &[("SSL_CERT_FILE", &other.ca_file())]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not trusted"), "{stderr}");
    // The variable is named as set, not advised as if it were not.
    let set = format!("no CA certificate in SSL_CERT_FILE={:?}", other.ca_file());
    assert!(stderr.contains(&set), "{stderr}");
    // A bundle of no PEM certificate (empty here; DER is the same) could
    // trust no server: refused, naming it.
    let empty = certs.ca_file().with_file_name("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let out = vectors_with(&url, &[("SSL_CERT_FILE", &empty)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let named = format!("SSL_CERT_FILE={:?} holds no PEM certificate", empty);
    assert!(stderr.contains(&named), "{stderr}");
    // A bundle that cannot be read fails every TLS connection: said so,
    // naming the variable, not as a dropped connection.
    let missing = certs.ca_file().with_file_name("missing.pem");
    let out = vectors_with(&url, &[("SSL_CERT_FILE", &missing)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("the system's CA certificates cannot be loaded"),
        "{stderr}"
    );
    assert!(stderr.contains("SSL_CERT_FILE"), "{stderr}");
}

/// Resumes a frozen server when the test ends, however it ends.
struct Resume<'a>(&'a RedisServer);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.resume();
    }
}

/// A Redis that stops answering mid-run (frozen with SIGSTOP) stops the run
/// at the first case whose call times out, as a store that cannot be used
/// (exit 2), rather than failing each case left after a timeout of its own.
#[test]
fn a_redis_that_stops_answering_stops_the_run() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let server = RedisServer::start();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args([
            "vectors",
            "--store",
            &server.url(),
            root.join("vectors").to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _resume = Resume(&server);
    // Frozen once some cases have written their keys: the run takes
    // seconds, so hundreds of cases are left.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let keys: usize = redis::cmd("DBSIZE").query(&mut conn).unwrap();
        if keys >= 20 {
            break;
        }
        assert!(Instant::now() < deadline, "the run wrote no keys");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(1));
    }
    server.pause();
    // One call's timeout (10 s), then the run ends; the bound, far above
    // it, only catches a run that waits out a timeout for each case left.
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the run was still going two minutes after Redis stopped answering");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(stderr.contains("store error at "), "{stderr}");
    // A timeout, whichever call the freeze met: a case's decision ("did
    // not answer within 10000 ms") or the check that makes a case's store
    // ("the check on the key ... failed: timed out").
    assert!(stderr.contains(": store timeout: "), "{stderr}");
    assert!(
        stderr.contains("the run stops here, the cases left not run"),
        "{stderr}"
    );
    // The case the store failed is no conformance failure.
    assert!(!stdout.contains("FAIL"), "{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.ends_with(" failed; stopped at a store error, the cases left not run"),
        "{last}"
    );
}

/// A store error of a case's own (here the ACL refusing the keys the
/// cases decide on, while the stores' own checks, on keys ending in
/// `:probe`, pass) fails that case, and the run goes on to the others:
/// only a store that stops answering, or loses its connection, stops the
/// run.
#[test]
fn a_case_refused_by_the_store_fails_and_the_run_goes_on() {
    let server = RedisServer::start();
    let granted = server.cli(&[
        "ACL",
        "SETUSER",
        "checks",
        "on",
        ">pw",
        "~ratewarden-vectors%3A*:probe",
        "+@all",
    ]);
    assert_eq!(granted.trim(), "OK");
    let url = format!("redis://checks:pw@127.0.0.1:{}", server.port());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args([
            "vectors",
            "--store",
            &url,
            root.join("vectors/seed-cases.json").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    let failed = stdout.lines().filter(|l| l.starts_with("FAIL ")).count();
    assert!(failed > 1, "every case is run: {stdout}");
    assert!(stdout.contains("store error: "), "{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    assert_eq!(last, format!("0 passed, {failed} failed"), "{stdout}");
}
