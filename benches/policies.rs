//! Each policy's hot path, written once against the `Store` trait and run
//! on every store: the in-memory store, and Redis (a `redis-server` this
//! bench starts on a free loopback port and stops, when one is installed).
//!
//! Set-up (a Redis server, the many keys) happens when a bench first runs,
//! so a filtered run (`cargo bench --bench policies -- memory/gcra`) pays
//! only for what it selects.
//!
//! `ratewarden bench` is the table users read (beside governor, with
//! memory and accuracy); these benches are for tracking one path over time.

use std::hint::black_box;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ratewarden_core::store::Store;
use ratewarden_core::{Decision, MemoryOptions, MemoryStore, PolicyConfig, PolicyKind, StoreError};
use ratewarden_redis::test_support::RedisServer;
use ratewarden_redis::{RedisOptions, RedisStore};

/// How much one store's benches do.
struct Sizes {
    /// Decisions per measured iteration.
    batch: u64,
    /// Keys of the many-keys bench, all inserted before timing.
    keys: u64,
    /// criterion samples per bench (criterion's least is 10).
    samples: usize,
}

const MEMORY: Sizes = Sizes {
    batch: 1024,
    keys: 100_000,
    samples: 100,
};

/// A Redis decision is a loopback round trip, tens of microseconds: fewer
/// decisions per iteration and fewer samples keep a run to minutes.
const REDIS: Sizes = Sizes {
    batch: 64,
    keys: 10_000,
    samples: 10,
};

/// A cheap, well-spread key for index `i` (an odd multiplier is a
/// bijection on `u64`, so the keys are distinct).
fn key(i: u64) -> u64 {
    i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// One request of cost 1. A store that fails stops the bench: timing its
/// errors would report a fast store that decides nothing.
#[inline]
fn decide<S: Store>(store: &S, key: u64, now_ms: u64) -> Decision {
    match store.decide(black_box(key), now_ms, 1) {
        Ok(decision) => decision,
        Err(e) => panic!("the store failed during the bench: {e}"),
    }
}

fn bench_store<S: Store>(c: &mut Criterion, name: &str, store: &S, sizes: &Sizes) {
    let batch = sizes.batch;
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(batch));
    group.sample_size(sizes.samples);
    let mut now_ms = 1;
    group.bench_function("hot-key", |b| {
        b.iter(|| {
            // One millisecond per batch, so windows roll over.
            now_ms += 1;
            for _ in 0..batch {
                black_box(decide(store, 7, now_ms));
            }
        })
    });
    group.bench_function("hot-key-every-ms", |b| {
        b.iter(|| {
            // A new millisecond per decision: no request repeats the one
            // before, so no refusal comes from the memory store's memo.
            for _ in 0..batch {
                now_ms += 1;
                black_box(decide(store, 7, now_ms));
            }
        })
    });
    let keys = sizes.keys;
    let mut inserted = false;
    let mut next = 0u64;
    group.bench_function(format!("{}-keys", keys), |b| {
        // The keys go in at this bench's first call, untimed: criterion
        // calls only the benches its filter selects, so a run filtered to
        // others pays nothing for them.
        if !inserted {
            // The hot key is held too, unless a filter skipped its benches.
            let held = store.entries_tracked() as u64;
            for i in 0..keys {
                store.decide(key(i), now_ms, 1).expect("room for every key");
            }
            assert_eq!(
                store.entries_tracked() as u64,
                held + keys,
                "every key is held before timing"
            );
            inserted = true;
        }
        b.iter(|| {
            now_ms += 1;
            for _ in 0..batch {
                // A stride coprime with the key count visits every key in
                // turn.
                next = (next + 7_919) % keys;
                black_box(decide(store, key(next), now_ms));
            }
        })
    });
    group.finish();
}

/// A [`BlockingRedis`] started at its first use, so that a run whose
/// filter selects none of a policy's Redis benches starts no server.
struct LazyRedis {
    config: PolicyConfig,
    started: OnceLock<BlockingRedis>,
}

impl LazyRedis {
    fn get(&self) -> &BlockingRedis {
        self.started
            .get_or_init(|| BlockingRedis::start(self.config))
    }
}

impl Store for LazyRedis {
    fn decide(&self, key: u64, now_ms: u64, cost: u64) -> Result<Decision, StoreError> {
        self.get().decide(key, now_ms, cost)
    }

    fn entries_tracked(&self) -> usize {
        self.get().entries_tracked()
    }
}

/// The Redis store driven synchronously, as the `Store` trait asks: each
/// decision is one script call on its own server, awaited on a
/// current-thread runtime.
struct BlockingRedis {
    runtime: tokio::runtime::Runtime,
    store: RedisStore,
    /// This store's own server: every key on it is the store's.
    server: RedisServer,
}

impl BlockingRedis {
    fn start(config: PolicyConfig) -> BlockingRedis {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let server = RedisServer::start();
        let options = RedisOptions {
            // A slow round trip on a busy machine is measured, not failed.
            timeout_ms: 1_000,
            // The bench passes its own time, far behind Redis's clock:
            // keys must outlive the whole run rather than expire by TIME
            // in the middle of it.
            ttl_grace_ms: 3_600_000,
            ..RedisOptions::default()
        };
        let store = runtime
            .block_on(RedisStore::connect(&server.url(), config, options))
            .expect("connect to the bench's redis-server");
        BlockingRedis {
            runtime,
            store,
            server,
        }
    }
}

impl Store for BlockingRedis {
    fn decide(&self, key: u64, now_ms: u64, cost: u64) -> Result<Decision, StoreError> {
        self.runtime
            .block_on(self.store.decide(key, Some(now_ms), cost))
    }

    fn entries_tracked(&self) -> usize {
        let reply = self.server.cli(&["DBSIZE"]);
        reply
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("DBSIZE answered {reply:?}"))
    }
}

/// Whether `redis-server` and `redis-cli` can be run here.
fn redis_installed() -> bool {
    ["redis-server", "redis-cli"].iter().all(|program| {
        Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|out| out.status.success())
    })
}

fn policies(c: &mut Criterion) {
    for kind in PolicyKind::ALL {
        let config = PolicyConfig::new(kind, 100, 1000);
        let store = MemoryStore::for_config(&config, MemoryOptions::default())
            .expect("the reference configuration is valid");
        bench_store(c, &format!("memory/{}", kind.name()), &store, &MEMORY);
    }
    if !redis_installed() {
        eprintln!(
            "redis benches skipped: redis-server or redis-cli is not on PATH \
             (Debian: apt-get install redis-server redis-tools)"
        );
        return;
    }
    for kind in PolicyKind::ALL {
        let store = LazyRedis {
            config: PolicyConfig::new(kind, 100, 1000),
            started: OnceLock::new(),
        };
        bench_store(c, &format!("redis/{}", kind.name()), &store, &REDIS);
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1));
    targets = policies
}
criterion_main!(benches);
