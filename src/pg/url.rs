//! `DATABASE_URL` → [`DbParams`]: where PostgreSQL is and who to log in as. Pure: no socket, no
//! environment. The accepted form is libpq's URI (`postgres://` or `postgresql://`):
//!
//! ```text
//! postgres://[user[:password]@][host][:port][/dbname][?param=value&...]
//! ```
//!
//! `host` is a name, an IPv4 address, `[IPv6]`, or a percent-encoded directory holding the unix
//! socket (`%2Fvar%2Frun%2Fpostgresql`); the query parameters `host`, `port`, `user`,
//! `password`, `dbname`, `application_name`, `connect_timeout` and `sslmode` override the parts.
//! TLS is not spoken: `sslmode` may be `disable`, `allow` or `prefer` (all mean plain TCP),
//! anything stronger is refused, so nobody believes they have TLS when they do not.

use std::fmt;
use std::path::PathBuf;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// A host name or address, resolved on the database thread.
    Tcp(String),
    /// The directory of the unix socket `.s.PGSQL.<port>`.
    Unix(PathBuf),
}

/// Everything needed to open a session. `Debug` and `Display` hide the password.
#[derive(Clone, PartialEq, Eq)]
pub struct DbParams {
    pub host: Host,
    pub port: u16,
    pub user: String,
    pub password: Option<String>,
    pub dbname: String,
    pub application_name: String,
    pub connect_timeout_ms: u64,
}

/// PostgreSQL's own default port.
pub const DEFAULT_PORT: u16 = 5432;
/// Debian's (and most distributions') socket directory, libpq's default host.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/postgresql";
/// Used when the URL names no user.
pub const DEFAULT_USER: &str = "postgres";
const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 5_000;

impl DbParams {
    /// The socket path for a unix host.
    pub fn socket_path(&self) -> Option<PathBuf> {
        match &self.host {
            Host::Unix(dir) => Some(dir.join(format!(".s.PGSQL.{}", self.port))),
            Host::Tcp(_) => None,
        }
    }
}

impl fmt::Display for DbParams {
    /// `user@host:port/dbname`, for logs: never the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Tcp(h) if h.contains(':') => write!(f, "{}@[{h}]:{}/{}", self.user, self.port, self.dbname),
            Host::Tcp(h) => write!(f, "{}@{h}:{}/{}", self.user, self.port, self.dbname),
            Host::Unix(dir) => write!(f, "{}@{}:{}/{}", self.user, dir.display(), self.port, self.dbname),
        }
    }
}

impl fmt::Debug for DbParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DbParams({self})")
    }
}

/// Where the user information ends. A user name holds none of `:/?#@`; after `user:` the
/// password runs to the last `@` of the URL, whatever comes before it — a password with an
/// unencoded `/`, `?`, `#` or `@` (generated passwords often have them) is still the password,
/// never a path or a port to echo back in an error. Without `user@` or `user:…@` at the start,
/// there is no user information, and an `@` further on is in the path or the query (a
/// `?password=` that holds one).
fn split_userinfo(rest: &str) -> (Option<&str>, &str) {
    let user_end = rest.find([':', '/', '?', '#', '@']).unwrap_or(rest.len());
    match rest.as_bytes().get(user_end) {
        Some(b'@') => (Some(&rest[..user_end]), &rest[user_end + 1..]),
        Some(b':') => match rest.rfind('@') {
            // (`host:port/db?password=a@b` is a query's password, not user information.)
            Some(at) if !rest[..at].contains("?password=") && !rest[..at].contains("&password=") => {
                (Some(&rest[..at]), &rest[at + 1..])
            }
            _ => (None, rest),
        },
        _ => (None, rest),
    }
}

