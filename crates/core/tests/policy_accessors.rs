//! What a built policy reports of itself: its configuration, and the state
//! of a key first touched at a given time.

use ratewarden_core::policy::{FixedWindowState, SlidingWindowCounterState};
use ratewarden_core::{
    FixedWindow, Gcra, Policy, PolicyConfig, PolicyKind, SlidingLog, SlidingWindowCounter,
    TokenBucket,
};

/// Each policy, and the registry's `AnyPolicy` over it, reports the limit,
/// window and burst it was built with (a library user reads them for
/// headers, say).
#[test]
fn policies_report_their_configuration() {
    let fw = FixedWindow::new(7, 2500).unwrap();
    assert_eq!((fw.limit(), fw.window_ms()), (7, 2500));
    let swc = SlidingWindowCounter::new(7, 2500).unwrap();
    assert_eq!((swc.limit(), swc.window_ms()), (7, 2500));
    let log = SlidingLog::new(7, 2500).unwrap();
    assert_eq!((log.limit(), log.window_ms()), (7, 2500));
    let tb = TokenBucket::new(7, 2500, Some(11)).unwrap();
    assert_eq!((tb.limit(), tb.window_ms(), tb.burst()), (7, 2500, 11));
    assert_eq!(TokenBucket::new(7, 2500, None).unwrap().burst(), 7);
    let g = Gcra::new(7, 2500, Some(11)).unwrap();
    assert_eq!((g.limit(), g.window_ms(), g.burst()), (7, 2500, 11));
    assert_eq!(Gcra::new(7, 2500, None).unwrap().burst(), 7);

    for kind in [
        PolicyKind::FixedWindow,
        PolicyKind::SlidingWindowCounter,
        PolicyKind::SlidingLog,
        PolicyKind::TokenBucket,
        PolicyKind::Gcra,
    ] {
        let built = PolicyConfig::new(kind, 7, 2500).build().unwrap();
        assert_eq!((built.limit(), built.window_ms()), (7, 2500), "{kind:?}");
    }
}

/// A fixed window's new key records the aligned window it was first
/// touched in, so a request stamped before that time counts there (the
/// clock-regression rule), not in a window of its own.
#[test]
fn a_fixed_window_new_key_records_its_aligned_window() {
    let p = FixedWindow::new(2, 1000).unwrap();
    assert_eq!(
        p.new_state(1500),
        FixedWindowState {
            window_start_ms: 1000,
            current: 0
        }
    );
    let mut s = p.new_state(1500);
    assert!(p.decide(&mut s, 400, 2).allowed);
    let d = p.decide(&mut s, 1500, 1);
    assert!(!d.allowed);
    assert_eq!(d.retry_after_ms, Some(500));
}

/// The same for the sliding-window counter.
#[test]
fn a_sliding_window_counter_new_key_records_its_aligned_window() {
    let p = SlidingWindowCounter::new(2, 1000).unwrap();
    assert_eq!(
        p.new_state(1500),
        SlidingWindowCounterState {
            window_start_ms: 1000,
            previous: 0,
            current: 0
        }
    );
    let mut s = p.new_state(1500);
    assert!(p.decide(&mut s, 400, 2).allowed);
    assert!(!p.decide(&mut s, 1500, 1).allowed);
}
