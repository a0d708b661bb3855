//! The journal's threads. The writer takes every batch the loop queued since its last write,
//! appends them, `fdatasync`s once, publishes the durable sequence number and wakes the loop
//! (group commit). The preparer fills the next segment file with zeros ahead of time, so that
//! appends overwrite blocks that exist and a sync carries no change of the file's size (one I/O
//! instead of two). The reader answers the loop's reads of records of tasks that left memory,
//! so a `GET` never waits behind a sync. The loop never touches the journal's files.
//!
//! A full disk is not fatal (SPEC §7): a write that fails for want of space or quota, or a
//! segment that cannot be made, leaves the records queued here, in order, and sets
//! [`Shared::full`]; the writer tries again every [`RETRY_MS`] (positional writes: a retry
//! rewrites the same bytes at the same offsets) and clears it once they are durable. A failed
//! `fdatasync` stays fatal: after one the page cache can no longer be trusted.
//!
//! Segments are deleted strictly oldest first, each only once the records that replaced it
//! are durable; a deletion that fails stops every newer one until a retry succeeds (deleting a
//! newer segment first could bring an older one's stale records back at the next replay).

use std::collections::{BTreeMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::codec;
use super::replay::segment_path;
use crate::log::Level;

pub type Wake = Arc<dyn Fn() + Send + Sync>;

/// What one loop turn hands the writer.
#[derive(Default)]
pub struct Batch {
    /// Bytes to append, in order, each to the end of its segment (a new segment number means
    /// a new file).
    pub chunks: Vec<(u32, Vec<u8>)>,
    /// Every record up to this sequence number is in this batch or an earlier one.
    pub lsn: u64,
    /// Segments nothing needs any more, oldest first: removed once this batch is durable.
    pub deletes: Vec<u32>,
    /// The size each segment started in this batch is closed at (its file of zeros is
    /// prepared, or written ahead, up to that size).
    pub opens: Vec<(u32, u64)>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.deletes.is_empty() && self.opens.is_empty()
    }
}

pub enum Msg {
    Batch(Batch),
    /// Prepare a file of zeros of this size for the next segment.
    Prepare(u64),
    /// Write what is queued, sync, and end the thread.
    Stop,
}

/// What the writer publishes.
#[derive(Default)]
pub struct Shared {
    pub durable_lsn: AtomicU64,
    /// Bytes made durable so far (the loop's backpressure compares it with what it sent).
    pub durable_bytes: AtomicU64,
    pub syncs: AtomicU64,
    /// A write or sync failed in a way relay cannot recover from: it must exit.
    pub failed: AtomicBool,
    /// The journal cannot write now (no space, quota, or the next segment cannot be made):
    /// what must be written is refused, and the writer retries by itself.
    pub full: AtomicBool,
    /// Segment deletions waiting for a retry after a failure.
    pub deletes_failing: AtomicU64,
}

/// The segment the previous run ended in: this run appends to it (a restart adds no file).
pub struct Resume {
    pub seg: u32,
    /// Where its records end.
    pub at: u64,
}

/// How often a write the disk refused, a probe for space, or a failed deletion is tried again.
pub const RETRY_MS: u64 = 250;

/// How far ahead of its records a segment that was not prepared is filled with zeros.
pub(super) const ZERO_STEP: u64 = 256 << 10;

/// The zero-filled file the preparer makes, and its name while it is being written.
pub(super) const PREPARED: &str = "next-segment.prepared";
pub(super) const PREPARING: &str = "next-segment.preparing";

/// A small write that tells a full disk from one with room again (removed at once).
const SPACE_PROBE: &str = ".space-probe";
const SPACE_PROBE_BYTES: usize = 64 << 10;

/// The preparer makes its file only if at least this much stays free beside it (and as much
/// again as the file): zeros written ahead must never be what fills the disk.
const PREPARE_HEADROOM_BYTES: u64 = 4 << 20;

