//! The registry as a JSON file (`TOKEN_STORE`): the server's stat-checked view of it, read off
//! the loop when it changed, and the writers' lock, re-read and atomic replace.
//!
//! Writers (the CLI) take an exclusive `flock` on `<store>.lock`, re-read the file, change it and
//! replace it atomically (temp file in the same directory, fsync, rename, fsync of the
//! directory), so two invocations that race both land and a reader never sees half a file.
//!
//! The server side is [`RegistryView`]: on each scoped-token request it `stat`s the file (cheap)
//! and re-reads it only when its identity (device, inode, size, mtime, ctime) changed, with a cap
//! on the bytes it will read. A missing, oversized, unreadable or malformed registry refuses every
//! JWT (fail closed).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::os::unix::io::AsRawFd as _;
use std::path::{Path, PathBuf};

use super::cli::CliError;
use super::record::*;
use crate::log::Level;

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
pub(super) fn lock_path(store: &Path) -> PathBuf {
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
pub(super) fn load(store: &Path) -> Result<Registry, String> {
    match std::fs::metadata(store) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Registry::default()),
        _ => {}
    }
    let (bytes, _) = read_bounded(store).map_err(|e| format!("{}: {e}", store.display()))?;
    parse_registry(&bytes).map_err(|e| format!("{}: {e}", store.display()))
}

pub(super) fn dir_of(path: &Path) -> &Path {
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
pub(super) fn modify<T>(
    store: &Path,
    change: impl FnOnce(&mut Registry) -> Result<(T, bool), CliError>,
) -> Result<T, CliError> {
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
