//! SIGTERM/SIGINT → a process-wide flag, through a `sigaction` handler that only touches
//! atomics and `clock_gettime` (both async-signal-safe). The runner polls the flag; nothing
//! blocks on it. Handlers are process-wide, so it does not matter which thread (a pool thread,
//! reqwest's runtime thread) the kernel picks to deliver the signal.
//!
//! A repeat signal ends the process at once (exit 1) only if it arrives at least
//! [`REPEAT_AFTER_NS`] (1 s) after the first; an earlier one is part of the same request to
//! drain. GNU `timeout` and some supervisors signal the child and then its process group, so
//! two signals arrive microseconds apart: they must not skip the graceful drain.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

/// How long after the first signal a repeat forces the exit (nanoseconds, 1 s).
pub const REPEAT_AFTER_NS: u64 = 1_000_000_000;

static STOP: AtomicBool = AtomicBool::new(false);
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// CLOCK_MONOTONIC of the first signal, in nanoseconds (at least 1); 0 = not recorded yet.
static FIRST_AT_NS: AtomicU64 = AtomicU64::new(0);

/// CLOCK_MONOTONIC in nanoseconds; `None` if the clock cannot be read. Async-signal-safe.
fn monotonic_ns() -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime is async-signal-safe (POSIX) and only writes `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return None;
    }
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u64::try_from(ts.tv_nsec).ok()?;
    secs.checked_mul(1_000_000_000)?.checked_add(nanos)
}

/// Whether a repeat signal at `now_ns` forces the exit, the first having come at `first_ns`
/// (0 = its time is not recorded yet: a signal racing the first on another thread, which is
/// as close to it as can be).
fn repeat_forces_exit(first_ns: u64, now_ns: u64) -> bool {
    first_ns != 0 && now_ns.saturating_sub(first_ns) >= REPEAT_AFTER_NS
}

extern "C" fn on_signal(sig: libc::c_int) {
    // An unreadable clock reads as "just now": a repeat then never forces the exit, which keeps
    // the drain (bounded by SHUTDOWN_TIMEOUT) rather than losing tasks.
    let now = monotonic_ns();
    if STOP.swap(true, Ordering::SeqCst) {
        if let Some(now) = now
            && repeat_forces_exit(FIRST_AT_NS.load(Ordering::SeqCst), now)
        {
            // SAFETY: _exit is async-signal-safe.
            unsafe { libc::_exit(1) };
        }
        return;
    }
    if let Some(now) = now {
        FIRST_AT_NS.store(now.max(1), Ordering::SeqCst);
    }
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Installs the handlers for SIGTERM and SIGINT; returns the flag they set.
pub fn install() -> std::io::Result<&'static AtomicBool> {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the sigaction struct is zeroed then filled; the handler only uses atomics,
        // clock_gettime and _exit, which are async-signal-safe.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(&STOP)
}

/// The name of the signal that set the flag, for the log line.
pub fn received() -> Option<&'static str> {
    match SIGNAL.load(Ordering::SeqCst) {
        libc::SIGTERM => Some("SIGTERM"),
        libc::SIGINT => Some("SIGINT"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_forces_the_exit_only_a_second_after_the_first() {
        let s = 1_000_000_000;
        for (first, now, expected) in [
            (5 * s, 5 * s, false),         // back to back
            (5 * s, 5 * s + 1_000, false), // microseconds apart (timeout: child, then group)
            (5 * s, 6 * s - 1, false),     // just under 1 s
            (5 * s, 6 * s, true),          // 1 s
            (5 * s, 60 * s, true),         // much later
            (0, 60 * s, false),            // first signal's time not recorded yet
            (5 * s, 4 * s, false),         // a clock going backwards never forces it
        ] {
            assert_eq!(repeat_forces_exit(first, now), expected, "first {first} now {now}");
        }
    }

    #[test]
    fn the_monotonic_clock_reads_and_advances() {
        let a = monotonic_ns().expect("CLOCK_MONOTONIC");
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = monotonic_ns().expect("CLOCK_MONOTONIC");
        assert!(b >= a + 5_000_000, "{a} {b}");
    }
}
