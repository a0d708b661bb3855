//! Reading the journal back at start: every segment in order, every frame checked. A torn tail
//! (the last frames of the last segment short or failing their checksum, with nothing valid
//! after them) is cut off; a damaged frame *followed by* valid ones is corruption: it is
//! skipped, counted and logged at error, and every valid record after it is kept.
//!
//! Runs before the event loop starts, on the main thread; it is the only journal code that
//! reads files outside the journal threads.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::codec::{self, FrameAt, HEADER_BYTES, Record};
use crate::log::Level;
use crate::tasks::{Evicted, Loc, Outcome, Status, Stored, Task, TaskId, kind_hash};

/// A finished task that did not fit in `TASK_MEMORY`: only where to find it is kept.
pub struct Light {
    pub evicted: Evicted,
    pub finished_wall_ms: u64,
    pub idempotency: Option<Box<(Box<str>, Box<str>)>>,
}

/// A kind's policy as the journal left it: its JSON, where its records are, and its buckets'
/// last state (tokens, counted at; the kind's own, and each lane's by submitter and key).
#[derive(Debug, Default)]
pub struct PolicyImage {
    pub kind: Box<str>,
    pub json: Box<str>,
    pub stored: Stored,
    pub bucket: Option<(f64, u64)>,
    pub lanes: HashMap<(Box<str>, Box<str>), (f64, u64)>,
}

pub struct Replayed {
    /// Tasks kept in memory (finished ones within the budget), as the journal left them.
    pub tasks: Vec<Box<Task>>,
    /// Finished tasks beyond the memory budget.
    pub evicted: Vec<(TaskId, Light)>,
    /// Tasks whose records span more segments than a task can pin: write them whole again.
    pub rehome: Vec<TaskId>,
    /// Kind policies (SPEC §14), with the buckets their dispatches left.
    pub policies: Vec<PolicyImage>,
    /// Segment numbers found, in order, with their size and how many records tasks still need
    /// in each.
    pub segments: Vec<SegmentInfo>,
    pub next_lsn: u64,
    /// The highest segment number present (new records go to the next one).
    pub max_segment: u32,
    pub records: u64,
    /// Damaged frames or regions skipped (not counting a torn tail).
    pub skipped: u64,
    pub truncated_bytes: u64,
    pub elapsed: Duration,
}

#[derive(Debug, Clone, Copy)]
pub struct SegmentInfo {
    pub num: u32,
    /// Where its records end (header included).
    pub bytes: u64,
    /// The file's size (zeros prepared past the records included).
    pub file_bytes: u64,
    /// The last segment, with a sound header and nothing damaged at its end: the next run
    /// appends to it.
    pub appendable: bool,
    /// Last modification, wall clock (compaction ages segments from it).
    pub modified_wall_ms: u64,
    pub pins: u32,
}

pub fn segment_path(dir: &Path, num: u32) -> PathBuf {
    dir.join(format!("{num:010}.journal"))
}

fn segment_number(name: &str) -> Option<u32> {
    let digits = name.strip_suffix(".journal")?;
    if digits.len() != 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The journal segments in `dir`, in order.
pub fn list_segments(dir: &Path) -> io::Result<Vec<u32>> {
    let mut nums = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if let Some(n) = entry.file_name().to_str().and_then(segment_number) {
            nums.push(n);
        }
    }
    nums.sort_unstable();
    Ok(nums)
}

struct Entry {
    /// `None` once evicted. Boxed once, here: the task table takes the box as it is.
    task: Option<Box<Task>>,
    light: Option<Light>,
    /// Position in `finished` (to tell a stale queue entry from the current one).
    finished_at: u64,
    overflow: bool,
}

struct State {
    /// Where each live task's entry is in `entries` (a small table of indices: the entries
    /// themselves are written in log order, not scattered over a huge table).
    index: HashMap<TaskId, u32>,
    /// In order of first appearance; a forgotten task leaves an empty entry behind.
    entries: Vec<(TaskId, Entry)>,
    finished: VecDeque<(u64, TaskId)>,
    finished_count: u64,
    finished_bytes: usize,
    budget_bytes: usize,
    max_seq: u64,
    /// The newest policy record of each kind (`json` empty: removed), with the bucket records
    /// after it.
    policies: HashMap<Box<str>, PolicyImage>,
}

