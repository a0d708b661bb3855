//! The journal's threads. The writer takes every batch the loop queued since its last write,
//! appends them, `fdatasync`s once, publishes the durable sequence number and wakes the loop
//! (group commit). The preparer fills the next segment file with zeros ahead of time, so that
//! appends overwrite blocks that exist and a sync carries no change of the file's size (one I/O
//! instead of two). The reader answers the loop's reads of records of tasks that left memory,
//! so a `GET` never waits behind a sync. The loop never touches the journal's files.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};

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
    /// Segments nothing needs any more: removed once this batch is durable.
    pub deletes: Vec<u32>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.deletes.is_empty()
    }
}

pub enum Msg {
    Batch(Batch),
    /// Segments are this large: prepare the next one at this size.
    SegmentBytes(u64),
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
    /// A write or sync failed: the page cache can no longer be trusted; relay must exit.
    pub failed: AtomicBool,
}

pub fn start_writer(
    dir: PathBuf,
    shared: Arc<Shared>,
    wake: Wake,
) -> io::Result<(Sender<Msg>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = channel();
    let prep = Preparer::start(&dir)?;
    let handle = std::thread::Builder::new().name("relay-journal".into()).spawn(move || {
        let mut w = Writer { dir, head: None, shared, wake, prep, segment_bytes: 0, zeros: Vec::new() };
        w.run(rx);
    })?;
    Ok((tx, handle))
}

/// How far ahead of its records a segment that was not prepared is filled with zeros.
pub(super) const ZERO_STEP: u64 = 256 << 10;

/// The zero-filled file the preparer makes, and its name while it is being written.
const PREPARED: &str = "next-segment.prepared";
pub(super) const PREPARING: &str = "next-segment.preparing";

