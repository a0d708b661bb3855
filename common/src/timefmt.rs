//! Wall-clock time as milliseconds since the Unix epoch, and RFC 3339 text in and out.
//!
//! Wall time is for what people read (`created_at`, token `exp`, log `ts`); deadlines and timers
//! use the reactor's monotonic clock and never come from here.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 if the clock is before 1970).
pub fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// `2026-11-29T12:06:15.123Z`.
pub fn rfc3339_ms(ms: u64) -> String {
    let mut out = String::with_capacity(24);
    write_rfc3339_ms(&mut out, ms);
    out
}

pub fn write_rfc3339_ms(out: &mut String, ms: u64) {
    let secs = ms / 1000;
    // The text up to the second is kept for the last second written: a task's JSON holds
    // several times of one second, written for every answer (this runs ~3 times per task).
    LAST_SECOND.with(|last| {
        let mut last = last.borrow_mut();
        if last.0 != secs || last.1.is_empty() {
            last.1.clear();
            write_second(&mut last.1, secs);
            last.0 = secs;
        }
        out.push_str(&last.1);
    });
    let milli = (ms % 1000) as u32;
    for digit in [milli / 100, milli / 10 % 10, milli % 10] {
        out.push(char::from(b'0' + digit as u8));
    }
    out.push('Z');
}

thread_local! {
    /// (second, its text up to and including the `.` before the milliseconds).
    static LAST_SECOND: std::cell::RefCell<(u64, String)> = const { std::cell::RefCell::new((0, String::new())) };
}

/// `2026-11-29T12:06:15.` for `secs` since the epoch.
fn write_second(out: &mut String, secs: u64) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    let _ = write!(out, "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.", rem / 3600, rem / 60 % 60, rem % 60);
}

/// An HTTP-date (RFC 9110 §5.6.7, IMF-fixdate) for `secs` since the epoch:
/// `Sun, 06 Nov 1994 08:49:37 GMT`, always 29 bytes (years past 9999 are written as 9999).
pub fn http_date(secs: u64) -> [u8; 29] {
    const DAYS: [&[u8; 3]; 7] = [b"Thu", b"Fri", b"Sat", b"Sun", b"Mon", b"Tue", b"Wed"];
    const MONTHS: [&[u8; 3]; 12] =
        [b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec"];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    let mut b = *b"Thu, 01 Jan 1970 00:00:00 GMT";
    b[0..3].copy_from_slice(DAYS[days.rem_euclid(7) as usize]);
    b[8..11].copy_from_slice(MONTHS[(m - 1).clamp(0, 11) as usize]);
    let mut put = |at: usize, width: usize, mut v: u64| {
        for i in (at..at + width).rev() {
            b[i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(5, 2, d as u64);
    put(12, 4, y.clamp(0, 9999) as u64);
    put(17, 2, rem / 3600);
    put(20, 2, rem / 60 % 60);
    put(23, 2, rem % 60);
    b
}

/// Parses RFC 3339 (`2026-11-29T12:00:00Z`, `...T12:00:00.5+05:00`, lower-case `t`/`z` and a
/// space separator accepted) into milliseconds since the epoch. Times before 1970 are an error.
pub fn parse_rfc3339_ms(text: &str) -> Result<u64, &'static str> {
    const BAD: &str = "expected an RFC 3339 time such as 2026-01-02T15:04:05Z";
    let b = text.trim().as_bytes();
    if b.len() < 20 {
        return Err(BAD);
    }
    let num = |range: std::ops::Range<usize>| -> Result<i64, &'static str> {
        let part = b.get(range).ok_or(BAD)?;
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return Err(BAD);
        }
        Ok(part.iter().fold(0i64, |acc, d| acc * 10 + i64::from(d - b'0')))
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') || b[13] != b':' || b[16] != b':' {
        return Err(BAD);
    }
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return Err("time out of range");
    }
    let mut i = 19;
    let mut frac_ms = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            if i - start < 3 {
                frac_ms = frac_ms * 10 + i64::from(b[i] - b'0');
            }
            i += 1;
        }
        let digits = i - start;
        if digits == 0 {
            return Err(BAD);
        }
        for _ in digits..3 {
            frac_ms *= 10;
        }
    }
    let offset_s = match b.get(i) {
        Some(b'Z' | b'z') if i + 1 == b.len() => 0,
        Some(sign @ (b'+' | b'-')) if i + 6 == b.len() && b[i + 3] == b':' => {
            let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if oh > 23 || om > 59 {
                return Err("time out of range");
            }
            let s = oh * 3600 + om * 60;
            if *sign == b'+' { s } else { -s }
        }
        _ => return Err(BAD),
    };
    let second = second.min(59); // a leap second counts as :59
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_s;
    if secs < 0 {
        return Err("time before 1970");
    }
    Ok((secs * 1000 + frac_ms) as u64)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ if is_leap(y) => 29,
        _ => 28,
    }
}

