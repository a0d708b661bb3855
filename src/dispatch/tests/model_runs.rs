//! The dispatch model's seeded runs (`model.rs` is the model; the fuzz target `dispatch_model`
//! and the PostgreSQL runs in `tests/it/model_pg.rs` include that file, not this one).

use super::model::*;

/// Operations per generated sequence (`MODEL_OPS` to change it).
fn sequence_ops() -> usize {
    std::env::var("MODEL_OPS").ok().and_then(|s| s.parse().ok()).unwrap_or(60)
}

/// Seeds `[from, from + count)`; `MODEL_SEQUENCES` scales every range (e.g. 10 for ten times as
/// many), `MODEL_SEED` runs that one seed alone (with the same `MODEL_OPS` it failed with).
/// Returns what the sequences reached.
fn check_seeds(from: u64, count: u64) -> Option<Stats> {
    let mut stats = Stats::default();
    if let Some(seed) = std::env::var("MODEL_SEED").ok().and_then(|s| s.parse::<u64>().ok()) {
        if (from..from + count).contains(&seed) {
            check_seed(seed, sequence_ops(), &mut stats);
        }
        return None;
    }
    let scale = std::env::var("MODEL_SEQUENCES").ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(1).max(1);
    for seed in from * scale..(from + count) * scale {
        check_seed(seed, sequence_ops(), &mut stats);
    }
    Some(stats)
}

/// Each range of seeds reaches every behaviour the model knows at least `min` times.
fn assert_reached(stats: Option<Stats>, min: u64) {
    let Some(stats) = stats else { return };
    let report: Vec<String> = Seen::ALL.iter().map(|s| format!("{s:?} {}", stats.get(*s))).collect();
    eprintln!("dispatch model reached: {}", report.join(", "));
    for s in Seen::ALL {
        assert!(
            stats.get(s) >= min,
            "the sequences reached {s:?} only {} times (want {min}): {report:?}",
            stats.get(s)
        );
    }
}

// 3,000 sequences in four parts (the test harness runs them side by side).
#[test]
fn model_sequences_0() {
    assert_reached(check_seeds(0, 750), 1);
}

#[test]
fn model_sequences_1() {
    assert_reached(check_seeds(750, 750), 1);
}

#[test]
fn model_sequences_2() {
    assert_reached(check_seeds(1_500, 750), 1);
}

#[test]
fn model_sequences_3() {
    assert_reached(check_seeds(2_250, 750), 1);
}

/// The fuzz target's decoder: any bytes are a sequence (here, random ones).
#[test]
fn byte_sequences_follow_the_model() {
    for seed in 0..16 {
        let mut s = Seeded::new(seed ^ 0xF00D);
        let bytes: Vec<u8> = (0..300).map(|_| s.byte()).collect();
        if let Err(f) = run_bytes(&bytes) {
            panic!("bytes of seed {seed}: {f}");
        }
    }
}

/// The sequences the model found bugs with, shrunk, each named after its bug (the fixes have
/// direct tests in `restarts.rs`).
mod found {
    use super::super::model::Op::*;
    use super::super::model::When::*;
    use super::super::model::{ModelConfig, run_ops};

    fn check(cfg: ModelConfig, ops: &[super::Op]) {
        if let Err(f) = run_ops(&cfg, ops) {
            panic!("{f}");
        }
    }

    #[test]
    fn a_second_restart_makes_the_attempt_the_first_cut_short_use_up_a_retry() {
        let cfg = ModelConfig {
            journal: true,
            small_segments: false,
            max_retries: 3,
            task_ttl_ms: 12000,
            max_pending: 8,
            max_pending_bytes: 1048576,
            task_memory_bytes: 3000,
            lanes: false,
        };
        check(
            cfg,
            &[
                Connect,
                Answer { w: 213, t: 72, done: true },
                Submit {
                    kind: Some(1),
                    queue: true,
                    when: Now,
                    max_retries: Some(0),
                    timeout_ms: None,
                    key: None,
                    pad: 2,
                },
                Restart { downtime_ms: 5000 },
                Restart { downtime_ms: 0 },
            ],
        );
    }

    #[test]
    fn a_task_forgotten_at_a_restart_stays_in_the_listing_index() {
        let cfg = ModelConfig {
            journal: true,
            small_segments: false,
            max_retries: 2,
            task_ttl_ms: 12000,
            max_pending: 3,
            max_pending_bytes: 1048576,
            task_memory_bytes: 67108864,
            lanes: false,
        };
        check(
            cfg,
            &[
                Submit {
                    kind: Some(2),
                    queue: true,
                    when: Now,
                    max_retries: Some(1),
                    timeout_ms: None,
                    key: None,
                    pad: 1,
                },
                Connect,
                Answer { w: 104, t: 58, done: false },
                Answer { w: 3, t: 222, done: true },
                Advance { ms: 5000 },
                Advance { ms: 1001 },
                Advance { ms: 3000 },
                Restart { downtime_ms: 1500 },
                Restart { downtime_ms: 1500 },
            ],
        );
    }

    #[test]
    fn a_canceled_task_comes_back_pending_once_its_forget_record_is_deleted() {
        let cfg = ModelConfig {
            journal: true,
            small_segments: true,
            max_retries: 3,
            task_ttl_ms: 4000,
            max_pending: 3,
            max_pending_bytes: 1048576,
            task_memory_bytes: 67108864,
            lanes: false,
        };
        check(
            cfg,
            &[
                Submit {
                    kind: Some(2),
                    queue: true,
                    when: Now,
                    max_retries: None,
                    timeout_ms: None,
                    key: Some((1, 2)),
                    pad: 1,
                },
                Submit {
                    kind: Some(2),
                    queue: true,
                    when: Now,
                    max_retries: Some(3),
                    timeout_ms: Some(3000),
                    key: None,
                    pad: 3,
                },
                Restart { downtime_ms: 0 },
                Cancel { t: 167 },
                Restart { downtime_ms: 30000 },
                Restart { downtime_ms: 0 },
                Restart { downtime_ms: 30000 },
            ],
        );
    }
}

#[test]
fn pg_sequences_follow_the_model_in_memory_too() {
    // The sequences `tests/it/model_pg.rs` runs over PostgreSQL, over the memory store.
    let mut stats = Stats::default();
    for seed in 0..40 {
        let (cfg, ops) = sequence_pg(seed, 40);
        if let Err(f) = run_counting(&cfg, &ops, &mut stats) {
            panic!("seed {seed}: {f}");
        }
    }
}
