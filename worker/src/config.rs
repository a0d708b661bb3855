//! Environment → validated `Config` for a worker. Every limit and timeout of the worker lives
//! here, with its unit in its name. Nothing here touches a socket; `from_lookup` takes any
//! variable lookup so the rules are unit-tested without touching the process environment.

use std::path::PathBuf;

use reqwest::Url;

/// A worker's configuration. `Config::from_env` reads it from the documented variables; a
/// program embedding the library may also build one by hand (`Config::new`) and adjust fields.
#[derive(Debug, Clone)]
pub struct Config {
    /// The relay WebSocket endpoint (`ws://` or `wss://`), without the token.
    pub relay_url: Url,
    /// The worker token, sent as `?token=` on `/ws` and as a bearer token on `/files`.
    pub token: String,
    /// Tasks run at once (threads in the pool); also announced to relay in `hello`.
    pub concurrency: usize,
    /// Bounds one whole HTTP exchange made by a built-in kind (connect, send, receive).
    pub http_timeout_ms: u64,
    /// When set, the http kind may only contact these hosts.
    pub allow_hosts: Option<AllowHosts>,
    /// A PEM bundle trusted in addition to the web PKI roots (wss:// and https).
    pub ca_file: Option<PathBuf>,
    /// How long running tasks may take to finish after SIGTERM/SIGINT.
    pub shutdown_timeout_ms: u64,
    /// Largest WebSocket message sent or accepted; keep it equal to relay's `MAX_MESSAGE_SIZE`.
    /// A result that would be larger is replaced by a `failed` one (relay would close the
    /// socket with 1009 otherwise, taking every other task on it down too).
    pub max_message_bytes: usize,
    /// TCP connect (per address) and the TLS + WebSocket handshake, each.
    pub connect_timeout_ms: u64,
    /// A write to relay that makes no progress for this long ends the connection.
    pub write_timeout_ms: u64,
    /// Silence from relay for this long makes the worker send a ping of its own.
    pub idle_ping_ms: u64,
    /// Silence from relay for this long (relay pings every 2 s by default) ends the connection.
    pub dead_after_ms: u64,
    /// How often the link thread wakes up to send finished results when relay is quiet.
    pub poll_interval_ms: u64,
    /// First reconnect delay; doubles per failed attempt up to `backoff_max_ms` (with jitter).
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
    /// A connection that stayed up this long resets the backoff.
    pub stable_after_ms: u64,
    /// The worker's session identity (SPEC §12): `WORKER_ID`, or a UUID made at start. Sent in
    /// every hello; a relay with sessions holds the tasks of a lost connection for it.
    pub worker_id: String,
    /// Results kept while disconnected, for a resumed session to deliver: at most
    /// `concurrency` of them and this many bytes.
    pub kept_results_max_bytes: usize,
}

pub use relay_common::ConfigError;

pub const DEFAULT_RELAY_URL: &str = "ws://localhost:8080/ws";
/// Upper bound of CONCURRENCY: one thread per slot, so this caps the threads too.
pub const MAX_CONCURRENCY: usize = 1024;

/// One documented variable: name, default (as text), meaning. `relay-worker --help` prints it.
pub const VARS: &[(&str, &str, &str)] = &[
    ("RELAY_URL", DEFAULT_RELAY_URL, "relay's worker endpoint, ws:// or wss:// (legacy name: MESH_URL)"),
    ("TOKEN", "(required)", "the worker token (relay's WORKER_TOKEN)"),
    ("CONCURRENCY", "16", "tasks run at once (1 to 1024)"),
    ("HTTP_TIMEOUT", "30s", "bounds each HTTP request of the http and file kinds"),
    ("ALLOW_HOSTS", "-", "comma list of host or host:port the http kind may contact (exact, no DNS)"),
    ("CA_FILE", "-", "PEM bundle trusted in addition to the web PKI roots (wss://, https)"),
    ("SHUTDOWN_TIMEOUT", "30s", "on SIGTERM/SIGINT, how long running tasks may take to finish"),
    ("MAX_MESSAGE_SIZE", "1048576", "largest WebSocket message; keep equal to relay's"),
    (
        "WORKER_ID",
        "(a UUID per process)",
        "the worker's session identity (1 to 128 bytes): relay holds its tasks across a lost connection",
    ),
];

