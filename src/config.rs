//! Environment → validated `Config`. Every limit and timeout of the server lives here, with its
//! unit in its name. Nothing else reads the environment; nothing here touches a socket.

use std::net::IpAddr;
use std::path::PathBuf;

use crate::log::Level;
use crate::pg::url::DbParams;
use crate::proxy::TrustedProxies;

#[derive(Debug, Clone)]
pub struct Config {
    pub port: u16,
    pub bind: IpAddr,
    pub worker_token: String,
    pub api_token: String,
    pub ping_interval_ms: u64,
    pub pong_wait_ms: u64,
    /// How long a session worker's attempts are held after its connection is lost
    /// (RESUME_WINDOW, SPEC §12; 0 = nothing is held).
    pub resume_window_ms: u64,
    pub task_timeout_ms: u64,
    pub max_retries: u32,
    pub wait_timeout_ms: u64,
    pub blob_dir: PathBuf,
    pub blob_ttl_ms: u64,
    pub max_file_bytes: u64,
    pub task_ttl_ms: u64,
    pub max_message_bytes: usize,
    pub token_secret: Option<String>,
    pub token_store: PathBuf,
    pub data_dir: Option<PathBuf>,
    pub max_connections: usize,
    pub header_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub max_pending: usize,
    pub max_pending_bytes: usize,
    pub max_batch_bytes: usize,
    /// Memory for finished tasks; beyond it the oldest leave memory (TASK_MEMORY).
    pub task_memory_bytes: usize,
    /// Unwritten HTTP output over every connection (OUTPUT_MEMORY): beyond it a connection
    /// that has output left gets no new answer, and those whose output stalls are closed.
    pub output_memory_bytes: usize,
    /// The largest a journal segment grows to (JOURNAL_SEGMENT_SIZE).
    pub journal_segment_bytes: u64,
    pub shutdown_timeout_ms: u64,
    pub log_level: Level,
    pub trusted_proxies: TrustedProxies,
    /// `DATABASE_URL`: cluster mode on PostgreSQL (SPEC §11); `None` = single node.
    pub database: Option<DbParams>,
    /// The retry policy (SPEC §13): `RETRY_BACKOFF` (0: retry at once), `RETRY_BACKOFF_MAX`,
    /// `RETRY_ANY_WORKER`.
    pub retry_backoff_ms: u64,
    pub retry_backoff_max_ms: u64,
    pub retry_any_worker: bool,
    /// `FAILED_TTL` (SPEC §13): how long failed tasks are kept (default TASK_TTL).
    pub failed_ttl_ms: u64,
}

pub use relay_common::ConfigError;

