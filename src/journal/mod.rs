//! The journal in DATA_DIR: an append-only log of task records that makes accepted tasks
//! survive a crash (SPEC §7).
//!
//! The loop side (this file) encodes records into the current turn's batch and keeps the
//! books: which segment every record went to, which segments tasks still need, when a
//! segment can go. It never touches a file: at the end of each turn the batch goes to the
//! writer thread (`thread`), which appends, syncs once and publishes the durable sequence
//! number; answers wait for it. Reads of tasks that left memory go to the reader thread.
//! Replay (`replay`) runs once at start, before the loop.
//!
//! Compaction: a task pins the segments holding the records it still needs (its last whole
//! record, and the attempt records after it). A segment nothing pins is deleted once the
//! records that replaced it are durable. A segment closed more than TASK_TTL ago can only be
//! pinned by tasks that are not finished (finished ones are forgotten by then): the core
//! writes those tasks again at the head, so the journal's size follows the live tasks plus one
//! TASK_TTL of history.
//!
//! A segment holding a `Forget` record goes only once every older segment has gone: an older
//! segment can still hold an earlier record of the forgotten task (its submit, say), which
//! replay would otherwise bring back to life. The writer keeps that order on disk too: a
//! deletion that fails holds every newer one back until it succeeds.
//!
//! Sizes follow the data: a new segment is as large as the journal's records (a power of two,
//! from [`MIN_SEGMENT_BYTES`] up to JOURNAL_SEGMENT_SIZE), a restart appends to the last
//! segment instead of starting one, and the next segment's file is prepared only once the
//! head is a quarter full. A journal of a few tasks is one small file, and replay reads about
//! as many bytes as there are records.
//!
//! A full disk (SPEC §7): [`Journal::writable`] says whether records can be written now; the
//! API refuses what must write while it is false, the core stops starting attempts, and
//! records that must be written anyway (results of attempts already running) wait in the
//! writer's queue, their answers held, until the writer gets them on disk.

pub mod codec;
pub mod crc;
pub mod replay;
pub mod thread;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, Sender};

use self::codec::{HEADER_BYTES, RecordType};
use self::replay::Replayed;
use self::thread::{Batch, Msg, ReadDone, ReadJob, Shared, Wake};
use crate::log::Level;
use crate::tasks::{Loc, Stored, Task, TaskId};

/// Segment files are closed and a new one started past this size (JOURNAL_SEGMENT_SIZE's
/// default): the size segments grow to.
pub const SEGMENT_BYTES: u64 = 64 << 20;

/// The size a journal's first segment starts at (or JOURNAL_SEGMENT_SIZE, if smaller).
pub const MIN_SEGMENT_BYTES: u64 = 1 << 20;

/// The size of a new segment for a journal holding `data_bytes` of records: as large as the
/// data (to the next power of two), within [`MIN_SEGMENT_BYTES`] and `max_bytes`. A small
/// journal takes little disk, a large one few files, and the zeros prepared ahead never
/// exceed about the data itself.
pub fn segment_size_for(data_bytes: u64, max_bytes: u64) -> u64 {
    data_bytes.max(1).checked_next_power_of_two().unwrap_or(u64::MAX).clamp(MIN_SEGMENT_BYTES.min(max_bytes), max_bytes)
}

/// How long records no answer waits on may be held back from the writer (ms): how much later
/// than at once they can become durable.
pub const HOLD_MS: u64 = 2;

/// Held-back records go to the writer at once past this many bytes.
const HOLD_BYTES: u64 = 256 << 10;

/// Why DATA_DIR cannot be used.
#[derive(Debug)]
pub enum OpenError {
    /// Not creatable, not writable, or locked by another relay: a configuration problem.
    Unusable(String),
    /// Reading the journal failed.
    Io(String),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::Unusable(m) | OpenError::Io(m) => f.write_str(m),
        }
    }
}

struct Segment {
    pins: u32,
    /// Bytes of its records (header included), as written or queued.
    bytes: u64,
    /// When it stopped being the head (monotonic ms; may be "before start" for replayed
    /// segments, hence signed).
    closed_ms: Option<i64>,
}

pub struct Journal {
    tx: Sender<Msg>,
    writer: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Shared>,
    reads: Sender<ReadJob>,
    read_done: Receiver<ReadDone>,
    /// Held for the process's life: the `flock` that keeps a second relay out of DATA_DIR.
    _lock: File,
    batch: Batch,
    batch_bytes: u64,
    /// The bytes of the last batch handed to the writer (at most [`HOLD_BYTES`]): the next
    /// batch's buffer starts that large, so a busy turn's records are not copied again and again
    /// as it doubles.
    last_batch_bytes: usize,
    /// Bytes handed to the writer so far.
    sent_bytes: u64,
    /// Every record up to here is handed to the writer.
    sent_lsn: u64,
    /// An answer waits on a record not yet handed to the writer.
    urgent: bool,
    /// Since when (the loop's clock) the records in `batch` are held back.
    held_since_ms: Option<u64>,
    next_lsn: u64,
    head: u32,
    /// The size the head segment is closed at.
    head_cap: u64,
    /// The size the next segment will have, fixed once its file was asked for.
    next_cap: Option<u64>,
    /// The newest segment whose size the writer was told.
    announced: u32,
    /// No segment number is left after the head (a planted name): nothing new is accepted.
    exhausted: bool,
    /// [`Journal::writable`] when the loop last asked ([`Journal::take_writable_again`]).
    was_writable: bool,
    segments: BTreeMap<u32, Segment>,
    /// JOURNAL_SEGMENT_SIZE: the largest a segment grows to.
    segment_bytes: u64,
    /// The loop's monotonic clock (ms), set each turn.
    pub now_ms: u64,
    pub records_written: u64,
    pub records_skipped_at_start: u64,
}