impl State {
    fn apply(&mut self, seq: u64, loc: Loc, record: Record) {
        self.max_seq = self.max_seq.max(seq);
        match record {
            Record::Task(image) => {
                let stored = Stored { lsn: seq, home: loc, segs: [loc.seg, 0, 0] };
                let id = image.id;
                let task = image.into_task(stored);
                self.remove(id);
                let mut entry = Entry { task: None, light: None, finished_at: 0, overflow: false };
                if task.status.is_final() {
                    self.finished_count += 1;
                    entry.finished_at = self.finished_count;
                    self.finished.push_back((self.finished_count, id));
                    self.finished_bytes += task.mem_bytes();
                }
                entry.task = Some(Box::new(task));
                match self.index.get(&id) {
                    Some(&i) => self.entries[i as usize].1 = entry,
                    None => {
                        self.index.insert(id, self.entries.len() as u32);
                        self.entries.push((id, entry));
                    }
                }
                self.evict_over_budget();
            }
            Record::AttemptStart { id, num, attempt } => {
                let Some(entry) = self.entry(id) else { return };
                let Some(task) = entry.task.as_mut().filter(|t| !t.status.is_final()) else { return };
                if task.attempts.len() + 1 != num as usize || task.attempts.last().is_some_and(|a| a.outcome.is_none())
                {
                    return;
                }
                task.attempts.push(attempt);
                task.status = Status::Dispatched;
                task.next_attempt_wall_ms = None;
                task.stored.lsn = seq;
                entry.overflow |= !pin(&mut task.stored, loc.seg);
            }
            Record::AttemptEnd { id, num, outcome, duration_ms, error, ext } => {
                let Some(entry) = self.entry(id) else { return };
                let Some(task) = entry.task.as_mut().filter(|t| !t.status.is_final()) else { return };
                if task.attempts.len() != num as usize {
                    return;
                }
                let Some(a) = task.attempts.last_mut().filter(|a| a.outcome.is_none()) else { return };
                a.outcome = outcome;
                a.duration_ms = duration_ms;
                a.error = error;
                // As when the whole task is read back: an attempt a restart cut short does not
                // use up a retry, however many restarts later.
                a.restarted =
                    a.outcome == Some(Outcome::Disconnect) && a.error.as_deref() == Some(codec::RESTART_ERROR);
                task.status = Status::Pending;
                task.next_attempt_wall_ms = ext.next_attempt_wall_ms;
                task.again = ext.again;
                task.stored.lsn = seq;
                entry.overflow |= !pin(&mut task.stored, loc.seg);
            }
            Record::Forget { id } => self.remove(id),
            Record::KindPolicy { kind, policy } => {
                // (A policy record starts the kind's state afresh: the store writes its buckets
                // that are not full after each one.)
                let stored = Stored { lsn: seq, home: loc, segs: [loc.seg, 0, 0] };
                let image =
                    PolicyImage { kind: kind.clone(), json: policy.unwrap_or_default(), stored, ..Default::default() };
                self.policies.insert(kind, image);
            }
            Record::KindBucket { kind, lane, tokens, at_ms } => {
                let Some(image) = self.policies.get_mut(&kind).filter(|i| !i.json.is_empty()) else { return };
                image.stored.lsn = seq;
                // (Past three segments the store writes the policy whole again at start.)
                pin(&mut image.stored, loc.seg);
                match lane {
                    Some(lane) => {
                        image.lanes.insert(lane, (tokens, at_ms));
                    }
                    None => image.bucket = Some((tokens, at_ms)),
                }
            }
        }
    }

    fn entry(&mut self, id: TaskId) -> Option<&mut Entry> {
        let i = *self.index.get(&id)?;
        self.entries.get_mut(i as usize).map(|(_, e)| e)
    }

    /// The task's state is replaced or forgotten: its finished bytes no longer count.
    fn remove(&mut self, id: TaskId) {
        let Some(i) = self.index.remove(&id) else { return };
        let Some((_, old)) = self.entries.get_mut(i as usize) else { return };
        let old = std::mem::replace(old, Entry { task: None, light: None, finished_at: 0, overflow: false });
        if let Some(t) = &old.task
            && t.status.is_final()
        {
            self.finished_bytes -= t.mem_bytes();
        }
    }

    /// Finished tasks beyond the budget leave memory, oldest first (the journal is in
    /// finishing order).
    fn evict_over_budget(&mut self) {
        while self.finished_bytes > self.budget_bytes {
            let Some((at, id)) = self.finished.pop_front() else { return };
            let Some(&i) = self.index.get(&id) else { continue };
            let Some((_, entry)) = self.entries.get_mut(i as usize) else { continue };
            if entry.finished_at != at {
                continue;
            }
            let Some(task) = entry.task.take() else { continue };
            self.finished_bytes -= task.mem_bytes();
            entry.light = Some(Light {
                evicted: Evicted {
                    loc: task.stored.home,
                    submit_seq: task.submit_seq,
                    status: task.status,
                    kind_hash: kind_hash(task.kind.as_deref()),
                    finished_mono_ms: 0,
                },
                finished_wall_ms: task.finished_wall_ms.unwrap_or(task.created_wall_ms),
                idempotency: task.idempotency,
            });
        }
    }
}