pub fn start_writer(
    dir: PathBuf,
    shared: Arc<Shared>,
    wake: Wake,
    resume: Option<Resume>,
    prepared_bytes: u64,
) -> io::Result<(Sender<Msg>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = channel();
    let prep = Preparer::start(&dir, prepared_bytes)?;
    let full = shared.full.load(Ordering::Acquire);
    let durable_lsn = shared.durable_lsn.load(Ordering::Acquire);
    let handle = std::thread::Builder::new().name("relay-journal".into()).spawn(move || {
        let mut w = Writer {
            dir,
            shared,
            wake,
            prep,
            head: None,
            resume,
            caps: BTreeMap::new(),
            queue: VecDeque::new(),
            queued_lsn: durable_lsn,
            durable_lsn,
            unsynced_bytes: 0,
            dir_dirty: false,
            deletes: VecDeque::new(),
            delete_failures: 0,
            zeros: Vec::new(),
            full,
        };
        w.run(rx);
    })?;
    Ok((tx, handle))
}

/// Is this error the disk (or the user's quota) being out of space?
fn no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Free bytes for relay's user on the filesystem of `dir` (`None` if it cannot be told).
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct; the path is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// The writer's handle on the preparer thread. Dropping it stops the thread and waits for it:
/// a preparer that outlived its journal could go on writing zeros into a file the next journal
/// on the same directory has taken as a segment (tests restart journals in one process).
struct Preparer {
    /// Sizes to prepare a file of (`None` once stopping).
    tx: Option<Sender<u64>>,
    /// The size of the prepared file that is ready (0: none). Held while the file is renamed
    /// or removed, so the writer and the preparer never act on it at once.
    ready: Arc<Mutex<u64>>,
    /// Set when stopping: a file being prepared is abandoned (and removed) between steps.
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

/// How a preparation ended.
enum Prepared {
    Done,
    Stopped,
    /// Not made: too little free space (nothing of it is left behind).
    NoRoom,
}

impl Preparer {
    /// `ready_bytes`: the size of the prepared file a previous run left (0: none).
    fn start(dir: &Path, ready_bytes: u64) -> io::Result<Preparer> {
        let _ = fs::remove_file(dir.join(PREPARING));
        let ready = Arc::new(Mutex::new(ready_bytes));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = channel::<u64>();
        let (dir, done, stopping) = (dir.to_path_buf(), ready.clone(), stop.clone());
        let handle = std::thread::Builder::new().name("relay-journal-prep".into()).spawn(move || {
            let mut low_on_space = false;
            while let Ok(mut bytes) = rx.recv() {
                // Only the newest request counts.
                while let Ok(b) = rx.try_recv() {
                    bytes = b;
                }
                {
                    let Ok(mut ready) = done.lock() else { return };
                    if *ready == bytes {
                        continue;
                    }
                    // One prepared file at most, of the size the next segment will have.
                    if *ready != 0 {
                        let _ = fs::remove_file(dir.join(PREPARED));
                        *ready = 0;
                    }
                }
                match prepare(&dir, bytes, &stopping, &done) {
                    Ok(Prepared::Done) => low_on_space = false,
                    Ok(Prepared::Stopped) => return,
                    Ok(Prepared::NoRoom) => {
                        if !low_on_space {
                            low_on_space = true;
                            crate::log!(
                                Level::Warn,
                                "journal: the disk is low on space; the next segment is not prepared ahead",
                                segment_bytes = bytes
                            );
                        }
                    }
                    // Not fatal: the segment then gets its zeros from the writer.
                    Err(e) => crate::log!(Level::Warn, "journal: cannot prepare the next segment", error = e),
                }
            }
        })?;
        Ok(Preparer { tx: Some(tx), ready, stop, handle: Some(handle) })
    }

    /// Takes the prepared file for segment `path` if there is one of `bytes`.
    fn take(&self, dir: &Path, path: &Path, bytes: u64) -> bool {
        let Ok(mut ready) = self.ready.lock() else { return false };
        if bytes == 0 || *ready != bytes {
            return false;
        }
        *ready = 0;
        fs::rename(dir.join(PREPARED), path).is_ok()
    }

    /// Asks for a prepared file of `bytes`.
    fn request(&self, bytes: u64) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(bytes);
        }
    }
}

