//! Worker integration tests: the real `relay` and the real `relay-worker` processes on
//! ephemeral loopback ports (plus, where the real relay cannot provoke a case, a fake relay or
//! the library in-process). Modules by theme; helpers in `support`.

mod support;

mod cli;
mod echo_kind;
mod files;
mod http_kind;
mod library;
mod link;
mod python;
mod sessions;
mod shutdown;
