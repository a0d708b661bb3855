//! `relay_worker`: write a relay worker in a few lines. A worker keeps one WebSocket to relay,
//! says `hello` with its kinds and concurrency, runs each task on a bounded thread pool with
//! the handler registered for the task's kind, and answers with the handler's result.
//!
//! A kind is one function `fn(task_id: &str, spec: &RawValue) -> Result<Value, Error>`: it gets
//! the task id and the payload's `spec` (raw JSON; `null` when the payload has none) and returns
//! the result's `data` (`done`) or an [`Error`] whose text becomes the result's `error`
//! (`failed`, so relay tries another worker). A handler that panics fails only its own task.
//!
//! ```no_run
//! use relay_worker::{Error, Worker};
//! use serde_json::value::RawValue;
//! use serde_json::{Value, json};
//!
//! fn shout(_task_id: &str, spec: &RawValue) -> Result<Value, Error> {
//!     let text: String = serde_json::from_str(spec.get())?;
//!     Ok(json!({ "text": text.to_uppercase() }))
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     // Reads RELAY_URL, TOKEN, CONCURRENCY, ... (exit 2 when invalid), keeps the built-in
//!     // `http`, `file` and `echo` kinds, adds `shout`, runs until SIGTERM/SIGINT.
//!     relay_worker::main_with(|worker: &mut Worker| {
//!         worker.register("shout", shout);
//!     })
//! }
//! ```
//!
//! Modules: `config` (environment → Config), `link` (the WebSocket: connect over ws/wss),
//! `runner` (connection states, reconnect with backoff, draining), `pool` (bounded threads,
//! `catch_unwind`), `protocol` (messages, pure), `kinds` (built-in http, file, echo), `tls`
//! (rustls roots), `signals` (SIGTERM/SIGINT → a flag). No async runtime here: reqwest's
//! blocking client keeps its own internally.

pub mod config;
pub mod kinds;
#[doc(hidden)]
pub mod log;

/// The parsers of what relay sends (its messages, a download's `Content-Disposition`), for
/// the fuzz targets in `fuzz/`; not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::kinds::file::filename_of;
    pub use crate::protocol::{ServerMsg, Task, parse_server_msg};
}

mod link;
mod pool;
mod protocol;
mod runner;
mod signals;
mod tls;

use std::collections::BTreeMap;
use std::fmt;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use serde_json::Value;
use serde_json::value::RawValue;

pub use crate::config::{AllowHosts, Config, ConfigError};

/// Why a task failed; its text is the `error` relay records for the attempt. Returned by
/// `run` too, when the worker cannot go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    message: String,
    config: bool,
    retry: RetryHint,
}

/// What a failed task tells relay about retrying it (SPEC §13; docs/protocol.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryHint {
    /// `"retry": false`: a permanent failure, the task fails at once.
    pub permanent: bool,
    /// `"retry_after_ms"`: the next attempt waits at least this long.
    pub after_ms: Option<u64>,
}

impl Error {
    pub fn new(message: impl Into<String>) -> Error {
        Error { message: message.into(), config: false, retry: RetryHint::default() }
    }

    /// An error of the worker's configuration: no retry can fix it (relay refused `TOKEN`, a
    /// value is invalid). `main_with` exits 2 on it.
    pub fn config(message: impl Into<String>) -> Error {
        Error { message: message.into(), config: true, retry: RetryHint::default() }
    }

    /// A failure no retry can fix (a bad request, not a bad network): relay fails the task at
    /// once, whatever retries remain.
    pub fn permanent(message: impl Into<String>) -> Error {
        Error { retry: RetryHint { permanent: true, after_ms: None }, ..Error::new(message) }
    }

    /// A failure to retry no sooner than `ms` from now (e.g. an upstream's `Retry-After`).
    pub fn retry_after(message: impl Into<String>, ms: u64) -> Error {
        Error { retry: RetryHint { permanent: false, after_ms: Some(ms) }, ..Error::new(message) }
    }

