//! SIGTERM/SIGINT → a process-wide flag, through a `sigaction` handler that only touches
//! atomics (async-signal-safe). The runner polls the flag; nothing blocks on it. Handlers are
//! process-wide, so it does not matter which thread (a pool thread, reqwest's runtime thread)
//! the kernel picks to deliver the signal. A second signal ends the process at once (exit 1).

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    if STOP.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(1) };
    }
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Installs the handlers for SIGTERM and SIGINT; returns the flag they set.
pub fn install() -> std::io::Result<&'static AtomicBool> {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the sigaction struct is zeroed then filled; the handler only uses atomics and
        // _exit, which are async-signal-safe.
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
