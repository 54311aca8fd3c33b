//! Each policy driven step by step by a manual clock through a
//! `LocalLimiter`, as a service would drive it with the system clock.

use ratewarden_core::{LocalLimiter, ManualClock, PolicyConfig, PolicyKind};

fn limiter(config: PolicyConfig) -> (LocalLimiter, ManualClock) {
    let clock = ManualClock::new(1_000_000);
    let limiter = LocalLimiter::with_clock(config, Default::default(), clock.clone()).unwrap();
    (limiter, clock)
}

/// (advance_ms, cost, allowed, retry_after_ms, remaining)
type Walk = [(u64, u64, bool, Option<u64>, u64)];

fn walk(config: PolicyConfig, steps: &Walk) {
    let (limiter, clock) = limiter(config);
    for (i, &(advance_ms, cost, allowed, retry, remaining)) in steps.iter().enumerate() {
        clock.advance_ms(advance_ms);
        let d = limiter.check_now(1, cost).unwrap();
        assert_eq!(
            (d.allowed, d.retry_after_ms, d.remaining),
            (allowed, retry, remaining),
            "{config}, step {i}"
        );
    }
}

#[test]
fn fixed_window_resets_at_the_edge() {
    walk(
        PolicyConfig::new(PolicyKind::FixedWindow, 2, 100),
        &[
            (0, 1, true, Some(0), 1),
            (50, 1, true, Some(0), 0),
            (49, 1, false, Some(1), 0),
            (1, 2, true, Some(0), 0),
        ],
    );
}

#[test]
fn sliding_window_counter_decays_the_previous_window() {
    walk(
        PolicyConfig::new(PolicyKind::SlidingWindowCounter, 4, 100),
        // 4 spent; at 150 (elapsed 50) 4 * 50 div 100 = 2 is carried.
        // Cost 2 needs carried <= 1: 4 * (100 - e) < 200 from e = 51 on.
        &[
            (0, 4, true, Some(0), 0),
            (150, 1, true, Some(0), 1),
            (0, 2, false, Some(1), 1),
            (1, 2, true, Some(0), 0),
        ],
    );
}

#[test]
fn sliding_log_frees_each_entry_one_window_later() {
    walk(
        PolicyConfig::new(PolicyKind::SlidingLog, 2, 100),
        &[
            (0, 1, true, Some(0), 1),
            (30, 1, true, Some(0), 0),
            (30, 1, false, Some(40), 0),
            (40, 1, true, Some(0), 0),
        ],
    );
}

#[test]
fn token_bucket_and_gcra_refill_continuously() {
    for policy in [PolicyKind::TokenBucket, PolicyKind::Gcra] {
        walk(
            PolicyConfig::new(policy, 4, 100).with_burst(2),
            // One token every 25 ms, at most 2.
            &[
                (0, 2, true, Some(0), 0),
                (10, 1, false, Some(15), 0),
                (15, 1, true, Some(0), 0),
                (1000, 3, false, None, 2),
            ],
        );
    }
}

#[test]
fn a_clock_stepping_back_never_refills() {
    let (limiter, clock) = limiter(PolicyConfig::new(PolicyKind::TokenBucket, 10, 1000));
    assert!(limiter.check_now(1, 10).unwrap().allowed);
    clock.set_ms(1_000_000 - 60_000);
    let d = limiter.check_now(1, 1).unwrap();
    assert!(!d.allowed);
    assert_eq!(d.retry_after_ms, Some(60_100));
}