impl Drop for Preparer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.tx = None;
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// Writes `bytes` of zeros to a new file, syncs it, and names it [`PREPARED`]. Checks the free
/// space before and between steps; whatever stops it early (a stop, an error, the disk running
/// low) removes the unfinished file, so no [`PREPARING`] is ever left behind.
fn prepare(dir: &Path, bytes: u64, stop: &AtomicBool, ready: &Mutex<u64>) -> io::Result<Prepared> {
    let room = |dir: &Path, left: u64| {
        free_bytes(dir).is_none_or(|free| free >= left.saturating_add(bytes).saturating_add(PREPARE_HEADROOM_BYTES))
    };
    if !room(dir, bytes) {
        return Ok(Prepared::NoRoom);
    }
    let tmp = dir.join(PREPARING);
    let written = (|| -> io::Result<Prepared> {
        let mut file = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        // In small synced steps: a burst of 64 MiB for the disk would delay the journal's own
        // syncs.
        let zeros = vec![0u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            if stop.load(Ordering::Acquire) {
                return Ok(Prepared::Stopped);
            }
            if !room(dir, left) {
                return Ok(Prepared::NoRoom);
            }
            let n = left.min(zeros.len() as u64) as usize;
            file.write_all(&zeros[..n])?;
            file.sync_data()?;
            left -= n as u64;
        }
        Ok(Prepared::Done)
    })();
    match written {
        Ok(Prepared::Done) => {
            let Ok(mut ready) = ready.lock() else { return Ok(Prepared::Stopped) };
            if let Err(e) = fs::rename(&tmp, dir.join(PREPARED)) {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
            *ready = bytes;
            Ok(Prepared::Done)
        }
        other => {
            let _ = fs::remove_file(&tmp);
            other
        }
    }
}

/// The segment being appended to.
struct Head {
    seg: u32,
    file: File,
    /// Where its next byte goes.
    at: u64,
    /// Where the zeros written ahead of its records end.
    zeroed: u64,
    /// The size it is closed at (0: unknown).
    cap: u64,
}

/// Why a write did not happen.
enum Failure {
    /// No space, no quota, or the segment cannot be made: retried.
    Full(io::Error),
    /// Anything else (a failed sync above all): relay stops.
    Fatal(io::Error),
}

/// A write's error: out of space is [`Failure::Full`], anything else fatal.
fn write_failure(e: io::Error) -> Failure {
    if no_space(&e) { Failure::Full(e) } else { Failure::Fatal(e) }
}

struct Writer {
    dir: PathBuf,
    shared: Arc<Shared>,
    wake: Wake,
    prep: Preparer,
    head: Option<Head>,
    /// The previous run's last segment, until this run's first write opens it.
    resume: Option<Resume>,
    /// Sizes of segments announced but not opened yet.
    caps: BTreeMap<u32, u64>,
    /// Records not yet written, in order (written chunks leave from the front).
    queue: VecDeque<(u32, Vec<u8>)>,
    /// Every record up to here is queued or written.
    queued_lsn: u64,
    durable_lsn: u64,
    /// Bytes written since the last sync (published as durable with it).
    unsynced_bytes: u64,
    /// A segment was made since the directory was last synced.
    dir_dirty: bool,
    /// Segments to delete, oldest first, each once records up to its sequence number are
    /// durable.
    deletes: VecDeque<(u32, u64)>,
    /// Failed tries of the oldest deletion.
    delete_failures: u64,
    /// Zeros to write ahead of the records of a segment that was not prepared.
    zeros: Vec<u8>,
    /// The last write was refused for want of space (see [`Shared::full`]).
    full: bool,
}

impl Writer {
    fn run(&mut self, rx: Receiver<Msg>) {
        loop {
            // Work waiting for a retry (a refused write, a failed deletion) wakes the thread by
            // itself; otherwise it sleeps until the loop sends something.
            let waiting = self.full || !self.deletes.is_empty();
            let mut next = if waiting {
                match rx.recv_timeout(Duration::from_millis(RETRY_MS)) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => Some(Msg::Stop),
                }
            } else {
                Some(rx.recv().unwrap_or(Msg::Stop))
            };
            // Group commit: everything queued meanwhile goes into the same write and sync.
            let mut stop = false;
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Batch(b) => self.take(b),
                    Msg::Prepare(n) => self.prep.request(n),
                    Msg::Stop => {
                        stop = true;
                        break;
                    }
                }
                next = match rx.try_recv() {
                    Ok(m) => Some(m),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => Some(Msg::Stop),
                };
            }
            if let Err(e) = self.step() {
                crate::log!(Level::Error, "journal write failed: relay cannot keep its promise and stops", error = e);
                self.shared.failed.store(true, Ordering::SeqCst);
                (self.wake)();
                return;
            }
            if stop {
                if !self.queue.is_empty() {
                    // Nobody saw these records' answers (they wait for durability): nothing a
                    // caller was shown is lost, but relay cannot say it flushed.
                    crate::log!(
                        Level::Error,
                        "journal: records could not be written before the stop (the disk is full); their answers were never sent",
                        bytes = self.queue.iter().map(|(_, b)| b.len()).sum::<usize>()
                    );
                    self.shared.failed.store(true, Ordering::SeqCst);
                }
                return;
            }
        }
    }

    fn take(&mut self, b: Batch) {
        for (seg, cap) in b.opens {
            match self.head.as_mut() {
                Some(h) if h.seg == seg => h.cap = cap,
                _ => {
                    self.caps.insert(seg, cap);
                }
            }
        }
        self.queue.extend(b.chunks);
        self.queued_lsn = self.queued_lsn.max(b.lsn);
        // A deletion waits for everything queued before it: the records that made the segment
        // unneeded may be in an earlier batch still waiting for the disk.
        for seg in b.deletes {
            self.deletes.push_back((seg, self.queued_lsn));
        }
    }

    /// Writes what is queued (or, full with nothing queued, looks for space), then deletes
    /// what may go. `Err` is fatal.
    fn step(&mut self) -> io::Result<()> {
        if !self.queue.is_empty() {
            match self.write_queue() {
                Ok(()) => {
                    self.durable_lsn = self.queued_lsn;
                    self.shared.durable_lsn.fetch_max(self.queued_lsn, Ordering::SeqCst);
                    self.shared.durable_bytes.fetch_add(std::mem::take(&mut self.unsynced_bytes), Ordering::SeqCst);
                    self.shared.syncs.fetch_add(1, Ordering::Relaxed);
                    self.set_full(None);
                    (self.wake)();
                }
                Err(Failure::Full(e)) => self.set_full(Some(e)),
                Err(Failure::Fatal(e)) => return Err(e),
            }
        } else if self.full {
            self.durable_lsn = self.queued_lsn;
            if self.probe_space().is_ok() {
                self.set_full(None);
            }
        } else {
            // (Batches of deletions alone.)
            self.durable_lsn = self.queued_lsn;
        }
        self.delete_due()
    }

    /// Records the journal's state; the loop learns a change at once.
    fn set_full(&mut self, why: Option<io::Error>) {
        let full = why.is_some();
        if full == self.full {
            return;
        }
        self.full = full;
        self.shared.full.store(full, Ordering::SeqCst);
        match why {
            Some(e) => crate::log!(
                Level::Error,
                "journal: cannot write (no space, quota, or no new segment); writes answer 503 until it can",
                data_dir = self.dir.display(),
                error = e
            ),
            None => crate::log!(Level::Info, "journal: writing again", data_dir = self.dir.display()),
        }
        (self.wake)();
    }

    /// Writes every queued chunk and syncs. On a refusal the chunks not written stay queued and
    /// the next try starts where this one stopped.
    fn write_queue(&mut self) -> Result<(), Failure> {
        while let Some(&(seg, _)) = self.queue.front() {
            if self.head.as_ref().is_none_or(|h| h.seg != seg) {
                self.close_head().map_err(Failure::Fatal)?;
                self.open_head(seg)?;
            }
            let Some(head) = self.head.as_mut() else { return Err(Failure::Fatal(io::ErrorKind::NotFound.into())) };
            let n = self.queue.iter().take_while(|(s, _)| *s == seg).count();
            let slices: Vec<&[u8]> = self.queue.iter().take(n).map(|(_, b)| b.as_slice()).collect();
            let written = pwrite_all_vectored(&head.file, &slices, head.at).map_err(write_failure)?;
            head.at += written;
            self.unsynced_bytes += written;
            self.queue.drain(..n);
            self.zero_ahead()?;
        }
        if let Some(head) = &self.head {
            head.file.sync_data().map_err(Failure::Fatal)?;
        }
        if self.dir_dirty {
            File::open(&self.dir).and_then(|d| d.sync_all()).map_err(Failure::Fatal)?;
            self.dir_dirty = false;
        }
        Ok(())
    }

    /// The head is complete: its zeros past the records are cut off (replay then reads only
    /// records, and the space is free again) and it is made durable before the next one starts.
    fn close_head(&mut self) -> io::Result<()> {
        let Some(head) = self.head.take() else { return Ok(()) };
        if head.zeroed > head.at {
            // (An optimisation only: a segment that keeps its zeros replays the same.)
            let _ = head.file.set_len(head.at);
        }
        head.file.sync_data()
    }

    /// Opens segment `seg` for appending: the previous run's last segment, or a new one (the
    /// prepared file of zeros if there is one of its size). Any failure to make the file is
    /// [`Failure::Full`]: the next segment cannot be made, which is retried.
    fn open_head(&mut self, seg: u32) -> Result<(), Failure> {
        let path = segment_path(&self.dir, seg);
        let cap = self.caps.get(&seg).copied().unwrap_or(0);
        if let Some(resume) = self.resume.as_ref().filter(|r| r.seg == seg) {
            let file = OpenOptions::new().write(true).open(&path).map_err(Failure::Full)?;
            let len = file.metadata().map_err(Failure::Fatal)?.len();
            self.head = Some(Head { seg, file, at: resume.at, zeroed: len.max(resume.at), cap });
            self.resume = None;
        } else {
            let _ = self.prep.take(&self.dir, &path, cap);
            let file = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)
                .map_err(Failure::Full)?;
            self.dir_dirty = true;
            file.write_all_at(&codec::segment_header(), 0).map_err(write_failure)?;
            // (A prepared file is its whole size of zeros already; so is one a failed try of
            // this segment had renamed into place.)
            let len = file.metadata().map_err(Failure::Fatal)?.len();
            let start = codec::HEADER_BYTES as u64;
            self.head = Some(Head { seg, file, at: start, zeroed: len.max(start), cap });
        }
        self.caps.remove(&seg);
        Ok(())
    }

    /// A segment that was not prepared (the first after a start, or the preparer fell behind
    /// or had no room) gets zeros written ahead of its records in steps: a sync that does not
    /// change the file's size or allocate blocks costs about half. Never past the segment's
    /// size; a disk too full for them just goes without.
    fn zero_ahead(&mut self) -> Result<(), Failure> {
        let Some(head) = self.head.as_mut() else { return Ok(()) };
        if head.at <= head.zeroed {
            return Ok(());
        }
        let cap = if head.cap == 0 { u64::MAX } else { head.cap.max(head.at) };
        let end = (head.at.next_multiple_of(ZERO_STEP) + ZERO_STEP).min(cap);
        if end <= head.at {
            return Ok(());
        }
        // (Allocated on first use, not a static: a static array of zeros would be stored in
        // the binary, 512 KiB of it.)
        if self.zeros.is_empty() {
            self.zeros = vec![0; 2 * ZERO_STEP as usize];
        }
        match head.file.write_all_at(&self.zeros[..(end - head.at) as usize], head.at) {
            Ok(()) => head.zeroed = end,
            Err(e) if no_space(&e) => {}
            Err(e) => return Err(Failure::Fatal(e)),
        }
        Ok(())
    }

    /// Is there room to write again? A small file written and removed (a statfs would not see
    /// a quota).
    fn probe_space(&mut self) -> io::Result<()> {
        if self.zeros.len() < SPACE_PROBE_BYTES {
            self.zeros = vec![0; 2 * ZERO_STEP as usize];
        }
        let path = self.dir.join(SPACE_PROBE);
        let written = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .and_then(|f| f.write_all_at(&self.zeros[..SPACE_PROBE_BYTES], 0));
        let _ = fs::remove_file(&path);
        written
    }

    /// Deletes segments, oldest first, whose replacing records are durable; stops at the first
    /// that cannot be deleted (retried in [`RETRY_MS`]). `Err` (the directory's sync) is fatal.
    fn delete_due(&mut self) -> io::Result<()> {
        let mut deleted = false;
        while let Some(&(seg, lsn)) = self.deletes.front() {
            if lsn > self.durable_lsn {
                break;
            }
            match fs::remove_file(segment_path(&self.dir, seg)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    self.delete_failures += 1;
                    if self.delete_failures == 1 {
                        crate::log!(
                            Level::Warn,
                            "journal: cannot remove a compacted segment; it and every newer one wait for a retry",
                            segment = seg,
                            error = e
                        );
                    }
                    self.shared.deletes_failing.store(self.deletes.len() as u64, Ordering::Relaxed);
                    break;
                }
            }
            if self.delete_failures > 0 {
                crate::log!(
                    Level::Info,
                    "journal: removed a compacted segment after failed tries",
                    segment = seg,
                    tries = self.delete_failures + 1
                );
                self.delete_failures = 0;
                self.shared.deletes_failing.store(0, Ordering::Relaxed);
            }
            self.deletes.pop_front();
            deleted = true;
        }
        if deleted {
            // A deletion that a crash forgets would only bring back records already superseded;
            // syncing the directory keeps the journal's size what compaction made it.
            File::open(&self.dir)?.sync_all()?;
        }
        Ok(())
    }
}

