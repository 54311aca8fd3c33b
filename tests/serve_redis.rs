//! End-to-end tests of `ratewarden serve --store redis://`: real
//! `redis-server` processes on free loopback ports, the real binary, a real
//! HTTP client.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratewarden_redis::test_support::{RedisServer, TestCerts};
use ratewarden_server::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use ratewarden_server::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use ratewarden_server::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use serde_json::{json, Value};

mod common;

use common::{raw_should, ConfigFile, Server};

/// A `ratewarden serve` process on `store` with the rules in `config`,
/// killed when dropped.
struct Serve {
    server: Server,
    _config: ConfigFile,
}

impl Serve {
    fn start(store: &str, config: &str) -> Serve {
        let file = ConfigFile::new(config);
        let server = Server::start(&["--store", store, "--config", file.path()]);
        Serve {
            server,
            _config: file,
        }
    }

    fn url(&self) -> String {
        self.server.url()
    }
}

/// One `ShouldRateLimit` request: domain `edge`, `path` `/a`.
fn path_a() -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "path".into(),
                value: "/a".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

async fn check(client: &reqwest::Client, url: &str, key: &str) -> (u16, Value) {
    let r = client
        .post(url)
        .json(&json!({"key": key}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_redis_admit_no_more_than_the_limit() {
    let redis = RedisServer::start();
    // A generous store timeout: this test is about the count, not failures.
    let config = "[server]\nstore_timeout_ms = 5000\n\n[keys]\nlimit = 100\nwindow_ms = 3600000\n";
    let a = Serve::start(&redis.url(), config);
    let b = Serve::start(&redis.url(), config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    // The count is exact only within one window (decided on Redis's clock,
    // this machine's).
    common::clear_of_window_edge(3_600_000, Duration::from_secs(30)).await;
    let mut tasks = Vec::new();
    for i in 0..64 {
        let url = if i % 2 == 0 { a.url() } else { b.url() };
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0;
            for _ in 0..5 {
                let (status, body) = check(&client, &url, "shared").await;
                assert!(
                    body.get("failure_policy").is_none(),
                    "the store failed: {body}"
                );
                match status {
                    200 => admitted += 1,
                    429 => {}
                    other => panic!("unexpected status {other}: {body}"),
                }
            }
            admitted
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    // 320 requests for one key with a limit of 100 in one (hour-long)
    // window: Redis decides each atomically, so exactly 100 pass.
    assert_eq!(admitted, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_gets_the_failure_policy_then_recovers() {
    for (policy, allowed_while_down) in [("open", true), ("closed", false), ("local", true)] {
        let mut redis = RedisServer::start();
        let config = format!(
            "[server]\nfailure_policy = \"{policy}\"\nstore_timeout_ms = 200\n\n\
             [keys]\nlimit = 1000\nwindow_ms = 3600000\n"
        );
        let serve = Serve::start(&redis.url(), &config);
        // Every answer comes within the client's bound, whatever Redis does.
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        // The short store timeout is what answers quickly while Redis is
        // down; on a busy machine it can also fail a healthy call, which
        // Redis may still have applied. So the first decision is asked on
        // a fresh key until one is answered (bounded), and that key is the
        // one followed through the outage.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut attempt = 0;
        let key = loop {
            let key = format!("k{attempt}");
            let (status, body) = check(&client, &serve.url(), &key).await;
            if body.get("failure_policy").is_none() {
                assert_eq!(status, 200, "{body}");
                assert_eq!(body["remaining"], 999, "{body}");
                break key;
            }
            assert_eq!(body["failure"], "timeout", "{policy}: {body}");
            assert!(
                Instant::now() < deadline,
                "{policy}: no call answered within 20 s"
            );
            attempt += 1;
        };

        // Load from 8 clients runs across the kill: every request gets an
        // answer (200 or 429), none an error.
        let stop = Arc::new(AtomicBool::new(false));
        let mut load = Vec::new();
        for _ in 0..8 {
            let (client, url, stop) = (client.clone(), serve.url(), Arc::clone(&stop));
            load.push(tokio::spawn(async move {
                let mut answered = 0u32;
                while !stop.load(Ordering::Relaxed) && answered < 100_000 {
                    let (status, body) = check(&client, &url, "load").await;
                    assert!(status == 200 || status == 429, "{status}: {body}");
                    answered += 1;
                }
                answered
            }));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        redis.kill();
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.store(true, Ordering::Relaxed);
        for task in load {
            assert!(task.await.unwrap() > 0);
        }
        let before = failure_count(&client, serve.server.http, policy, allowed_while_down).await;
        for _ in 0..20 {
            let (status, body) = check(&client, &serve.url(), &key).await;
            assert_eq!(body["failure_policy"], true, "{policy}: {body}");
            assert!(
                matches!(
                    body["failure"].as_str(),
                    Some("connection_dropped" | "timeout")
                ),
                "{policy}: {body}"
            );
            assert_eq!(body["allowed"], allowed_while_down, "{policy}: {body}");
            assert_eq!(
                status,
                if allowed_while_down { 200 } else { 429 },
                "{policy}: {body}"
            );
        }
        let after = failure_count(&client, serve.server.http, policy, allowed_while_down).await;
        assert_eq!(after - before, 20, "{policy}: each failure is counted");

        // Back again (with empty data, as after a crash): answers come from
        // Redis once the connection is re-established.
        redis.restart();
        let deadline = Instant::now() + Duration::from_secs(20);
        // Calls that timed out once Redis was back may have been applied:
        // each can take one from the count.
        let mut timed_out = 0;
        loop {
            let (status, body) = check(&client, &serve.url(), &key).await;
            if body.get("failure_policy").is_none() {
                assert_eq!(status, 200, "{body}");
                let remaining = body["remaining"].as_u64().unwrap();
                assert!(
                    (999 - timed_out..=999).contains(&remaining),
                    "a fresh Redis has a fresh count ({timed_out} calls timed out): {body}"
                );
                break;
            }
            if body["failure"] == "timeout" {
                timed_out += 1;
            }
            assert!(
                Instant::now() < deadline,
                "{policy}: no recovery within 20 s of the restart"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn readyz(client: &reqwest::Client, serve: &Serve) -> (u16, String) {
    let r = client
        .get(format!("http://{}/readyz", serve.server.http))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Polls `/readyz` until it answers `want`, for at most 20 s; the last
/// body.
async fn readyz_until(client: &reqwest::Client, serve: &Serve, want: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = readyz(client, serve).await;
        if status == want {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz still {status} after 20 s: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Under `failure_policy = "error"` a request whose store fails is left to
/// its caller: HTTP `503`, gRPC `UNAVAILABLE`, which Envoy answers with its
/// own `failure_mode_deny`, as it answers envoyproxy/ratelimit's errors.
/// Decided again once Redis is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_error_policy_leaves_a_failing_store_to_the_caller() {
    let mut redis = RedisServer::start();
    // A generous store timeout: the failures here are a killed Redis's,
    // refused at once; the default 100 ms could fail a healthy call on a
    // busy machine.
    let config = "[server]\nfailure_policy = \"error\"\nstore_timeout_ms = 5000\n\n\
                  [keys]\nlimit = 10\nwindow_ms = 3600000\n\n\
                  [[domains]]\ndomain = \"edge\"\n\n\
                  [[domains.descriptors]]\nkey = \"path\"\nlimit = 10\nwindow_ms = 3600000\n";
    let serve = Serve::start(&redis.url(), config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut grpc = serve.server.grpc().await;
    assert_eq!(check(&client, &serve.url(), "k").await.0, 200);
    grpc.should_rate_limit(path_a()).await.unwrap();

    redis.kill();
    let (status, body) = check(&client, &serve.url(), "k").await;
    assert_eq!(status, 503, "{body}");
    let message = body["error"].as_str().unwrap();
    assert!(
        message.starts_with("the store failed (")
            && message.ends_with(
                "deciding the key (rule \"keys\"), and failure_policy = \"error\" leaves the \
             decision to the caller"
            ),
        "{body}"
    );
    let body =
        json!({"domain": "edge", "descriptors": [{"entries": [{"key": "path", "value": "/a"}]}]});
    let r = client.post(serve.url()).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("deciding descriptor 0 (rule \"edge.path\")"),
        "{body}"
    );
    let refusal = grpc.should_rate_limit(path_a()).await.unwrap_err();
    assert_eq!(refusal.code(), tonic::Code::Unavailable, "{refusal:?}");
    assert!(
        refusal.message().contains("(rule \"edge.path\")"),
        "{refusal:?}"
    );
    let text = common::metrics(&client, serve.server.http).await;
    assert_eq!(
        common::metric_value(
            &text,
            "ratewarden_failure_policy_decisions_total{policy=\"error\",outcome=\"unanswered\"}"
        ),
        3,
        "{text}"
    );
    // The requests were sound.
    for api in ["http", "grpc"] {
        let series = format!("ratewarden_bad_requests_total{{api=\"{api}\"}}");
        assert_eq!(common::metric_value(&text, &series), 0, "{text}");
    }

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = check(&client, &serve.url(), "k").await;
        if status == 200 {
            // A fresh Redis, a fresh count.
            assert_eq!(body["remaining"], 9, "{body}");
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(Instant::now() < deadline, "no recovery within 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `/readyz` follows Redis: ready while it answers, 503 naming the store
/// (never its password) while it is down or frozen, ready again once it is
/// back; `/healthz` and the failure policy's answers go on throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reports_whether_redis_answers() {
    let mut redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let url = format!("redis://:s3cret@127.0.0.1:{}", redis.port());
    let config = "[server]\nfailure_policy = \"open\"\nstore_timeout_ms = 200\n\n\
                  [keys]\nlimit = 10\nwindow_ms = 3600000\n";
    let serve = Serve::start(&url, config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    // Polled: on a busy machine even a healthy Redis can miss the 200 ms
    // this test needs to show a frozen one.
    assert_eq!(readyz_until(&client, &serve, 200).await, "ready\n");

    // Frozen: PING gets no answer within the store's timeout.
    redis.pause();
    let body = readyz_until(&client, &serve, 503).await;
    assert!(
        body.starts_with("not ready: redis://")
            && body.contains("did not answer PING within 200 ms"),
        "{body}"
    );
    assert!(!body.contains("s3cret"), "{body}");
    redis.resume();
    readyz_until(&client, &serve, 200).await;

    // Down: the connection is refused.
    redis.kill();
    let body = readyz_until(&client, &serve, 503).await;
    assert!(body.starts_with("not ready: redis://"), "{body}");
    assert!(!body.contains("s3cret"), "{body}");
    let health = client
        .get(format!("http://{}/healthz", serve.server.http))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200, "liveness is not readiness");
    let (status, body) = check(&client, &serve.url(), "k").await;
    assert_eq!(
        (status, &body["failure_policy"]),
        (200, &json!(true)),
        "{body}"
    );

    redis.restart();
    assert_eq!(readyz_until(&client, &serve, 200).await, "ready\n");
}

/// A limit override new to the server has its limiter made within the
/// store timeout, as every store call is bounded: with Redis frozen, the
/// failure policy answers it as a timeout, not after the connect timeout
/// (a second, past Envoy's own timeout) as a backend failure; thawed, the
/// next request makes it and decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_override_on_a_frozen_redis_waits_one_store_timeout() {
    let mut redis = RedisServer::start();
    let config = "[server]\nfailure_policy = \"closed\"\nstore_timeout_ms = 100\n\n\
                  [[domains]]\ndomain = \"api\"\n\n\
                  [[domains.descriptors]]\nkey = \"user\"\nlimit = 5\nwindow_ms = 3600000\n";
    let serve = Serve::start(&redis.url(), config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    // `value` names the client: the override's limiter is the same for
    // every value.
    let ask_as = |limit: u64, value: String| {
        let client = client.clone();
        let url = serve.url();
        async move {
            let r = client
                .post(url)
                .json(&json!({"domain": "api", "descriptors": [{
                    "entries": [{"key": "user", "value": value}],
                    "limit": {"requests_per_unit": limit, "unit": "hour"}}]}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let ask_with = |limit: u64| ask_as(limit, "ov".into());
    let ask = || ask_with(7);
    redis.pause();
    let (status, body) = ask().await;
    redis.resume();
    assert_eq!(
        (status, &body["failure_policy"], &body["failure"]),
        (429, &json!(true), &json!("timeout")),
        "{body}"
    );
    // The next request makes it (on a busy machine, a Redis just thawed
    // may take longer than 100 ms: the one after tries again, for a client
    // of its own, as a request that timed out may still have been counted).
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut attempt = 0;
    let (status, body) = loop {
        let (status, body) = ask_as(7, format!("thawed{attempt}")).await;
        if status == 200 || Instant::now() > deadline {
            break (status, body);
        }
        attempt += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (status, &body["rule"], &body["remaining"]),
        (200, &json!("api.user.override"), &json!(6)),
        "{body}"
    );
    // Redis gone: a new override's limiter cannot be made, and its calls
    // fail as the rules' do, their connection dropped (not `backend`).
    redis.kill();
    let (status, body) = ask_with(8).await;
    assert_eq!(
        (status, &body["failure_policy"], &body["failure"]),
        (429, &json!(true), &json!("connection_dropped")),
        "{body}"
    );
}

/// An override whose limiter Redis refuses to make (its user may not
/// touch the override's keys) fails as a rule's refused call does, a
/// `backend` failure, not as a request to correct (`invalid_input`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_refused_its_keys_is_a_backend_failure() {
    let redis = RedisServer::start();
    let acl = |keys: &[&str]| {
        let mut args = vec!["ACL", "SETUSER", "rw", "on", ">pw", "+@all", "resetkeys"];
        args.extend_from_slice(keys);
        assert_eq!(redis.cli(&args).trim(), "OK");
    };
    acl(&["~*"]);
    // A generous store timeout: on a busy machine the default 100 ms could
    // make the refusal a timeout.
    let config = "[server]\nfailure_policy = \"open\"\nstore_timeout_ms = 5000\n\n[[domains]]\ndomain = \"api\"\n\n\
                  [[domains.descriptors]]\nkey = \"user\"\nlimit = 5\nwindow_ms = 60000\n";
    let url = format!("redis://rw:pw@127.0.0.1:{}", redis.port());
    let serve = Serve::start(&url, config);
    // The rule's own keys (as `ratewarden key` names them) and the
    // check's stay allowed; the override's are not.
    let file = ConfigFile::new(config);
    let rule_key = key_name(&file, &["--domain", "api", "--entry", "user=x"]).unwrap();
    let rule_prefix = rule_key.split(":v2:").next().unwrap();
    let rule_keys = format!("~{rule_prefix}:*");
    acl(&[&rule_keys, "~ratewarden%3Aprobe:*"]);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let r = client
        .post(serve.url())
        .json(&json!({"domain": "api", "descriptors": [{
            "entries": [{"key": "user", "value": "x"}],
            "limit": {"requests_per_unit": 7, "unit": "hour"}}]}))
        .send()
        .await
        .unwrap();
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        (&body["failure_policy"], &body["failure"]),
        (&json!(true), &json!("backend")),
        "{body}"
    );
}

/// A call its client resets while it waits on a frozen store (as Envoy
/// does at its own timeout) is timed too, to the reset: a slow store's
/// calls are in the latency histogram whichever end gave up first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_its_client_resets_is_in_the_latency_histogram() {
    let redis = RedisServer::start();
    let config = "[server]\nstore_timeout_ms = 3000\n\n\
                  [[domains]]\ndomain = \"edge\"\n\n\
                  [[domains.descriptors]]\nkey = \"path\"\nlimit = 5\nwindow_ms = 60000\n";
    let serve = Serve::start(&redis.url(), config);
    let message = common::grpc_message(&path_a());
    redis.pause();
    let tcp = tokio::net::TcpStream::connect(serve.server.grpc)
        .await
        .unwrap();
    let (h2_client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut h2_client = h2_client.ready().await.unwrap();
    let (_response, mut stream) = h2_client
        .send_request(common::raw_rls_head(serve.server.grpc, Some("5S")), false)
        .unwrap();
    stream.send_data(message.into(), true).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stream.send_reset(h2::Reason::CANCEL);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let series = "ratewarden_request_duration_seconds_count{api=\"grpc\"}";
    // Well before the store's 3 s: the reset, not the store, ends it.
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut timed = 0;
    while timed == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        timed = common::metric(&client, serve.server.http, series).await;
    }
    redis.resume();
    assert_eq!(
        timed, 1,
        "the reset call is not timed within 2 s of its reset"
    );
}

/// On a cluster, `/readyz` pings every master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_on_a_cluster_pings_every_master() {
    let cluster = ratewarden_redis::test_support::RedisCluster::start();
    let config = "[server]\nstore_timeout_ms = 500\n\n[keys]\nlimit = 10\nwindow_ms = 3600000\n";
    let serve = Serve::start(&cluster.url(), config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    assert_eq!(readyz(&client, &serve).await, (200, "ready\n".to_owned()));
    // One master frozen (the cluster has no replica to take over): the
    // cluster cannot decide that master's keys, so it is not ready.
    let frozen = (0..cluster.nodes().len())
        .find(|&i| cluster.is_master(i))
        .unwrap();
    cluster.nodes()[frozen].pause();
    let body = readyz_until(&client, &serve, 503).await;
    assert!(body.starts_with("not ready: redis-cluster://"), "{body}");
    // Every probe fails, not one in three: each pings every master.
    for _ in 0..5 {
        let (status, body) = readyz(&client, &serve).await;
        assert_eq!(status, 503, "{body}");
    }
    cluster.nodes()[frozen].resume();
    readyz_until(&client, &serve, 200).await;
}

/// A cluster over TLS (`rediss-cluster://`): decisions and `/readyz` go
/// through every master's TLS port, its CA named in `[redis]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_decides_on_a_cluster_over_tls() {
    let certs = TestCerts::new();
    let cluster = ratewarden_redis::test_support::RedisCluster::start_tls(&certs);
    let file = ConfigFile::new(&format!(
        "[server]\nstore_timeout_ms = 5000\n[redis]\ntls_ca_file = {:?}\n\
         [keys]\nlimit = 1\nwindow_ms = 3600000\n",
        certs.ca_file().display().to_string()
    ));
    let url = cluster.tls_url().unwrap();
    let serve = Server::start(&["--store", &url, "--config", file.path()]);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    for key in ["a", "b", "c", "d", "e", "f"] {
        let (status, body) = check(&client, &serve.url(), key).await;
        assert_eq!(status, 200, "{key}: {body}");
        let (status, _) = check(&client, &serve.url(), key).await;
        assert_eq!(status, 429, "{key}");
    }
    let keys: usize = cluster
        .nodes()
        .iter()
        .map(|n| n.cli(&["DBSIZE"]).trim().parse::<usize>().unwrap())
        .sum();
    assert_eq!(keys, 6);
    let ready = client
        .get(format!("http://{}/readyz", serve.http))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status().as_u16(), 200);
}

/// Two deployments on one Redis, each with its own `key_prefix`, keep
/// their own counts for rules of the same identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_with_their_own_key_prefix_share_no_count() {
    let redis = RedisServer::start();
    let config = |prefix: &str| {
        // A store timeout far above any healthy call's, however busy the
        // machine: the counts are what is checked.
        format!(
            "[server]\nkey_prefix = \"{prefix}\"\nstore_timeout_ms = 5000\n\
             [keys]\nlimit = 1\nwindow_ms = 3600000\n"
        )
    };
    let staging = Serve::start(&redis.url(), &config("rw-staging"));
    let production = Serve::start(&redis.url(), &config("rw-production"));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    for serve in [&staging, &production] {
        let (status, body) = check(&client, &serve.url(), "k").await;
        assert_eq!(status, 200, "each deployment has its own budget: {body}");
        let (status, _) = check(&client, &serve.url(), "k").await;
        assert_eq!(status, 429);
    }
    let keys = redis.cli(&["--scan"]);
    let mut prefixes: Vec<&str> = keys
        .lines()
        // The prefix, then the rule's hash after an escaped `:`.
        .map(|k| k.split("%3A").next().unwrap_or_default())
        .collect();
    prefixes.sort();
    assert_eq!(prefixes, ["rw-production", "rw-staging"], "{keys}");
}

/// The log shows an outage's end as well as its start: one line a second
/// while calls fail, counting the failures it stands for, and one when a
/// call succeeds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_says_when_the_store_answers_again() {
    let mut redis = RedisServer::start();
    let log = tempfile::NamedTempFile::new().unwrap();
    let file = ConfigFile::new(
        // A killed Redis refuses at once; the timeout only keeps a healthy
        // call slowed by a busy machine from making a second outage.
        "[server]\nfailure_policy = \"open\"\nstore_timeout_ms = 5000\n\
         [keys]\nlimit = 10\nwindow_ms = 60000\n",
    );
    let server = Server::start_with_stderr(
        &["--store", &redis.url(), "--config", file.path()],
        std::process::Stdio::from(log.reopen().unwrap()),
    );
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let (status, _) = check(&client, &server.url(), "k").await;
    assert_eq!(status, 200);
    redis.kill();
    for _ in 0..5 {
        let (_, body) = check(&client, &server.url(), "k").await;
        assert_eq!(body["failure_policy"], true, "{body}");
    }
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = check(&client, &server.url(), "k").await;
        if body.get("failure_policy").is_none() {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery within 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The end of the outage is announced by a success a second after the
    // last failure, not by the first success, which may sit among failures.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, _) = check(&client, &server.url(), "k").await;
    assert_eq!(status, 200);
    let errors: u64 = common::metrics(&client, server.http)
        .await
        .lines()
        .filter(|l| l.starts_with("ratewarden_store_errors_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    server.stop();
    let text = std::fs::read_to_string(log.path()).unwrap();
    let failed: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("store failed"))
        .collect();
    assert!(!failed.is_empty(), "{text}");
    let again: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("succeed again"))
        .collect();
    assert_eq!(again.len(), 1, "{text}");
    assert!(again[0].contains("first_rule=keys"), "{text}");
    // Every failure is in the log's counts, those of the last second
    // before the outage ended on the line that says so.
    let not_logged = |line: &str| common::log_field(line, "failures_not_logged");
    let logged = failed.iter().map(|l| 1 + not_logged(l)).sum::<u64>() + not_logged(again[0]);
    assert_eq!(logged, errors, "{text}");
}

/// `ratewarden_failure_policy_decisions_total` for one policy and outcome.
async fn failure_count(
    client: &reqwest::Client,
    http: SocketAddr,
    policy: &str,
    allowed: bool,
) -> u64 {
    let outcome = if allowed { "allowed" } else { "refused" };
    let series = format!(
        "ratewarden_failure_policy_decisions_total{{policy=\"{policy}\",outcome=\"{outcome}\"}}"
    );
    common::metric(client, http, &series).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_on_redis_cluster_admit_exactly_the_limit() {
    let cluster = ratewarden_redis::test_support::RedisCluster::start();
    let config = "[server]\nstore_timeout_ms = 5000\n\n[[domains]]\ndomain = \"edge\"\n\n\
                  [[domains.descriptors]]\nkey = \"remote_address\"\nlimit = 100\nwindow_ms = 3600000\n\n\
                  [[domains.descriptors]]\nkey = \"path\"\nlimit = 30\nwindow_ms = 3600000\n";
    let serve = Serve::start(&cluster.url(), config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let request = |address: &str, path: Option<&str>| {
        let mut descriptors =
            vec![json!({"entries": [{"key": "remote_address", "value": address}]})];
        if let Some(p) = path {
            descriptors.push(json!({"entries": [{"key": "path", "value": p}]}));
        }
        json!({"domain": "edge", "descriptors": descriptors})
    };
    // The counts are exact only within one window (decided on Redis's
    // clock, this machine's).
    common::clear_of_window_edge(3_600_000, Duration::from_secs(30)).await;
    let mut admitted = 0;
    for _ in 0..150 {
        let r = client
            .post(serve.url())
            .json(&request("10.0.0.1", None))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap();
        assert!(body.get("failure_policy").is_none(), "{body}");
        if status == 200 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 100);
    // Two descriptors: the path's 30 run out first, and the refused
    // requests take nothing from the address's count.
    let mut admitted = 0;
    for _ in 0..50 {
        let r = client
            .post(serve.url())
            .json(&request("10.0.0.2", Some("/a")))
            .send()
            .await
            .unwrap();
        if r.status().as_u16() == 200 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 30);
    let r = client
        .post(serve.url())
        .json(&request("10.0.0.2", None))
        .send()
        .await
        .unwrap();
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["remaining"], 69, "{body}");
}

/// A gRPC call whose `grpc-timeout` is zero (Envoy's `timeout: 0s`, meant
/// as none) is answered when its decision is, however long the store
/// takes, rather than cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_grpc_timeout_waits_for_a_slow_store() {
    let redis = RedisServer::start();
    let config = "[server]\nstore_timeout_ms = 5000\n\n[[domains]]\ndomain = \"edge\"\n\n\
                  [[domains.descriptors]]\nkey = \"path\"\nlimit = 1\nwindow_ms = 3600000\n";
    let serve = Serve::start(&redis.url(), config);
    let grpc = serve.server.grpc;
    let request = path_a();
    // The first call loads the policy's script.
    let (status, message, _) = raw_should(grpc, "5S", &request, true).await;
    assert_eq!(status, "0", "{message}");

    redis.pause();
    let asked = Instant::now();
    let call = tokio::spawn(async move { raw_should(grpc, "0m", &request, true).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();
    let (status, message, answered) = call.await.unwrap();
    assert_eq!(status, "0", "{message}");
    assert!(answered - asked >= Duration::from_millis(300));
}

/// Every rule's store shares one connection to Redis: fifty rules hold
/// two connections between them, the rules' and the readiness probe's,
/// and still keep their counts apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_share_one_connection_to_redis() {
    let redis = RedisServer::start();
    let mut config =
        String::from("[server]\nstore_timeout_ms = 5000\n\n[[domains]]\ndomain = \"d\"\n");
    for i in 0..50 {
        config.push_str(&format!(
            "\n[[domains.descriptors]]\nkey = \"k{i}\"\nlimit = {}\nwindow_ms = 3600000\n",
            2 + i % 2
        ));
    }
    let serve = Serve::start(&redis.url(), &config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let descriptors: Vec<Value> = (0..50)
        .map(|i| json!({"entries": [{"key": format!("k{i}"), "value": "v"}]}))
        .collect();
    let body = json!({"domain": "d", "descriptors": descriptors});
    // The rules with a limit of 2 refuse the third request; one refusal
    // refuses it all, and takes nothing from the others.
    for want in [200, 200, 429] {
        let r = client.post(serve.url()).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        let reply: Value = r.json().await.unwrap();
        assert_eq!(status, want, "{reply}");
        assert!(reply.get("failure_policy").is_none(), "{reply}");
    }
    let odd = json!({"domain": "d", "descriptors": [{"entries": [{"key": "k1", "value": "v"}]}]});
    let r = client.post(serve.url()).json(&odd).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "k1's limit is 3");
    assert_eq!(readyz(&client, &serve).await, (200, "ready\n".to_owned()));
    assert_eq!(redis.clients(), 2, "{}", redis.cli(&["CLIENT", "LIST"]));
}

/// Runs `ratewarden serve --store STORE` expecting it to stop at start;
/// returns its exit status and standard error. Bounded: a server that
/// starts anyway is killed after 20 s and the test fails.
fn serve_refused(store: &str) -> (std::process::ExitStatus, String) {
    serve_refused_as(store, &[], &[])
}

/// [`serve_refused`], with more environment variables.
fn serve_refused_with(
    store: &str,
    env: &[(&str, &std::path::Path)],
) -> (std::process::ExitStatus, String) {
    serve_refused_as(store, env, &[])
}

/// [`serve_refused`], with a configuration file.
fn serve_refused_with_config(store: &str, config: &str) -> (std::process::ExitStatus, String) {
    serve_refused_as(store, &[], &["--config", config])
}

/// [`serve_refused`], with more environment variables and arguments.
fn serve_refused_as(
    store: &str,
    env: &[(&str, &std::path::Path)],
    args: &[&str],
) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    let mut child = std::process::Command::new(common::BIN)
        .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .args(["--store", store])
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the ratewarden binary starts");
    let status = common::exit_within(&mut child, Duration::from_secs(20))
        .unwrap_or_else(|| panic!("serve --store {store} did not stop at start"));
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status, stderr)
}

#[test]
fn a_redis_that_wants_a_password_stops_serve_at_start_saying_so() {
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let (status, stderr) = serve_refused(&redis.url());
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("requires a password"), "{stderr}");
}

/// serve decides by Redis's clock: a user refused `TIME` would fail every
/// decision, so it stops at start saying what to grant.
#[test]
fn a_user_refused_time_stops_serve_at_start_saying_so() {
    let redis = RedisServer::start();
    let granted = redis.cli(&["ACL", "SETUSER", "rw", "on", ">pw", "~*", "+@all", "-time"]);
    assert_eq!(granted.trim(), "OK");
    let url = format!("redis://rw:pw@127.0.0.1:{}", redis.port());
    let (status, stderr) = serve_refused(&url);
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("the command TIME"), "{stderr}");
    assert!(stderr.contains("grant it +time"), "{stderr}");
    // Not a key refused: no key pattern is asked for.
    assert!(!stderr.contains("for serve, grant"), "{stderr}");
    // The error's kind would only label what its words say.
    assert!(!stderr.contains("invalid input:"), "{stderr}");
    assert!(!stderr.contains(":pw@"), "{stderr}");
}

/// A host name that does not resolve stops serve saying so, without the
/// advice to start redis-server there or to use TLS.
#[test]
fn a_store_host_that_does_not_resolve_is_said_to_be_one() {
    let (status, stderr) = serve_refused("redis://nohost.invalid:6379");
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("the host's name did not resolve"),
        "{stderr}"
    );
    assert!(!stderr.contains("start redis-server there"), "{stderr}");
    assert!(!stderr.contains("TLS only"), "{stderr}");
}

/// A user whose key pattern is written from the prefix as given
/// (`~ratewarden:*`) misses the keys, whose `:` is stored as %3A: serve
/// stops at start naming the pattern that covers every rule's keys, and
/// that pattern starts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_refused_the_keys_stops_serve_at_start_naming_the_pattern() {
    let redis = RedisServer::start();
    let granted = redis.cli(&[
        "ACL",
        "SETUSER",
        "rw",
        "on",
        ">pw",
        "~ratewarden:*",
        "+@all",
    ]);
    assert_eq!(granted.trim(), "OK");
    let url = format!("redis://rw:pw@127.0.0.1:{}", redis.port());
    // A generous store timeout: the start's checks and the calls must be
    // answered, and on a busy machine the default 100 ms could time one
    // out (and so stop serve, or fail a call, for another reason).
    let config = "[server]\nstore_timeout_ms = 5000\n\n[keys]\nlimit = 10\nwindow_ms = 60000\n";
    let file = ConfigFile::new(config);
    let (status, stderr) = serve_refused_with_config(&url, file.path());
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("lacks a command or a key"), "{stderr}");
    assert!(
        stderr.contains("for serve, grant ~ratewarden%3A*"),
        "{stderr}"
    );
    let granted = redis.cli(&["ACL", "SETUSER", "rw", "resetkeys", "~ratewarden%3A*"]);
    assert_eq!(granted.trim(), "OK");
    let serve = Serve::start(&url, config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let (status, body) = check(&client, &serve.url(), "k").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["remaining"], 9, "{body}");
    drop(serve);
    // A prefix holding a glob's own characters: the pattern written from
    // it (`[1]` matches "1", not "[1]") misses its keys, and the one
    // named, escaped, starts serve.
    let config =
        "[server]\nkey_prefix = \"t[1]*\"\nstore_timeout_ms = 5000\n\n[keys]\nlimit = 10\nwindow_ms = 60000\n";
    let file = ConfigFile::new(config);
    let granted = redis.cli(&["ACL", "SETUSER", "rw", "resetkeys", "~t[1]*%3A*"]);
    assert_eq!(granted.trim(), "OK");
    let (status, stderr) = serve_refused_with_config(&url, file.path());
    assert!(!status.success(), "{stderr}");
    let advised = stderr
        .split("for serve, grant ")
        .nth(1)
        .and_then(|rest| rest.split(" instead").next())
        .unwrap_or_else(|| panic!("no pattern named: {stderr}"));
    assert_eq!(advised, "~t\\[1\\]\\*%3A*");
    let granted = redis.cli(&["ACL", "SETUSER", "rw", "resetkeys", advised]);
    assert_eq!(granted.trim(), "OK");
    let serve = Serve::start(&url, config);
    let (status, body) = check(&client, &serve.url(), "k").await;
    assert_eq!(status, 200, "{body}");
}

/// A key pattern covering only the check's keys (`~ratewarden%3Aprobe:*`,
/// which the store's own message names) stops serve at start naming the
/// pattern for every rule's keys too; and when the ACL takes the keys away
/// while serving, `/readyz` names that pattern, not the check's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_keys_are_answered_with_the_pattern_for_every_rule() {
    let redis = RedisServer::start();
    let acl = |args: &[&str]| {
        let mut all = vec!["ACL", "SETUSER", "rw"];
        all.extend_from_slice(args);
        assert_eq!(redis.cli(&all).trim(), "OK");
    };
    acl(&["on", ">pw", "~ratewarden%3Aprobe:*", "+@all"]);
    let url = format!("redis://rw:pw@127.0.0.1:{}", redis.port());
    // A generous store timeout: the start's checks and the probes must be
    // answered, and on a busy machine the default 100 ms could time one
    // out, which stops serve or fails /readyz for another reason.
    let config = "[server]\nstore_timeout_ms = 5000\n\n[keys]\nlimit = 10\nwindow_ms = 60000\n";
    let file = ConfigFile::new(config);
    let (status, stderr) = serve_refused_with_config(&url, file.path());
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("for serve, grant ~ratewarden%3A* instead"),
        "{stderr}"
    );
    acl(&["resetkeys", "~ratewarden%3A*"]);
    let serve = Serve::start(&url, config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    assert_eq!(readyz(&client, &serve).await, (200, "ready\n".to_owned()));
    acl(&["resetkeys", "~other*"]);
    let body = readyz_until(&client, &serve, 503).await;
    assert!(
        body.contains("for serve, grant ~ratewarden%3A* instead"),
        "{body}"
    );
}

/// A Redis that evicts keys once full would let an evicted key's count
/// start again from empty: serve says so at start, once, and serves.
#[test]
fn an_evicting_redis_is_named_in_a_warning_at_start() {
    let redis =
        RedisServer::start_with(&["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"]);
    let config = ConfigFile::new("[keys]\nlimit = 10\nwindow_ms = 60000\n");
    let (server, log) = Server::start_logged(&["--store", &redis.url(), "--config", config.path()]);
    let lines = log.through_containing("listening");
    let warned: Vec<&String> = lines.iter().filter(|l| l.contains("evicts keys")).collect();
    assert_eq!(warned.len(), 1, "{lines:#?}");
    assert!(warned[0].contains("WARN"), "{}", warned[0]);
    assert!(
        warned[0].contains("maxmemory-policy allkeys-lru")
            && warned[0].contains("set maxmemory-policy noeviction"),
        "{}",
        warned[0]
    );
    server.stop();
}

/// A user that may not run INFO leaves the eviction check (and a single
/// node's check for a writable replica) undone: serve says so at start,
/// once, and serves.
#[test]
fn a_user_without_info_is_told_what_went_unchecked() {
    let redis =
        RedisServer::start_with(&["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"]);
    let granted = redis.cli(&["ACL", "SETUSER", "rw", "on", ">pw", "~*", "+@all", "-info"]);
    assert_eq!(granted.trim(), "OK");
    let url = format!("redis://rw:pw@127.0.0.1:{}", redis.port());
    let config = ConfigFile::new("[keys]\nlimit = 10\nwindow_ms = 60000\n");
    let (server, log) = Server::start_logged(&["--store", &url, "--config", config.path()]);
    let lines = log.through_containing("listening");
    let warned: Vec<&String> = lines.iter().filter(|l| l.contains("INFO memory")).collect();
    assert_eq!(warned.len(), 1, "{lines:#?}");
    assert!(
        warned[0].contains("WARN")
            && warned[0].contains("whether it evicts keys once full was not checked")
            && warned[0].contains("nor whether it is a writable replica")
            && warned[0].contains("grant the URL's user +info"),
        "{}",
        warned[0]
    );
    assert!(!warned[0].contains("pw@"), "{}", warned[0]);
    server.stop();
}

/// On a cluster, the warning names the master that evicts: the URL's
/// seeds need not be it, and one looked at would say `noeviction`.
#[test]
fn an_evicting_cluster_master_is_named_in_the_warning() {
    let cluster = ratewarden_redis::test_support::RedisCluster::start();
    let last = cluster.nodes().last().unwrap();
    for (setting, value) in [("maxmemory", "100mb"), ("maxmemory-policy", "volatile-lru")] {
        assert_eq!(last.cli(&["CONFIG", "SET", setting, value]).trim(), "OK");
    }
    let config = ConfigFile::new("[keys]\nlimit = 10\nwindow_ms = 60000\n");
    let (server, log) =
        Server::start_logged(&["--store", &cluster.url(), "--config", config.path()]);
    let lines = log.through_containing("listening");
    let warned: Vec<&String> = lines.iter().filter(|l| l.contains("evicts keys")).collect();
    assert_eq!(warned.len(), 1, "{lines:#?}");
    assert!(
        warned[0].contains(&format!(
            "(its master at 127.0.0.1:{}) evicts keys once full (maxmemory-policy volatile-lru",
            last.port()
        )),
        "{}",
        warned[0]
    );
    server.stop();
}

#[test]
fn the_password_is_never_logged() {
    use std::io::BufRead;
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let url = format!("redis://:s3cret@127.0.0.1:{}", redis.port());
    // From the environment, which keeps the password out of the process
    // list.
    let mut child = std::process::Command::new(common::BIN)
        .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .env("RATEWARDEN_STORE", &url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the ratewarden binary starts");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let done = line.contains("listening");
            let _ = tx.send(line);
            if done {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        let done = line.contains("listening");
        lines.push(line);
        if done {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let log = lines.join("\n");
    assert!(log.contains("listening"), "{log}");
    assert!(log.contains("redis://:***@127.0.0.1"), "{log}");
    assert!(!log.contains("s3cret"), "{log}");

    // An error at start neither.
    let (status, stderr) =
        serve_refused(&format!("redis://:pw-not-shown@127.0.0.1:{}", redis.port()));
    assert!(!status.success(), "{stderr}");
    assert!(!stderr.contains("pw-not-shown"), "{stderr}");
    // Nor a password whose unescaped `/`, `?` or `@` makes the URL
    // unreadable: the error says to percent-encode it.
    for password in ["pw/not-shown", "pw?not-shown", "p@w:not/shown,x"] {
        let (status, stderr) =
            serve_refused(&format!("redis://:{password}@127.0.0.1:{}", redis.port()));
        assert!(!status.success(), "{stderr}");
        assert!(!stderr.contains("not-shown"), "{stderr}");
        assert!(!stderr.contains("not/shown"), "{stderr}");
        assert!(stderr.contains("percent-encoded"), "{stderr}");
    }
}

/// A configuration whose `[redis]` table names `ca.crt`, `client.crt` and
/// `client.key` beside it, with a long store timeout and one `[keys]` rule
/// admitting `limit` an hour.
fn tls_config(limit: u64) -> ConfigFile {
    ConfigFile::new(&format!(
        "[server]\nstore_timeout_ms = 5000\n\
         [redis]\ntls_ca_file = \"ca.crt\"\ntls_cert_file = \"client.crt\"\n\
         tls_key_file = \"client.key\"\n\
         [keys]\nlimit = {limit}\nwindow_ms = 3600000\n"
    ))
}

/// Writes `certs`' CA, client certificate and key as the files that
/// [`tls_config`]'s `file` names.
fn client_files(certs: &TestCerts, file: &ConfigFile) {
    for (from, to) in [
        (certs.ca_file(), "ca.crt"),
        (certs.client_cert_file(), "client.crt"),
        (certs.client_key_file(), "client.key"),
    ] {
        std::fs::copy(from, file.dir().join(to)).unwrap();
    }
}

/// `serve` on a Redis that takes TLS and asks for a client certificate:
/// the `[redis]` files, found from the configuration file's directory,
/// trust its CA and show the certificate. Without them, `serve` stops at
/// start saying which file to give; a password in the URL is never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_decides_over_tls_with_the_files_its_config_names() {
    let certs = TestCerts::new();
    let redis = RedisServer::start_tls(&certs, true);
    let tls_url = redis.tls_url().unwrap();
    let file = tls_config(1);
    client_files(&certs, &file);
    let serve = Server::start(&["--store", &tls_url, "--config", file.path()]);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let (status, body) = check(&client, &serve.url(), "k").await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = check(&client, &serve.url(), "k").await;
    assert_eq!(status, 429);
    assert_eq!(
        redis.cli(&["DBSIZE"]).trim(),
        "1",
        "the count lives in Redis"
    );
    serve.stop();

    // The same files with a plain URL: refused at start, as the link
    // would stay plain, as the [redis] table's mistake (not a rule's).
    let (status, stderr) = serve_refused_with_config(&redis.url(), file.path());
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "the configuration's [redis] table: tls_ca_file is given, but the URL does not \
             use TLS"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("rule"), "{stderr}");
    // The system's roots do not trust the test CA.
    let (status, stderr) = serve_refused(&tls_url);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("not trusted") && stderr.contains("tls_ca_file"),
        "{stderr}"
    );
    // Trusted through SSL_CERT_FILE, but without the client certificate.
    let (status, stderr) = serve_refused_with(&tls_url, &[("SSL_CERT_FILE", &certs.ca_file())]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("asks for a client certificate") && stderr.contains("tls_cert_file"),
        "{stderr}"
    );
    // A password in a TLS URL is shown by no message, the handshake's
    // failure included.
    let port = redis.tls_port().unwrap();
    let (status, stderr) = serve_refused(&format!("rediss://:pw-not-shown@127.0.0.1:{port}"));
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("not trusted"), "{stderr}");
    assert!(!stderr.contains("pw-not-shown"), "{stderr}");
    for refused in ["valkey://:pw-not-shown@h:1", "memroy:pw-not-shown@h"] {
        let (status, stderr) = serve_refused(refused);
        assert_eq!(status.code(), Some(2), "{refused}: {stderr}");
        assert!(stderr.contains("--store"), "{refused}: {stderr}");
        assert!(!stderr.contains("pw-not-shown"), "{refused}: {stderr}");
    }
}

/// Certificates rotated under a running `serve`: Redis restarts with a new
/// CA's certificate, and the `[redis]` files are replaced on disk. The
/// checks get the failure policy and `/readyz` says why until the files
/// fit, and then decide and report ready again, with no restart or reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reads_certificates_rotated_on_disk_at_its_next_connection() {
    let certs = TestCerts::new();
    let mut redis = RedisServer::start_tls(&certs, true);
    let tls_url = redis.tls_url().unwrap();
    let file = tls_config(1000);
    client_files(&certs, &file);
    let serve = Serve {
        server: Server::start(&["--store", &tls_url, "--config", file.path()]),
        _config: file,
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    // Decided by Redis: no `failure_policy` in the answer.
    let (status, body) = check(&client, &serve.url(), "k").await;
    assert_eq!(
        (status, &body["failure_policy"]),
        (200, &Value::Null),
        "{body}"
    );
    assert_eq!(readyz(&client, &serve).await, (200, "ready\n".to_owned()));

    // Redis's side first: its new certificate is not trusted yet.
    let rotated = TestCerts::new();
    for (from, to) in [
        (rotated.ca_file(), certs.ca_file()),
        (rotated.server_cert_file(), certs.server_cert_file()),
        (rotated.server_key_file(), certs.server_key_file()),
    ] {
        std::fs::copy(from, to).unwrap();
    }
    redis.restart();
    let body = readyz_until(&client, &serve, 503).await;
    assert!(
        body.contains("not signed by the CA in tls_ca_file"),
        "{body}"
    );
    let (status, body) = check(&client, &serve.url(), "k").await;
    assert_eq!(
        (status, &body["failure_policy"]),
        (429, &json!(true)),
        "{body}"
    );

    // Then the files `serve` reads: decided by Redis, and ready, again.
    client_files(&rotated, &serve._config);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = check(&client, &serve.url(), "k").await;
        if status == 200 && body["failure_policy"] == Value::Null {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {status} after 20 s: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(readyz_until(&client, &serve, 200).await, "ready\n");
}

/// Mistakes that show in the URL itself are refused while the arguments
/// are read (exit 2), saying what to write, and a typo with no password in
/// it is shown whole.
#[test]
fn store_url_mistakes_are_refused_before_anything_runs() {
    let (status, stderr) = serve_refused("redis://127.0.0.1:1?db=3");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--store"), "{stderr}");
    assert!(stderr.contains("redis://HOST:PORT/DB"), "{stderr}");
    assert!(!stderr.contains("rule"), "{stderr}");
    let (status, stderr) = serve_refused("redis:/127.0.0.1:1");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("\"redis:/127.0.0.1:1\""), "{stderr}");
    // The scheme left out: shown, with the URL to write.
    let (status, stderr) = serve_refused("127.0.0.1:1");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("\"127.0.0.1:1\" has no scheme; write redis://127.0.0.1:1"),
        "{stderr}"
    );
    // A database that is no number: refused here, not by a rule's
    // connection, and not shown (it may be a password in the wrong place).
    let (status, stderr) = serve_refused("redis://127.0.0.1:1/s3cret");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "\"redis://127.0.0.1:1/***\": what follows HOST:PORT/ must be a database number"
        ),
        "{stderr}"
    );
    assert!(
        !stderr.contains("s3cret") && !stderr.contains("rule"),
        "{stderr}"
    );
    // Digits past any database number, likewise.
    let (status, stderr) = serve_refused("redis://127.0.0.1:1/99999999999999999999");
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("must be a database number"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_url_serves() {
    let socket = std::env::temp_dir().join(format!("ratewarden-serve-{}.sock", std::process::id()));
    let path = socket.display().to_string();
    let redis = RedisServer::start_with(&["--unixsocket", &path, "--unixsocketperm", "700"]);
    let serve = Serve::start(
        &format!("redis+unix://{path}"),
        "[server]\nstore_timeout_ms = 5000\n\n[keys]\nlimit = 2\nwindow_ms = 3600000\n",
    );
    let client = reqwest::Client::new();
    let mut allowed = Vec::new();
    for _ in 0..3 {
        let (_, body) = check(&client, &serve.url(), "unix").await;
        assert_ne!(body["failure_policy"], json!(true), "{body}");
        allowed.push(body["allowed"].as_bool().unwrap());
    }
    assert_eq!(allowed, [true, true, false]);
    drop(serve);
    drop(redis);
    let _ = std::fs::remove_file(&socket);
}

/// A key holding state the script cannot read fails on every request until
/// it is deleted: under `open` it is refused, not admitted for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_key_is_refused_even_under_open() {
    let redis = RedisServer::start();
    let serve = Serve::start(
        &redis.url(),
        // A store timeout far above any healthy call's: only the corrupt
        // key may fail.
        "[server]\nfailure_policy = \"open\"\nstore_timeout_ms = 5000\n\
         [keys]\nlimit = 5\nwindow_ms = 3600000\n",
    );
    let client = reqwest::Client::new();
    let (status, _) = check(&client, &serve.url(), "victim").await;
    assert_eq!(status, 200);
    let keys = redis.cli(&["--scan"]);
    let keys: Vec<&str> = keys.lines().collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(
        redis.cli(&["SET", keys[0], "garbage", "KEEPTTL"]).trim(),
        "OK"
    );
    for _ in 0..3 {
        let (status, body) = check(&client, &serve.url(), "victim").await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["failure_policy"], true, "{body}");
        assert_eq!(body["failure"], "corrupt_state", "{body}");
    }
    let text = common::metrics(&client, serve.server.http).await;
    assert!(
        text.contains("ratewarden_store_errors_total{rule=\"keys\",kind=\"corrupt_state\"} 3\n"),
        "{text}"
    );
    // Another key of the rule is decided as ever.
    let (status, body) = check(&client, &serve.url(), "other").await;
    assert_eq!((status, &body["remaining"]), (200, &json!(4)), "{body}");
}

/// `ratewarden key`'s line for `args` (with the configuration `file`): the
/// Redis key name it prints, or its error.
fn key_name(file: &ConfigFile, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(common::BIN)
        .args(["key", "--config", file.path()])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    if out.status.success() {
        Ok(stdout.trim_end().to_owned())
    } else {
        assert!(stdout.is_empty(), "{stdout}");
        Err(stderr)
    }
}

/// `ratewarden key` names the Redis key of the count a request spends:
/// deleting it gives that one client its whole budget back, for a key
/// request, a descriptor and a descriptor's own limit alike, and leaves
/// every other client's count as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_command_names_the_redis_key_of_one_clients_count() {
    let redis = RedisServer::start();
    let config = "[server]\nstore_timeout_ms = 5000\nkey_prefix = \"app:limits\"\n\n\
                  [keys]\npolicy = \"gcra\"\nlimit = 2\nwindow_ms = 3600000\n\n\
                  [[domains]]\ndomain = \"api\"\n\n[[domains.descriptors]]\nkey = \"path\"\n\n\
                  [[domains.descriptors.descriptors]]\nkey = \"user\"\npolicy = \"sliding-log\"\n\
                  limit = 2\nunit = \"hour\"\n";
    let serve = Serve::start(&redis.url(), config);
    let file = ConfigFile::new(config);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let url = serve.url();
    let descriptor = |user: &str, limit: Option<Value>| {
        let mut d =
            json!({"entries": [{"key": "path", "value": "/a=b"}, {"key": "user", "value": user}]});
        if let Some(limit) = limit {
            d["limit"] = limit;
        }
        json!({"domain": "api", "descriptors": [d]})
    };
    let post = |body: Value| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let r = client.post(&url).json(&body).send().await.unwrap();
            r.status().as_u16()
        }
    };
    let over = json!({"requests_per_unit": 3, "unit": "day"});
    let requests = [
        (json!({"key": "user:42"}), 2),
        (descriptor("ann", None), 2),
        (descriptor("ann", Some(over.clone())), 3),
    ];
    // Each count spent, for the client whose count is deleted and for
    // one whose is not.
    for (body, limit) in &requests {
        for other in [false, true] {
            let body = if other {
                let text = body
                    .to_string()
                    .replace("user:42", "user:7")
                    .replace("ann", "bob");
                serde_json::from_str(&text).unwrap()
            } else {
                body.clone()
            };
            for _ in 0..*limit {
                assert_eq!(post(body.clone()).await, 200, "{body}");
            }
            assert_eq!(post(body.clone()).await, 429, "{body}");
        }
    }
    // `key`'s arguments for ann's descriptor, then `more`.
    let ann = |more: &[&'static str]| {
        let mut args = vec![
            "--domain",
            "api",
            "--entry",
            "path=/a=b",
            "--entry",
            "user=ann",
        ];
        args.extend_from_slice(more);
        key_name(&file, &args)
    };
    let names = [
        key_name(&file, &["--key", "user:42"]).unwrap(),
        ann(&[]).unwrap(),
        ann(&["--limit", "3/DAY"]).unwrap(),
    ];
    // A limit the service ignores (a sliding-log override whose log could
    // hold more than 10,000 entries) leaves the rule's count, named so.
    let ignored = ann(&["--limit", "20000/hour"]);
    assert_eq!(ignored.as_ref(), Ok(&names[1]));
    // A key may start with '-'.
    assert!(key_name(&file, &["--key", "-1"]).is_ok());
    for ((body, _), name) in requests.iter().zip(&names) {
        assert!(name.starts_with("app%3Alimits%3A"), "{name}");
        assert_eq!(redis.cli(&["DEL", name]).trim(), "1", "{name}");
        assert_eq!(post(body.clone()).await, 200, "{body}");
    }
    // The other client's counts were left whole: still refused.
    for (body, _) in &requests {
        let text = body
            .to_string()
            .replace("user:42", "user:7")
            .replace("ann", "bob");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(post(body.clone()).await, 429, "{body}");
    }
    // What keeps no count says so, rather than naming a key.
    for (args, said) in [
        (
            &["--key", "a", "--limit", "1/second"][..],
            "cannot be used with",
        ),
        (&["--key", ""][..], "the key is empty"),
        (&["--domain", "", "--entry", "a=b"][..], "domain is empty"),
        (
            &["--domain", "web", "--entry", "path=/"][..],
            "no [[domains]] entry \"web\"",
        ),
        (
            &["--domain", "api", "--entry", "user=ann"][..],
            "matches no rule",
        ),
        (
            &["--domain", "api", "--entry", "path"][..],
            "write KEY=VALUE",
        ),
        (
            &[
                "--domain",
                "api",
                "--entry",
                "path=/",
                "--limit",
                "3/fortnight",
            ][..],
            "unknown unit",
        ),
    ] {
        let e = key_name(&file, args).unwrap_err();
        assert!(e.contains(said), "{args:?}: {e}");
    }
}