/// One documented variable: name, default (as text), meaning. `relay --help` prints this table.
pub const VARS: &[(&str, &str, &str)] = &[
    ("PORT", "8080", "HTTP/WebSocket port (0 = ephemeral, logged at start)"),
    ("BIND", "0.0.0.0", "listen address"),
    ("WORKER_TOKEN", "(required*)", "token workers present on /ws?token="),
    ("API_TOKEN", "(required*)", "root token of the task API (Authorization: Bearer)"),
    ("AUTH_TOKEN", "-", "legacy single token: fills whichever of the two above is unset"),
    ("PING_INTERVAL", "2s", "WebSocket ping period"),
    ("PONG_WAIT", "6s", "a worker silent this long is dead"),
    (
        "RESUME_WINDOW",
        "10s",
        "a session worker's running attempts are held this long after its connection is lost (0s = never)",
    ),
    ("TASK_TIMEOUT", "10s", "one attempt: how long to wait for a worker's answer"),
    ("MAX_RETRIES", "2", "how many other workers to try after the first attempt"),
    (
        "RETRY_BACKOFF",
        "0s",
        "delay before a task's first retry, doubling for each further one (random, up to it); 0s: at once",
    ),
    ("RETRY_BACKOFF_MAX", "5m", "the longest retry delay"),
    ("FAILED_TTL", "= TASK_TTL", "failed tasks are kept this long after they fail (to inspect and re-run)"),
    (
        "RETRY_ANY_WORKER",
        "false",
        "with no untried eligible worker connected, retry on the one tried longest ago instead of failing",
    ),
    ("WAIT_TIMEOUT", "35s", "longest an HTTP wait=true call blocks"),
    ("BLOB_DIR", "$TMPDIR/relay-blobs", "uploaded files"),
    ("BLOB_TTL", "1h", "files are deleted this long after upload"),
    ("MAX_FILE_SIZE", "104857600", "bytes per uploaded file"),
    ("TASK_TTL", "1h", "finished tasks are forgotten this long after they finish"),
    ("MAX_MESSAGE_SIZE", "1048576", "bytes per worker WebSocket message and per POST /tasks body (at most 256 MiB)"),
    ("TOKEN_SECRET", "-", "HS256 secret for scoped tokens (>= 32 bytes; empty = disabled)"),
    ("TOKEN_STORE", "relay-tokens.json", "scoped token registry file"),
    ("DATA_DIR", "relay-data", "journal directory; empty = memory only"),
    ("MAX_CONNECTIONS", "10000", "open client + worker connections"),
    ("HEADER_TIMEOUT", "10s", "a request (head and body) must arrive within this"),
    ("IDLE_TIMEOUT", "60s", "idle keep-alive connections close after this"),
    ("MAX_PENDING", "1000000", "tasks waiting as pending; beyond it submit answers 429"),
    ("MAX_PENDING_BYTES", "268435456", "payload bytes of tasks waiting as pending; beyond it submit answers 429"),
    ("MAX_BATCH_BYTES", "67108864", "body limit of POST /tasks/batch"),
    (
        "TASK_MEMORY",
        "67108864",
        "bytes of memory for finished tasks; beyond it the oldest are read back from the journal on demand \
         (memory only: forgotten early)",
    ),
    (
        "OUTPUT_MEMORY",
        "268435456",
        "bytes of unwritten HTTP answers held for all clients together; beyond it clients that do not \
         read get no more and those stalled longest are closed",
    ),
    (
        "JOURNAL_SEGMENT_SIZE",
        "67108864",
        "the largest a journal segment grows to (bytes, at most 1 GiB; the first is 1 MiB)",
    ),
    ("SHUTDOWN_TIMEOUT", "5s", "grace period on SIGTERM/SIGINT"),
    ("LOG_LEVEL", "info", "error, warn, info, debug or trace"),
    ("TRUSTED_PROXIES", "-", "IPs/CIDRs whose X-Forwarded-For / X-Real-IP is believed"),
    (
        "DATABASE_URL",
        "-",
        "postgres://user:pw@host:port/db (or ?host=/socket/dir): cluster mode; replaces DATA_DIR and TOKEN_STORE",
    ),
];

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Builds a config from any variable lookup (the tests pass a table).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        // An empty value counts as unset everywhere except DATA_DIR, where empty means "off".
        let var = |name: &str| get(name).filter(|v| !v.is_empty());
        let legacy = var("AUTH_TOKEN");
        let worker_token = var("WORKER_TOKEN").or_else(|| legacy.clone());
        let api_token = var("API_TOKEN").or(legacy);
        let worker_token = worker_token.ok_or_else(|| missing("WORKER_TOKEN"))?;
        let api_token = api_token.ok_or_else(|| missing("API_TOKEN"))?;

        let blob_dir = match var("BLOB_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => std::env::temp_dir().join("relay-blobs"),
        };
        let data_dir = match get("DATA_DIR") {
            None => Some(PathBuf::from("relay-data")),
            Some(v) if v.is_empty() => None,
            Some(v) => Some(PathBuf::from(v)),
        };
        let tokens = TokenConfig::from_lookup(&get)?;
        let database = tokens.database.clone();
        let log_level = match var("LOG_LEVEL") {
            None => Level::Info,
            Some(v) => Level::parse(&v).ok_or_else(|| ConfigError {
                var: "LOG_LEVEL",
                value: v.clone(),
                reason: "expected error, warn, info, debug or trace".into(),
            })?,
        };
        let trusted_proxies = match var("TRUSTED_PROXIES") {
            None => TrustedProxies::default(),
            Some(v) => TrustedProxies::parse(&v).map_err(|reason| ConfigError {
                var: "TRUSTED_PROXIES",
                value: v.clone(),
                reason,
            })?,
        };
        let bind = match var("BIND") {
            None => IpAddr::from([0, 0, 0, 0]),
            Some(v) => v.parse().map_err(|_| ConfigError {
                var: "BIND",
                value: v.clone(),
                reason: "expected an IP address such as 0.0.0.0 or ::1".into(),
            })?,
        };
        let port = match var("PORT") {
            None => 8080,
            Some(v) => v.parse::<u16>().map_err(|_| ConfigError {
                var: "PORT",
                value: v.clone(),
                reason: "expected a port number from 0 to 65535".into(),
            })?,
        };

        let duration = |name: &'static str, default_ms: u64| -> Result<u64, ConfigError> {
            match var(name) {
                None => Ok(default_ms),
                Some(v) => parse_duration_ms(&v).map_err(|reason| ConfigError { var: name, value: v.clone(), reason }),
            }
        };
        let count = |name: &'static str, default: u64| -> Result<u64, ConfigError> {
            match var(name) {
                None => Ok(default),
                Some(v) => v.trim().parse::<u64>().map_err(|_| ConfigError {
                    var: name,
                    value: v.clone(),
                    reason: "expected a non-negative integer".into(),
                }),
            }
        };
        let positive = |name: &'static str, default: u64| -> Result<u64, ConfigError> {
            let n = count(name, default)?;
            if n == 0 {
                return Err(ConfigError { var: name, value: "0".into(), reason: "must be at least 1".into() });
            }
            Ok(n)
        };

        let ping_interval_ms = duration("PING_INTERVAL", 2_000)?;
        let pong_wait_ms = duration("PONG_WAIT", 6_000)?;
        if pong_wait_ms <= ping_interval_ms {
            // Any frame counts as life, so a worker answering every ping would still be
            // declared dead between two pings.
            return Err(ConfigError {
                var: "PONG_WAIT",
                value: var("PONG_WAIT").unwrap_or_default(),
                reason: format!("must be longer than PING_INTERVAL ({ping_interval_ms} ms)"),
            });
        }
        let max_retries = count("MAX_RETRIES", 2)?;
        let max_retries = u32::try_from(max_retries.min(1000)).unwrap_or(1000);
        let retry_backoff_ms = match var("RETRY_BACKOFF") {
            None => 0,
            Some(v) => match parse_duration_ms(&v) {
                Ok(ms) => ms,
                // (`0s` is allowed: no backoff.)
                Err(reason) if reason == "must be positive" => 0,
                Err(reason) => return Err(ConfigError { var: "RETRY_BACKOFF", value: v.clone(), reason }),
            },
        };
        let retry_any_worker = match var("RETRY_ANY_WORKER") {
            None => false,
            Some(v) => parse_bool(&v).ok_or_else(|| ConfigError {
                var: "RETRY_ANY_WORKER",
                value: v.clone(),
                reason: "expected true, false, 1 or 0".into(),
            })?,
        };
        Ok(Config {
            port,
            bind,
            worker_token,
            api_token,
            ping_interval_ms,
            pong_wait_ms,
            // (`0s` is valid here: it turns holding off.)
            resume_window_ms: match var("RESUME_WINDOW") {
                None => 10_000,
                Some(v) => match parse_duration_ms(&v) {
                    Ok(ms) => ms,
                    Err(reason) if reason == "must be positive" => 0,
                    Err(reason) => return Err(ConfigError { var: "RESUME_WINDOW", value: v.clone(), reason }),
                },
            },
            task_timeout_ms: duration("TASK_TIMEOUT", 10_000)?,
            max_retries,
            wait_timeout_ms: duration("WAIT_TIMEOUT", 35_000)?,
            blob_dir,
            blob_ttl_ms: duration("BLOB_TTL", 3_600_000)?,
            max_file_bytes: count("MAX_FILE_SIZE", 104_857_600)?,
            task_ttl_ms: duration("TASK_TTL", 3_600_000)?,
            max_message_bytes: {
                // A task's journal record holds its payload and its result: both must stay far
                // below the largest record replay accepts (1 GiB).
                let n = positive("MAX_MESSAGE_SIZE", 1_048_576)?;
                if n > 256 << 20 {
                    return Err(ConfigError {
                        var: "MAX_MESSAGE_SIZE",
                        value: n.to_string(),
                        reason: "must be at most 268435456 (256 MiB)".into(),
                    });
                }
                as_usize(n)
            },
            token_secret: tokens.secret,
            token_store: tokens.store,
            data_dir,
            max_connections: as_usize(positive("MAX_CONNECTIONS", 10_000)?),
            header_timeout_ms: duration("HEADER_TIMEOUT", 10_000)?,
            idle_timeout_ms: duration("IDLE_TIMEOUT", 60_000)?,
            max_pending: as_usize(count("MAX_PENDING", 1_000_000)?),
            max_pending_bytes: as_usize(count("MAX_PENDING_BYTES", 268_435_456)?),
            max_batch_bytes: as_usize(positive("MAX_BATCH_BYTES", 67_108_864)?),
            task_memory_bytes: as_usize(count("TASK_MEMORY", 67_108_864)?),
            output_memory_bytes: as_usize(positive("OUTPUT_MEMORY", 268_435_456)?),
            journal_segment_bytes: {
                // Records are found by 32-bit offsets within their segment.
                let n = positive("JOURNAL_SEGMENT_SIZE", 67_108_864)?;
                if n > 1 << 30 {
                    return Err(ConfigError {
                        var: "JOURNAL_SEGMENT_SIZE",
                        value: n.to_string(),
                        reason: "must be at most 1073741824 (1 GiB)".into(),
                    });
                }
                n
            },
            shutdown_timeout_ms: duration("SHUTDOWN_TIMEOUT", 5_000)?,
            log_level,
            trusted_proxies,
            database,
            retry_backoff_ms,
            retry_backoff_max_ms: duration("RETRY_BACKOFF_MAX", 300_000)?,
            retry_any_worker,
            failed_ttl_ms: match var("FAILED_TTL") {
                None => duration("TASK_TTL", 3_600_000)?,
                Some(_) => duration("FAILED_TTL", 0)?,
            },
        })
    }
}

