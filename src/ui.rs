//! The built-in dashboard (`/ui`): three static files compiled into the binary, served with
//! headers that keep a hostile task value from ever running as code. No I/O, no state: the
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

/// Served with every dashboard file.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                       connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The files under `/ui/` (the page itself is `/ui`).
const FILES: &[(&str, &str, &str)] = &[
    ("index.html", "text/html; charset=utf-8", INDEX_HTML),
    ("app.js", "text/javascript; charset=utf-8", APP_JS),
    ("app.css", "text/css; charset=utf-8", APP_CSS),
];

pub fn exists(name: &str) -> bool {
    FILES.iter().any(|(n, _, _)| *n == name)
}

/// The response for one dashboard file (404 for a name that is not one).
pub fn asset(name: &str) -> Response {
    let Some((_, content_type, body)) = FILES.iter().find(|(n, _, _)| *n == name) else {
        return crate::http::error(404, "no such dashboard file");
    };
    let mut r = Response::json(200, body.as_bytes().to_vec())
        .with_header("Content-Security-Policy", CSP)
        .with_header("X-Content-Type-Options", "nosniff")
        .with_header("Referrer-Policy", "no-referrer")
        .with_header("X-Frame-Options", "DENY")
        // Small files: revalidating costs little and a new binary shows its new page at once.
        .with_header("Cache-Control", "no-cache");
    r.content_type = content_type;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_headers() {
        for (name, ct) in [("index.html", "text/html"), ("app.js", "text/javascript"), ("app.css", "text/css")] {
            let r = asset(name);
            assert_eq!(r.status, 200, "{name}");
            assert!(r.content_type.starts_with(ct), "{name}: {}", r.content_type);
            let header = |h: &str| r.headers.iter().find(|(n, _)| *n == h).map(|(_, v)| v.as_str());
            assert_eq!(header("X-Content-Type-Options"), Some("nosniff"));
            assert_eq!(header("Content-Security-Policy"), Some(CSP));
        }
        assert_eq!(asset("nope.js").status, 404);
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
