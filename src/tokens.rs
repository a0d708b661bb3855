//! The scoped-token registry (`TOKEN_STORE`) and the `relay token create|list|revoke` CLI.
//!
//! The registry is a JSON file that names every token ever issued by its `jti`, with its name,
//! kinds and times. It holds no token material: a token is only ever printed once, by `create`.
//!
//! Writers (the CLI) take an exclusive `flock` on `<store>.lock`, re-read the file, change it and
//! replace it atomically (temp file in the same directory, fsync, rename, fsync of the
//! directory), so two invocations that race both land and a reader never sees half a file.
//!
//! The server side is [`RegistryView`]: on each scoped-token request it `stat`s the file (cheap)
//! and re-reads it only when its identity (device, inode, size, mtime, ctime) changed, with a cap
//! on the bytes it will read. A missing, oversized, unreadable or malformed registry refuses every
//! JWT (fail closed). This module never sees a socket; the JWT math is in `jwt`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::os::unix::io::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::{Deserialize, Serialize};

use crate::config::{TokenConfig, parse_duration_ms};
use crate::jwt::{self, Claims};
use crate::log::Level;
use crate::timefmt::{parse_rfc3339_ms, rfc3339_ms};

/// Largest registry file read, by the server or the CLI. Bigger counts as unreadable. At about
/// 250 bytes a token this is some 60 000 tokens.
pub const MAX_REGISTRY_BYTES: u64 = 16 * 1024 * 1024;

/// Longest token name, and longest kind name, accepted by `create`.
const MAX_NAME_BYTES: usize = 200;

/// The latest `expires` `create` accepts (9999-12-31T23:59:59Z), so times stay RFC 3339.
const MAX_EXP_S: u64 = 253_402_300_799;

const REGISTRY_VERSION: u32 = 1;

// ---------------------------------------------------------------------------------------------
// The file format.

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    pub version: u32,
    pub tokens: Vec<Record>,
}

impl Default for Registry {
    fn default() -> Registry {
        Registry { version: REGISTRY_VERSION, tokens: Vec::new() }
    }
}

/// One issued token. Times are RFC 3339 UTC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub jti: String,
    pub name: String,
    pub kinds: Vec<String>,
    pub created_at: String,
    pub expires_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Active,
    Revoked,
    Expired,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Active => "active",
            Status::Revoked => "revoked",
            Status::Expired => "expired",
        }
    }
}

impl Record {
    /// Revoked wins over expired; an `expires_at` that does not parse counts as expired.
    pub fn status(&self, now_ms: u64) -> Status {
        if self.revoked_at.is_some() {
            Status::Revoked
        } else if parse_rfc3339_ms(&self.expires_at).map_or(true, |exp| exp <= now_ms) {
            Status::Expired
        } else {
            Status::Active
        }
    }
}

/// Parses registry bytes. The version must be one this build understands.
pub fn parse_registry(bytes: &[u8]) -> Result<Registry, String> {
    let registry: Registry = serde_json::from_slice(bytes).map_err(|e| format!("not a token registry: {e}"))?;
    if registry.version != REGISTRY_VERSION {
        return Err(format!("registry version {} is not supported (expected {REGISTRY_VERSION})", registry.version));
    }
    Ok(registry)
}

// ---------------------------------------------------------------------------------------------
// The server's view.

/// What the registry says about a `jti`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Active,
    Revoked,
    Unknown,
    /// The registry is missing or unreadable: refuse (fail closed).
    Unavailable,
    /// The file changed and its new version is being read off the loop: ask again once
    /// [`RegistryView::poll_loaded`] installed it.
    Pending,
}

impl Lookup {
    pub fn as_str(self) -> &'static str {
        match self {
            Lookup::Active => "active",
            Lookup::Revoked => "revoked",
            Lookup::Unknown => "unknown_jti",
            Lookup::Unavailable => "registry_unavailable",
            Lookup::Pending => "registry_loading",
        }
    }
}