impl Config {
    /// A configuration with every default, for the given endpoint and token.
    pub fn new(relay_url: &str, token: &str) -> Result<Config, ConfigError> {
        let relay_url = parse_relay_url("RELAY_URL", relay_url)?;
        if token.is_empty() {
            return Err(ConfigError { var: "TOKEN", value: String::new(), reason: "is required".into() });
        }
        Ok(Config {
            relay_url,
            token: token.to_string(),
            concurrency: 16,
            http_timeout_ms: 30_000,
            allow_hosts: None,
            ca_file: None,
            shutdown_timeout_ms: 30_000,
            max_message_bytes: 1_048_576,
            connect_timeout_ms: 10_000,
            write_timeout_ms: 10_000,
            idle_ping_ms: 5_000,
            dead_after_ms: 15_000,
            poll_interval_ms: 10,
            backoff_initial_ms: 250,
            backoff_max_ms: 30_000,
            stable_after_ms: 10_000,
            worker_id: uuid::Uuid::new_v4().to_string(),
            kept_results_max_bytes: 64 << 20,
        })
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Builds a config from any variable lookup (the tests pass a table). An empty value counts
    /// as unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let var = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let (url_var, url) = match (var("RELAY_URL"), var("MESH_URL")) {
            (Some(u), _) => ("RELAY_URL", u),
            (None, Some(u)) => ("MESH_URL", u),
            (None, None) => ("RELAY_URL", DEFAULT_RELAY_URL.to_string()),
        };
        let relay_url = parse_relay_url(url_var, &url)?;
        let token = var("TOKEN").ok_or_else(|| ConfigError {
            var: "TOKEN",
            value: String::new(),
            reason: "is required: set it to relay's WORKER_TOKEN".into(),
        })?;
        let mut cfg = Config::new(relay_url.as_str(), &token)?;

        if let Some(v) = var("CONCURRENCY") {
            cfg.concurrency = match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_CONCURRENCY).contains(&n) => n,
                _ => {
                    return Err(ConfigError {
                        var: "CONCURRENCY",
                        value: v,
                        reason: format!("expected an integer from 1 to {MAX_CONCURRENCY}"),
                    });
                }
            };
        }
        let duration = |name: &'static str, default_ms: u64| -> Result<u64, ConfigError> {
            match var(name) {
                None => Ok(default_ms),
                Some(v) => parse_duration_ms(&v).map_err(|reason| ConfigError { var: name, value: v, reason }),
            }
        };
        if let Some(v) = get("WORKER_ID").filter(|v| !v.is_empty()) {
            if v.len() > 128 {
                return Err(ConfigError { var: "WORKER_ID", value: v, reason: "expected 1 to 128 bytes".into() });
            }
            cfg.worker_id = v;
        }
        cfg.http_timeout_ms = duration("HTTP_TIMEOUT", cfg.http_timeout_ms)?;
        cfg.shutdown_timeout_ms = duration("SHUTDOWN_TIMEOUT", cfg.shutdown_timeout_ms)?;
        if let Some(v) = var("ALLOW_HOSTS") {
            cfg.allow_hosts =
                Some(AllowHosts::parse(&v).map_err(|reason| ConfigError { var: "ALLOW_HOSTS", value: v, reason })?);
        }
        if let Some(v) = var("CA_FILE") {
            let path = PathBuf::from(v.trim());
            if let Err(e) = crate::tls::load_ca_file(&path) {
                return Err(ConfigError { var: "CA_FILE", value: v, reason: format!("cannot be used: {e}") });
            }
            cfg.ca_file = Some(path);
        }
        if let Some(v) = var("MAX_MESSAGE_SIZE") {
            cfg.max_message_bytes = match v.trim().parse::<usize>() {
                Ok(n) if n >= 1024 => n,
                _ => {
                    return Err(ConfigError {
                        var: "MAX_MESSAGE_SIZE",
                        value: v,
                        reason: "expected an integer of at least 1024 (bytes)".into(),
                    });
                }
            };
        }
        Ok(cfg)
    }

    /// The `/ws` URL with the token in its query (never logged).
    pub fn ws_url_with_token(&self) -> Url {
        let mut url = self.relay_url.clone();
        let kept: Vec<(String, String)> =
            url.query_pairs().filter(|(k, _)| k != "token").map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
        url.set_query(None);
        {
            let mut q = url.query_pairs_mut();
            for (k, v) in &kept {
                q.append_pair(k, v);
            }
            q.append_pair("token", &self.token);
        }
        url
    }

    /// The URL for logs: scheme, host, port and path only.
    pub fn relay_url_for_logs(&self) -> String {
        let mut url = self.relay_url.clone();
        url.set_query(None);
        url.set_fragment(None);
        let _ = url.set_username("");
        let _ = url.set_password(None);
        url.to_string()
    }

    /// relay's HTTP base derived from RELAY_URL: `ws` → `http`, `wss` → `https`, the last path
    /// segment (`ws`) dropped, so `wss://h/relay/ws` gives `https://h/relay/`.
    pub fn http_base(&self) -> Url {
        http_base_of(&self.relay_url)
    }
}

