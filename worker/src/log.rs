//! Logs: `ts=... level=info msg="..." key=value` lines on stderr, the same shape as relay's.
//! Each line is one `write_all` on a locked stderr, so lines from pool threads never interleave.
//! The worker token is never passed here.

use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

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

fn push_value(line: &mut String, value: &str) {
    let plain =
        !value.is_empty() && value.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'=' && b != b'\\');
    if plain {
        line.push_str(value);
        return;
    }
    line.push('"');
    for c in value.chars() {
        match c {
            '"' => line.push_str("\\\""),
            '\\' => line.push_str("\\\\"),
            '\n' => line.push_str("\\n"),
            '\r' => line.push_str("\\r"),
            '\t' => line.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(line, "\\u{{{:x}}}", c as u32);
            }
            c => line.push(c),
        }
    }
    line.push('"');
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// `2026-11-29T12:06:15.123Z`.
fn rfc3339_ms(ms: u64) -> String {
    let secs = ms / 1000;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem / 60 % 60, rem % 60, ms % 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(value: &str, expected: &str) {
        let mut line = String::new();
        push_value(&mut line, value);
        assert_eq!(line, expected, "push_value({value:?})");
    }

    #[test]
    fn quoting() {
        for (value, expected) in [
            ("plain", "plain"),
            ("two words", "\"two words\""),
            ("", "\"\""),
            ("a=b", "\"a=b\""),
            ("x\ny", "\"x\\ny\""),
        ] {
            check(value, expected);
        }
    }

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339_ms(1_795_867_575_000), "2026-11-28T12:06:15.000Z");
    }
}
