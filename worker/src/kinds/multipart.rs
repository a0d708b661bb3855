//! A streaming `multipart/form-data` writer for one file part: the bytes before the file
//! (`head`) and after it (`tail`), so the file itself can be streamed between them. Pure.
//! Header values are sanitised: a quote, backslash or control character in a file name becomes
//! `_`, and a content type that is not a plain `type/subtype[; params]` becomes
//! `application/octet-stream`.

pub struct Multipart {
    boundary: String,
    field: String,
    filename: String,
    content_type: String,
}

/// Longest file name sent (bytes); relay sanitises names again on its side.
const MAX_FILENAME_BYTES: usize = 255;

impl Multipart {
    pub fn new(boundary: &str, field: &str, filename: &str, content_type: &str) -> Multipart {
        Multipart {
            boundary: format!("relay-worker-{boundary}"),
            field: sanitize_name(field),
            filename: sanitize_name(filename),
            content_type: sanitize_content_type(content_type),
        }
    }

    /// The request's `Content-Type`.
    pub fn content_type(&self) -> String {
        format!("multipart/form-data; boundary={}", self.boundary)
    }

    pub fn head(&self) -> Vec<u8> {
        format!(
            "--{}\r\nContent-Disposition: form-data; name=\"{}\"; filename=\"{}\"\r\nContent-Type: {}\r\n\r\n",
            self.boundary, self.field, self.filename, self.content_type
        )
        .into_bytes()
    }

    pub fn tail(&self) -> Vec<u8> {
        format!("\r\n--{}--\r\n", self.boundary).into_bytes()
    }
}

fn sanitize_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len().min(MAX_FILENAME_BYTES));
    for c in name.chars() {
        let c = if c == '"' || c == '\\' || c.is_control() { '_' } else { c };
        if out.len() + c.len_utf8() > MAX_FILENAME_BYTES {
            break;
        }
        out.push(c);
    }
    if out.is_empty() { "file".to_string() } else { out }
}

fn sanitize_content_type(ct: &str) -> String {
    let ct = ct.trim();
    let media = ct.split(';').next().unwrap_or_default().trim();
    let token = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b));
    let plain = ct.bytes().all(|b| (0x20..0x7f).contains(&b));
    match media.split_once('/') {
        Some((t, s)) if plain && token(t) && token(s) && ct.len() <= 256 => ct.to_string(),
        _ => "application/octet-stream".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(filename: &str, content_type: &str, expected_head: &str) {
        let m = Multipart::new("b1", "file", filename, content_type);
        assert_eq!(String::from_utf8(m.head()).expect("utf8"), expected_head, "{filename:?} {content_type:?}");
        assert_eq!(m.tail(), b"\r\n--relay-worker-b1--\r\n");
        assert_eq!(m.content_type(), "multipart/form-data; boundary=relay-worker-b1");
    }

    fn head(filename: &str, content_type: &str) -> String {
        format!(
            "--relay-worker-b1\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
             Content-Type: {content_type}\r\n\r\n"
        )
    }

    #[test]
    fn heads() {
        let table = [
            ("report.pdf", "application/pdf", head("report.pdf", "application/pdf")),
            ("a\"b\\c\r\nd.txt", "text/plain; charset=utf-8", head("a_b_c__d.txt", "text/plain; charset=utf-8")),
            ("", "text/plain\r\nX-Evil: 1", head("file", "application/octet-stream")),
            ("ünï.txt", "nonsense", head("ünï.txt", "application/octet-stream")),
            ("x", "a/b c", head("x", "application/octet-stream")),
        ];
        for (filename, ct, expected) in table {
            check(filename, ct, &expected);
        }
        let long = "é".repeat(200);
        let m = Multipart::new("b1", "file", &long, "a/b");
        assert_eq!(m.filename.len(), 254, "cut at a char boundary under 255 bytes");
    }

    /// The whole body round-trips through a minimal parser: boundary, part headers, bytes.
    #[test]
    fn body_parses_back() {
        let m = Multipart::new("xyz", "file", "data.bin", "application/octet-stream");
        let payload: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut body = m.head();
        body.extend_from_slice(&payload);
        body.extend_from_slice(&m.tail());
        let boundary = m.content_type().split("boundary=").nth(1).expect("boundary").to_string();
        let delimiter = format!("--{boundary}");
        assert!(body.starts_with(delimiter.as_bytes()));
        let header_end = body.windows(4).position(|w| w == b"\r\n\r\n").expect("headers") + 4;
        let closing = format!("\r\n--{boundary}--\r\n");
        assert!(body.ends_with(closing.as_bytes()));
        assert_eq!(&body[header_end..body.len() - closing.len()], &payload[..]);
    }
}