/// The writer's handle on the preparer thread. Dropping it stops the thread and waits for it:
/// a preparer that outlived its journal could go on writing zeros into a file the next journal
/// on the same directory has taken as a segment (tests restart journals in one process).
struct Preparer {
    /// Sizes to prepare a file of (`None` once stopping).
    tx: Option<Sender<u64>>,
    /// The size of the prepared file that is ready (0: none).
    ready: Arc<AtomicU64>,
    /// Set when stopping: a file being prepared is abandoned between steps.
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Preparer {
    fn start(dir: &Path) -> io::Result<Preparer> {
        let _ = fs::remove_file(dir.join(PREPARING));
        let ready = Arc::new(AtomicU64::new(fs::metadata(dir.join(PREPARED)).map_or(0, |m| m.len())));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = channel::<u64>();
        let (dir, done, stopping) = (dir.to_path_buf(), ready.clone(), stop.clone());
        let handle = std::thread::Builder::new().name("relay-journal-prep".into()).spawn(move || {
            while let Ok(bytes) = rx.recv() {
                if done.load(Ordering::Acquire) == bytes {
                    continue;
                }
                match prepare(&dir, bytes, &stopping) {
                    Ok(true) => done.store(bytes, Ordering::Release),
                    // Stopping: the unfinished file is removed at the next start.
                    Ok(false) => return,
                    // Not fatal: segments are then created empty and grow as before.
                    Err(e) => crate::log!(Level::Warn, "journal: cannot prepare the next segment", error = e),
                }
            }
        })?;
        Ok(Preparer { tx: Some(tx), ready, stop, handle: Some(handle) })
    }

    /// Takes the prepared file for segment `path` if there is one of `bytes`.
    fn take(&self, dir: &Path, path: &Path, bytes: u64) -> bool {
        if bytes == 0 || self.ready.load(Ordering::Acquire) != bytes {
            return false;
        }
        self.ready.store(0, Ordering::Release);
        let taken = fs::rename(dir.join(PREPARED), path).is_ok();
        self.request(bytes);
        taken
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

/// Writes `bytes` of zeros to a new file, syncs it, and names it [`PREPARED`]; `Ok(false)` when
/// `stop` was set before it was done.
fn prepare(dir: &Path, bytes: u64, stop: &AtomicBool) -> io::Result<bool> {
    let tmp = dir.join(PREPARING);
    let mut file = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    // In small synced steps: a burst of 64 MiB for the disk would delay the journal's own syncs.
    let zeros = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        if stop.load(Ordering::Acquire) {
            return Ok(false);
        }
        let n = left.min(zeros.len() as u64) as usize;
        file.write_all(&zeros[..n])?;
        file.sync_data()?;
        left -= n as u64;
    }
    fs::rename(&tmp, dir.join(PREPARED))?;
    Ok(true)
}

struct Writer {
    dir: PathBuf,
    /// The segment being appended to, where its next byte goes, and where the zeros written
    /// ahead of it end.
    head: Option<(u32, File, u64, u64)>,
    shared: Arc<Shared>,
    wake: Wake,
    prep: Preparer,
    segment_bytes: u64,
    /// Zeros to write ahead of the records of a segment that was not prepared.
    zeros: Vec<u8>,
}

impl Writer {
    fn run(&mut self, rx: Receiver<Msg>) {
        loop {
            let mut batches = Vec::new();
            let mut stop = false;
            match rx.recv() {
                Ok(Msg::Batch(b)) => batches.push(b),
                Ok(Msg::SegmentBytes(n)) => self.set_segment_bytes(n),
                Ok(Msg::Stop) | Err(_) => stop = true,
            }
            // Group commit: everything queued meanwhile goes into the same write and sync.
            while !stop {
                match rx.try_recv() {
                    Ok(Msg::Batch(b)) => batches.push(b),
                    Ok(Msg::SegmentBytes(n)) => self.set_segment_bytes(n),
                    Ok(Msg::Stop) => stop = true,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => stop = true,
                }
            }
            if !batches.is_empty()
                && let Err(e) = self.commit(&batches)
            {
                crate::log!(Level::Error, "journal write failed: relay cannot keep its promise and stops", error = e);
                self.shared.failed.store(true, Ordering::SeqCst);
                (self.wake)();
                return;
            }
            if stop {
                return;
            }
        }
    }

    fn set_segment_bytes(&mut self, bytes: u64) {
        self.segment_bytes = bytes;
        self.prep.request(bytes);
    }

    fn commit(&mut self, batches: &[Batch]) -> io::Result<()> {
        let mut dir_dirty = false;
        let mut bytes = 0u64;
        let mut i = 0;
        let chunks: Vec<&(u32, Vec<u8>)> = batches.iter().flat_map(|b| &b.chunks).collect();
        while i < chunks.len() {
            let seg = chunks[i].0;
            let mut j = i;
            while j < chunks.len() && chunks[j].0 == seg {
                j += 1;
            }
            if self.head.as_ref().is_none_or(|(s, ..)| *s != seg) {
                // The previous segment is complete: make it durable before moving on.
                if let Some((_, old, ..)) = self.head.take() {
                    old.sync_data()?;
                }
                // A new segment: the prepared file of zeros if there is one (replay stops at
                // the zeros after the last record), else an empty file.
                let path = segment_path(&self.dir, seg);
                let prepared = self.prep.take(&self.dir, &path, self.segment_bytes);
                let file = OpenOptions::new().write(true).create(true).truncate(false).mode(0o600).open(&path)?;
                file.write_all_at(&codec::segment_header(), 0)?;
                dir_dirty = true;
                let zeroed = if prepared { self.segment_bytes } else { codec::HEADER_BYTES as u64 };
                self.head = Some((seg, file, codec::HEADER_BYTES as u64, zeroed));
            }
            if let Some((_, file, at, zeroed)) = self.head.as_mut() {
                let mut slices: Vec<&[u8]> = chunks[i..j].iter().map(|c| c.1.as_slice()).collect();
                let n: u64 = slices.iter().map(|s| s.len() as u64).sum();
                // A segment that was not prepared (the first after a start, or the preparer
                // fell behind) gets zeros written ahead of its records in steps: a sync that
                // does not change the file's size or allocate blocks costs about half.
                let end = *at + n;
                // (Not past the segment's size: a small JOURNAL_SEGMENT_SIZE stays small.)
                let cap = if self.segment_bytes == 0 { u64::MAX } else { self.segment_bytes.max(end) };
                let ahead =
                    if end > *zeroed { (end.next_multiple_of(ZERO_STEP) + ZERO_STEP).min(cap) - end } else { 0 };
                if ahead > 0 {
                    // (Allocated on first use, not a static: a static array of zeros would be
                    // stored in the binary, 512 KiB of it.)
                    if self.zeros.is_empty() {
                        self.zeros = vec![0; 2 * ZERO_STEP as usize];
                    }
                    slices.push(&self.zeros[..ahead as usize]);
                }
                pwrite_all_vectored(file, &slices, *at)?;
                *zeroed = (*zeroed).max(end + ahead);
                *at = end;
                bytes += n;
            }
            i = j;
        }
        if let Some((_, file, ..)) = &self.head {
            file.sync_data()?;
        }
        if dir_dirty {
            File::open(&self.dir)?.sync_all()?;
        }
        let mut deleted = false;
        for seg in batches.iter().flat_map(|b| &b.deletes) {
            deleted = true;
            match fs::remove_file(segment_path(&self.dir, *seg)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    crate::log!(Level::Warn, "journal: cannot remove a compacted segment", segment = seg, error = e)
                }
            }
        }
        if deleted {
            // A deletion that a crash forgets would only bring back records already superseded;
            // syncing the directory keeps the journal's size what compaction made it.
            File::open(&self.dir)?.sync_all()?;
        }
        let lsn = batches.iter().map(|b| b.lsn).max().unwrap_or(0);
        self.shared.durable_lsn.fetch_max(lsn, Ordering::SeqCst);
        self.shared.durable_bytes.fetch_add(bytes, Ordering::SeqCst);
        self.shared.syncs.fetch_add(1, Ordering::Relaxed);
        (self.wake)();
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
    /// as a segment (the dispatch model's restarts found records overwritten that way).
    #[test]
    fn a_dropped_preparer_has_stopped_and_leaves_no_prepared_file() {
        let dir = std::env::temp_dir().join(format!("relay-journal-prep-{}", uuid::Uuid::new_v4().simple()));
        fs::create_dir_all(&dir).expect("dir");
        let prep = Preparer::start(&dir).expect("preparer");
        let ready = prep.ready.clone();
        prep.request(64 << 20);
        drop(prep);
        // The thread held the other reference to `ready` for as long as it ran.
        assert_eq!(Arc::strong_count(&ready), 1, "the preparer thread outlived its handle");
        assert!(!dir.join(PREPARED).exists(), "a file was prepared after the stop");
        assert_eq!(ready.load(Ordering::Acquire), 0);
        let _ = fs::remove_dir_all(&dir);
    }
}