/// Writes `parts` in order at `offset` (few syscalls: `pwritev`). Returns the bytes written.
fn pwrite_all_vectored(file: &File, parts: &[&[u8]], offset: u64) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let (mut idx, mut skip, mut done) = (0, 0, 0usize);
    while idx < parts.len() {
        let iov: Vec<libc::iovec> = std::iter::once(&parts[idx][skip..])
            .chain(parts[idx + 1..].iter().copied())
            .take(512)
            .map(|p| libc::iovec { iov_base: p.as_ptr() as *mut libc::c_void, iov_len: p.len() })
            .collect();
        // SAFETY: every iovec points into a slice that outlives the call; the fd is open.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                (offset + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 && done < total {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let mut n = n as usize;
        done += n;
        while idx < parts.len() && n >= parts[idx].len() - skip {
            n -= parts[idx].len() - skip;
            idx += 1;
            skip = 0;
        }
        skip += n;
    }
    Ok(total as u64)
}

/// A read of one record for the loop.
pub struct ReadJob {
    pub token: u64,
    pub seg: u32,
    pub off: u32,
    pub len: u32,
}

pub struct ReadDone {
    pub token: u64,
    pub result: Result<Vec<u8>, String>,
}

pub fn start_reader(dir: PathBuf, wake: Wake) -> io::Result<(Sender<ReadJob>, Receiver<ReadDone>)> {
    let (jobs_tx, jobs_rx) = channel::<ReadJob>();
    let (done_tx, done_rx) = channel::<ReadDone>();
    std::thread::Builder::new().name("relay-journal-read".into()).spawn(move || {
        while let Ok(job) = jobs_rx.recv() {
            let result = read_at(&dir, &job).map_err(|e| e.to_string());
            if done_tx.send(ReadDone { token: job.token, result }).is_err() {
                return;
            }
            wake();
        }
    })?;
    Ok((jobs_tx, done_rx))
}