/// The URL with its password replaced, for the error about a URL that does not parse. Only a
/// plain `user[:password]@rest` (a user name without delimiters, nothing after the last `@`
/// that names a password) is shown, its password masked; a URL without `@` or `password=` is
/// shown whole; anything else is not shown at all — in a malformed URL any part may be a
/// piece of the password.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        // Not a URL at all: nothing of it is shown (it may be all password).
        return "(not a URL)".to_string();
    };
    let query_password = rest.contains("?password=") || rest.contains("&password=");
    // (Without an `@`, a port that is not a number may be a password whose host was left out:
    // `postgres://user:secret`.)
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let port_ok = match authority.rsplit_once(':') {
        Some((_, port)) => port.bytes().all(|b| b.is_ascii_digit()) || authority.starts_with('['),
        None => true,
    };
    if !rest.contains('@') && !query_password && port_ok && !rest.contains('#') {
        return url.to_string();
    }
    if let Some(at) = rest.rfind('@') {
        let (info, after) = (&rest[..at], &rest[at + 1..]);
        let user_end = info.find([':', '/', '?', '#', '&', '=']).unwrap_or(info.len());
        let plain_user = matches!(info.as_bytes().get(user_end), None | Some(b':'));
        // (`password=` before the last `@` may be a query's password that holds an `@`.)
        let names_password = |t: &str| t.contains("password=");
        let host = &after[..after.find(['/', '?']).unwrap_or(after.len())];
        let plain_host =
            host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '[' | ']' | '%'));
        if plain_user && plain_host && !names_password(after) && !names_password(info) {
            let masked = if user_end < info.len() { ":***" } else { "" };
            return format!("{scheme}://{}{masked}@{after}", &info[..user_end]);
        }
    }
    format!("{scheme}://… (not shown: it may hold a password)")
}

/// Parses a `DATABASE_URL`. The error says what is wrong, never repeating the password.
pub fn parse(url: &str) -> Result<DbParams, String> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or("expected a postgres:// or postgresql:// URL")?;
    let (userinfo, after) = split_userinfo(rest);
    let (before_query, query) = match after.split_once('?') {
        Some((a, q)) => (a, Some(q)),
        None => (after, None),
    };
    let (hostport, path) = match before_query.find('/') {
        Some(i) => (&before_query[..i], &before_query[i + 1..]),
        None => (before_query, ""),
    };
    let (mut user, mut password) = (None, None);
    if let Some(info) = userinfo {
        let (u, p) = match info.split_once(':') {
            Some((u, p)) => (u, Some(p)),
            None => (info, None),
        };
        if !u.is_empty() {
            user = Some(decode(u)?);
        }
        // (A password that is not valid %-encoding is taken as it is: it is never shown.)
        password = p.map(|p| decode(p).unwrap_or_else(|_| p.to_string()));
    }
    if hostport.contains(',') {
        return Err("several hosts are not supported: give one host (put a load balancer or a proxy in front)".into());
    }
    let (host_text, port_text) = split_host_port(hostport)?;
    let mut host = if host_text.is_empty() {
        None
    } else {
        let h = decode(host_text)?;
        Some(if h.starts_with('/') { Host::Unix(PathBuf::from(h)) } else { Host::Tcp(tcp_host(h)?) })
    };
    let mut port = port_text.map(parse_port).transpose()?;
    let mut dbname = if path.is_empty() { None } else { Some(decode(path)?) };
    let mut application_name = None;
    let mut connect_timeout_ms = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        // (Errors name a parameter only when it is one relay knows: an unknown name may be part
        // of a password whose `&` was not %-encoded.)
        let (key, value) = pair.split_once('=').ok_or_else(|| match known_parameter(pair) {
            Some(name) => format!("query parameter {name:?} has no value"),
            None => "a query parameter has no value (an unencoded & in a password? encode it as %26)".to_string(),
        })?;
        let value = decode(value)?;
        match key {
            "host" => {
                if value.contains(',') {
                    return Err("several hosts are not supported".into());
                }
                host = Some(if value.starts_with('/') {
                    Host::Unix(PathBuf::from(value))
                } else {
                    Host::Tcp(tcp_host(value)?)
                });
            }
            "port" => port = Some(parse_port(&value)?),
            "user" => user = Some(value),
            "password" => password = Some(value),
            "dbname" => dbname = Some(value),
            "application_name" => application_name = Some(value),
            "connect_timeout" => {
                let s: u64 = value
                    .parse()
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or("connect_timeout must be a positive number of seconds")?;
                connect_timeout_ms = Some(s.saturating_mul(1000));
            }
            "sslmode" => match value.as_str() {
                "disable" | "allow" | "prefer" => {}
                _ => {
                    let shown =
                        if ["require", "verify-ca", "verify-full"].contains(&value.as_str()) { &value } else { "…" };
                    return Err(format!(
                        "sslmode={shown} is not supported: relay speaks plain TCP or a unix socket to PostgreSQL \
                         (use sslmode=disable, or a local TLS tunnel)"
                    ));
                }
            },
            _ => {
                return Err("an unknown query parameter (its name is not shown: it may be part of a password with an \
                     unencoded &; encode it as %26)"
                    .to_string());
            }
        }
    }
    let user = user.unwrap_or_else(|| DEFAULT_USER.to_string());
    if user.contains('\0') || password.as_deref().is_some_and(|p| p.contains('\0')) {
        return Err("user and password must not contain NUL".into());
    }
    Ok(DbParams {
        host: host.unwrap_or_else(|| Host::Unix(PathBuf::from(DEFAULT_SOCKET_DIR))),
        port: port.unwrap_or(DEFAULT_PORT),
        dbname: dbname.unwrap_or_else(|| user.clone()),
        user,
        password,
        application_name: application_name.unwrap_or_else(|| "relay".to_string()),
        connect_timeout_ms: connect_timeout_ms.unwrap_or(DEFAULT_CONNECT_TIMEOUT_MS),
    })
}

