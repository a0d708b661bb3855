//! `relay token create|list|revoke`: the CLI over either registry (the file, or the database
//! with `DATABASE_URL`), with the same output formats.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use serde::Serialize;

use super::file::*;
use super::record::*;
use crate::config::{TokenConfig, parse_duration_ms};
use crate::jwt::{self, Claims};
use crate::timefmt::rfc3339_ms;

// ---------------------------------------------------------------------------------------------
// The CLI.

#[derive(Debug, PartialEq, Eq)]
pub enum CliError {
    /// Bad arguments (exit 2).
    Usage(String),
    /// Bad configuration (exit 2).
    Config(String),
    /// The command could not be carried out (exit 1).
    Failed(String),
}

impl CliError {
    pub(super) fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Config(_) => 2,
            CliError::Failed(_) => 1,
        }
    }
}

pub const HELP: &str = "\
relay token — manage scoped tokens (JWT HS256) for the task API.

Usage:
  relay token create --name NAME --kinds KIND[,KIND...] --ttl DURATION [--json]
  relay token list [--json]
  relay token revoke JTI
  relay token --help

create   issues a token that may submit, read and cancel only tasks whose payload.kind is one
         of KINDS, until now + DURATION (Go syntax: 90s, 12h, 720h). Prints jti, name, kinds,
         expires and the token itself (shown only this once; the registry keeps no copy).
list     shows every token: JTI NAME KINDS STATUS (active|revoked|expired) EXPIRES.
revoke   revokes a token by its jti; the server refuses it from its next request on.

Environment (the same values as the server's):
  TOKEN_SECRET   HS256 secret, at least 32 bytes (required)
  TOKEN_STORE    registry file (default relay-tokens.json)
  DATABASE_URL   cluster mode: the registry is the database's relay_tokens table instead
                 (TOKEN_STORE is not used); a revoke reaches every node within 1 s

Exit codes: 0 success, 1 failure (e.g. unknown jti), 2 usage or configuration error.
";

/// `relay token ...`: reads the environment and the clock, prints, returns the exit code.
pub fn main(args: &[String]) -> ExitCode {
    let mut out = String::new();
    let result = run(args, TokenConfig::from_env, crate::timefmt::wall_ms(), &mut out);
    print!("{out}");
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match &e {
                CliError::Usage(msg) => eprintln!("relay token: {msg}\n(see relay token --help)"),
                CliError::Config(msg) => eprintln!("relay token: invalid configuration: {msg}"),
                CliError::Failed(msg) => eprintln!("relay token: {msg}"),
            }
            ExitCode::from(e.exit_code())
        }
    }
}

/// Settings the commands need once the arguments parsed.
struct Ready {
    secret: Vec<u8>,
    store: PathBuf,
    /// `DATABASE_URL`: the registry is the database's `relay_tokens` table (cluster mode).
    database: Option<crate::pg::url::DbParams>,
}

fn ready(config: impl FnOnce() -> Result<TokenConfig, crate::config::ConfigError>) -> Result<Ready, CliError> {
    let cfg = config().map_err(|e| CliError::Config(e.to_string()))?;
    let Some(secret) = cfg.secret else {
        return Err(CliError::Config("TOKEN_SECRET is not set (the same secret as the server's)".into()));
    };
    Ok(Ready { secret: secret.into_bytes(), store: cfg.store, database: cfg.database })
}

/// The CLI without its side effects on the process: output goes to `out`.
pub fn run(
    args: &[String],
    config: impl FnOnce() -> Result<TokenConfig, crate::config::ConfigError>,
    now_ms: u64,
    out: &mut String,
) -> Result<(), CliError> {
    let (command, rest) = match args.split_first() {
        None => return Err(CliError::Usage("missing command: create, list or revoke".into())),
        Some((c, rest)) => (c.as_str(), rest),
    };
    if matches!(command, "-h" | "--help" | "help") || rest.iter().any(|a| a == "-h" || a == "--help") {
        out.push_str(HELP);
        return Ok(());
    }
    match command {
        "create" => {
            let req = parse_create(rest)?;
            create(&ready(config)?, &req, now_ms, out)
        }
        "list" => {
            let json = parse_flags_only(rest, "list")?;
            list(&ready(config)?, json, now_ms, out)
        }
        "revoke" => {
            let jti = match rest {
                [jti] if !jti.starts_with('-') => jti.as_str(),
                [] => return Err(CliError::Usage("revoke needs the token's jti".into())),
                _ => return Err(CliError::Usage("revoke takes exactly one argument, the token's jti".into())),
            };
            revoke(&ready(config)?, jti, now_ms, out)
        }
        other => Err(CliError::Usage(format!("unknown command {other:?} (create, list or revoke)"))),
    }
}