/// Identifies one version of the file without reading it. The CLI replaces the file by rename,
/// so each version is a new inode; size and the nanosecond times catch in-place edits too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_s: i64,
    mtime_ns: i64,
    ctime_s: i64,
    ctime_ns: i64,
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_s: m.mtime(),
            mtime_ns: m.mtime_nsec(),
            ctime_s: m.ctime(),
            ctime_ns: m.ctime_nsec(),
        }
    }
}

#[derive(Debug)]
enum Loaded {
    /// jti → revoked.
    Ready(HashMap<String, bool>),
    Unavailable(String),
}

/// The server's cached copy of the registry, refreshed when the file changes.
#[derive(Debug)]
pub struct RegistryView {
    path: PathBuf,
    /// The version `loaded` came from; `None` when the file could not even be `stat`ed.
    stamp: Option<Stamp>,
    loaded: Loaded,
    /// `false` until the first refresh, so the first state is always logged.
    refreshed: bool,
    /// With a loader, a changed file is read on its thread ([`RegistryView::check`]).
    loader: Option<Loader>,
}

/// The helper thread that reads and parses a changed registry (up to 16 MiB) off the loop.
struct Loader {
    requests: std::sync::mpsc::Sender<()>,
    results: std::sync::mpsc::Receiver<(Option<Stamp>, Loaded)>,
    /// A read was asked for and its answer has not been installed yet.
    in_flight: bool,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader").field("in_flight", &self.in_flight).finish()
    }
}

/// Reads the registry now: (the stamp of what was read, what it says).
fn load_view(path: &Path) -> (Option<Stamp>, Loaded) {
    match read_bounded(path) {
        // The stamp of what was actually read (the file may have been replaced after a stat).
        Ok((bytes, read_stamp)) => match parse_registry(&bytes) {
            Ok(registry) => {
                let mut map = HashMap::with_capacity(registry.tokens.len());
                for r in registry.tokens {
                    // A duplicated jti counts as revoked if any copy is.
                    *map.entry(r.jti).or_insert(false) |= r.revoked_at.is_some();
                }
                (Some(read_stamp), Loaded::Ready(map))
            }
            Err(e) => (Some(read_stamp), Loaded::Unavailable(e)),
        },
        Err(e) => (std::fs::metadata(path).ok().map(|m| Stamp::of(&m)), Loaded::Unavailable(e)),
    }
}

impl RegistryView {
    pub fn new(path: &Path) -> RegistryView {
        RegistryView {
            path: path.to_path_buf(),
            stamp: None,
            loaded: Loaded::Unavailable("not read yet".into()),
            refreshed: false,
            loader: None,
        }
    }

    /// Starts the helper thread that re-reads the file when it changes; `wake` is called when
    /// a new version is ready for [`RegistryView::poll_loaded`].
    pub fn start_loader(&mut self, wake: std::sync::Arc<dyn Fn() + Send + Sync>) -> io::Result<()> {
        let (req_tx, req_rx) = std::sync::mpsc::channel::<()>();
        let (res_tx, res_rx) = std::sync::mpsc::channel();
        let path = self.path.clone();
        std::thread::Builder::new().name("relay-tokens".into()).spawn(move || {
            while req_rx.recv().is_ok() {
                // Requests that queued up meanwhile are answered by this one read.
                while req_rx.try_recv().is_ok() {}
                if res_tx.send(load_view(&path)).is_err() {
                    return;
                }
                wake();
            }
        })?;
        self.loader = Some(Loader { requests: req_tx, results: res_rx, in_flight: false });
        Ok(())
    }