/// `host`, `host:port`, `[v6]`, `[v6]:port`, `:port` or empty.
fn split_host_port(text: &str) -> Result<(&str, Option<&str>), String> {
    if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or("unclosed [ in the host")?;
        return match after {
            "" => Ok((host, None)),
            _ => after.strip_prefix(':').map(|p| (host, Some(p))).ok_or_else(|| "junk after ]".to_string()),
        };
    }
    Ok(match text.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (text, None),
    })
}

fn parse_port(text: &str) -> Result<u16, String> {
    // (The text is not repeated: a malformed URL can put part of its password here.)
    text.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| "bad port (not a number from 1 to 65535)".to_string())
}

/// A TCP host as a name or an address (letters, digits, `.`, `-`, `_`, or an IPv6 address's
/// hex digits and `:`). Anything else is refused without being shown: in a URL that lost its
/// host, what stands there may be the tail of a password.
fn tcp_host(h: String) -> Result<String, String> {
    let ok = !h.is_empty() && h.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'));
    if ok { Ok(h) } else { Err("bad host name (not shown: it may be part of a password)".to_string()) }
}

/// `name`, when it is a query parameter relay knows.
fn known_parameter(name: &str) -> Option<&'static str> {
    ["host", "port", "user", "password", "dbname", "application_name", "connect_timeout", "sslmode"]
        .into_iter()
        .find(|k| *k == name)
}