fn read_at(dir: &Path, job: &ReadJob) -> io::Result<Vec<u8>> {
    let file = File::open(segment_path(dir, job.seg))?;
    let mut buf = vec![0u8; job.len as usize];
    file.read_exact_at(&mut buf, u64::from(job.off))?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A preparer in the middle of a 64 MiB file is gone once its handle is dropped: left
    /// running, it could write zeros into a file a later journal on the same directory took
    /// as a segment (the dispatch model's restarts found records overwritten that way). It
    /// leaves neither a prepared file nor the unfinished one behind.
    #[test]
    fn a_dropped_preparer_has_stopped_and_leaves_no_prepared_file() {
        let dir = std::env::temp_dir().join(format!("relay-journal-prep-{}", uuid::Uuid::new_v4().simple()));
        fs::create_dir_all(&dir).expect("dir");
        let prep = Preparer::start(&dir, 0).expect("preparer");
        let ready = prep.ready.clone();
        prep.request(64 << 20);
        drop(prep);
        // The thread held the other reference to `ready` for as long as it ran.
        assert_eq!(Arc::strong_count(&ready), 1, "the preparer thread outlived its handle");
        assert!(!dir.join(PREPARED).exists(), "a file was prepared after the stop");
        assert!(!dir.join(PREPARING).exists(), "the unfinished file was left behind");
        assert_eq!(*ready.lock().expect("lock"), 0);
        let _ = fs::remove_dir_all(&dir);
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("relay-journal-{tag}-{}", uuid::Uuid::new_v4().simple()));
        fs::create_dir_all(&dir).expect("dir");
        dir
    }

    fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "never: {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// A segment whose deletion failed was skipped while newer ones went, so a restart read its
    /// stale records back (tasks answered done came back pending). The writer now stops at it,
    /// retries it, and only then deletes the newer ones. (A directory in its place makes the
    /// deletion fail without root.)
    #[test]
    fn a_deletion_that_fails_holds_every_newer_one_back_until_a_retry_succeeds() {
        let dir = scratch("delete");
        fs::create_dir_all(segment_path(&dir, 1).join("in-the-way")).expect("a directory in the way");
        for n in [2, 3] {
            fs::write(segment_path(&dir, n), codec::segment_header()).expect("segment");
        }
        let shared = Arc::new(Shared::default());
        let (tx, handle) = start_writer(dir.clone(), shared.clone(), Arc::new(|| {}), None, 0).expect("writer");
        tx.send(Msg::Batch(Batch { deletes: vec![1, 2, 3], ..Batch::default() })).expect("send");
        until("the deletion failed", || shared.deletes_failing.load(Ordering::Relaxed) == 3);
        assert!(segment_path(&dir, 2).exists() && segment_path(&dir, 3).exists(), "a newer segment went first");
        fs::remove_dir_all(segment_path(&dir, 1)).expect("out of the way");
        until("the retry deleted them", || !segment_path(&dir, 2).exists() && !segment_path(&dir, 3).exists());
        assert_eq!(shared.deletes_failing.load(Ordering::Relaxed), 0);
        tx.send(Msg::Stop).expect("stop");
        handle.join().expect("writer");
        let _ = fs::remove_dir_all(&dir);
    }

    /// A write the disk refuses (ENOSPC: here the segment is `/dev/full`) is not fatal: the
    /// journal says it is full, nothing becomes durable, and once the disk takes writes again
    /// the same records are written and made durable by the writer's own retry.
    #[test]
    fn a_write_the_disk_refuses_is_retried_until_it_is_durable() {
        let dir = scratch("full");
        let seg = segment_path(&dir, 1);
        std::os::unix::fs::symlink("/dev/full", &seg).expect("symlink");
        let shared = Arc::new(Shared::default());
        let (tx, handle) = start_writer(dir.clone(), shared.clone(), Arc::new(|| {}), None, 0).expect("writer");
        let mut frame = Vec::new();
        codec::put_frame(&mut frame, 1, codec::RecordType::Forget, |out| codec::put_forget(out, 7));
        let batch = Batch { chunks: vec![(1, frame.clone())], lsn: 1, opens: vec![(1, 1 << 20)], deletes: Vec::new() };
        tx.send(Msg::Batch(batch)).expect("send");
        until("the journal is full", || shared.full.load(Ordering::Acquire));
        assert_eq!(shared.durable_lsn.load(Ordering::Acquire), 0, "durable on a disk that refused it");
        assert!(!shared.failed.load(Ordering::Acquire), "a full disk is not fatal");
        fs::remove_file(&seg).expect("the disk takes writes again");
        until("the record is durable", || shared.durable_lsn.load(Ordering::Acquire) == 1);
        assert!(!shared.full.load(Ordering::Acquire));
        tx.send(Msg::Stop).expect("stop");
        handle.join().expect("writer");
        let bytes = fs::read(&seg).expect("segment");
        assert!(codec::check_header(&bytes).is_ok());
        assert_eq!(&bytes[codec::HEADER_BYTES..codec::HEADER_BYTES + frame.len()], frame.as_slice());
        let _ = fs::remove_dir_all(&dir);
    }

    /// A request for another size replaces the prepared file (never two files of zeros), and
    /// one larger than the free space allows is not made at all.
    #[test]
    fn the_preparer_keeps_one_file_of_the_size_asked_and_never_fills_the_disk() {
        let dir = std::env::temp_dir().join(format!("relay-journal-prep-{}", uuid::Uuid::new_v4().simple()));
        fs::create_dir_all(&dir).expect("dir");
        let prep = Preparer::start(&dir, 0).expect("preparer");
        let ready_is = |n: u64| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while *prep.ready.lock().expect("lock") != n {
                assert!(std::time::Instant::now() < deadline, "no prepared file of {n} bytes");
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        prep.request(1 << 20);
        ready_is(1 << 20);
        assert_eq!(fs::metadata(dir.join(PREPARED)).expect("prepared").len(), 1 << 20);
        prep.request(2 << 20);
        ready_is(2 << 20);
        assert_eq!(fs::metadata(dir.join(PREPARED)).expect("prepared").len(), 2 << 20);
        // More than the disk has: refused before a byte is written.
        let free = free_bytes(&dir).expect("statvfs");
        prep.request(free);
        ready_is(0);
        drop(prep);
        assert!(!dir.join(PREPARED).exists() && !dir.join(PREPARING).exists());
        let _ = fs::remove_dir_all(&dir);
    }
}
