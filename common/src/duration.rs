//! Go-style durations (`500ms`, `1m30s`, `720h`), as relay and its worker read them from the
//! environment and requests.

/// The longest duration accepted anywhere (100 years): every deadline computed from one stays
/// far from overflow, and every time shown stays a four-digit-year RFC 3339 time.
pub const MAX_DURATION_MS: u64 = 36_525 * 86_400 * 1000;

/// Parses a Go-style duration (`500ms`, `2s`, `1m30s`, `1.5h`, `720h`) into whole milliseconds.
/// The result must be positive and at most [`MAX_DURATION_MS`]; a sub-millisecond positive
/// value rounds up to 1 ms.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    const BAD: &str = "expected a positive duration such as 500ms, 2s, 1m30s or 720h";
    let s = text.trim();
    if s.is_empty() || s.starts_with('-') {
        return Err(BAD.into());
    }
    let s = s.strip_prefix('+').unwrap_or(s);
    if s == "0" {
        return Err("must be positive".into());
    }
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total_ns: u128 = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let number = &s[start..i];
        if number.is_empty() || number.matches('.').count() > 1 || number == "." {
            return Err(BAD.into());
        }
        let unit_start = i;
        while i < bytes.len() && !(bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let unit_ns: u128 = match &s[unit_start..i] {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(BAD.into()),
        };
        let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
        let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| BAD.to_string())? };
        let mut part = whole.checked_mul(unit_ns).ok_or("duration too large")?;
        let mut scale = unit_ns;
        for digit in frac.bytes().take(18) {
            scale /= 10;
            part += u128::from(digit - b'0') * scale;
        }
        total_ns = total_ns.checked_add(part).ok_or("duration too large")?;
    }
    if total_ns == 0 {
        return Err("must be positive".into());
    }
    let ms = total_ns.div_ceil(1_000_000);
    if ms > u128::from(MAX_DURATION_MS) {
        return Err("must be at most 100 years".into());
    }
    Ok(ms as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_duration(input: &str, expected: Result<u64, ()>) {
        let got = parse_duration_ms(input).map_err(|_| ());
        assert_eq!(got, expected, "parse_duration_ms({input:?})");
    }

    #[test]
    fn durations() {
        let table: &[(&str, Result<u64, ()>)] = &[
            ("500ms", Ok(500)),
            ("2s", Ok(2_000)),
            ("1m30s", Ok(90_000)),
            ("720h", Ok(2_592_000_000)),
            ("1.5s", Ok(1_500)),
            ("1h2m3s4ms", Ok(3_723_004)),
            ("1us", Ok(1)),
            ("999ns", Ok(1)),
            (" 3s ", Ok(3_000)),
            ("0", Err(())),
            ("0s", Err(())),
            ("-1s", Err(())),
            ("", Err(())),
            ("10", Err(())),
            ("s", Err(())),
            ("1x", Err(())),
            ("1..2s", Err(())),
            ("1.2.3s", Err(())),
            ("99999999999999999999999h", Err(())),
            ("18446744073709551615ms", Err(())),
            ("5000000000000h", Err(())),
            ("876600h", Ok(3_155_760_000_000)),
            ("876601h", Err(())),
        ];
        for (input, expected) in table {
            check_duration(input, *expected);
        }
    }
}