/// Days since 1970-01-01 → (year, month, day). Howard Hinnant's algorithm.
/// An HTTP-date in IMF-fixdate form (`Sun, 06 Nov 1994 08:49:37 GMT`, RFC 9110 §5.6.7, the
/// form senders must use) as ms since the epoch. Untrusted text (a `Retry-After` header):
/// anything else is `None`, never a panic.
pub fn parse_http_date_ms(text: &str) -> Option<u64> {
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let b = text.trim().as_bytes();
    if b.len() != 29 || &b[3..5] != b", " || &b[25..] != b" GMT" || b[7] != b' ' || b[11] != b' ' || b[16] != b' ' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let d = b.get(r)?;
        if !d.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(d).ok()?.parse().ok()
    };
    let day = num(5..7)?;
    let month = MONTHS.iter().position(|m| m.as_bytes() == &b[8..11])? as i64 + 1;
    let year = num(12..16)?;
    if b[19] != b':' || b[22] != b':' {
        return None;
    }
    let (h, mi, s) = (num(17..19)?, num(20..22)?, num(23..25)?);
    if !(1..=31).contains(&day) || h > 23 || mi > 59 || s > 60 || year < 1970 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + h * 3600 + mi * 60 + s;
    u64::try_from(secs).ok().map(|s| s * 1000)
}

/// A `Retry-After` header (RFC 9110 §10.2.3): delay-seconds or an HTTP-date, as ms to wait
/// from `now_wall_ms` (a date in the past: 0). `None` when it is neither.
pub fn parse_retry_after_ms(text: &str, now_wall_ms: u64) -> Option<u64> {
    let t = text.trim();
    if !t.is_empty() && t.bytes().all(|c| c.is_ascii_digit()) {
        // (An absurd number of seconds is capped, never an overflow.)
        return Some(t.parse::<u64>().unwrap_or(u64::MAX / 1000).saturating_mul(1000));
    }
    parse_http_date_ms(t).map(|at| at.saturating_sub(now_wall_ms))
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        assert_eq!(parse_retry_after_ms("120", 0), Some(120_000));
        assert_eq!(parse_retry_after_ms(" 0 ", 0), Some(0));
        let at = parse_http_date_ms("Sun, 06 Nov 1994 08:49:37 GMT").expect("date");
        assert_eq!(String::from_utf8_lossy(&http_date(at / 1000)), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(parse_retry_after_ms("Sun, 06 Nov 1994 08:49:37 GMT", at - 5_000), Some(5_000));
        assert_eq!(parse_retry_after_ms("Sun, 06 Nov 1994 08:49:37 GMT", at + 5_000), Some(0));
        assert_eq!(parse_retry_after_ms("99999999999999999999999", 0), Some((u64::MAX / 1000) * 1000));
        for bad in [
            "",
            "-1",
            "1.5",
            "soon",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 32 Nov 1994 08:49:37 GMT",
            "Sun, 06 Foo 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 24:49:37 GMT",
            "Sun, 06 Nov 19x4 08:49:37 GMT",
        ] {
            assert_eq!(parse_retry_after_ms(bad, 0), None, "{bad:?}");
        }
    }

    fn check(text: &str, expected: Result<u64, ()>) {
        assert_eq!(parse_rfc3339_ms(text).map_err(|_| ()), expected, "parse_rfc3339_ms({text:?})");
    }

    #[test]
    fn parse_table() {
        let table: &[(&str, Result<u64, ()>)] = &[
            ("1970-01-01T00:00:00Z", Ok(0)),
            ("1970-01-01T00:00:01.5Z", Ok(1_500)),
            ("2026-11-29T12:06:15.123Z", Ok(1_795_953_975_123)),
            ("2026-11-29t12:06:15.123456z", Ok(1_795_953_975_123)),
            ("2026-11-29T17:06:15.123+05:00", Ok(1_795_953_975_123)),
            ("2026-11-29T07:06:15.123-05:00", Ok(1_795_953_975_123)),
            ("2024-02-29T00:00:00Z", Ok(1_709_164_800_000)),
            ("2023-02-29T00:00:00Z", Err(())),
            ("2026-13-01T00:00:00Z", Err(())),
            ("2026-11-29T24:00:00Z", Err(())),
            ("2026-11-29T12:00:00", Err(())),
            ("2026-11-29T12:00:00.Z", Err(())),
            ("2026-11-29T12:00:00+0500", Err(())),
            ("1969-12-31T23:59:59Z", Err(())),
            ("yesterday", Err(())),
            ("", Err(())),
        ];
        for (text, expected) in table {
            check(text, *expected);
        }
    }

    #[test]
    fn format_round_trips() {
        for ms in [0, 1_500, 951_782_400_000, 1_709_164_800_000, 1_795_953_975_123, 4_102_444_799_999] {
            let text = rfc3339_ms(ms);
            assert_eq!(parse_rfc3339_ms(&text), Ok(ms), "{text}");
        }
        assert_eq!(rfc3339_ms(1_795_953_975_123), "2026-11-29T12:06:15.123Z");
        // The second's text is kept between calls: the same second, another, and back.
        assert_eq!(rfc3339_ms(1_795_953_975_007), "2026-11-29T12:06:15.007Z");
        assert_eq!(rfc3339_ms(1_795_953_976_090), "2026-11-29T12:06:16.090Z");
        assert_eq!(rfc3339_ms(1_795_953_975_999), "2026-11-29T12:06:15.999Z");
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(253_402_300_800_000), "10000-01-01T00:00:00.000Z");
    }

    #[test]
    fn http_dates() {
        let table: &[(u64, &str)] = &[
            (0, "Thu, 01 Jan 1970 00:00:00 GMT"),
            (784_111_777, "Sun, 06 Nov 1994 08:49:37 GMT"),
            (951_782_400, "Tue, 29 Feb 2000 00:00:00 GMT"),
            (1_795_953_975, "Sun, 29 Nov 2026 12:06:15 GMT"),
        ];
        for (secs, text) in table {
            assert_eq!(std::str::from_utf8(&http_date(*secs)), Ok(*text), "{secs}");
        }
    }
}