    /// Looks a `jti` up without reading the file on this thread: one `stat`; when the file
    /// changed, the loader reads it and the answer is [`Lookup::Pending`] until
    /// [`RegistryView::poll_loaded`] installed the new version (so a revoke or a new token is
    /// in force for the first request that can see it). Without a loader, as [`Self::lookup`].
    pub fn check(&mut self, jti: &str) -> Lookup {
        if self.loader.is_none() {
            return self.lookup(jti);
        }
        match std::fs::metadata(&self.path) {
            Err(e) => {
                // Missing: fail closed at once, nothing to read.
                if self.stamp.is_some() || !self.refreshed {
                    self.set(None, Loaded::Unavailable(format!("cannot stat: {e}")));
                }
            }
            Ok(m) if self.refreshed && self.stamp == Some(Stamp::of(&m)) => {}
            Ok(_) => {
                if let Some(loader) = &mut self.loader
                    && !loader.in_flight
                {
                    loader.in_flight = loader.requests.send(()).is_ok();
                }
                return Lookup::Pending;
            }
        }
        self.answer(jti)
    }

    /// Installs what the loader read. `true` if a new version was installed (requests that
    /// got [`Lookup::Pending`] may ask again).
    pub fn poll_loaded(&mut self) -> bool {
        let mut latest = None;
        if let Some(loader) = &mut self.loader {
            while let Ok(result) = loader.results.try_recv() {
                latest = Some(result);
            }
            if latest.is_some() {
                loader.in_flight = false;
            }
        }
        let Some((stamp, loaded)) = latest else { return false };
        self.set(stamp, loaded);
        true
    }

    fn answer(&self, jti: &str) -> Lookup {
        match &self.loaded {
            Loaded::Unavailable(_) => Lookup::Unavailable,
            Loaded::Ready(map) => match map.get(jti) {
                Some(false) => Lookup::Active,
                Some(true) => Lookup::Revoked,
                None => Lookup::Unknown,
            },
        }
    }

    /// Looks a `jti` up in the current version of the file.
    pub fn lookup(&mut self, jti: &str) -> Lookup {
        self.refresh();
        self.answer(jti)
    }

    /// One `stat`; a bounded read and parse only when the file changed.
    pub fn refresh(&mut self) {
        let stamp = match std::fs::metadata(&self.path) {
            Ok(m) => Stamp::of(&m),
            Err(e) => {
                if self.stamp.is_some() || !self.refreshed {
                    self.set(None, Loaded::Unavailable(format!("cannot stat: {e}")));
                }
                return;
            }
        };
        if self.refreshed && self.stamp == Some(stamp) {
            return;
        }
        let (read_stamp, loaded) = load_view(&self.path);
        self.set(Some(read_stamp.unwrap_or(stamp)), loaded);
    }

    fn set(&mut self, stamp: Option<Stamp>, loaded: Loaded) {
        let path = self.path.display();
        match &loaded {
            Loaded::Ready(map) => crate::log!(Level::Info, "token registry loaded", path = path, tokens = map.len()),
            Loaded::Unavailable(why) => crate::log!(
                Level::Warn,
                "token registry unavailable: every scoped token is refused",
                path = path,
                error = why
            ),
        }
        self.stamp = stamp;
        self.loaded = loaded;
        self.refreshed = true;
    }
}

/// Reads a regular file of at most [`MAX_REGISTRY_BYTES`]. `O_NONBLOCK` so that a FIFO put in
/// the file's place cannot block the caller; the type is checked on the opened descriptor.
fn read_bounded(path: &Path) -> Result<(Vec<u8>, Stamp), String> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot open: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot stat: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.size() > MAX_REGISTRY_BYTES {
        return Err(format!("larger than {MAX_REGISTRY_BYTES} bytes"));
    }
    let mut bytes = Vec::with_capacity(meta.size() as usize);
    file.take(MAX_REGISTRY_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_REGISTRY_BYTES {
        return Err(format!("larger than {MAX_REGISTRY_BYTES} bytes"));
    }
    Ok((bytes, Stamp::of(&meta)))
}

// ---------------------------------------------------------------------------------------------
// Writing: lock, re-read, replace.