/// Creates DATA_DIR if needed (mode 0700; an existing one is made private too), takes its lock,
/// and checks that it is writable. Returns the lock and whether the disk is full (relay then
/// starts all the same and serves what it can: SPEC §7).
fn prepare_dir(dir: &Path) -> Result<(File, bool), OpenError> {
    let unusable = |what: &str, e: io::Error| OpenError::Unusable(format!("DATA_DIR={}: {what}: {e}", dir.display()));
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| unusable("cannot create it", e))?;
    let meta = fs::metadata(dir).map_err(|e| unusable("cannot read it", e))?;
    if !meta.is_dir() {
        return Err(OpenError::Unusable(format!("DATA_DIR={}: not a directory", dir.display())));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && me != 0 {
        return Err(OpenError::Unusable(format!(
            "DATA_DIR={}: owned by another user (uid {}); relay keeps its journal private",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        // Tasks carry callers' payloads and results: as BLOB_DIR, no one else may read them.
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| unusable("cannot make it private", e))?;
    }
    let lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(dir.join("LOCK"))
        .map_err(|e| unusable("not writable", e))?;
    // SAFETY: flock on a file descriptor we own.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(OpenError::Unusable(format!(
            "DATA_DIR={}: in use by another relay process (its LOCK is held)",
            dir.display()
        )));
    }
    // A block of data, not an empty file: a full disk still makes empty files.
    let probe = dir.join(".write-probe");
    let written = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&probe)
        .and_then(|f| f.write_all_at(&[0u8; 4096], 0).map(|()| f));
    let full = match written {
        Ok(f) => {
            f.sync_all().map_err(|e| unusable("not writable", e))?;
            false
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
            crate::log!(
                Level::Error,
                "DATA_DIR is full: relay starts, and writes answer 503 until there is room",
                data_dir = dir.display(),
                error = e
            );
            true
        }
        Err(e) => {
            let _ = fs::remove_file(&probe);
            return Err(unusable("not writable", e));
        }
    };
    let _ = fs::remove_file(&probe);
    Ok((lock, full))
}

/// Keeps the prepared file a previous run left if it can serve as a segment of `bytes`
/// (shortened to that size: zeros all the same) and removes it otherwise. Returns its size
/// (0: none). Before the loop runs, as replay.
fn reuse_prepared(dir: &Path, bytes: u64) -> u64 {
    let path = dir.join(thread::PREPARED);
    let Ok(meta) = fs::symlink_metadata(&path) else { return 0 };
    if meta.is_file() && meta.len() >= bytes {
        let shortened =
            OpenOptions::new().write(true).open(&path).and_then(|f| f.set_len(bytes).and_then(|()| f.sync_all()));
        if shortened.is_ok() {
            return bytes;
        }
    }
    let _ = fs::remove_file(&path);
    0
}

impl Journal {
    /// Opens DATA_DIR: lock, replay (keeping at most `memory_budget_bytes` of finished tasks in
    /// memory), start the threads. Writing continues in a new segment.
    pub fn open(
        dir: &Path,
        memory_budget_bytes: usize,
        now_wall_ms: u64,
        wake: Wake,
    ) -> Result<(Journal, Replayed), OpenError> {
        let (lock, full) = prepare_dir(dir)?;
        let replayed = replay::replay(dir, memory_budget_bytes)
            .map_err(|e| OpenError::Io(format!("cannot read the journal in {}: {e}", dir.display())))?;
        let next = replayed.max_segment.checked_add(1).ok_or_else(|| {
            OpenError::Io(format!("{}: no segment number is left after {}", dir.display(), replayed.max_segment))
        })?;
        let data: u64 = replayed.segments.iter().map(|s| s.bytes).sum();
        let size = segment_size_for(data, SEGMENT_BYTES);
        // A restart goes on in the last segment while it has room: a new file per restart
        // would keep a TASK_TTL of nearly empty files (and their zeros) around.
        let resume = replayed.segments.last().filter(|s| s.appendable && s.num > 0).and_then(|s| {
            let cap = size.max(s.file_bytes).min(SEGMENT_BYTES);
            (s.bytes < cap).then_some((s.num, s.bytes, cap))
        });
        let (head, head_cap, prepared_for) = match resume {
            Some((num, _, cap)) => (num, cap, size),
            None => (next, size, size),
        };
        let prepared = reuse_prepared(dir, prepared_for);
        let shared = Arc::new(Shared::default());
        shared.durable_lsn.store(replayed.next_lsn.saturating_sub(1), Ordering::SeqCst);
        shared.full.store(full, Ordering::SeqCst);
        let resume_at = resume.map(|(seg, at, _)| thread::Resume { seg, at });
        let (tx, writer) = thread::start_writer(dir.to_path_buf(), shared.clone(), wake.clone(), resume_at, prepared)
            .map_err(|e| OpenError::Io(format!("cannot start the journal thread: {e}")))?;
        let (reads, read_done) = thread::start_reader(PathBuf::from(dir), wake)
            .map_err(|e| OpenError::Io(format!("cannot start the journal reader: {e}")))?;
        let mut segments = BTreeMap::new();
        for s in &replayed.segments {
            let age_ms = now_wall_ms.saturating_sub(s.modified_wall_ms) as i64;
            let closed_ms = (s.num != head).then_some(-age_ms);
            segments.insert(s.num, Segment { pins: s.pins, bytes: s.bytes, closed_ms });
        }
        segments.entry(head).or_insert(Segment { pins: 0, bytes: HEADER_BYTES as u64, closed_ms: None });
        let mut journal = Journal {
            tx,
            writer: Some(writer),
            shared,
            reads,
            read_done,
            _lock: lock,
            batch: Batch::default(),
            batch_bytes: 0,
            last_batch_bytes: 0,
            sent_bytes: 0,
            sent_lsn: replayed.next_lsn.saturating_sub(1),
            urgent: false,
            held_since_ms: None,
            next_lsn: replayed.next_lsn.max(1),
            head,
            head_cap,
            // A continued head takes the prepared file as its successor; a new head takes it
            // itself (the writer renames it into place).
            next_cap: (resume.is_some() && prepared > 0).then_some(prepared),
            announced: head - 1,
            exhausted: false,
            was_writable: !full,
            segments,
            segment_bytes: SEGMENT_BYTES,
            now_ms: 0,
            records_written: 0,
            records_skipped_at_start: replayed.skipped,
        };
        journal.drop_unpinned_prefix();
        Ok((journal, replayed))
    }

