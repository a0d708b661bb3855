//! Logs: `ts=... level=info msg="..." key=value` lines on stderr, the same shape as relay's.
//! Each line is one `write_all` on a locked stderr, so lines from pool threads never interleave.
//! The worker token is never passed here.

use relay_common::push_log_value as push_value;
use relay_common::timefmt::{rfc3339_ms, wall_ms};
use std::fmt::{self, Write as _};
use std::io::Write as _;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Error,
    Warn,
    Info,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
        }
    }
}

pub fn emit(level: Level, msg: &str, fields: &[(&str, &dyn fmt::Display)]) {
    let mut line = String::with_capacity(128);
    let _ = write!(line, "ts={} level={} msg=", rfc3339_ms(wall_ms()), level.name());
    push_value(&mut line, msg);
    let mut scratch = String::new();
    for (key, value) in fields {
        scratch.clear();
        let _ = write!(scratch, "{value}");
        line.push(' ');
        line.push_str(key);
        line.push('=');
        push_value(&mut line, &scratch);
    }
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// `log!(Level::Info, "connected", url = u)`.
#[macro_export]
#[doc(hidden)]
macro_rules! log {
    ($level:expr, $msg:expr $(, $key:ident = $value:expr)* $(,)?) => {
        $crate::log::emit($level, $msg, &[$((stringify!($key), &$value as &dyn ::std::fmt::Display)),*])
    };
}