/// Adds `seg` to the segments a task needs; `false` if it needs more than it can hold.
pub fn pin(stored: &mut Stored, seg: u32) -> bool {
    if stored.segs.contains(&seg) {
        return true;
    }
    match stored.segs.iter_mut().find(|s| **s == 0) {
        Some(free) => {
            *free = seg;
            true
        }
        None => false,
    }
}

/// Is there a frame that could be valid at `off` (cheap checks before the checksum)?
fn plausible(bytes: &[u8], off: usize) -> bool {
    let b = &bytes[off..];
    if b.len() < codec::FRAME_PREFIX_BYTES + 9 {
        return false;
    }
    let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    (9..=b.len() - codec::FRAME_PREFIX_BYTES).contains(&len) && (1..=4).contains(&b[16])
}

/// The next offset after `from` (8-byte aligned) where a valid frame starts. Checksumming
/// candidates costs their length: `budget` (bytes) bounds that work, so damage or a crafted
/// file full of plausible lengths cannot make replay quadratic; once spent, `None`.
fn next_valid(bytes: &[u8], from: usize, budget: &mut usize) -> Option<usize> {
    let mut off = from + 8;
    while off + codec::FRAME_PREFIX_BYTES <= bytes.len() {
        if plausible(bytes, off) {
            let len = u32::from_le_bytes([bytes[off], bytes[off + 1], bytes[off + 2], bytes[off + 3]]) as usize;
            if len > *budget {
                return None;
            }
            *budget -= len;
            if matches!(codec::frame_at(&bytes[off..]), FrameAt::Valid { .. }) {
                return Some(off);
            }
        }
        off += 8;
    }
    None
}

fn modified_wall_ms(path: &Path) -> u64 {
    fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

/// A valid frame found by [`scan_segment`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRef {
    pub off: usize,
    /// Bytes the frame takes, padding included.
    pub total: usize,
    pub seq: u64,
    pub kind: u8,
    /// Where its payload is in the segment.
    pub payload: (usize, usize),
}

/// What scanning one segment's bytes found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan {
    pub frames: Vec<FrameRef>,
    /// Damaged regions (offset, length) followed by valid frames, or at the end of a segment
    /// that is not the last: corruption.
    pub skipped: Vec<(usize, usize)>,
    /// The last segment ends in a torn write from this offset on: cut it off.
    pub torn_at: Option<usize>,
    /// The records end here and zeros follow (a segment prepared ahead of its records).
    pub zeros_at: Option<usize>,
}