/// Strict percent-decoding: a `%` must start a valid escape, and the result must be UTF-8.
fn decode(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            let b = hex.and_then(|h| u8::from_str_radix(h, 16).ok()).ok_or("bad %-escape")?;
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "a %-escape does not decode to UTF-8".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(url: &str, expected: Result<&str, ()>) {
        let got = parse(url)
            .map(|p| format!("{p} pw={:?} app={} ct={}", p.password, p.application_name, p.connect_timeout_ms));
        match expected {
            Ok(text) => assert_eq!(got.as_deref(), Ok(text), "{url}"),
            Err(()) => assert!(got.is_err(), "{url} should be refused, got {got:?}"),
        }
    }

    #[test]
    fn urls() {
        let table: &[(&str, Result<&str, ()>)] = &[
            ("postgres://", Ok("postgres@/var/run/postgresql:5432/postgres pw=None app=relay ct=5000")),
            (
                "postgresql://u:p%40ss@db.example:6543/relay",
                Ok("u@db.example:6543/relay pw=Some(\"p@ss\") app=relay ct=5000"),
            ),
            (
                "postgres://u@127.0.0.1/x?application_name=n1&connect_timeout=2",
                Ok("u@127.0.0.1:5432/x pw=None app=n1 ct=2000"),
            ),
            ("postgres://[::1]:7/d", Ok("postgres@[::1]:7/d pw=None app=relay ct=5000")),
            ("postgres://%2Ftmp%2Fpg:5433/d", Ok("postgres@/tmp/pg:5433/d pw=None app=relay ct=5000")),
            ("postgres:///d?host=/tmp/s&port=9&user=me", Ok("me@/tmp/s:9/d pw=None app=relay ct=5000")),
            ("postgres://h/d?host=%2Frun%2Fpg", Ok("postgres@/run/pg:5432/d pw=None app=relay ct=5000")),
            (
                "postgres://h/?sslmode=disable&password=s",
                Ok("postgres@h:5432/postgres pw=Some(\"s\") app=relay ct=5000"),
            ),
            ("mysql://h/d", Err(())),
            ("http://h/d", Err(())),
            ("postgres://h/d?sslmode=require", Err(())),
            ("postgres://h/d?sslmode=verify-full", Err(())),
            ("postgres://h:0/d", Err(())),
            ("postgres://h:99999/d", Err(())),
            ("postgres://h:x/d", Err(())),
            ("postgres://a,b/d", Err(())),
            ("postgres://h/d?frob=1", Err(())),
            ("postgres://h/d?port", Err(())),
            ("postgres://%zz/d", Err(())),
            ("postgres://h/%ff", Err(())),
            ("postgres://[::1/d", Err(())),
            ("postgres://h/d?connect_timeout=0", Err(())),
        ];
        for (url, expected) in table {
            check(url, *expected);
        }
    }

    #[test]
    fn passwords_are_never_shown() {
        let url = "postgres://u:hunter2@h/d?password=hunter3";
        let p = parse(url).expect("valid");
        assert!(!format!("{p} {p:?}").contains("hunter"));
        let r = redact(url);
        assert!(!r.contains("hunter"), "{r}");
        assert_eq!(r, "postgres://… (not shown: it may hold a password)", "(two passwords: ambiguous)");
        assert_eq!(redact("postgres://u:hunter2@h:99999/d"), "postgres://u:***@h:99999/d");
        assert_eq!(redact("postgres://u@h/d"), "postgres://u@h/d");
        assert_eq!(redact("postgres://h:5432/d"), "postgres://h:5432/d");
        assert_eq!(redact("postgres://h:x/d"), "postgres://… (not shown: it may hold a password)");
        assert_eq!(p.socket_path(), None);
        let p = parse("postgres:///d?host=/tmp/x&port=7").expect("valid");
        assert_eq!(p.socket_path(), Some(PathBuf::from("/tmp/x/.s.PGSQL.7")));
    }

    #[test]
    fn passwords_with_unencoded_delimiters_are_passwords() {
        // Issue 19: `postgres://u:Secr3t/x@h/d` was read as host `u`, port `Secr3t/x`…, and
        // the error said `bad port "Secr3t"`.
        for pw in ["Secr3t/x", "Secr3t?x", "Secr3t#x", "Secr3t@x", "Se:cr3t", "Secr3t%zz", "/?#@"] {
            let url = format!("postgres://u:{pw}@db.example:6543/relay?application_name=n");
            let p = parse(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(p.password.as_deref(), Some(pw), "{url}");
            assert_eq!(format!("{p}"), "u@db.example:6543/relay", "{url}");
            let r = redact(&url);
            assert!(!r.contains("Secr3t") && !r.contains("cr3t"), "{r}");
        }
        // A password in the query may hold an `@` too.
        let p = parse("postgres://h/d?password=Secr3t@x").expect("a query's password");
        assert_eq!((p.password.as_deref(), format!("{p}").as_str()), (Some("Secr3t@x"), "postgres@h:5432/d"));
        assert!(!redact("postgres://h/d?password=Secr3t@x").contains("Secr3t"));
        // However a URL is malformed, its error and its redacted form never show the password.
        for url in [
            "postgres://u:Secr3t/x@h:notaport/d",
            "postgres://u:Secr3t/x@h/d?frob=1",
            "postgres://u:Secr3t/x@a,b/d",
            "postgres://u:Secr3t/x@[::1/d",
            "postgres://u:Secr3t?@h/%ff",
            "mysql://u:Secr3t@h/d",
            "u:Secr3t@h/d",
            // (Found by fuzz/fuzz_targets/database_url.rs: a password in the query with an
            // unencoded `&`, whose second half was named as a parameter.)
            "postgres://u@h/d?password=ab&Secr3t",
            "postgres://u@h/d?password=ab&Secr3t=1",
            "postgres://u@h/d?password=ab&port=Secr3t",
            "postgres://u@h/d?password=ab&sslmode=Secr3t",
            // (Found by a hostile probe: a URL without its host.)
            "postgres://relay:Secr3t",
            "postgres://relay:Pa55:Secr3t",
            "postgres://relay:Secr3t/x",
            "postgres://r2:Secr3t/a?b#c@Secr3t&f",
        ] {
            let e = parse(url).expect_err(url);
            assert!(!e.contains("Secr3t"), "{url}: {e}");
            let r = redact(url);
            assert!(!r.contains("Secr3t"), "{url}: {r}");
        }
    }
}
