//! The quoting of a `key=value` log line's values.

use std::fmt::Write as _;

/// Appends a log line's value: as it is when it is plain (visible ASCII without `"`, `=` or
/// `\`), else quoted with `"`, `\`, newlines, tabs and control characters escaped — so one event
/// stays one line, and a value can never forge another key.
pub fn push_log_value(line: &mut String, value: &str) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn check(value: &str, expected: &str) {
        let mut line = String::new();
        push_log_value(&mut line, value);
        assert_eq!(line, expected, "push_log_value({value:?})");
    }

    #[test]
    fn quoting() {
        for (value, expected) in [
            ("plain", "plain"),
            ("two words", "\"two words\""),
            ("", "\"\""),
            ("a=b", "\"a=b\""),
            ("say \"hi\"", "\"say \\\"hi\\\"\""),
            ("line\nbreak", "\"line\\nbreak\""),
        ] {
            check(value, expected);
        }
    }
}
