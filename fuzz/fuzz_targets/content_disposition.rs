//! File names on their way through relay and back into a worker: relay's sanitised name
//! (files::sanitize_filename) never holds `"`, `/`, `\`, CR, LF or another control character
//! and is at most 255 bytes; the `Content-Disposition` relay writes for it (files::
//! content_disposition) is a safe header value; and the worker's parser (the file kind's
//! filename_of) reads exactly that name back from it. filename_of never panics on any value.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::files::{content_disposition, sanitize_filename};
use relay_worker::fuzzing::filename_of;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = filename_of(text);

    let name = sanitize_filename(text);
    assert!(!name.is_empty() && name.len() <= 255, "{name:?}");
    assert!(!name.contains(['"', '/', '\\', '\r', '\n']), "unsafe name {name:?} from {text:?}");
    assert!(!name.chars().any(char::is_control), "control character in {name:?}");

    let header = content_disposition(&name);
    assert!(header.starts_with("attachment; filename=\""), "{header:?}");
    assert!(header.bytes().all(|b| b == b'\t' || (0x20..0x7f).contains(&b)), "not a safe header value: {header:?}");
    assert_eq!(filename_of(&header).as_deref(), Some(name.as_str()), "{header:?}");
});
