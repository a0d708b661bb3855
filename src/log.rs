//! Structured logs: `ts=... level=info msg="..." key=value` lines on stderr.
//!
//! The loop thread never writes to stderr itself: lines go through a bounded channel to a helper
//! thread, and a line that does not fit is dropped and counted (a blocked stderr must not stall
//! the reactor). Tokens are never passed to this module.

use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};

use relay_common::push_log_value as push_value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
    Trace = 5,
}

impl Level {
    pub fn parse(text: &str) -> Option<Level> {
        match text.trim().to_ascii_lowercase().as_str() {
            "error" => Some(Level::Error),
            "warn" | "warning" => Some(Level::Warn),
            "info" => Some(Level::Info),
            "debug" => Some(Level::Debug),
            "trace" => Some(Level::Trace),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
            Level::Trace => "trace",
        }
    }
}

static LEVEL: AtomicU8 = AtomicU8::new(Level::Info as u8);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static SINK: OnceLock<SyncSender<Msg>> = OnceLock::new();

enum Msg {
    Line(String),
    /// Answered once every line sent before it is written.
    Flush(SyncSender<()>),
}

/// Lines that could wait in the channel before new ones are dropped.
const QUEUE_LINES: usize = 16_384;

pub fn set_level(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

pub fn enabled(level: Level) -> bool {
    level as u8 <= LEVEL.load(Ordering::Relaxed)
}

pub fn dropped_lines() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Starts the writer thread. Before it runs (and in unit tests) lines go straight to stderr.
pub fn start_writer() {
    let (tx, rx) = mpsc::sync_channel::<Msg>(QUEUE_LINES);
    if SINK.set(tx).is_err() {
        return;
    }
    let spawned = std::thread::Builder::new().name("relay-log".into()).spawn(move || {
        let stderr = std::io::stderr();
        while let Ok(msg) = rx.recv() {
            match msg {
                Msg::Line(line) => {
                    let _ = stderr.lock().write_all(line.as_bytes());
                }
                Msg::Flush(done) => {
                    let _ = done.send(());
                }
            }
        }
    });
    if spawned.is_err() {
        eprintln!("relay: could not start the log thread; logging directly");
    }
}

/// Blocks until every queued line is written (used right before exit).
pub fn flush() {
    if let Some(tx) = SINK.get() {
        // The channel is FIFO: once the marker is answered, everything before it was written.
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        if tx.send(Msg::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv_timeout(std::time::Duration::from_secs(2));
        }
    }
}

pub fn emit(level: Level, msg: &str, fields: &[(&str, &dyn fmt::Display)]) {
    if enabled(level) {
        emit_always(level, msg, fields);
    }
}

/// Emits whatever LOG_LEVEL says. SPEC §2 allows one such line: `listening` (it carries the
/// address picked for `PORT=0`). Nothing else may use it.
pub fn emit_always(level: Level, msg: &str, fields: &[(&str, &dyn fmt::Display)]) {
    let mut line = String::with_capacity(128);
    let _ = write!(line, "ts={} level={} msg=", crate::timefmt::rfc3339_ms(crate::timefmt::wall_ms()), level.name());
    push_value(&mut line, msg);
    let mut scratch = String::new();
    for (key, value) in fields {
        scratch.clear();
        let _ = write!(scratch, "{value}");
        line.push(' ');
        // `stringify!(r#type)` is "r#type": the key is the identifier without its raw prefix.
        line.push_str(key.strip_prefix("r#").unwrap_or(key));
        line.push('=');
        push_value(&mut line, &scratch);
    }
    line.push('\n');
    match SINK.get() {
        Some(tx) => {
            if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = tx.try_send(Msg::Line(line)) {
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
        None => {
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }
}

/// `log_always!(Level::Info, "listening", addr = a)`: printed at any LOG_LEVEL.
#[macro_export]
macro_rules! log_always {
    ($level:expr, $msg:expr $(, $key:ident = $value:expr)* $(,)?) => {
        $crate::log::emit_always($level, $msg, &[$((stringify!($key), &$value as &dyn ::std::fmt::Display)),*])
    };
}

/// `log!(Level::Info, "worker connected", client_id = id, ip = ip)`.
#[macro_export]
macro_rules! log {
    ($level:expr, $msg:expr $(, $key:ident = $value:expr)* $(,)?) => {
        if $crate::log::enabled($level) {
            $crate::log::emit($level, $msg, &[$((stringify!($key), &$value as &dyn ::std::fmt::Display)),*]);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels() {
        assert_eq!(Level::parse("WARN"), Some(Level::Warn));
        assert_eq!(Level::parse("Trace"), Some(Level::Trace));
        assert_eq!(Level::parse("verbose"), None);
        assert!(Level::Error < Level::Debug);
    }
}
