//! SIGTERM/SIGINT → a flag and a wake-up of the loop, through a helper thread that waits for
//! the signals with `sigwait` (no async-signal-safety puzzles, no self-pipe).
//!
//! `block_shutdown_signals` must run before any other thread starts, so that every thread
//! inherits the mask and only the helper ever receives them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

fn shutdown_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset only write the set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        set
    }
}

/// Blocks SIGTERM and SIGINT in the calling thread (and every thread it starts later).
pub fn block_shutdown_signals() {
    let set = shutdown_set();
    // SAFETY: the set is initialised; a null old-set pointer is allowed.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// How long after the first signal a second one means "stop now". Supervisors such as GNU
/// `timeout` signal the process and then its group, so two signals within microseconds are one
/// request for a graceful shutdown.
const FORCE_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// Starts the helper: the first signal sets `flag` and calls `wake`; another one at least a
/// second later ends the process at once (exit 1), for an operator who does not want to wait.
pub fn spawn_waiter(flag: Arc<AtomicBool>, wake: impl Fn() + Send + 'static) -> std::io::Result<()> {
    std::thread::Builder::new().name("relay-signals".into()).spawn(move || {
        let set = shutdown_set();
        let mut first: Option<std::time::Instant> = None;
        loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: both pointers are valid for the duration of the call.
            let rc = unsafe { libc::sigwait(&set, &mut sig) };
            if rc != 0 {
                continue;
            }
            if let Some(at) = first {
                if at.elapsed() >= FORCE_AFTER {
                    crate::log!(crate::log::Level::Warn, "second signal: exiting now");
                    crate::log::flush();
                    std::process::exit(1);
                }
                continue;
            }
            first = Some(std::time::Instant::now());
            flag.store(true, Ordering::SeqCst);
            let name = if sig == libc::SIGTERM { "SIGTERM" } else { "SIGINT" };
            crate::log!(crate::log::Level::Info, "signal received", signal = name);
            wake();
        }
    })?;
    Ok(())
}
