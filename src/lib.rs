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
pub mod tasks;
pub use relay_common::timefmt;
pub mod timer;
pub mod tokens;
pub mod ui;
