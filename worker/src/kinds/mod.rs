//! The built-in kinds of `relay-worker`: `http` (one HTTP request), `file` (download from
//! relay, hash, upload back) and `echo` (the spec back, offline). Each `run` has the handler
//! signature, so the library registers them like any user kind.

pub mod echo;
pub mod file;
pub mod http;
pub(crate) mod multipart;

/// An error and its sources, `: `-joined (reqwest's own text alone hides the cause, such as
/// "connection refused" or "invalid peer certificate").
pub(crate) fn describe_error(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}
