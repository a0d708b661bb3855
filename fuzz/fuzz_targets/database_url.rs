//! `DATABASE_URL` (pg::url::parse, pg::url::redact): never a panic, and the password never
//! appears in an error or a redacted URL, however the URL around it is malformed — also with an
//! unencoded `/`, `?`, `@` or `#` in the password (generated passwords have them).
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::pg::url::{parse, redact};

const MARK: &str = "Pw7Zq";

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = parse(&text);
    let _ = redact(&text);
    // The input split in three: the user, the password (with the marker) and what follows.
    let mut parts = text.splitn(3, '\u{1}');
    let (user, secret, rest) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if user.contains(MARK) || rest.contains(MARK) || secret.contains(MARK) {
        return;
    }
    let password = format!("{MARK}{secret}{MARK}");
    for scheme in ["postgres://", "postgresql://"] {
        let url = format!("{scheme}{user}:{password}@{rest}");
        if let Err(e) = parse(&url) {
            assert!(!e.contains(MARK), "the password in an error: {e:?} for {url:?}");
        }
        let shown = redact(&url);
        assert!(!shown.contains(MARK), "the password in {shown:?} for {url:?}");
        let in_query = format!("{scheme}{user}@{rest}?password={password}");
        if let Err(e) = parse(&in_query) {
            assert!(!e.contains(MARK), "the password in an error: {e:?} for {in_query:?}");
        }
        let shown = redact(&in_query);
        assert!(!shown.contains(MARK), "the password in {shown:?} for {in_query:?}");
    }
});
