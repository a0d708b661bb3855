//! relay: a task relay. HTTP in, WebSocket workers out, with fallback and a per-attempt history.
//!
//! The server is one single-threaded mio reactor (`reactor`) around pure modules: HTTP parsing
//! (`http`), the API (`api`), the one dispatch core (`dispatch`) over a task store (`store`:
//! memory and journal, or PostgreSQL), tasks (`tasks`), timers (`timer`). See ARCHITECTURE.md
//! for the codemap and the invariants.

// The dispatch model test (src/dispatch/tests/model.rs) names the crate `relay::` as the fuzz
// target that shares it does.
#[cfg(test)]
extern crate self as relay;

pub mod api;
pub mod auth;
pub mod config;
pub mod conn;
pub mod dispatch;
pub mod files;
pub mod flow;
pub mod http;
pub mod journal;
pub mod jwt;
pub mod listing;
pub mod log;
pub mod metrics;
pub mod multipart;
pub mod pg;
pub mod proxy;
pub mod reactor;
pub mod signals;
pub mod store;
pub mod stream;
pub mod tasks;
pub use relay_common::timefmt;
pub mod timer;
pub mod tokens;
pub mod ui;

#[cfg(test)]
mod layering {
    /// Nothing below the reactor reaches up to it: the core, the stores, the API and the
    /// parsers are driven through `dispatch::Io` and events, never by naming the reactor.
    #[test]
    fn nothing_below_the_reactor_names_it() {
        fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for entry in std::fs::read_dir(dir).expect("src is readable").flatten() {
                let path = entry.path();
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    out.push(path);
                }
            }
        }
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        walk(&src, &mut files);
        assert!(files.len() > 20, "src/ was not found");
        let above = [src.join("reactor"), src.join("reactor.rs"), src.join("main.rs"), src.join("lib.rs")];
        for file in files.iter().filter(|f| !above.iter().any(|a| f.starts_with(a))) {
            let text = std::fs::read_to_string(file).expect("readable");
            assert!(!text.contains("crate::reactor"), "{} reaches up to the reactor", file.display());
        }
    }
}
