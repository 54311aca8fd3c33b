//! Many clients at once on one key admit exactly the limit, on every
//! policy: the read-modify-write is one atomic script. Tasks on separate
//! connections, two OS processes, and 10,000 keys at once; beside them, the
//! seed's non-atomic MGET-then-INCR pattern under the same load, measured.

mod common;

use std::process::Command;
use std::sync::Arc;

use ratewarden_core::{Clock, PolicyConfig, PolicyKind, SystemClock};
use ratewarden_redis::test_support::RedisServer;
use ratewarden_redis::RedisStore;
use tokio::sync::Barrier;

const CLIENTS: usize = 64;
const REQUESTS_PER_CLIENT: usize = 4;
const LIMIT: u64 = 100;
const RUNS: u64 = 20;
/// Every request is decided at one instant, so no window rolls and no
/// bucket refills while the clients race: exactly `LIMIT` may pass.
const NOW_MS: u64 = 1_764_000_000_000;

/// `CLIENTS` stores, each on its own connection.
async fn clients(url: &str, config: PolicyConfig, prefix: &str) -> Vec<RedisStore> {
    let mut out = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        let mut options = common::exact_options("race");
        options.prefix = prefix.to_owned();
        // A pipelined batch's last reply waits for every client's batches
        // queued before it on one single-threaded Redis (about 6 s a
        // policy on a busy 2-core machine): far more time than that, since
        // counting is checked here, not latency.
        options.timeout_ms = 120_000;
        out.push(
            RedisStore::connect(url, config, options)
                .await
                .expect("connect"),
        );
    }
    out
}