/// `<store>.lock` beside the registry. It is never deleted: removing a lock file while another
/// process waits on it would let a third one lock a different inode.
fn lock_path(store: &Path) -> PathBuf {
    let mut name = store.file_name().map(|n| n.to_os_string()).unwrap_or_else(|| "relay-tokens.json".into());
    name.push(".lock");
    store.with_file_name(name)
}

/// An exclusive lock on the registry, released when dropped (the descriptor closes).
struct WriteLock {
    _file: File,
}

fn lock(store: &Path) -> io::Result<WriteLock> {
    let path = lock_path(store);
    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path)?;
    loop {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        if rc == 0 {
            return Ok(WriteLock { _file: file });
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// The registry as the CLI sees it: a missing file is an empty registry; anything else that
/// cannot be read or parsed is an error (never silently overwritten).
fn load(store: &Path) -> Result<Registry, String> {
    match std::fs::metadata(store) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Registry::default()),
        _ => {}
    }
    let (bytes, _) = read_bounded(store).map_err(|e| format!("{}: {e}", store.display()))?;
    parse_registry(&bytes).map_err(|e| format!("{}: {e}", store.display()))
}

fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Replaces `path` with `bytes` atomically: a reader sees the old file or the new one, and
/// after a crash the file is one or the other.
fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = dir_of(path);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), uuid::Uuid::new_v4().simple()));
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(0o644).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        // The rename itself is durable only once the directory is synced.
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Lock, load, change, write. `change` returns what to report, or an error that leaves the
/// file untouched.
fn modify<T>(store: &Path, change: impl FnOnce(&mut Registry) -> Result<(T, bool), CliError>) -> Result<T, CliError> {
    let _lock =
        lock(store).map_err(|e| CliError::Failed(format!("cannot lock {}: {e}", lock_path(store).display())))?;
    let mut registry = load(store).map_err(CliError::Failed)?;
    let (out, changed) = change(&mut registry)?;
    if changed {
        let mut bytes = serde_json::to_vec_pretty(&registry)
            .map_err(|e| CliError::Failed(format!("cannot encode the registry: {e}")))?;
        bytes.push(b'\n');
        write_atomic(store, &bytes).map_err(|e| CliError::Failed(format!("cannot write {}: {e}", store.display())))?;
    }
    Ok(out)
}

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
    fn exit_code(&self) -> u8 {
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
struct CreateRequest {
    name: String,
    kinds: Vec<String>,
    ttl_ms: u64,
    json: bool,
}

fn parse_create(args: &[String]) -> Result<CreateRequest, CliError> {
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
        Some(db) => crate::pg::tokens::insert(db, &record).map_err(CliError::Failed)?,
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
            Registry { version: REGISTRY_VERSION, tokens: crate::pg::tokens::load(db).map_err(CliError::Failed)? }
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
        use crate::pg::tokens::Revoked;
        let message = match crate::pg::tokens::revoke(db, jti, now_ms).map_err(CliError::Failed)? {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system temp dir, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!("relay-tokens-{tag}-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const SECRET: &str = "0123456789abcdef0123456789abcdef";
    const NOW_MS: u64 = 1_800_000_000_000;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn cli(store: &Path, line: &str, now_ms: u64) -> (Result<(), CliError>, String) {
        let mut out = String::new();
        let cfg = || Ok(TokenConfig { secret: Some(SECRET.into()), store: store.to_path_buf(), database: None });
        let r = run(&args(line), cfg, now_ms, &mut out);
        (r, out)
    }

    fn check_create(line: &str, expected: Result<CreateRequest, ()>) {
        assert_eq!(parse_create(&args(line)).map_err(|_| ()), expected, "parse_create({line:?})");
    }

    #[test]
    fn create_arguments() {
        let req = |name: &str, kinds: &[&str], ttl_ms, json| CreateRequest {
            name: name.into(),
            kinds: kinds.iter().map(|k| k.to_string()).collect(),
            ttl_ms,
            json,
        };
        let table: Vec<(&str, Result<CreateRequest, ()>)> = vec![
            ("--name a --kinds http,file --ttl 720h", Ok(req("a", &["http", "file"], 2_592_000_000, false))),
            ("--json --ttl=1s --kinds=http --name=b", Ok(req("b", &["http"], 1_000, true))),
            ("--name a --kinds http,http,file --ttl 1s", Ok(req("a", &["http", "file"], 1_000, false))),
            ("--name a --kinds http", Err(())),
            ("--kinds http --ttl 1s", Err(())),
            ("--name a --ttl 1s", Err(())),
            ("--name a --kinds http --ttl", Err(())),
            ("--name a --kinds http --ttl 0s", Err(())),
            ("--name a --kinds http --ttl soon", Err(())),
            ("--name a --kinds http, --ttl 1s", Err(())),
            ("--name a --kinds ,http --ttl 1s", Err(())),
            ("--name a --name b --kinds http --ttl 1s", Err(())),
            ("--name a --kinds http --ttl 1s --color", Err(())),
            ("--name a --kinds http --ttl 1s extra", Err(())),
            ("--json=yes --name a --kinds http --ttl 1s", Err(())),
        ];
        for (line, expected) in table {
            check_create(line, expected);
        }
    }

    #[test]
    fn status_table() {
        let rec = |expires_at: &str, revoked_at: Option<&str>| Record {
            jti: "j".into(),
            name: "n".into(),
            kinds: vec![],
            created_at: rfc3339_ms(0),
            expires_at: expires_at.into(),
            revoked_at: revoked_at.map(String::from),
        };
        let later = rfc3339_ms(NOW_MS + 1);
        let now = rfc3339_ms(NOW_MS);
        for (r, expected) in [
            (rec(&later, None), Status::Active),
            (rec(&now, None), Status::Expired),
            (rec(&later, Some(&now)), Status::Revoked),
            (rec(&now, Some(&now)), Status::Revoked),
            (rec("garbage", None), Status::Expired),
        ] {
            assert_eq!(r.status(NOW_MS), expected, "{r:?}");
        }
    }

    #[test]
    fn create_list_revoke_and_the_view() {
        let dir = TempDir::new("cli");
        let store = dir.0.join("tokens.json");
        let mut view = RegistryView::new(&store);
        assert_eq!(view.lookup("x"), Lookup::Unavailable, "missing registry fails closed");

        let (r, out) = cli(&store, "create --name billing --kinds http,file --ttl 1h", NOW_MS);
        assert_eq!(r, Ok(()));
        let fields: HashMap<&str, &str> = out.lines().filter_map(|l| l.split_once(": ")).collect();
        let jti = fields["jti"];
        assert_eq!(fields["name"], "billing");
        assert_eq!(fields["kinds"], "http,file");
        assert_eq!(fields["expires"], rfc3339_ms(NOW_MS + 3_600_000));
        let claims = jwt::verify(SECRET.as_bytes(), fields["token"], NOW_MS).expect("the printed token verifies");
        assert_eq!((claims.jti.as_str(), claims.kinds.len()), (jti, 2));
        let on_disk = std::fs::read_to_string(&store).expect("registry");
        assert!(!on_disk.contains(fields["token"]), "the registry holds no token material");
        assert!(!on_disk.contains(SECRET));

        assert_eq!(view.lookup(jti), Lookup::Active);
        assert_eq!(view.lookup("other"), Lookup::Unknown);

        let (r, out) = cli(&store, "list", NOW_MS);
        assert_eq!(r, Ok(()));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert!(lines[0].starts_with("JTI") && lines[0].contains("STATUS"), "{out}");
        assert!(lines[1].starts_with(jti) && lines[1].contains(" active "), "{out}");

        let (r, _) = cli(&store, &format!("revoke {jti}"), NOW_MS + 1);
        assert_eq!(r, Ok(()));
        assert_eq!(view.lookup(jti), Lookup::Revoked, "a revoke is seen without a restart");
        let (r, out) = cli(&store, &format!("revoke {jti}"), NOW_MS + 2);
        assert_eq!(r, Ok(()));
        assert!(out.starts_with("already revoked"), "{out}");
        let (r, _) = cli(&store, "revoke no-such-jti", NOW_MS);
        assert!(matches!(r, Err(CliError::Failed(_))), "{r:?}");

        let (r, out) = cli(&store, "list --json", NOW_MS + 3);
        assert_eq!(r, Ok(()));
        let v: serde_json::Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v[0]["status"], "revoked");
        assert_eq!(v[0]["revoked_at"], rfc3339_ms(NOW_MS + 1));
        assert_eq!(v[0]["kinds"], serde_json::json!(["http", "file"]));

        let (_, out) = cli(&store, "list", NOW_MS + 3_600_000);
        assert!(out.contains(" revoked "), "revoked wins over expired: {out}");

        // Corrupt, oversized or deleted: fail closed; the CLI refuses to overwrite a corrupt file.
        std::fs::write(&store, b"{not json").expect("write");
        assert_eq!(view.lookup(jti), Lookup::Unavailable);
        let (r, _) = cli(&store, "create --name x --kinds http --ttl 1h", NOW_MS);
        assert!(matches!(r, Err(CliError::Failed(_))), "{r:?}");
        assert_eq!(std::fs::read(&store).expect("read"), b"{not json");
        std::fs::remove_file(&store).expect("rm");
        assert_eq!(view.lookup(jti), Lookup::Unavailable);
        let file = File::create(&store).expect("create");
        file.set_len(MAX_REGISTRY_BYTES + 1).expect("grow");
        assert_eq!(view.lookup(jti), Lookup::Unavailable, "oversized registry");
    }

    #[test]
    fn cli_errors_and_exit_codes() {
        let dir = TempDir::new("errors");
        let store = dir.0.join("tokens.json");
        let table: &[(&str, u8)] =
            &[("", 2), ("frobnicate", 2), ("revoke", 2), ("revoke a b", 2), ("list --all", 2), ("revoke nope", 1)];
        for (line, code) in table {
            let (r, _) = cli(&store, line, NOW_MS);
            assert_eq!(r.map_err(|e| e.exit_code()), Err(*code), "relay token {line}");
        }
        let (r, out) = cli(&store, "create --help", NOW_MS);
        assert_eq!(r, Ok(()));
        assert!(out.contains("relay token create"));

        let mut out = String::new();
        let none = || Ok(TokenConfig { secret: None, store: store.clone(), database: None });
        let r = run(&args("list"), none, NOW_MS, &mut out);
        assert_eq!(r.map_err(|e| e.exit_code()), Err(2), "no TOKEN_SECRET");
        let long_name = format!("--name {} --kinds http --ttl 1h", "n".repeat(MAX_NAME_BYTES + 1));
        assert!(matches!(parse_create(&args(&long_name)), Err(CliError::Usage(_))));
        let many_kinds: Vec<String> = (0..400).map(|i| format!("kind{i}")).collect();
        let (r, _) = cli(&store, &format!("create --name a --kinds {} --ttl 1h", many_kinds.join(",")), NOW_MS);
        assert!(matches!(r, Err(CliError::Usage(_))), "a token over MAX_TOKEN_BYTES is refused: {r:?}");
        assert!(!store.exists(), "nothing was written");
    }

    #[test]
    fn lock_file_sits_beside_the_store() {
        assert_eq!(lock_path(Path::new("/var/lib/relay/t.json")), PathBuf::from("/var/lib/relay/t.json.lock"));
        assert_eq!(lock_path(Path::new("t.json")), PathBuf::from("t.json.lock"));
        assert_eq!(dir_of(Path::new("t.json")), Path::new("."));
    }
}