#[derive(Debug, PartialEq, Eq)]
pub(super) struct CreateRequest {
    pub(super) name: String,
    pub(super) kinds: Vec<String>,
    pub(super) ttl_ms: u64,
    pub(super) json: bool,
}

pub(super) fn parse_create(args: &[String]) -> Result<CreateRequest, CliError> {
    let usage = |m: String| CliError::Usage(m);
    let (mut name, mut kinds, mut ttl, mut json) = (None, None, None, false);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let slot = match flag {
            "--json" if inline.is_none() => {
                json = true;
                continue;
            }
            "--name" => &mut name,
            "--kinds" => &mut kinds,
            "--ttl" => &mut ttl,
            _ => return Err(usage(format!("create: unknown argument {arg:?}"))),
        };
        let value = match inline {
            Some(v) => v,
            None => it.next().cloned().ok_or_else(|| usage(format!("create: {flag} needs a value")))?,
        };
        if slot.replace(value).is_some() {
            return Err(usage(format!("create: {flag} given twice")));
        }
    }
    let name = name.ok_or_else(|| usage("create: --name is required".into()))?;
    let kinds = kinds.ok_or_else(|| usage("create: --kinds is required".into()))?;
    let ttl = ttl.ok_or_else(|| usage("create: --ttl is required (e.g. --ttl 720h)".into()))?;
    let name = name.trim().to_string();
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.chars().any(char::is_control) {
        return Err(usage(format!("create: --name must be 1 to {MAX_NAME_BYTES} bytes of printable text")));
    }
    let mut list: Vec<String> = Vec::new();
    for kind in kinds.split(',').map(str::trim) {
        if kind.is_empty() || kind.len() > MAX_NAME_BYTES || kind.chars().any(char::is_control) {
            return Err(usage(format!("create: --kinds must be a comma list of kind names (got {kinds:?})")));
        }
        if !list.iter().any(|k| k == kind) {
            list.push(kind.to_string());
        }
    }
    let ttl_ms = parse_duration_ms(&ttl).map_err(|e| usage(format!("create: --ttl {ttl:?}: {e}")))?;
    Ok(CreateRequest { name, kinds: list, ttl_ms, json })
}

/// Commands whose only option is `--json`.
fn parse_flags_only(args: &[String], command: &str) -> Result<bool, CliError> {
    let mut json = false;
    for arg in args {
        match arg.as_str() {
            "--json" if !json => json = true,
            _ => return Err(CliError::Usage(format!("{command}: unexpected argument {arg:?}"))),
        }
    }
    Ok(json)
}

fn create(ready: &Ready, req: &CreateRequest, now_ms: u64, out: &mut String) -> Result<(), CliError> {
    // At least the full TTL: round the expiry up to the next whole second.
    let exp_s = now_ms.saturating_add(req.ttl_ms).div_ceil(1000);
    if exp_s > MAX_EXP_S {
        return Err(CliError::Usage("create: --ttl reaches past the year 9999".into()));
    }
    let claims = Claims {
        jti: uuid::Uuid::new_v4().to_string(),
        name: req.name.clone(),
        kinds: req.kinds.clone(),
        iat: now_ms / 1000,
        exp: exp_s,
    };
    let token = jwt::sign(&ready.secret, &claims);
    if token.len() > jwt::MAX_TOKEN_BYTES {
        return Err(CliError::Usage(format!(
            "create: the token would be {} bytes, over the {} the server accepts; shorten --name or --kinds",
            token.len(),
            jwt::MAX_TOKEN_BYTES
        )));
    }
    let expires = rfc3339_ms(exp_s * 1000);
    let record = Record {
        jti: claims.jti.clone(),
        name: claims.name.clone(),
        kinds: claims.kinds.clone(),
        created_at: rfc3339_ms(now_ms),
        expires_at: expires.clone(),
        revoked_at: None,
    };
    match &ready.database {
        Some(db) => crate::tokens::pg::insert(db, &record).map_err(CliError::Failed)?,
        None => modify(&ready.store, |registry| {
            registry.tokens.push(record);
            Ok(((), true))
        })?,
    }
    if req.json {
        let v = CreatedJson {
            jti: &claims.jti,
            name: &claims.name,
            kinds: &claims.kinds,
            expires: &expires,
            token: &token,
        };
        let _ = writeln!(out, "{}", serde_json::to_string(&v).unwrap_or_default());
    } else {
        let _ = writeln!(out, "jti: {}", claims.jti);
        let _ = writeln!(out, "name: {}", claims.name);
        let _ = writeln!(out, "kinds: {}", claims.kinds.join(","));
        let _ = writeln!(out, "expires: {expires}");
        let _ = writeln!(out, "token: {token}");
    }
    Ok(())
}