/// Every client sends its requests on `key` at once; returns how many
/// were admitted.
async fn race(stores: &[RedisStore], key: u64) -> u64 {
    let barrier = Arc::new(Barrier::new(stores.len()));
    let mut tasks = Vec::new();
    for store in stores {
        let (store, barrier) = (store.clone(), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut admitted = 0;
            for _ in 0..REQUESTS_PER_CLIENT {
                if store
                    .decide(key, Some(NOW_MS), 1)
                    .await
                    .expect("decide")
                    .allowed
                {
                    admitted += 1;
                }
            }
            admitted
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("client task");
    }
    total
}

#[test]
fn sixty_four_clients_on_one_key_admit_exactly_the_limit() {
    let server = RedisServer::start();
    let rt = common::runtime();
    rt.block_on(async {
        for policy in PolicyKind::ALL {
            let config = PolicyConfig::new(policy, LIMIT, 1000);
            let stores = clients(&server.url(), config, &common::fresh_prefix("race")).await;
            for run in 0..RUNS {
                let admitted = race(&stores, run).await;
                assert_eq!(admitted, LIMIT, "{policy}, run {run}");
            }
        }
    });
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

/// The child side of the two-process test: races `CLIENTS / 2` clients on
/// the key the parent names, prints the count admitted.
#[test]
fn child_process_race() {
    let Ok(url) = std::env::var("RATEWARDEN_RACE_URL") else {
        return;
    };
    let policy: PolicyKind = std::env::var("RATEWARDEN_RACE_POLICY")
        .unwrap()
        .parse()
        .unwrap();
    let prefix = std::env::var("RATEWARDEN_RACE_PREFIX").unwrap();
    let key: u64 = std::env::var("RATEWARDEN_RACE_KEY")
        .unwrap()
        .parse()
        .unwrap();
    let start_ms: u64 = std::env::var("RATEWARDEN_RACE_START_MS")
        .unwrap()
        .parse()
        .unwrap();
    let rt = common::runtime();
    let admitted = rt.block_on(async {
        let config = PolicyConfig::new(policy, LIMIT, 1000);
        let stores = clients(&url, config, &prefix).await;
        // Both processes start racing at one agreed instant, so that their
        // requests overlap (the wait is bounded by the parent's choice).
        let wait = start_ms.saturating_sub(SystemClock.now_ms()).min(5_000);
        tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
        race(&stores[..CLIENTS / 2], key).await
    });
    println!("ADMITTED={admitted}");
}

#[test]
fn two_processes_on_one_key_admit_exactly_the_limit() {
    let server = RedisServer::start();
    let exe = std::env::current_exe().expect("test binary");
    for policy in PolicyKind::ALL {
        let prefix = common::fresh_prefix("procs");
        for run in 0..RUNS {
            let start_ms = SystemClock.now_ms() + 300;
            let children: Vec<_> = (0..2)
                .map(|_| {
                    Command::new(&exe)
                        .args([
                            "--exact",
                            "child_process_race",
                            "--nocapture",
                            "--test-threads=1",
                        ])
                        .env("RATEWARDEN_RACE_URL", server.url())
                        .env("RATEWARDEN_RACE_POLICY", policy.name())
                        .env("RATEWARDEN_RACE_PREFIX", &prefix)
                        .env("RATEWARDEN_RACE_KEY", run.to_string())
                        .env("RATEWARDEN_RACE_START_MS", start_ms.to_string())
                        .output_spawn()
                })
                .collect();
            let admitted: u64 = children.into_iter().map(wait_admitted).sum();
            assert_eq!(admitted, LIMIT, "{policy}, run {run}");
        }
    }
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

trait SpawnPiped {
    fn output_spawn(&mut self) -> std::process::Child;
}

impl SpawnPiped for Command {
    fn output_spawn(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn child test process")
    }
}

fn wait_admitted(child: std::process::Child) -> u64 {
    let out = child.wait_with_output().expect("child output");
    assert!(out.status.success(), "child failed");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.split("ADMITTED=").nth(1))
        .unwrap_or_else(|| panic!("child printed no count: {text}"))
        .trim()
        .parse()
        .expect("count")
}

/// `CLIENTS` clients race on `keys` keys at once, for every policy at
/// `key_limit` per window: client `c` asks for every key `k` with
/// `k mod groups = c mod groups`, `repeats` times each, in pipelined
/// batches, so every key gets `CLIENTS / groups * repeats` requests from
/// that many clients at once. Every key must admit exactly `key_limit`,
/// in each of `runs` runs (each on fresh keys).
fn keys_at_once(keys: u64, key_limit: u64, groups: usize, repeats: usize, runs: u64) {
    assert!(
        (CLIENTS / groups * repeats) as u64 > key_limit,
        "every key must be asked for more than its limit"
    );
    const BATCH: usize = 500;
    let server = RedisServer::start();
    let rt = common::runtime();
    rt.block_on(async {
        for policy in PolicyKind::ALL {
            let config = PolicyConfig::new(policy, key_limit, 1000);
            let stores = clients(&server.url(), config, &common::fresh_prefix("keys")).await;
            for run in 0..runs {
                let barrier = Arc::new(Barrier::new(CLIENTS));
                let mut tasks = Vec::new();
                for (c, store) in stores.iter().enumerate() {
                    let (store, barrier) = (store.clone(), Arc::clone(&barrier));
                    tasks.push(tokio::spawn(async move {
                        barrier.wait().await;
                        let mut admitted = vec![0u64; keys as usize];
                        // Keys of this run: fresh, so every run starts full.
                        let mine: Vec<u64> = (0..keys)
                            .filter(|k| k % groups as u64 == (c % groups) as u64)
                            .flat_map(|k| std::iter::repeat_n(k, repeats))
                            .collect();
                        for chunk in mine.chunks(BATCH) {
                            let batch: Vec<(u64, u64)> =
                                chunk.iter().map(|&k| (run * keys + k, 1)).collect();
                            let results = store
                                .decide_many(&batch, Some(NOW_MS))
                                .await
                                .expect("batch");
                            for (&k, r) in chunk.iter().zip(results) {
                                if r.expect("decision").allowed {
                                    admitted[k as usize] += 1;
                                }
                            }
                        }
                        admitted
                    }));
                }
                let mut per_key = vec![0u64; keys as usize];
                for t in tasks {
                    for (k, n) in t.await.expect("client task").into_iter().enumerate() {
                        per_key[k] += n;
                    }
                }
                let wrong: Vec<_> = per_key
                    .iter()
                    .enumerate()
                    .filter(|(_, &n)| n != key_limit)
                    .take(5)
                    .collect();
                assert!(
                    wrong.is_empty(),
                    "{policy}, run {run}: keys admitting other than {key_limit}: {wrong:?}"
                );
            }
        }
    });
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

/// 10,000 keys at once, scaled to stay within CI's time: a limit of 5,
/// each key asked for by 8 of the 64 clients at once (80,000 requests for
/// 50,000 permits per policy), one run per policy.
#[test]
fn ten_thousand_keys_at_once_each_admit_exactly_the_limit() {
    keys_at_once(10_000, 5, 8, 1, 1);
}

/// The same at full scale, as the single-key test runs: a limit of 100,
/// every key asked for twice by each of the 64 clients (1,280,000 requests
/// per policy and run), 20 runs: 128 million requests. On the 2-core
/// development machine the 20 runs took 1,476 s in a release build (and
/// take several times as long in a debug build), too long for CI, so it
/// runs only when asked:
/// `cargo test --release -p ratewarden-redis --test concurrency -- --ignored`
/// (`RATEWARDEN_FULL_SCALE_RUNS=N` runs N times instead of 20).
#[test]
#[ignore = "full scale: 128 million requests; run with --ignored"]
fn ten_thousand_keys_at_once_at_full_scale() {
    let runs = std::env::var("RATEWARDEN_FULL_SCALE_RUNS")
        .map(|v| {
            v.parse()
                .expect("RATEWARDEN_FULL_SCALE_RUNS is a number of runs")
        })
        .unwrap_or(RUNS);
    keys_at_once(10_000, LIMIT, 1, 2, runs);
}

/// The seed's sliding-window counter (`002`): MGET the two windows, then
/// INCR + EXPIRE if the estimate is under the limit. Two round trips, not
/// atomic.
async fn seed_allowed(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    limit: u64,
    window_s: u64,
) -> bool {
    let now = NOW_MS as f64 / 1000.0;
    let current = (now / window_s as f64).floor() as u64;
    let elapsed = (now % window_s as f64) / window_s as f64;
    let (cur_key, prev_key) = (format!("{key}:{current}"), format!("{key}:{}", current - 1));
    let (cur, prev): (Option<u64>, Option<u64>) = redis::cmd("MGET")
        .arg(&cur_key)
        .arg(&prev_key)
        .query_async(conn)
        .await
        .expect("MGET");
    let estimate = cur.unwrap_or(0) as f64 + prev.unwrap_or(0) as f64 * (1.0 - elapsed);
    if estimate >= limit as f64 {
        return false;
    }
    let _: () = redis::pipe()
        .cmd("INCR")
        .arg(&cur_key)
        .ignore()
        .cmd("EXPIRE")
        .arg(&cur_key)
        .arg(window_s * 2)
        .ignore()
        .query_async(conn)
        .await
        .expect("INCR");
    true
}

/// Measures the seed's pattern under the load above (64 clients on their
/// own connections, 4 requests each, one fresh key, limit 100, 20 runs) and
/// prints the figures recorded in docs/redis.md. Run with `--nocapture`.
#[test]
fn seed_pattern_under_the_same_load_is_measured() {
    let server = RedisServer::start();
    let rt = common::runtime();
    let counts = rt.block_on(async {
        let mut conns = Vec::new();
        for _ in 0..CLIENTS {
            conns.push(common::plain_connection(&server.url()).await);
        }
        let mut counts = Vec::new();
        for run in 0..RUNS {
            let barrier = Arc::new(Barrier::new(CLIENTS));
            let key = format!("seed-race:{run}");
            let mut tasks = Vec::new();
            for conn in &conns {
                let (mut conn, barrier, key) = (conn.clone(), Arc::clone(&barrier), key.clone());
                tasks.push(tokio::spawn(async move {
                    barrier.wait().await;
                    let mut admitted = 0u64;
                    for _ in 0..REQUESTS_PER_CLIENT {
                        if seed_allowed(&mut conn, &key, LIMIT, 60).await {
                            admitted += 1;
                        }
                    }
                    admitted
                }));
            }
            let mut total = 0;
            for t in tasks {
                total += t.await.unwrap();
            }
            counts.push(total);
        }
        counts
    });
    // The pattern never admits fewer than the limit (each admission counts
    // before any refusal can see the limit), only more.
    assert!(counts.iter().all(|&n| n >= LIMIT), "{counts:?}");
    let max = counts.iter().max().unwrap();
    let over = counts.iter().filter(|&&n| n > LIMIT).count();
    println!(
        "seed MGET-then-INCR, {CLIENTS} clients x {REQUESTS_PER_CLIENT} requests, limit {LIMIT}: \
         admitted per run {counts:?}; max {max}; {over} of {RUNS} runs over the limit"
    );
}