/// Are all these bytes zero? (Word at a time: the zeros after a head segment's records are
/// most of what a small journal's replay reads.)
fn all_zero(bytes: &[u8]) -> bool {
    let mut words = bytes.chunks_exact(4096);
    for block in &mut words {
        if block
            .chunks_exact(8)
            .fold(0u64, |acc, w| acc | u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
            != 0
        {
            return false;
        }
    }
    words.remainder().iter().all(|&b| b == 0)
}

/// Finds every valid frame of a segment (`bytes` includes the header, already checked).
/// Pure: this is what the fuzz target and the property test drive.
pub fn scan_segment(bytes: &[u8], last: bool) -> Scan {
    let mut scan = Scan::default();
    let mut off = HEADER_BYTES;
    // Resynchronising after damage may checksum at most four times the segment.
    let mut budget = bytes.len().saturating_mul(4).saturating_add(1 << 20);
    while off < bytes.len() {
        match codec::frame_at(&bytes[off..]) {
            FrameAt::Valid { seq, kind, total, payload } => {
                let start = off + codec::FRAME_PREFIX_BYTES + 9;
                scan.frames.push(FrameRef { off, total, seq, kind, payload: (start, start + payload.len()) });
                off += total;
            }
            FrameAt::Short | FrameAt::Bad if all_zero(&bytes[off..]) => {
                scan.zeros_at = Some(off);
                break;
            }
            FrameAt::Short | FrameAt::Bad => match next_valid(bytes, off, &mut budget) {
                Some(next) => {
                    scan.skipped.push((off, next - off));
                    off = next;
                }
                None if last => {
                    scan.torn_at = Some(off);
                    break;
                }
                None => {
                    scan.skipped.push((off, bytes.len() - off));
                    break;
                }
            },
        }
    }
    scan
}

/// Replay without files: segments as (number, bytes), the last one possibly torn. The result's
/// `segments` carry no modification times.
pub fn replay_bytes(segments: &[(u32, &[u8])], budget_bytes: usize) -> Replayed {
    let mut r = Replayer::new(budget_bytes);
    for (i, (num, bytes)) in segments.iter().enumerate() {
        r.segment(*num, bytes, i + 1 == segments.len(), None);
    }
    r.finish()
}

/// Replay's state across segments.
struct Replayer {
    state: State,
    records: u64,
    skipped: u64,
    truncated_bytes: u64,
    segments: Vec<SegmentInfo>,
    max_segment: u32,
    started: Instant,
    /// A segment of a journal format this relay does not read.
    unreadable: Option<String>,
    /// The last segment's header is all zeros (see [`Replayer::segment`]).
    unwritten_header: bool,
}

impl Replayer {
    fn new(budget_bytes: usize) -> Replayer {
        Replayer {
            state: State {
                index: HashMap::new(),
                entries: Vec::new(),
                finished: VecDeque::new(),
                finished_count: 0,
                finished_bytes: 0,
                budget_bytes,
                max_seq: 0,
                policies: HashMap::new(),
            },
            records: 0,
            skipped: 0,
            truncated_bytes: 0,
            segments: Vec::new(),
            max_segment: 0,
            started: Instant::now(),
            unreadable: None,
            unwritten_header: false,
        }
    }

    /// Applies one segment. Returns where a torn tail starts, if it has one. `path` only
    /// names the file in logs.
    fn segment(&mut self, num: u32, bytes: &[u8], last: bool, path: Option<&Path>) -> Option<usize> {
        self.max_segment = self.max_segment.max(num);
        let name = path.map_or_else(|| format!("segment {num}"), |p| p.display().to_string());
        let mut header_ok = true;
        if last && bytes.len() >= HEADER_BYTES && all_zero(&bytes[..HEADER_BYTES]) {
            // A crash between naming a prepared file of zeros as the new segment and writing
            // its header: not damage (nothing in it was acknowledged before its header was
            // durable). [`replay`] writes the header, and the next run appends to it.
            self.unwritten_header = true;
            crate::log!(
                Level::Warn,
                "journal: the last segment's header was never written (a crash as it was made)",
                file = name
            );
        } else if let Err(why) = codec::check_header(bytes) {
            header_ok = false;
            if bytes.len() >= HEADER_BYTES && bytes.starts_with(codec::SEGMENT_MAGIC) {
                // Written by a relay of another format (a downgrade?): reading on would lose
                // its tasks, so replay stops and the file stays as it is.
                self.unreadable.get_or_insert(format!("{name}: {why}"));
                return None;
            }
            // A damaged header: its frames carry their own checksums; read them.
            self.skipped += 1;
            crate::log!(
                Level::Error,
                "journal: damaged segment header; the valid records after it are kept",
                file = name,
                error = why
            );
        }
        let scan = scan_segment(bytes, last);
        for f in &scan.frames {
            let payload = &bytes[f.payload.0..f.payload.1];
            let loc = Loc { seg: num, off: f.off as u32, len: f.total as u32 };
            match codec::decode(f.kind, payload) {
                Some(record) => {
                    self.records += 1;
                    self.state.apply(f.seq, loc, record);
                }
                None => {
                    self.skipped += 1;
                    crate::log!(
                        Level::Error,
                        "journal: record with a valid checksum but unreadable content skipped",
                        file = name,
                        offset = f.off
                    );
                }
            }
        }
        for &(off, len) in &scan.skipped {
            self.skipped += 1;
            crate::log!(
                Level::Error,
                "journal: damaged record skipped; the valid records after it are kept",
                file = name,
                offset = off,
                bytes_skipped = len
            );
        }
        let end = scan.torn_at.or(scan.zeros_at).unwrap_or(bytes.len());
        if let Some(at) = scan.torn_at {
            self.truncated_bytes += (bytes.len() - at) as u64;
            crate::log!(
                Level::Warn,
                "journal: torn tail cut off (a write interrupted by a crash)",
                file = name,
                offset = at,
                bytes = bytes.len() - at
            );
        }
        self.segments.push(SegmentInfo {
            num,
            bytes: end as u64,
            file_bytes: bytes.len() as u64,
            appendable: last && header_ok && scan.skipped.is_empty(),
            modified_wall_ms: path.map_or(0, modified_wall_ms),
            pins: 0,
        });
        scan.torn_at
    }

    /// Room for about `tasks` tasks up front (the table would otherwise double its way there).
    fn reserve(&mut self, tasks: usize) {
        self.state.index.reserve(tasks);
        self.state.entries.reserve(tasks);
    }

    fn finish(self) -> Replayed {
        let Replayer { state, records, skipped, truncated_bytes, mut segments, max_segment, started, .. } = self;
        let mut pins: BTreeMap<u32, u32> = BTreeMap::new();
        let mut tasks = Vec::with_capacity(state.entries.len());
        let mut evicted = Vec::new();
        let mut rehome = Vec::new();
        for (id, entry) in state.entries {
            if entry.task.is_none() && entry.light.is_none() {
                continue; // forgotten
            }
            if entry.overflow {
                rehome.push(id);
            }
            if let Some(task) = entry.task {
                for seg in task.stored.segs.into_iter().filter(|s| *s != 0) {
                    *pins.entry(seg).or_default() += 1;
                }
                tasks.push(task);
            } else if let Some(light) = entry.light {
                *pins.entry(light.evicted.loc.seg).or_default() += 1;
                evicted.push((id, light));
            }
        }
        let mut policies = Vec::new();
        for image in state.policies.into_values() {
            if !image.json.is_empty() {
                for seg in image.stored.segs.into_iter().filter(|s| *s != 0) {
                    *pins.entry(seg).or_default() += 1;
                }
                policies.push(image);
            }
        }
        for seg in &mut segments {
            seg.pins = pins.get(&seg.num).copied().unwrap_or(0);
        }
        Replayed {
            tasks,
            evicted,
            rehome,
            policies,
            segments,
            next_lsn: state.max_seq + 1,
            max_segment,
            records,
            skipped,
            truncated_bytes,
            elapsed: started.elapsed(),
        }
    }
}

/// Replays every segment in `dir`, keeping at most `budget_bytes` of finished tasks in memory.
/// Cuts a torn tail off the last segment (the only write replay makes).
pub fn replay(dir: &Path, budget_bytes: usize) -> io::Result<Replayed> {
    let nums = list_segments(dir)?;
    let mut r = Replayer::new(budget_bytes);
    // The smallest whole-task record is about this size: an upper bound on the tasks to hold.
    const MIN_TASK_RECORD_BYTES: u64 = 128;
    let total: u64 = nums.iter().filter_map(|n| fs::metadata(segment_path(dir, *n)).ok()).map(|m| m.len()).sum();
    r.reserve((total / MIN_TASK_RECORD_BYTES).min(1 << 26) as usize);
    for (i, &num) in nums.iter().enumerate() {
        let last = i + 1 == nums.len();
        let path = segment_path(dir, num);
        let bytes = fs::read(&path)?;
        if last && bytes.len() < HEADER_BYTES {
            // Created just before a crash, its header never written whole.
            crate::log!(Level::Warn, "journal: removing an incomplete last segment", file = path.display());
            fs::remove_file(&path)?;
            r.truncated_bytes += bytes.len() as u64;
            continue;
        }
        let torn = r.segment(num, &bytes, last, Some(&path));
        if torn.is_some() || r.unwritten_header {
            use std::os::unix::fs::FileExt;
            let file = fs::OpenOptions::new().write(true).open(&path)?;
            if let Some(at) = torn {
                file.set_len(at as u64)?;
            }
            if std::mem::take(&mut r.unwritten_header) {
                file.write_all_at(&codec::segment_header(), 0)?;
            }
            file.sync_all()?;
        }
        if let Some(why) = r.unreadable.take() {
            return Err(io::Error::other(why));
        }
    }
    Ok(r.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::codec::{RecordType, put_frame, segment_header};
    use crate::tasks::{Attempt, Outcome, Place};
    use serde_json::value::RawValue;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    fn task(id: TaskId, status: Status, rng: &mut Rng) -> Task {
        let n_attempts = rng.below(3) as usize;
        let attempts = (0..n_attempts)
            .map(|i| Attempt {
                client_id: u128::from(rng.next()),
                client_ip: if i % 2 == 0 { "10.1.2.3".parse().expect("ip") } else { "::1".parse().expect("ip") },
                node: None,
                started_wall_ms: rng.next() >> 20,
                outcome: Some(Outcome::ALL[rng.below(6) as usize]),
                error: (rng.below(2) == 0).then(|| Box::from("it \"broke\"\n")),
                duration_ms: rng.below(100_000),
                answered: false,
                restarted: false,
                resumes: 0,
                session: None,
            })
            .collect();
        let payload = format!("{{\"kind\":\"k{}\",\"n\":{}}}", rng.below(3), rng.next());
        Task {
            id,
            status,
            kind: (rng.below(4) != 0).then(|| Box::from(format!("k{}", rng.below(3)))),
            payload: (!status.is_final()).then(|| RawValue::from_string(payload).expect("json").into()),
            created_wall_ms: rng.next() >> 20,
            run_at_wall_ms: (rng.below(2) == 0).then(|| rng.next() >> 20),
            due_wall_ms: 0,
            finished_wall_ms: status.is_final().then(|| rng.next() >> 20),
            result: (status == Status::Done).then(|| RawValue::from_string("[1,\"two\",{}]".into()).expect("json")),
            error: (status == Status::Failed).then(|| Box::from("no worker")),
            attempts,
            max_retries: rng.below(5) as u32,
            timeout_ms: rng.below(1 << 30),
            place: Place::Nowhere,
            queued: rng.below(2) == 0,
            restored: false,
            submit_seq: rng.next() >> 1,
            priority: [0, 0, 1, -1, 86_400, -86_400][rng.below(6) as usize],
            submitter: ["", "jti-1"][rng.below(2) as usize].into(),
            key: ["", "k", "c\u{e9}"][rng.below(3) as usize].into(),
            held_by: Default::default(),
            idempotency: (rng.below(2) == 0).then(|| Box::new((Box::from("jti-1"), Box::from("key é")))),
            retry: crate::tasks::RetryPolicy {
                backoff_ms: (rng.below(2) == 0).then(|| rng.below(100_000)),
                backoff_max_ms: (rng.below(2) == 0).then(|| rng.below(100_000) + 1),
                any_worker: [None, Some(false), Some(true)][rng.below(3) as usize],
            },
            next_attempt_wall_ms: (status == Status::Pending && rng.below(2) == 0).then(|| rng.next() >> 20),
            again: (status == Status::Pending && rng.below(2) == 0).then(|| u128::from(rng.next())),
            reruns: rng.below(3) as u32,
            rerun_base: rng.below(3) as u32,
            finished_mono_ms: 0,
            stored: Stored::default(),
        }
    }

    fn json(t: &Task) -> String {
        let mut s = String::new();
        t.write_json(&mut s);
        s
    }

    #[test]
    fn task_records_round_trip() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for i in 0..500u128 {
            let status = [Status::Pending, Status::Dispatched, Status::Done, Status::Failed, Status::Canceled]
                [rng.below(5) as usize];
            let t = task(i << 64 | 7, status, &mut rng);
            let mut bytes = Vec::new();
            put_frame(&mut bytes, 5, RecordType::Task, |out| codec::put_task(out, &t));
            let FrameAt::Valid { kind, payload, .. } = codec::frame_at(&bytes) else { panic!("frame") };
            let Some(Record::Task(image)) = codec::decode(kind, payload) else { panic!("decode") };
            let back = image.into_task(Stored::default());
            assert_eq!(json(&back), json(&t));
            assert_eq!(back.payload.as_ref().map(|p| p.get()), t.payload.as_ref().map(|p| p.get()));
            assert_eq!(
                (back.submit_seq, back.queued, back.max_retries, back.timeout_ms, back.priority),
                (t.submit_seq, t.queued, t.max_retries, t.timeout_ms, t.priority)
            );
            assert_eq!(back.idempotency, t.idempotency);
            assert_eq!((back.retry, back.next_attempt_wall_ms, back.again), (t.retry, t.next_attempt_wall_ms, t.again));
        }
    }

    #[test]
    fn an_attempt_end_keeps_how_its_retry_waits_and_an_old_one_still_decodes() {
        let a = Attempt {
            client_id: 9,
            client_ip: "127.0.0.1".parse().expect("ip"),
            started_wall_ms: 1,
            node: None,
            outcome: Some(Outcome::Failed),
            error: Some(Box::from("boom")),
            duration_ms: 5,
            answered: false,
            restarted: false,
            resumes: 0,
            session: None,
        };
        let ext = codec::Ext { next_attempt_wall_ms: Some(77), again: Some(9), ..codec::Ext::default() };
        for (ext, with) in [(ext, true), (codec::Ext::default(), false)] {
            let mut bytes = Vec::new();
            put_frame(&mut bytes, 3, RecordType::AttemptEnd, |out| codec::put_attempt_end_with(out, 5, 1, &a, &ext));
            let FrameAt::Valid { kind, payload, .. } = codec::frame_at(&bytes) else { panic!("frame") };
            let Some(Record::AttemptEnd { ext: back, .. }) = codec::decode(kind, payload) else { panic!("decode") };
            assert_eq!(back, ext);
            // Without a wait, the record is byte for byte what an older relay wrote.
            let mut old = Vec::new();
            put_frame(&mut old, 3, RecordType::AttemptEnd, |out| codec::put_attempt_end(out, 5, 1, &a));
            assert_eq!(old == bytes, !with);
        }
    }

    /// A segment of `n` random records; returns the bytes and each frame's offset and seq.
    fn segment(rng: &mut Rng, n: usize) -> (Vec<u8>, Vec<(usize, u64)>) {
        let mut bytes = segment_header().to_vec();
        let mut frames = Vec::new();
        for i in 0..n {
            let seq = i as u64 + 1;
            let off = bytes.len();
            let id = u128::from(rng.below(20));
            match rng.below(4) {
                0 => {
                    let t = task(id, Status::Pending, rng);
                    put_frame(&mut bytes, seq, RecordType::Task, |out| codec::put_task(out, &t));
                }
                1 => {
                    let t = task(id, Status::Dispatched, rng);
                    match t.attempts.first() {
                        Some(a) => put_frame(&mut bytes, seq, RecordType::AttemptStart, |out| {
                            codec::put_attempt_start(out, id, 1, a)
                        }),
                        None => put_frame(&mut bytes, seq, RecordType::AttemptEnd, |out| {
                            let mut a = task(id, Status::Done, &mut Rng(5)).attempts;
                            a.resize_with(1, || Attempt {
                                client_id: 9,
                                client_ip: "127.0.0.1".parse().expect("ip"),
                                started_wall_ms: 1,
                                node: None,
                                outcome: Some(Outcome::Timeout),
                                error: Some(Box::from("late")),
                                duration_ms: 5,
                                answered: false,
                                restarted: false,
                                resumes: 0,
                                session: None,
                            });
                            codec::put_attempt_end(out, id, 1, &a[0])
                        }),
                    };
                }
                2 => {
                    let t = task(id, Status::Done, rng);
                    put_frame(&mut bytes, seq, RecordType::Task, |out| codec::put_task(out, &t));
                }
                _ => {
                    put_frame(&mut bytes, seq, RecordType::Forget, |out| codec::put_forget(out, id));
                }
            }
            frames.push((off, seq));
        }
        (bytes, frames)
    }

    fn seqs(scan: &Scan) -> Vec<u64> {
        scan.frames.iter().map(|f| f.seq).collect()
    }

    #[test]
    fn a_cut_anywhere_keeps_exactly_the_records_before_it() {
        let mut rng = Rng(12345);
        for round in 0..300 {
            let n = 1 + rng.below(40) as usize;
            let (bytes, frames) = segment(&mut rng, n);
            let cut = HEADER_BYTES + rng.below((bytes.len() - HEADER_BYTES) as u64 + 1) as usize;
            let scan = scan_segment(&bytes[..cut], true);
            // A frame is whole once its checksummed bytes are (its zero padding does not matter).
            let end = |i: usize| {
                let b = &bytes[frames[i].0..];
                frames[i].0 + 8 + u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
            };
            let whole: Vec<u64> = (0..frames.len()).filter(|&i| end(i) <= cut).map(|i| frames[i].1).collect();
            assert_eq!(seqs(&scan), whole, "round {round}, cut at {cut} of {}", bytes.len());
            assert!(scan.skipped.is_empty(), "round {round}: a cut is a torn tail, not corruption");
            // The torn tail starts where the first incomplete frame starts (none on a boundary).
            let expected_torn = (0..frames.len()).find(|&i| end(i) > cut).map(|i| frames[i].0).filter(|off| *off < cut);
            assert_eq!(scan.torn_at, expected_torn, "round {round}, cut at {cut}");
        }
    }

    #[test]
    fn a_prepared_segment_ends_at_its_zeros_without_damage() {
        let mut rng = Rng(4242);
        let (mut bytes, frames) = segment(&mut rng, 20);
        let end = bytes.len();
        bytes.resize(end + (1 << 16), 0);
        for last in [true, false] {
            let scan = scan_segment(&bytes, last);
            assert_eq!(scan.frames.len(), frames.len());
            assert_eq!((scan.skipped.len(), scan.torn_at, scan.zeros_at), (0, None, Some(end)), "last: {last}");
        }
        // A record torn before the zeros is a torn tail (last segment) as before.
        let mut torn = bytes.clone();
        torn[end..end + 12].copy_from_slice(&[200, 0, 0, 0, 1, 2, 3, 4, 9, 9, 9, 9]);
        let scan = scan_segment(&torn, true);
        assert_eq!((scan.frames.len(), scan.torn_at), (frames.len(), Some(end)));
    }

    #[test]
    fn crafted_plausible_garbage_cannot_make_the_resync_quadratic() {
        // Every 8-byte offset announces a frame reaching to the end of the segment, with a valid
        // type byte: each is a checksum candidate of up to the whole rest. Without a bound on
        // that work this is ~20 GB of CRC for 1 MiB; with it, a few MiB.
        let mut bytes = segment_header().to_vec();
        let n = 1 << 20;
        while bytes.len() < HEADER_BYTES + n {
            let rest = (HEADER_BYTES + n - bytes.len()) as u32;
            bytes.extend_from_slice(&(rest - 8).to_le_bytes());
            bytes.extend_from_slice(&[0xAB, 0xCD, 0xEF, 0x01]);
            bytes.extend_from_slice(&[7, 0, 0, 0, 0, 0, 0, 0]);
            bytes.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        }
        let started = std::time::Instant::now();
        let scan = scan_segment(&bytes, false);
        assert!(scan.frames.is_empty());
        assert_eq!(scan.skipped.len(), 1, "{:?}", scan.skipped);
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
    }

    #[test]
    fn a_damaged_frame_in_the_middle_loses_only_itself() {
        let mut rng = Rng(777);
        for round in 0..300 {
            let n = 3 + rng.below(40) as usize;
            let (bytes, frames) = segment(&mut rng, n);
            let victim = rng.below(frames.len() as u64 - 1) as usize; // not the last frame
            let start = frames[victim].0;
            let end = frames[victim + 1].0;
            let mut damaged = bytes.clone();
            let len = u32::from_le_bytes([bytes[start], bytes[start + 1], bytes[start + 2], bytes[start + 3]]) as usize;
            let at = start + rng.below(8 + len as u64) as usize; // len, crc, seq, type or payload
            damaged[at] ^= 1 << rng.below(8);
            let scan = scan_segment(&damaged, true);
            let expected: Vec<u64> = frames.iter().filter(|(off, _)| *off != start).map(|(_, s)| *s).collect();
            assert_eq!(seqs(&scan), expected, "round {round}, byte {at} of frame {victim}");
            assert_eq!(scan.skipped, vec![(start, end - start)], "round {round}");
            assert_eq!(scan.torn_at, None);
            // Not the last segment: the same.
            assert_eq!(seqs(&scan_segment(&damaged, false)), expected);
        }
    }

    /// A crash between naming a prepared file of zeros as the new segment and writing its
    /// header left an all-zero last segment, counted as corruption at every start. It is
    /// not: replay writes the header, and the segment is the one the next run appends to.
    /// An all-zero segment that is not the last is damage all the same.
    #[test]
    fn an_all_zero_last_segment_is_no_damage_and_gets_its_header() {
        let dir = std::env::temp_dir().join(format!("relay-replay-zeros-{}", uuid::Uuid::new_v4().simple()));
        fs::create_dir_all(&dir).expect("dir");
        let mut rng = Rng(31);
        let (first, frames) = segment(&mut rng, 5);
        fs::write(segment_path(&dir, 1), &first).expect("segment 1");
        fs::write(segment_path(&dir, 2), vec![0u8; 1 << 16]).expect("segment 2");
        for round in 0..2 {
            let r = replay(&dir, 1 << 20).expect("replay");
            assert_eq!((r.skipped, r.truncated_bytes, r.records), (0, 0, frames.len() as u64), "round {round}");
            let last = r.segments.last().copied().expect("segment 2");
            assert_eq!((last.num, last.bytes, last.appendable), (2, HEADER_BYTES as u64, true));
            assert!(codec::check_header(&fs::read(segment_path(&dir, 2)).expect("read")).is_ok());
        }
        fs::write(segment_path(&dir, 3), segment_header()).expect("segment 3");
        fs::write(segment_path(&dir, 2), vec![0u8; 1 << 16]).expect("zeros again");
        assert_eq!(replay(&dir, 1 << 20).expect("replay").skipped, 1, "not the last: damage");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn zeros_are_told_from_data_at_every_length() {
        for len in [0, 1, 7, 8, 4095, 4096, 4097, 12_345] {
            let mut b = vec![0u8; len];
            assert!(all_zero(&b), "{len}");
            for at in [0, len / 2, len.saturating_sub(1)] {
                if at < len {
                    b[at] = 1;
                    assert!(!all_zero(&b), "{len}: a byte at {at}");
                    b[at] = 0;
                }
            }
        }
    }

    #[test]
    fn replay_rebuilds_tasks_and_keeps_the_memory_budget() {
        let mut rng = Rng(99);
        let mut bytes = segment_header().to_vec();
        let mut seq = 0;
        for i in 0..200u128 {
            let t = task(i, Status::Done, &mut rng);
            seq += 1;
            put_frame(&mut bytes, seq, RecordType::Task, |out| codec::put_task(out, &t));
        }
        let pending = task(1000, Status::Pending, &mut rng);
        seq += 1;
        put_frame(&mut bytes, seq, RecordType::Task, |out| codec::put_task(out, &pending));
        seq += 1;
        put_frame(&mut bytes, seq, RecordType::Forget, |out| codec::put_forget(out, 3));
        let budget = 20 * (std::mem::size_of::<Task>() + 400);
        let r = replay_bytes(&[(1, &bytes)], budget);
        assert_eq!(r.records, 202);
        assert_eq!(r.tasks.len() + r.evicted.len(), 200, "199 finished + 1 pending");
        assert!(!r.evicted.is_empty() && r.tasks.len() < 60, "{} in memory", r.tasks.len());
        let in_memory: usize = r.tasks.iter().filter(|t| t.status.is_final()).map(|t| t.mem_bytes()).sum();
        assert!(in_memory <= budget);
        // The oldest left memory; the newest stayed.
        assert!(r.evicted.iter().any(|(id, _)| *id == 0));
        assert!(r.tasks.iter().any(|t| t.id == 199));
        assert!(r.tasks.iter().any(|t| t.id == 1000 && t.payload.is_some()));
        assert!(!r.tasks.iter().any(|t| t.id == 3) && !r.evicted.iter().any(|(id, _)| *id == 3));
        assert_eq!(r.next_lsn, seq + 1);
        assert_eq!(r.segments[0].pins as usize, r.tasks.len() + r.evicted.len());
    }
}