/// `create --json`, keys in the order of the text output.
#[derive(Serialize)]
struct CreatedJson<'a> {
    jti: &'a str,
    name: &'a str,
    kinds: &'a [String],
    expires: &'a str,
    token: &'a str,
}

/// One element of `list --json`.
#[derive(Serialize)]
struct ListedJson<'a> {
    jti: &'a str,
    name: &'a str,
    kinds: &'a [String],
    status: &'static str,
    created_at: &'a str,
    expires_at: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    revoked_at: Option<&'a str>,
}

/// For the table: a hand-edited registry must not be able to move the terminal's cursor.
fn printable(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

fn list(ready: &Ready, json: bool, now_ms: u64, out: &mut String) -> Result<(), CliError> {
    let registry = match &ready.database {
        Some(db) => {
            Registry { version: REGISTRY_VERSION, tokens: crate::tokens::pg::load(db).map_err(CliError::Failed)? }
        }
        None => load(&ready.store).map_err(CliError::Failed)?,
    };
    if json {
        let items: Vec<ListedJson<'_>> = registry
            .tokens
            .iter()
            .map(|r| ListedJson {
                jti: &r.jti,
                name: &r.name,
                kinds: &r.kinds,
                status: r.status(now_ms).as_str(),
                created_at: &r.created_at,
                expires_at: &r.expires_at,
                revoked_at: r.revoked_at.as_deref(),
            })
            .collect();
        let _ = writeln!(out, "{}", serde_json::to_string(&items).unwrap_or_default());
        return Ok(());
    }
    let rows: Vec<[String; 5]> = registry
        .tokens
        .iter()
        .map(|r| {
            [
                printable(&r.jti),
                printable(&r.name),
                printable(&r.kinds.join(",")),
                r.status(now_ms).as_str().to_string(),
                printable(&r.expires_at),
            ]
        })
        .collect();
    let header = ["JTI", "NAME", "KINDS", "STATUS", "EXPIRES"].map(String::from);
    let mut widths = header.clone().map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    Ok(())
}

fn revoke(ready: &Ready, jti: &str, now_ms: u64, out: &mut String) -> Result<(), CliError> {
    if let Some(db) = &ready.database {
        use crate::tokens::pg::Revoked;
        let message = match crate::tokens::pg::revoke(db, jti, now_ms).map_err(CliError::Failed)? {
            Revoked::Now(at) => format!("revoked: {jti} (at {at})"),
            Revoked::Before(at) => format!("already revoked: {jti} (at {at})"),
            Revoked::Unknown => {
                return Err(CliError::Failed(format!("no token with jti {jti:?} in the database {db}")));
            }
        };
        let _ = writeln!(out, "{message}");
        return Ok(());
    }
    let message = modify(&ready.store, |registry| {
        let Some(record) = registry.tokens.iter_mut().find(|r| r.jti == jti) else {
            return Err(CliError::Failed(format!("no token with jti {jti:?} in {}", ready.store.display())));
        };
        if let Some(at) = &record.revoked_at {
            return Ok((format!("already revoked: {jti} (at {at})"), false));
        }
        let at = rfc3339_ms(now_ms);
        let msg = format!("revoked: {jti} (at {at})");
        record.revoked_at = Some(at);
        Ok((msg, true))
    })?;
    let _ = writeln!(out, "{message}");
    Ok(())
}