/// What the server and the `relay token` CLI must agree on: the HS256 secret and the registry.
#[derive(Debug, Clone)]
pub struct TokenConfig {
    /// `None` when `TOKEN_SECRET` is unset or empty (scoped tokens disabled).
    pub secret: Option<String>,
    pub store: PathBuf,
    /// `DATABASE_URL`: the registry is the database's `relay_tokens` table instead of `store`.
    pub database: Option<DbParams>,
}

/// Shortest `TOKEN_SECRET` accepted: HS256 wants a key of at least the hash's 32 bytes.
pub const MIN_TOKEN_SECRET_BYTES: usize = 32;

impl TokenConfig {
    pub fn from_env() -> Result<TokenConfig, ConfigError> {
        TokenConfig::from_lookup(|name| std::env::var(name).ok())
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<TokenConfig, ConfigError> {
        let var = |name: &str| get(name).filter(|v| !v.is_empty());
        let secret = var("TOKEN_SECRET");
        if let Some(secret) = &secret
            && secret.len() < MIN_TOKEN_SECRET_BYTES
        {
            // The value itself is never echoed: it is a secret.
            return Err(ConfigError {
                var: "TOKEN_SECRET",
                value: String::new(),
                reason: format!("must be at least {MIN_TOKEN_SECRET_BYTES} bytes (got {})", secret.len()),
            });
        }
        let store = PathBuf::from(var("TOKEN_STORE").unwrap_or_else(|| "relay-tokens.json".into()));
        let database = database_from(var("DATABASE_URL"))?;
        Ok(TokenConfig { secret, store, database })
    }
}

/// `DATABASE_URL`, parsed. The value shown in an error has its password masked.
fn database_from(value: Option<String>) -> Result<Option<DbParams>, ConfigError> {
    let Some(url) = value else { return Ok(None) };
    crate::pg::url::parse(&url).map(Some).map_err(|reason| ConfigError {
        var: "DATABASE_URL",
        value: crate::pg::url::redact(&url),
        reason,
    })
}

/// SPEC §2's booleans: `true`/`false`/`1`/`0`.
fn parse_bool(text: &str) -> Option<bool> {
    match text.trim() {
        "true" | "1" => Some(true),
        "false" | "0" => Some(false),
        _ => None,
    }
}

fn as_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn missing(var: &'static str) -> ConfigError {
    ConfigError { var, value: String::new(), reason: "is required (set it, or set AUTH_TOKEN for both roles)".into() }
}

pub use relay_common::{MAX_DURATION_MS, parse_duration_ms};

/// The text of `relay --help`.
pub fn help_text() -> String {
    let mut out = String::from(
        "relay — a task relay: HTTP in, WebSocket workers out, with fallback.\n\n\
         Usage:\n  relay [serve]            run the server (configured by the environment)\n  \
         relay token <command>    manage scoped tokens (relay token --help)\n  \
         relay --help | --version\n\nEnvironment:\n",
    );
    relay_common::push_var_table(&mut out, VARS, 20);
    out.push_str(
        "\n* AUTH_TOKEN fills whichever of WORKER_TOKEN / API_TOKEN is unset.\n\
         Durations use Go syntax (500ms, 2s, 1m30s, 720h). Invalid values stop startup (exit 2).\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn retry_policy() {
        let base = [("WORKER_TOKEN", "w"), ("API_TOKEN", "a")];
        let c = from(&base).expect("defaults");
        assert_eq!((c.retry_backoff_ms, c.retry_backoff_max_ms, c.retry_any_worker), (0, 300_000, false));
        let mut vars = base.to_vec();
        vars.extend([("RETRY_BACKOFF", "200ms"), ("RETRY_BACKOFF_MAX", "1m"), ("RETRY_ANY_WORKER", "1")]);
        let c = from(&vars).expect("set");
        assert_eq!((c.retry_backoff_ms, c.retry_backoff_max_ms, c.retry_any_worker), (200, 60_000, true));
        let mut vars = base.to_vec();
        vars.push(("RETRY_BACKOFF", "0s"));
        assert_eq!(from(&vars).expect("0s is no backoff").retry_backoff_ms, 0);
        let mut vars = base.to_vec();
        vars.push(("TASK_TTL", "10m"));
        assert_eq!(from(&vars).expect("default").failed_ttl_ms, 600_000, "FAILED_TTL defaults to TASK_TTL");
        vars.push(("FAILED_TTL", "7d"));
        assert!(from(&vars).is_err(), "Go durations have no days");
        vars.pop();
        vars.push(("FAILED_TTL", "168h"));
        assert_eq!(from(&vars).expect("set").failed_ttl_ms, 168 * 3_600_000);
    }

    #[test]
    fn tokens_and_legacy() {
        let c = from(&[("AUTH_TOKEN", "x")]).expect("legacy fills both");
        assert_eq!((c.worker_token.as_str(), c.api_token.as_str()), ("x", "x"));
        let c = from(&[("AUTH_TOKEN", "x"), ("API_TOKEN", "a")]).expect("legacy fills one");
        assert_eq!((c.worker_token.as_str(), c.api_token.as_str()), ("x", "a"));
        assert_eq!(from(&[("API_TOKEN", "a")]).unwrap_err().var, "WORKER_TOKEN");
        assert_eq!(from(&[("WORKER_TOKEN", "w"), ("API_TOKEN", "")]).unwrap_err().var, "API_TOKEN");
    }

    #[test]
    fn invalid_values_name_the_variable() {
        let base = [("WORKER_TOKEN", "w"), ("API_TOKEN", "a")];
        let table: &[(&str, &str)] = &[
            ("PORT", "70000"),
            ("PORT", "-1"),
            ("BIND", "nowhere"),
            ("PING_INTERVAL", "0s"),
            ("TASK_TIMEOUT", "-3s"),
            ("MAX_RETRIES", "-1"),
            ("MAX_RETRIES", "two"),
            ("RETRY_BACKOFF", "-1s"),
            ("RETRY_BACKOFF", "soon"),
            ("RETRY_BACKOFF_MAX", "0s"),
            ("RETRY_ANY_WORKER", "yes"),
            ("FAILED_TTL", "0s"),
            ("LOG_LEVEL", "loud"),
            ("MAX_CONNECTIONS", "0"),
            ("TOKEN_SECRET", "short"),
            ("TRUSTED_PROXIES", "10.0.0.0/99"),
            ("PONG_WAIT", "2s"),
            ("DATABASE_URL", "mysql://h/db"),
            ("DATABASE_URL", "postgres://h/db?sslmode=require"),
            // (Review of issue 9) offsets in a segment are 32-bit: a larger segment made reads
            // of tasks that left memory point at the wrong bytes.
            ("JOURNAL_SEGMENT_SIZE", "5000000000"),
            ("MAX_MESSAGE_SIZE", "268435457"),
            ("RESUME_WINDOW", "soon"),
            ("RESUME_WINDOW", "-1s"),
        ];
        for (var, value) in table {
            let mut vars = base.to_vec();
            vars.push((var, value));
            let err = from(&vars).expect_err(var);
            assert_eq!(err.var, *var, "{var}={value}");
        }
        let c = from(&[("WORKER_TOKEN", "w"), ("API_TOKEN", "a"), ("LOG_LEVEL", "DEBUG"), ("DATA_DIR", "")])
            .expect("valid");
        assert_eq!(c.log_level, Level::Debug);
        assert!(c.data_dir.is_none());
        assert!(c.database.is_none(), "no DATABASE_URL: single node");
        assert_eq!(c.resume_window_ms, 10_000, "RESUME_WINDOW defaults to 10s");
        let c = from(&[("WORKER_TOKEN", "w"), ("API_TOKEN", "a"), ("RESUME_WINDOW", "0s")]).expect("0s disables");
        assert_eq!(c.resume_window_ms, 0);
    }

    #[test]
    fn database_url() {
        let base = [("WORKER_TOKEN", "w"), ("API_TOKEN", "a")];
        for url in ["postgres://u:pw@db:5433/relay", "postgresql:///relay?host=/run/pg"] {
            let mut vars = base.to_vec();
            vars.push(("DATABASE_URL", url));
            let c = from(&vars).expect(url);
            assert!(c.database.is_some(), "{url}");
        }
        let mut vars = base.to_vec();
        vars.push(("DATABASE_URL", "mysql://u:secretpw@h/db"));
        let err = from(&vars).expect_err("other scheme");
        assert_eq!(err.var, "DATABASE_URL");
        assert!(!err.to_string().contains("secretpw"), "the password is masked: {err}");
        assert!(help_text().contains("DATABASE_URL"));
    }
}