    /// JOURNAL_SEGMENT_SIZE: the largest a segment grows to (small in tests of compaction).
    pub fn set_segment_bytes(&mut self, bytes: u64) {
        self.segment_bytes = bytes.max(4096);
        let data = self.data_bytes();
        let head_bytes = self.segments.get(&self.head).map_or(0, |s| s.bytes);
        self.head_cap = if head_bytes <= HEADER_BYTES as u64 {
            segment_size_for(data, self.segment_bytes)
        } else {
            self.head_cap.min(self.segment_bytes)
        };
        if self.head <= self.announced {
            // (The writer may hold the head open already: it learns its new size.)
            self.batch.opens.push((self.head, self.head_cap));
        }
        if self.next_cap.is_some_and(|n| n > self.segment_bytes) {
            self.next_cap = None;
        }
    }

    /// Can records be written now? `false` while the disk is full (or the journal failed):
    /// requests that must write are refused (503 `journal_unavailable`), and no attempt
    /// starts, until the writer gets through again by itself.
    pub fn writable(&self) -> bool {
        !self.shared.full.load(Ordering::Acquire) && !self.failed() && !self.exhausted
    }

    /// `true` once each time the journal becomes writable again (idle workers then get the
    /// tasks that waited).
    pub fn take_writable_again(&mut self) -> bool {
        let now = self.writable();
        let again = now && !self.was_writable;
        self.was_writable = now;
        again
    }

