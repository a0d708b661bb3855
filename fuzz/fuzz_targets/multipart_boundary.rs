//! The multipart boundary taken from a request's `Content-Type`: any header text is accepted
//! or refused without a panic; a valid boundary (RFC 2046: 1 to 70 `bchars`, not ending in a
//! space), written as a token when it can be or as a quoted string, with any case and spacing
//! and other parameters around it, is accepted, and a body written with it yields its file.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::files::UploadParse;

/// RFC 2046 `bcharsnospace`, then space.
const BCHARS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? ";
/// The `bchars` an RFC 9110 token may hold (the others need a quoted string).
fn token_safe(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"'+_-.".contains(&b)
}

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = UploadParse::new(Some(text), 100);
    }
    let Some((&shape, rest)) = data.split_first() else { return };
    let mut boundary: Vec<u8> = rest.iter().take(70).map(|b| BCHARS[usize::from(*b) % BCHARS.len()]).collect();
    while boundary.last() == Some(&b' ') {
        boundary.pop();
    }
    if boundary.is_empty() {
        return;
    }
    let boundary = String::from_utf8(boundary).expect("ASCII");
    let value =
        if shape & 1 == 0 && boundary.bytes().all(token_safe) { boundary.clone() } else { format!("\"{boundary}\"") };
    let content_type = match (shape >> 1) % 5 {
        0 => format!("multipart/form-data; boundary={value}"),
        1 => format!("Multipart/Form-Data;boundary={value}"),
        2 => format!("multipart/form-data; charset=utf-8; BOUNDARY={value}"),
        3 => format!("multipart/form-data ;  boundary={value} ; charset=utf-8"),
        _ => format!("multipart/form-data; boundary = {value}"),
    };
    let mut upload = match UploadParse::new(Some(&content_type), 100) {
        Ok(u) => u,
        Err(e) => panic!("{content_type:?} refused: {e:?}"),
    };
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.txt\"\r\n\r\nhello\r\n--{boundary}--\r\n"
    );
    let mut file = Vec::new();
    match upload.feed(body.as_bytes(), &mut file) {
        Ok(_) => {}
        Err(e) => panic!("{content_type:?}: the body written with its boundary is refused: {e:?}"),
    }
    let meta = upload.finish().unwrap_or_else(|e| panic!("{content_type:?}: no file: {e:?}"));
    assert_eq!((file.as_slice(), meta.filename.as_str()), (b"hello".as_slice(), "f.txt"), "{content_type:?}");
});
