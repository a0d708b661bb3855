//! The built-in dashboard (`/ui`): four static files compiled into the binary (the page, its
//! script, its style sheet and its icon), served with headers that keep a hostile task value
//! from ever running as code, and with an `ETag` so a browser revalidates them for a 304. No I/O, no state: the
//! page makes only the authenticated JSON calls a curl user could make.
//!
//! The page never builds HTML from data: every value from a task or a worker goes in through
//! `textContent` (see `ui/app.js`), and the Content-Security-Policy allows scripts and styles
//! from these files only (no inline script, no inline style, no eval), so even a mistake
//! there could not run a payload.

use crate::http::Response;

const INDEX_HTML: &str = include_str!("ui/index.html");
const APP_JS: &str = include_str!("ui/app.js");
const APP_CSS: &str = include_str!("ui/app.css");
const FAVICON_SVG: &str = include_str!("ui/favicon.svg");

/// Served with every dashboard file.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                       connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The files under `/ui/` (the page itself is `/ui`).
const FILES: &[(&str, &str, &str)] = &[
    ("index.html", "text/html; charset=utf-8", INDEX_HTML),
    ("app.js", "text/javascript; charset=utf-8", APP_JS),
    ("app.css", "text/css; charset=utf-8", APP_CSS),
    ("favicon.svg", "image/svg+xml", FAVICON_SVG),
];

/// Each file's validator: the first 128 bits of its SHA-256, computed once (the files are
/// the binary's, so a new build gets new tags).
fn etag(name: &str) -> Option<&'static str> {
    use sha2::Digest;
    static TAGS: std::sync::OnceLock<Vec<(&'static str, String)>> = std::sync::OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        FILES
            .iter()
            .map(|(n, _, body)| {
                let digest = sha2::Sha256::digest(body.as_bytes());
                let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
                (*n, format!("\"{hex}\""))
            })
            .collect()
    });
    tags.iter().find(|(n, _)| *n == name).map(|(_, t)| t.as_str())
}

pub fn exists(name: &str) -> bool {
    FILES.iter().any(|(n, _, _)| *n == name)
}

/// The response for one dashboard file (404 for a name that is not one); 304 when
/// `if_none_match` names its current `ETag`.
pub fn asset(name: &str, if_none_match: Option<&str>) -> Response {
    let (Some((_, content_type, body)), Some(etag)) = (FILES.iter().find(|(n, _, _)| *n == name), etag(name)) else {
        return crate::http::error(404, "no such dashboard file");
    };
    let fresh = if_none_match.is_some_and(|h| crate::http::none_match(h, etag));
    let body = if fresh { Vec::new() } else { body.as_bytes().to_vec() };
    let mut r = Response::json(if fresh { 304 } else { 200 }, body)
        .with_header("ETag", etag)
        .with_header("Content-Security-Policy", CSP)
        .with_header("X-Content-Type-Options", "nosniff")
        .with_header("Referrer-Policy", "no-referrer")
        .with_header("X-Frame-Options", "DENY")
        // Small files: revalidating costs little (a 304) and a new binary shows its new page at once.
        .with_header("Cache-Control", "no-cache");
    r.content_type = content_type;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_headers() {
        for (name, ct) in [
            ("index.html", "text/html"),
            ("app.js", "text/javascript"),
            ("app.css", "text/css"),
            ("favicon.svg", "image/svg+xml"),
        ] {
            let r = asset(name, None);
            assert_eq!(r.status, 200, "{name}");
            assert!(r.content_type.starts_with(ct), "{name}: {}", r.content_type);
            let header = |h: &str| r.headers.iter().find(|(n, _)| *n == h).map(|(_, v)| v.as_str());
            assert_eq!(header("X-Content-Type-Options"), Some("nosniff"));
            assert_eq!(header("Content-Security-Policy"), Some(CSP));
            let etag = header("ETag").expect("an ETag");
            let again = asset(name, Some(etag));
            assert_eq!((again.status, again.body.len()), (304, 0), "{name}");
            assert_eq!(asset(name, Some("\"stale\"")).status, 200, "{name}");
        }
        assert_ne!(etag("app.js"), etag("app.css"));
        assert!(INDEX_HTML.contains("rel=\"icon\" href=\"/ui/favicon.svg\""), "the page names its icon");
        assert_eq!(asset("nope.js", None).status, 404);
        assert!(!exists("../Cargo.toml"));
    }

    #[test]
    fn the_page_has_no_inline_script_or_style_and_builds_no_html() {
        // The CSP would block them anyway; this keeps the page working under it.
        let html = INDEX_HTML.to_ascii_lowercase();
        assert!(!html.contains("<script>") && !html.contains("<style"), "inline script or style");
        assert!(!html.contains(" style="), "inline style attribute");
        let handler = html.match_indices(" on").any(|(i, _)| {
            let rest = &html[i + 3..];
            let name_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
            name_len > 0 && rest[name_len..].starts_with('=')
        });
        assert!(!handler, "inline event handler attribute");
        for forbidden in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"] {
            assert!(!APP_JS.contains(forbidden), "app.js uses {forbidden}");
        }
        assert!(
            !APP_JS.contains("localStorage") && !APP_JS.contains("document.cookie"),
            "token kept outside sessionStorage"
        );
    }
}