    /// The journal's state for `/healthz`: `ok` or `full`.
    pub fn state(&self) -> &'static str {
        if self.writable() { "ok" } else { "full" }
    }

    /// Segment deletions waiting for a retry (one failed).
    pub fn deletes_failing(&self) -> u64 {
        self.shared.deletes_failing.load(Ordering::Relaxed)
    }

    /// Bytes of records in the segments kept.
    fn data_bytes(&self) -> u64 {
        self.segments.values().map(|s| s.bytes).sum()
    }

    /// The sequence number of the newest record.
    pub fn lsn(&self) -> u64 {
        self.next_lsn - 1
    }

    pub fn durable_lsn(&self) -> u64 {
        self.shared.durable_lsn.load(Ordering::Acquire)
    }

    pub fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    pub fn syncs(&self) -> u64 {
        self.shared.syncs.load(Ordering::Relaxed)
    }

    /// Bytes encoded but not yet durable.
    pub fn backlog_bytes(&self) -> u64 {
        (self.sent_bytes + self.batch_bytes).saturating_sub(self.shared.durable_bytes.load(Ordering::Acquire))
    }

    /// Total size of the segments on disk (as written or queued).
    pub fn disk_bytes(&self) -> u64 {
        self.segments.values().map(|s| s.bytes).sum()
    }

    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The chunk of this batch that goes to the head (the writer learns a new head's size
    /// with its first chunk).
    fn head_chunk(&mut self) -> &mut Vec<u8> {
        if self.head > self.announced {
            self.batch.opens.push((self.head, self.head_cap));
            self.announced = self.head;
        }
        if self.batch.chunks.last().is_none_or(|(seg, _)| *seg != self.head) {
            // (The batch's first chunk: as large as the last batch; a later one, after a
            // rotation, grows as it needs.)
            let cap = if self.batch.chunks.is_empty() { self.last_batch_bytes } else { 0 };
            self.batch.chunks.push((self.head, Vec::with_capacity(cap)));
        }
        let Some((_, buf)) = self.batch.chunks.last_mut() else { unreachable!("a chunk was just pushed") };
        buf
    }

    fn append(&mut self, kind: RecordType, fill: impl FnOnce(&mut Vec<u8>)) -> (u64, Loc) {
        let lsn = self.next_lsn;
        self.next_lsn += 1;
        let buf = self.head_chunk();
        let start = buf.len();
        let n = codec::put_frame(buf, lsn, kind, fill) as u64;
        let head_bytes = self.segment_mut(self.head).map_or(0, |s| s.bytes);
        if head_bytes > HEADER_BYTES as u64 && head_bytes + n > self.head_cap && self.can_rotate() {
            // It goes to a new segment.
            let Some((_, buf)) = self.batch.chunks.last_mut() else { unreachable!("the frame is in it") };
            let frame = buf.split_off(start);
            if buf.is_empty() {
                self.batch.chunks.pop();
            }
            self.rotate();
            self.head_chunk().extend_from_slice(&frame);
        }
        let head = self.head;
        if self.segment_mut(head).is_none() {
            self.segments.insert(head, Segment { pins: 0, bytes: HEADER_BYTES as u64, closed_ms: None });
        }
        let Some(seg) = self.segment_mut(head) else { unreachable!("the head segment was just inserted") };
        let off = seg.bytes;
        seg.bytes += n;
        let filled = seg.bytes;
        self.batch_bytes += n;
        self.batch.lsn = lsn;
        self.records_written += 1;
        if self.next_cap.is_none() && filled.saturating_mul(4) >= self.head_cap {
            // A quarter full: time to have the next file made (not before: a journal that
            // never fills its first segment never takes the disk space of a second).
            let next = segment_size_for(self.data_bytes(), self.segment_bytes);
            self.next_cap = Some(next);
            let _ = self.tx.send(Msg::Prepare(next));
        }
        (lsn, Loc { seg: head, off: off as u32, len: n as u32 })
    }

    /// Is there a segment number after the head? (Only a planted file name takes the last.)
    fn can_rotate(&mut self) -> bool {
        if self.head.checked_add(1).is_some() {
            return true;
        }
        if !self.exhausted {
            self.exhausted = true;
            crate::log!(Level::Error, "journal: no segment number is left; writes answer 503", segment = self.head);
        }
        false
    }

    fn rotate(&mut self) {
        let old = self.head;
        self.head += 1;
        self.head_cap = self.next_cap.take().unwrap_or_else(|| segment_size_for(self.data_bytes(), self.segment_bytes));
        self.segments.insert(self.head, Segment { pins: 0, bytes: HEADER_BYTES as u64, closed_ms: None });
        let now = self.now_ms as i64;
        if let Some(seg) = self.segments.get_mut(&old) {
            seg.closed_ms = Some(now);
        }
        self.drop_unpinned_prefix();
    }

    /// Segment `n`. Most records go to, pin and unpin the head, the newest segment: the map's
    /// last entry, reached without comparing keys (a search compares with every older segment
    /// kept, and a young journal keeps several small ones).
    fn segment_mut(&mut self, n: u32) -> Option<&mut Segment> {
        if self.segments.last_key_value().is_some_and(|(&last, _)| last == n) {
            return self.segments.last_entry().map(|e| e.into_mut());
        }
        self.segments.get_mut(&n)
    }

    fn pin(&mut self, seg: u32) {
        if let Some(s) = self.segment_mut(seg) {
            s.pins += 1;
        }
    }

    fn unpin(&mut self, seg: u32) {
        let Some(s) = self.segment_mut(seg) else { return };
        s.pins = s.pins.saturating_sub(1);
        self.drop_unpinned_prefix();
    }

    /// Deletes the oldest segments while nothing needs them. Only ever a prefix of the log: a
    /// record is superseded only by later ones (the task's newer state, its `Forget`), so
    /// deleting a segment while an older one stays could bring that older one's stale records
    /// back at the next replay — a finished or forgotten task pending again. Segments in the
    /// middle that nothing needs wait for the ones before them (compaction empties those
    /// within TASK_TTL).
    fn drop_unpinned_prefix(&mut self) {
        while let Some((&seg, s)) = self.segments.first_key_value() {
            if seg == self.head || s.pins > 0 {
                break;
            }
            self.drop_segment(seg);
        }
    }

    /// Deletes the segment once the records that replaced it are durable (the writer removes
    /// it after the batch's sync).
    fn drop_segment(&mut self, seg: u32) {
        self.segments.remove(&seg);
        self.batch.deletes.push(seg);
    }

    fn unpin_all(&mut self, stored: &Stored) {
        for seg in stored.segs {
            if seg != 0 {
                self.unpin(seg);
            }
        }
    }

    /// Writes the whole task; it now needs only this record.
    pub fn task(&mut self, t: &Task, stored: &mut Stored) {
        let (lsn, loc) = self.append(RecordType::Task, |out| codec::put_task(out, t));
        self.pin(loc.seg);
        self.unpin_all(stored);
        *stored = Stored { lsn, home: loc, segs: [loc.seg, 0, 0] };
    }

    /// Records the start of the task's last attempt.
    pub fn attempt_started(&mut self, t: &Task, stored: &mut Stored) {
        let num = t.attempts.len() as u32;
        let Some(a) = t.attempts.last() else { return };
        if !self.has_room(stored) {
            return self.task(t, stored);
        }
        let (lsn, loc) = self.append(RecordType::AttemptStart, |out| codec::put_attempt_start(out, t.id, num, a));
        if !self.add_record(stored, lsn, loc) {
            self.task(t, stored);
        }
    }

    /// Records how the task's last attempt ended.
    pub fn attempt_ended(&mut self, t: &Task, stored: &mut Stored) {
        let num = t.attempts.len() as u32;
        let Some(a) = t.attempts.last() else { return };
        if !self.has_room(stored) {
            return self.task(t, stored);
        }
        let ext = codec::Ext::of(t);
        let (lsn, loc) =
            self.append(RecordType::AttemptEnd, |out| codec::put_attempt_end_with(out, t.id, num, a, &ext));
        if !self.add_record(stored, lsn, loc) {
            self.task(t, stored);
        }
    }

    /// Can a record in the head segment be added to what the task pins?
    fn has_room(&self, stored: &Stored) -> bool {
        stored.segs.contains(&self.head) || stored.segs.contains(&0)
    }

    /// Adds a record to what the task pins. `false` if its segment cannot be pinned (the record
    /// started a new segment and the task pins three already): the caller writes the task whole.
    fn add_record(&mut self, stored: &mut Stored, lsn: u64, loc: Loc) -> bool {
        stored.lsn = lsn;
        if !stored.segs.contains(&loc.seg) {
            let Some(free) = stored.segs.iter_mut().find(|s| **s == 0) else { return false };
            *free = loc.seg;
            self.pin(loc.seg);
        }
        true
    }

    /// A kind's policy was set (`Some`, its JSON: it now needs only this record) or removed.
    pub fn policy(&mut self, kind: &str, policy: Option<&str>, stored: &mut Stored) {
        let (lsn, loc) = self.append(RecordType::KindPolicy, |out| codec::put_kind_policy(out, kind, policy));
        if policy.is_some() {
            self.pin(loc.seg);
        }
        self.unpin_all(stored);
        *stored = match policy {
            Some(_) => Stored { lsn, home: loc, segs: [loc.seg, 0, 0] },
            None => Stored { lsn, ..Stored::default() },
        };
    }

    /// A bucket of the kind whose policy `stored` tracks (SPEC §14: a restart must not refill
    /// it). `false` when it could not be added to what the policy pins: the caller writes the
    /// policy whole again (its record, then every bucket not full).
    pub fn bucket(
        &mut self,
        kind: &str,
        lane: Option<(&str, &str)>,
        tokens: f64,
        at_ms: u64,
        stored: &mut Stored,
    ) -> bool {
        if !self.has_room(stored) {
            return false;
        }
        let (lsn, loc) =
            self.append(RecordType::KindBucket, |out| codec::put_kind_bucket(out, kind, lane, tokens, at_ms));
        self.add_record(stored, lsn, loc)
    }

    /// The task was forgotten (TASK_TTL): it needs nothing any more.
    pub fn forget(&mut self, id: TaskId, stored: &Stored) {
        self.append(RecordType::Forget, |out| codec::put_forget(out, id));
        self.unpin_all(stored);
    }

    /// An answer waits until the record `lsn` is durable: the turn's records go to the writer
    /// now, with the ones held back before (see [`Journal::end_turn`]).
    pub fn want(&mut self, lsn: u64) {
        if lsn > self.sent_lsn {
            self.urgent = true;
        }
    }

    /// Hands the records to the writer, at once when an answer waits on them ([`Journal::want`])
    /// or they fill [`HOLD_BYTES`]; records nobody waits on yet (the attempt a dispatch began,
    /// the submit of a `wait=true` task, whose answer waits for its end) are held back up to
    /// [`HOLD_MS`] for the turn that brings one, so that they share its sync: a `wait=true`
    /// task costs one sync, not two, and the writer is woken once per sync.
    pub fn end_turn(&mut self) {
        if self.batch.is_empty() {
            self.urgent = false;
            return;
        }
        let since = *self.held_since_ms.get_or_insert(self.now_ms);
        if !self.urgent && self.batch_bytes < HOLD_BYTES && self.now_ms < since + HOLD_MS {
            return;
        }
        self.urgent = false;
        self.held_since_ms = None;
        self.sent_lsn = self.lsn();
        let batch = std::mem::take(&mut self.batch);
        self.last_batch_bytes = self.batch_bytes.min(HOLD_BYTES) as usize;
        self.sent_bytes += self.batch_bytes;
        self.batch_bytes = 0;
        if self.tx.send(Msg::Batch(batch)).is_err() {
            // The writer only ends after a failure, which `failed` reports.
            self.shared.failed.store(true, Ordering::SeqCst);
        }
    }

    /// When records held back must go to the writer even if no answer asks for them (the
    /// loop's clock, ms). Records added after the turn's [`Journal::end_turn`] (a dispatch
    /// while output is flushed) start their hold here.
    pub fn hold_deadline_ms(&mut self) -> Option<u64> {
        if self.batch.is_empty() {
            return None;
        }
        Some(*self.held_since_ms.get_or_insert(self.now_ms) + HOLD_MS)
    }

    /// The newest segment closed at least `age_ms` ago, if any: tasks still pinning it (or an
    /// older one) should be written again at the head.
    pub fn stale_segment(&self, age_ms: u64) -> Option<u32> {
        let limit = self.now_ms as i64 - age_ms.min(i64::MAX as u64) as i64;
        self.segments.iter().take_while(|(_, s)| s.closed_ms.is_some_and(|c| c <= limit)).map(|(n, _)| *n).last()
    }

    /// Asks the reader thread for a record.
    pub fn read(&self, token: u64, loc: Loc) {
        let _ = self.reads.send(ReadJob { token, seg: loc.seg, off: loc.off, len: loc.len });
    }

    pub fn try_read_done(&self) -> Option<ReadDone> {
        self.read_done.try_recv().ok()
    }

    /// Writes what is queued, waits until it is durable, and stops the writer.
    pub fn stop(&mut self) {
        self.urgent = true;
        self.end_turn();
        let _ = self.tx.send(Msg::Stop);
        if let Some(handle) = self.writer.take() {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::codec::{Ext, TaskImage};
    use super::*;
    use crate::tasks::{Attempt, Status};

    fn task(id: TaskId, pad: usize) -> Task {
        TaskImage {
            id,
            status: Status::Pending,
            queued: true,
            submit_seq: 1,
            created_wall_ms: 1,
            max_retries: 2,
            timeout_ms: 1000,
            run_at_wall_ms: None,
            finished_wall_ms: None,
            kind: None,
            payload: Some(serde_json::value::RawValue::from_string(format!("\"{}\"", "p".repeat(pad))).expect("json")),
            result: None,
            error: None,
            idempotency: None,
            priority: 0,
            submitter: "".into(),
            key: "".into(),
            attempts: Vec::new(),
            ext: Ext::default(),
        }
        .into_task(Stored::default())
    }

    fn attempt() -> Attempt {
        Attempt {
            client_id: 7,
            client_ip: "127.0.0.1".parse().expect("ip"),
            started_wall_ms: 1,
            node: None,
            outcome: None,
            error: None,
            duration_ms: 0,
            answered: false,
            restarted: false,
            resumes: 0,
            session: None,
        }
    }

    /// An attempt record that did not fit in the head went to a new segment, but a task already
    /// pinning three segments (the head among them) could not pin the new one: nothing kept
    /// that segment, and once it was deleted replay lost the attempt (a timeout read back as
    /// "relay restarted", which does not count against retries).
    #[test]
    fn an_attempt_record_that_starts_a_new_segment_is_kept_by_its_task() {
        let dir = std::env::temp_dir().join(format!("relay-journal-pin-{}", uuid::Uuid::new_v4().simple()));
        let (mut j, _) = Journal::open(&dir, 1 << 20, 0, Arc::new(|| {})).expect("open");
        j.set_segment_bytes(4096);
        let mut t = task(1, 10);
        let mut ts = Stored::default();
        j.task(&t, &mut ts);
        let filler = task(2, 1000);
        let mut fs = Stored::default();
        let rotate = |j: &mut Journal, fs: &mut Stored| {
            let head = j.head;
            while j.head == head {
                j.task(&filler, fs);
            }
        };
        let end = |t: &mut Task, error: String| {
            if let Some(a) = t.attempts.last_mut() {
                a.outcome = Some(crate::tasks::Outcome::Timeout);
                a.error = Some(Box::from(error));
            }
        };
        rotate(&mut j, &mut fs);
        t.attempts.push(attempt());
        j.attempt_started(&t, &mut ts);
        rotate(&mut j, &mut fs);
        end(&mut t, "no answer".into());
        j.attempt_ended(&t, &mut ts);
        assert_eq!(ts.segs, [1, 2, 3], "the task pins three segments, the head among them");
        t.attempts.push(attempt());
        j.attempt_started(&t, &mut ts);
        // A long error: the record does not fit in what is left of the head.
        end(&mut t, "e".repeat(5000));
        j.attempt_ended(&t, &mut ts);
        assert!(ts.segs.contains(&j.head), "the segment with the task's newest record is not pinned: {ts:?}");
        j.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A segment named 4294967295.journal (the largest number a name can carry) made the next
    /// segment number overflow: a panic, or in a release build segment 0, the number that
    /// means "none" in a task's pins.
    #[test]
    fn the_largest_segment_number_stops_opening_instead_of_wrapping() {
        let dir = std::env::temp_dir().join(format!("relay-journal-max-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(replay::segment_path(&dir, u32::MAX), codec::segment_header()).expect("segment");
        let opened = Journal::open(&dir, 1 << 20, 0, Arc::new(|| {}));
        assert!(matches!(&opened, Err(OpenError::Io(m)) if m.contains("segment")), "{:?}", opened.err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn wait_durable(j: &Journal, lsn: u64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while j.durable_lsn() < lsn {
            assert!(std::time::Instant::now() < deadline, "record {lsn} never became durable");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Records no answer waits on are held back from the writer for at most HOLD_MS (the loop
    /// wakes by `hold_deadline_ms`), an answer's `want` sends them at once, and a full hold
    /// goes at once too: without the hold a `wait=true` task cost two syncs.
    #[test]
    fn records_nobody_waits_on_are_held_until_an_answer_wants_them_or_the_deadline() {
        let dir = std::env::temp_dir().join(format!("relay-journal-hold-{}", uuid::Uuid::new_v4().simple()));
        let (mut j, _) = Journal::open(&dir, 1 << 20, 0, Arc::new(|| {})).expect("open");
        let mut st = Stored::default();
        j.now_ms = 100;
        j.task(&task(1, 10), &mut st);
        let first = j.lsn();
        j.end_turn();
        assert_eq!(j.hold_deadline_ms(), Some(100 + HOLD_MS), "held, with a deadline for the loop's wake-up");
        assert!(j.backlog_bytes() > 0);
        // A later turn before the deadline adds to the same hold.
        j.now_ms = 100 + HOLD_MS - 1;
        j.task(&task(2, 10), &mut st);
        j.end_turn();
        assert_eq!(j.hold_deadline_ms(), Some(100 + HOLD_MS), "the deadline counts from the first held record");
        // An answer wants the first record: everything held goes now.
        j.want(first);
        j.end_turn();
        assert_eq!(j.hold_deadline_ms(), None);
        wait_durable(&j, j.lsn());
        // Wanting what was handed over already needs no extra send.
        j.want(first);
        j.end_turn();
        assert_eq!(j.hold_deadline_ms(), None);
        // The deadline alone sends them.
        j.now_ms = 200;
        j.task(&task(3, 10), &mut st);
        j.end_turn();
        assert_eq!(j.hold_deadline_ms(), Some(200 + HOLD_MS));
        j.now_ms = 200 + HOLD_MS;
        j.end_turn();
        assert_eq!(j.hold_deadline_ms(), None, "past the deadline the records go");
        wait_durable(&j, j.lsn());
        // A record added after the turn's end (a dispatch while output is flushed) gets a
        // deadline too, from the loop's next look at it.
        j.now_ms = 250;
        j.end_turn();
        assert_eq!(j.hold_deadline_ms(), None, "nothing held");
        j.task(&task(5, 10), &mut st);
        assert_eq!(j.hold_deadline_ms(), Some(250 + HOLD_MS), "records added after end_turn are not forgotten");
        j.now_ms = 250 + HOLD_MS;
        j.end_turn();
        assert_eq!(j.hold_deadline_ms(), None);
        wait_durable(&j, j.lsn());
        // A hold that reaches HOLD_BYTES goes at once.
        j.now_ms = 300;
        let big = task(4, 4096);
        while j.hold_deadline_ms().is_some() || j.batch_bytes == 0 {
            j.task(&big, &mut st);
            j.end_turn();
            assert!(j.sent_bytes + j.batch_bytes < 4 * HOLD_BYTES, "the hold never went");
            if j.hold_deadline_ms().is_none() {
                break;
            }
        }
        assert_eq!(j.batch_bytes, 0);
        wait_durable(&j, j.lsn());
        j.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn segments_are_as_large_as_the_data_within_their_bounds() {
        let check = |data: u64, max: u64, want: u64| assert_eq!(segment_size_for(data, max), want, "{data} of {max}");
        check(0, SEGMENT_BYTES, MIN_SEGMENT_BYTES);
        check(300 << 10, SEGMENT_BYTES, MIN_SEGMENT_BYTES);
        check((1 << 20) + 1, SEGMENT_BYTES, 2 << 20);
        check(20 << 20, SEGMENT_BYTES, 32 << 20);
        check(5 << 30, SEGMENT_BYTES, SEGMENT_BYTES);
        check(0, 4096, 4096);
        check(u64::MAX, 4096, 4096);
    }

    fn segment_files(dir: &Path) -> Vec<u32> {
        replay::list_segments(dir).expect("list")
    }

    /// After one task DATA_DIR held 129 MiB (a 64 MiB segment and a 64 MiB prepared one), and
    /// every restart started another segment. Now the first segment is small, nothing is
    /// prepared before the head is a quarter full, and a restart appends to the last segment.
    #[test]
    fn a_restart_appends_to_the_last_segment_and_a_small_journal_stays_one_small_file() {
        let dir = std::env::temp_dir().join(format!("relay-journal-resume-{}", uuid::Uuid::new_v4().simple()));
        let mut ids = Vec::new();
        for run in 0..4u128 {
            let (mut j, r) = Journal::open(&dir, 1 << 20, 0, Arc::new(|| {})).expect("open");
            j.set_segment_bytes(SEGMENT_BYTES);
            assert_eq!(r.tasks.len(), ids.len(), "run {run}");
            assert_eq!((j.head, j.head_cap, j.next_cap), (1, MIN_SEGMENT_BYTES, None), "run {run}");
            let mut st = Stored::default();
            j.task(&task(run, 100), &mut st);
            ids.push(run);
            j.want(j.lsn());
            j.end_turn();
            wait_durable(&j, j.lsn());
            j.stop();
            drop(j);
            assert_eq!(segment_files(&dir), [1], "run {run}");
            let len = std::fs::metadata(replay::segment_path(&dir, 1)).expect("segment").len();
            assert!(len <= MIN_SEGMENT_BYTES, "run {run}: {len}");
            assert!(!dir.join(thread::PREPARED).exists() && !dir.join(thread::PREPARING).exists());
        }
        let r = replay::replay(&dir, 1 << 20).expect("replay");
        assert_eq!((r.tasks.len(), r.skipped, r.truncated_bytes), (4, 0, 0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The next segment's file is asked for once the head is a quarter full, at the size the
    /// data calls for; the rotation takes it; and a closed segment keeps no zeros past its
    /// records (replay reads only records). A prepared file a run leaves is reused by the next.
    #[test]
    fn the_next_segment_is_prepared_at_a_quarter_and_sizes_grow_with_the_data() {
        let dir = std::env::temp_dir().join(format!("relay-journal-grow-{}", uuid::Uuid::new_v4().simple()));
        let (mut j, _) = Journal::open(&dir, 1 << 20, 0, Arc::new(|| {})).expect("open");
        j.set_segment_bytes(SEGMENT_BYTES);
        let big = task(1, 16 << 10);
        let mut st = Stored::default();
        let write = |j: &mut Journal, st: &mut Stored, t: &Task| {
            j.task(t, st);
            j.want(j.lsn());
            j.end_turn();
            wait_durable(j, j.lsn());
        };
        while j.next_cap.is_none() {
            write(&mut j, &mut st, &big);
        }
        let filled = j.segments.get(&j.head).map_or(0, |s| s.bytes);
        assert!(filled * 4 >= MIN_SEGMENT_BYTES && filled * 4 < MIN_SEGMENT_BYTES + 4 * (20 << 10), "{filled}");
        assert_eq!(j.next_cap, Some(MIN_SEGMENT_BYTES));
        let prepared = dir.join(thread::PREPARED);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::metadata(&prepared).map_or(0, |m| m.len()) != MIN_SEGMENT_BYTES {
            assert!(std::time::Instant::now() < deadline, "no prepared file");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        // Other tasks, so segment 1 stays pinned and the data grows.
        let mut n = 10;
        while j.head == 1 {
            let mut other = Stored::default();
            write(&mut j, &mut other, &task(n, 16 << 10));
            n += 1;
        }
        assert!(!prepared.exists(), "the rotation took the prepared file");
        let closed = std::fs::metadata(replay::segment_path(&dir, 1)).expect("segment 1").len();
        assert_eq!(closed, j.segments[&1].bytes, "a closed segment is cut to its records");
        while j.next_cap.is_none() {
            let mut other = Stored::default();
            write(&mut j, &mut other, &task(n, 16 << 10));
            n += 1;
        }
        assert_eq!(j.next_cap, Some(2 << 20), "the journal passed 1 MiB: the next segment is 2 MiB");
        while std::fs::metadata(&prepared).map_or(0, |m| m.len()) != 2 << 20 {
            assert!(std::time::Instant::now() < deadline, "no prepared file of 2 MiB");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        j.stop();
        drop(j);
        // Reopened: the head goes on, and the prepared file (2 MiB) is the next segment's.
        let (j, _) = Journal::open(&dir, 1 << 20, 0, Arc::new(|| {})).expect("reopen");
        assert_eq!((j.head, j.next_cap), (2, Some(2 << 20)));
        assert_eq!(segment_files(&dir), [1, 2]);
        drop(j);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A segment started without a prepared file gets zeros written ahead of its records, in
    /// steps (a sync without a change of size or new blocks costs about half), and replay
    /// still ends at the last record without calling the zeros damage.
    #[test]
    fn an_unprepared_segment_is_zero_filled_ahead_and_replays_clean() {
        let dir = std::env::temp_dir().join(format!("relay-journal-ahead-{}", uuid::Uuid::new_v4().simple()));
        // The preparer cannot make its file (a directory holds the name): no segment is prepared.
        std::fs::create_dir_all(dir.join(thread::PREPARING)).expect("mkdir");
        let (mut j, _) = Journal::open(&dir, 1 << 20, 0, Arc::new(|| {})).expect("open");
        j.set_segment_bytes(1 << 20);
        let mut st = Stored::default();
        for _ in 0..3 {
            j.task(&task(1, 100), &mut st);
        }
        j.want(j.lsn());
        j.end_turn();
        wait_durable(&j, j.lsn());
        let seg = replay::segment_path(&dir, j.head);
        let len = std::fs::metadata(&seg).expect("segment").len();
        assert!(len >= thread::ZERO_STEP && len.is_multiple_of(thread::ZERO_STEP), "no zeros ahead: {len} bytes");
        let written = j.segments.get(&j.head).map_or(0, |s| s.bytes);
        assert!(written < 4096, "{written}");
        let bytes = std::fs::read(&seg).expect("read");
        assert!(bytes[written as usize..].iter().all(|b| *b == 0), "past the records, zeros only");
        j.stop();
        drop(j);
        let r = replay::replay(&dir, 1 << 20).expect("replay");
        assert_eq!(
            (r.tasks.len(), r.skipped, r.truncated_bytes),
            (1, 0, 0),
            "one task (three records of it), nothing damaged"
        );
        let _ = std::fs::remove_dir_all(&dir);
        // Segments smaller than the step get zeros up to their size, no further.
        let (mut j, _) = Journal::open(&dir, 1 << 20, 0, Arc::new(|| {})).expect("open again");
        j.set_segment_bytes(64 << 10);
        j.task(&task(1, 100), &mut st);
        j.want(j.lsn());
        j.end_turn();
        wait_durable(&j, j.lsn());
        let len = std::fs::metadata(replay::segment_path(&dir, j.head)).expect("segment").len();
        assert_eq!(len, 64 << 10, "zeros past a small segment's size");
        j.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
