//! What the server (`relay`) and the worker (`relay-worker`) share, written once: Go-style
//! durations as both read them, the configuration error naming its variable, the quoting of a `key=value` log line's values, and wall-clock
//! RFC 3339 times. No dependencies, no I/O beyond reading the clock.

pub mod config;
pub mod duration;
pub mod logfmt;
pub mod timefmt;

pub use config::{ConfigError, push_var_table};
pub use duration::{MAX_DURATION_MS, parse_duration_ms};
pub use logfmt::push_log_value;