    pub fn retry_hint(&self) -> RetryHint {
        self.retry
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether this is a configuration error (see [`Error::config`]).
    pub fn is_config(&self) -> bool {
        self.config
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<String> for Error {
    fn from(message: String) -> Error {
        Error::new(message)
    }
}

impl From<&str> for Error {
    fn from(message: &str) -> Error {
        Error::new(message)
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Error {
        Error::new(format!("bad spec: {e}"))
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::new(e.to_string())
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Error {
        Error::config(e.to_string())
    }
}

/// A registered kind's handler.
pub type Handler = Arc<dyn Fn(&str, &RawValue) -> Result<Value, Error> + Send + Sync + 'static>;

/// A worker: a configuration and the kinds it runs. Build it, register kinds, `run` it.
pub struct Worker {
    config: Config,
    kinds: BTreeMap<String, Handler>,
}

impl Worker {
    /// A worker with no kinds yet.
    pub fn new(config: Config) -> Worker {
        Worker { config, kinds: BTreeMap::new() }
    }

    /// Adds (or replaces) the handler of `kind`. A plain `fn` or a closure both work.
    pub fn register<F>(&mut self, kind: &str, handler: F) -> &mut Worker
    where
        F: Fn(&str, &RawValue) -> Result<Value, Error> + Send + Sync + 'static,
    {
        self.kinds.insert(kind.to_string(), Arc::new(handler));
        self
    }

    /// Registers the built-in `http`, `file` and `echo` kinds (SPEC §8; `echo` returns its spec).
    /// Fails when `CA_FILE` cannot be loaded or the HTTP client cannot be built.
    pub fn register_builtin_kinds(&mut self) -> Result<&mut Worker, Error> {
        let tls = tls::client_config(self.config.ca_file.as_deref())?;
        let http = kinds::http::HttpKind::new(&self.config, (*tls).clone())?;
        let file = kinds::file::FileKind::new(&self.config, (*tls).clone())?;
        self.register("http", move |id, spec| http.run(id, spec));
        self.register("file", move |id, spec| file.run(id, spec));
        self.register("echo", kinds::echo::run);
        Ok(self)
    }

    /// The kinds announced in `hello`, sorted.
    pub fn kinds(&self) -> Vec<String> {
        self.kinds.keys().cloned().collect()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Runs until SIGTERM or SIGINT, then drains (hello with concurrency 0, finish running
    /// tasks within `shutdown_timeout_ms`) and returns. Installs process-wide handlers for both
    /// signals; a repeat signal at least 1 s after the first exits the process at once with
    /// code 1 (an earlier one, as GNU `timeout` sends, is part of the same drain).
    pub fn run(self) -> Result<(), Error> {
        let stop = signals::install().map_err(|e| Error::new(format!("cannot install signal handlers: {e}")))?;
        self.run_until(stop)
    }

    /// Runs until `stop` becomes true, then drains as `run` does. For embedding and tests.
    /// Fails with a configuration error ([`Error::is_config`]) when relay refuses the token.
    pub fn run_until(self, stop: &AtomicBool) -> Result<(), Error> {
        runner::run(self.config, self.kinds, stop)
    }
}

/// A whole worker program: `--help`/`--version`, configuration from the environment (exit 2
/// with a message naming the variable when invalid), the built-in kinds plus whatever
/// `register` adds, and `run`. Exit 0 after a graceful shutdown, 2 when relay refuses `TOKEN`
/// (a 401 on connect is final), 1 on another runtime failure.
pub fn main_with(register: impl FnOnce(&mut Worker)) -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => {}
        Some("-h" | "--help" | "help") => {
            print!("{}", config::help_text());
            return ExitCode::SUCCESS;
        }
        Some("-V" | "--version" | "version") => {
            println!("relay-worker {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Some(other) => {
            eprintln!("relay-worker: unknown argument {other:?} (see relay-worker --help)");
            return ExitCode::from(2);
        }
    }
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("relay-worker: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let mut worker = Worker::new(config);
    if let Err(e) = worker.register_builtin_kinds() {
        eprintln!("relay-worker: invalid configuration: {e}");
        return ExitCode::from(2);
    }
    register(&mut worker);
    match worker.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_config() => {
            eprintln!("relay-worker: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            log!(log::Level::Error, "worker failed", error = e);
            ExitCode::from(1)
        }
    }
}