fn parse_relay_url(var: &'static str, text: &str) -> Result<Url, ConfigError> {
    let bad = |reason: &str| ConfigError { var, value: text.to_string(), reason: reason.to_string() };
    let url = Url::parse(text.trim()).map_err(|e| bad(&format!("not a URL ({e})")))?;
    if !matches!(url.scheme(), "ws" | "wss") {
        return Err(bad("expected a ws:// or wss:// URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("the URL has no host"));
    }
    Ok(url)
}

pub(crate) fn http_base_of(relay_url: &Url) -> Url {
    let mut url = relay_url.clone();
    let scheme = if url.scheme() == "wss" { "https" } else { "http" };
    // `set_scheme` refuses ws → http (special vs. non-special schemes); rebuild from text.
    let rest = &url.as_str()[url.scheme().len()..];
    if let Ok(u) = Url::parse(&format!("{scheme}{rest}")) {
        url = u;
    }
    url.set_query(None);
    url.set_fragment(None);
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let path = url.path().to_string();
    let dir = match path.rfind('/') {
        Some(i) => &path[..=i],
        None => "/",
    };
    url.set_path(dir);
    url
}

/// `ALLOW_HOSTS`: host names or `host:port`, compared exactly (ASCII case-insensitive) with a
/// URL's host, without DNS — `localhost` does not allow `127.0.0.1`. A bare host allows every
/// port; `host:port` only that port (the scheme's default port counts: `example.com:443`
/// allows `https://example.com/`). IPv6 entries are written `[::1]` or `[::1]:8080`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowHosts {
    entries: Vec<(String, Option<u16>)>,
}

impl AllowHosts {
    pub fn parse(text: &str) -> Result<AllowHosts, String> {
        let mut entries = Vec::new();
        for raw in text.split(',') {
            let item = raw.trim();
            if item.is_empty() {
                continue;
            }
            let bad = || format!("bad entry {item:?}: expected host or host:port");
            let (host, port) = if let Some(rest) = item.strip_prefix('[') {
                let (addr, after) = rest.split_once(']').ok_or_else(bad)?;
                let port = match after {
                    "" => None,
                    p => Some(p.strip_prefix(':').ok_or_else(bad)?.parse::<u16>().map_err(|_| bad())?),
                };
                (format!("[{}]", addr.to_ascii_lowercase()), port)
            } else if item.matches(':').count() > 1 {
                // A bare IPv6 address: URLs write it in brackets.
                (format!("[{}]", item.to_ascii_lowercase()), None)
            } else if let Some((h, p)) = item.split_once(':') {
                (h.to_ascii_lowercase(), Some(p.parse::<u16>().map_err(|_| bad())?))
            } else {
                (item.to_ascii_lowercase(), None)
            };
            if host.is_empty() || host == "[]" || host.contains(['/', ' ', '@', '?', '#']) {
                return Err(bad());
            }
            entries.push((host, port));
        }
        if entries.is_empty() {
            return Err("no hosts listed".into());
        }
        Ok(AllowHosts { entries })
    }

    /// Whether the http kind may contact `url`.
    pub fn allows(&self, url: &Url) -> bool {
        let Some(host) = url.host_str() else { return false };
        let port = url.port_or_known_default();
        self.entries.iter().any(|(h, p)| h.eq_ignore_ascii_case(host) && (p.is_none() || *p == port))
    }
}

pub use relay_common::parse_duration_ms;

/// The text of `relay-worker --help`.
pub fn help_text() -> String {
    let mut out = String::from(
        "relay-worker — runs relay tasks (kinds: http, file, echo) over a WebSocket to relay.\n\n\
         Usage:\n  relay-worker               run (configured by the environment)\n  \
         relay-worker --help | --version\n\nEnvironment:\n",
    );
    relay_common::push_var_table(&mut out, VARS, 24);
    out.push_str(
        "\nDurations use Go syntax (500ms, 2s, 1m30s). Invalid values stop startup (exit 2).\n\
         relay answering 401 (TOKEN is not its WORKER_TOKEN) is final: no retry, exit 2.\n\
         SIGTERM/SIGINT: stop taking tasks, finish running ones within SHUTDOWN_TIMEOUT, exit 0.\n",
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

    /// `expected`: Ok(()) for a valid config, Err(var) for an error naming `var`.
    fn check(vars: &[(&str, &str)], expected: Result<(), &str>) {
        let got = from(vars).map(|_| ()).map_err(|e| e.var);
        assert_eq!(got, expected, "{vars:?}");
    }

    type Case<'a> = (&'a [(&'a str, &'a str)], Result<(), &'a str>);

    #[test]
    fn validation() {
        let t = ("TOKEN", "w");
        let table: &[Case] = &[
            (&[t], Ok(())),
            (&[], Err("TOKEN")),
            (&[("TOKEN", "")], Err("TOKEN")),
            (&[t, ("RELAY_URL", "http://x/ws")], Err("RELAY_URL")),
            (&[t, ("RELAY_URL", "not a url")], Err("RELAY_URL")),
            (&[t, ("MESH_URL", "tcp://x")], Err("MESH_URL")),
            (&[t, ("RELAY_URL", "wss://relay.example.com/ws")], Ok(())),
            (&[t, ("CONCURRENCY", "0")], Err("CONCURRENCY")),
            (&[t, ("CONCURRENCY", "-1")], Err("CONCURRENCY")),
            (&[t, ("CONCURRENCY", "many")], Err("CONCURRENCY")),
            (&[t, ("CONCURRENCY", "1025")], Err("CONCURRENCY")),
            (&[t, ("CONCURRENCY", "4")], Ok(())),
            (&[t, ("HTTP_TIMEOUT", "0s")], Err("HTTP_TIMEOUT")),
            (&[t, ("HTTP_TIMEOUT", "30")], Err("HTTP_TIMEOUT")),
            (&[t, ("HTTP_TIMEOUT", "1m30s")], Ok(())),
            (&[t, ("SHUTDOWN_TIMEOUT", "-1s")], Err("SHUTDOWN_TIMEOUT")),
            (&[t, ("ALLOW_HOSTS", "a.com:http")], Err("ALLOW_HOSTS")),
            (&[t, ("ALLOW_HOSTS", " , ")], Err("ALLOW_HOSTS")),
            (&[t, ("CA_FILE", "/nonexistent/ca.pem")], Err("CA_FILE")),
            (&[t, ("MAX_MESSAGE_SIZE", "10")], Err("MAX_MESSAGE_SIZE")),
            (&[t, ("WORKER_ID", "w-1")], Ok(())),
            (&[t, ("WORKER_ID", &"x".repeat(129))], Err("WORKER_ID")),
        ];
        for (vars, expected) in table {
            check(vars, *expected);
        }
    }

    #[test]
    fn relay_url_legacy_and_defaults() {
        let c = from(&[("TOKEN", "w")]).expect("defaults");
        assert_eq!(c.relay_url.as_str(), DEFAULT_RELAY_URL);
        assert_eq!((c.concurrency, c.http_timeout_ms), (16, 30_000));
        assert!(uuid::Uuid::parse_str(&c.worker_id).is_ok(), "WORKER_ID defaults to a UUID: {}", c.worker_id);
        assert_ne!(c.worker_id, from(&[("TOKEN", "w")]).expect("again").worker_id, "one per process start");
        let c = from(&[("TOKEN", "w"), ("MESH_URL", "ws://mesh:1/ws")]).expect("legacy");
        assert_eq!(c.relay_url.as_str(), "ws://mesh:1/ws");
        let c = from(&[("TOKEN", "w"), ("MESH_URL", "ws://mesh:1/ws"), ("RELAY_URL", "ws://r:2/ws")]).expect("both");
        assert_eq!(c.relay_url.as_str(), "ws://r:2/ws");
    }

    #[test]
    fn token_url_and_log_url() {
        let c = from(&[("TOKEN", "a b&c"), ("RELAY_URL", "wss://u:p@h:9/x/ws?token=old&v=1")]).expect("ok");
        assert_eq!(c.ws_url_with_token().as_str(), "wss://u:p@h:9/x/ws?v=1&token=a+b%26c");
        assert_eq!(c.relay_url_for_logs(), "wss://h:9/x/ws");
    }

    fn check_base(relay: &str, expected: &str) {
        let url = Url::parse(relay).expect("url");
        assert_eq!(http_base_of(&url).as_str(), expected, "{relay}");
    }

    #[test]
    fn http_base() {
        check_base("ws://localhost:8080/ws", "http://localhost:8080/");
        check_base("wss://relay.example.com/ws", "https://relay.example.com/");
        check_base("wss://relay.example.com:443/relay/ws?x=1", "https://relay.example.com/relay/");
        check_base("ws://127.0.0.1:9/", "http://127.0.0.1:9/");
        check_base("ws://[::1]:9/ws", "http://[::1]:9/");
    }

    fn check_allow(list: &str, url: &str, expected: bool) {
        let hosts = AllowHosts::parse(list).expect("list");
        let url = Url::parse(url).expect("url");
        assert_eq!(hosts.allows(&url), expected, "ALLOW_HOSTS={list} url={url}");
    }

    #[test]
    fn allow_hosts() {
        let table = [
            ("example.com", "https://example.com/x", true),
            ("Example.COM", "http://EXAMPLE.com:8080/", true),
            ("example.com", "https://api.example.com/", false),
            ("example.com", "https://example.com.evil.net/", false),
            ("localhost", "http://127.0.0.1/", false),
            ("127.0.0.1", "http://localhost/", false),
            ("127.0.0.1:8080", "http://127.0.0.1:8080/", true),
            ("127.0.0.1:8080", "http://127.0.0.1:8081/", false),
            ("example.com:443", "https://example.com/", true),
            ("example.com:443", "http://example.com/", false),
            ("a.com, b.com:81", "http://b.com:81/", true),
            ("a.com, b.com:81", "http://b.com/", false),
            ("[::1]:8080", "http://[::1]:8080/", true),
            ("::1", "http://[::1]:9/", true),
            ("[::1]", "http://127.0.0.1/", false),
        ];
        for (list, url, expected) in table {
            check_allow(list, url, expected);
        }
    }
}
