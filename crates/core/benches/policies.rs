//! Each policy's hot path on the in-memory store, written against the
//! `Store` trait so that every store can run the same benches.
//!
//! `ratewarden bench` is the table users read (beside governor, with
//! memory and accuracy); these benches are for tracking one path over time.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ratewarden_core::store::Store;
use ratewarden_core::{MemoryOptions, MemoryStore, PolicyConfig, PolicyKind};

/// Decisions per measured iteration.
const BATCH: u64 = 1024;
/// Keys of the many-keys bench, all inserted before timing.
const KEYS: u64 = 100_000;

/// A cheap, well-spread key for index `i` (an odd multiplier is a
/// bijection on `u64`, so the keys are distinct).
fn key(i: u64) -> u64 {
    i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn bench_store<S: Store>(c: &mut Criterion, name: &str, store: &S) {
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(BATCH));
    let mut now_ms = 1;
    group.bench_function("hot-key", |b| {
        b.iter(|| {
            // One millisecond per batch, so windows roll over.
            now_ms += 1;
            for _ in 0..BATCH {
                black_box(store.decide(black_box(7), now_ms, 1).ok());
            }
        })
    });
    group.bench_function("hot-key-every-ms", |b| {
        b.iter(|| {
            // A new millisecond per decision: no request repeats the one
            // before, so no refusal comes from the store's memo.
            for _ in 0..BATCH {
                now_ms += 1;
                black_box(store.decide(black_box(7), now_ms, 1).ok());
            }
        })
    });
    for i in 0..KEYS {
        store.decide(key(i), now_ms, 1).expect("room for every key");
    }
    let mut next = 0u64;
    group.bench_function("100k-keys", |b| {
        b.iter(|| {
            now_ms += 1;
            for _ in 0..BATCH {
                // A stride coprime with KEYS visits every key in turn.
                next = (next + 7_919) % KEYS;
                black_box(store.decide(black_box(key(next)), now_ms, 1).ok());
            }
        })
    });
    group.finish();
}

fn policies(c: &mut Criterion) {
    for kind in PolicyKind::ALL {
        let config = PolicyConfig::new(kind, 100, 1000);
        let store = MemoryStore::for_config(&config, MemoryOptions::default())
            .expect("the reference configuration is valid");
        bench_store(c, kind.name(), &store);
    }
}

criterion_group!(benches, policies);
criterion_main!(benches);
