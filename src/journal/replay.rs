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
use crate::tasks::{Evicted, Loc, Status, Stored, Task, TaskId, kind_hash};

/// A finished task that did not fit in `TASK_MEMORY`: only where to find it is kept.
pub struct Light {
    pub evicted: Evicted,
    pub finished_wall_ms: u64,
    pub idempotency: Option<Box<(Box<str>, Box<str>)>>,
}

pub struct Replayed {
    /// Tasks kept in memory (finished ones within the budget), as the journal left them.
    pub tasks: Vec<Task>,
    /// Finished tasks beyond the memory budget.
    pub evicted: Vec<(TaskId, Light)>,
    /// Tasks whose records span more segments than a task can pin: write them whole again.
    pub rehome: Vec<TaskId>,
    /// Segment numbers found, in order, with their size and how many records tasks still need
    /// in each.
    pub segments: Vec<SegmentInfo>,
    pub next_lsn: u64,
    pub records: u64,
    /// Damaged frames or regions skipped (not counting a torn tail).
    pub skipped: u64,
    pub truncated_bytes: u64,
    pub elapsed: Duration,
}

#[derive(Debug, Clone, Copy)]
pub struct SegmentInfo {
    pub num: u32,
    pub bytes: u64,
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
    /// `None` once evicted.
    task: Option<Task>,
    light: Option<Light>,
    /// Position in `finished` (to tell a stale queue entry from the current one).
    finished_at: u64,
    overflow: bool,
}

struct State {
    entries: HashMap<TaskId, Entry>,
    finished: VecDeque<(u64, TaskId)>,
    finished_count: u64,
    finished_bytes: usize,
    budget_bytes: usize,
    max_seq: u64,
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
                entry.task = Some(task);
                self.entries.insert(id, entry);
                self.evict_over_budget();
            }
            Record::AttemptStart { id, num, attempt } => {
                let Some(entry) = self.entries.get_mut(&id) else { return };
                let Some(task) = entry.task.as_mut().filter(|t| !t.status.is_final()) else { return };
                if task.attempts.len() + 1 != num as usize || task.attempts.last().is_some_and(|a| a.outcome.is_none())
                {
                    return;
                }
                task.attempts.push(attempt);
                task.status = Status::Dispatched;
                task.stored.lsn = seq;
                entry.overflow |= !pin(&mut task.stored, loc.seg);
            }
            Record::AttemptEnd { id, num, outcome, duration_ms, error } => {
                let Some(entry) = self.entries.get_mut(&id) else { return };
                let Some(task) = entry.task.as_mut().filter(|t| !t.status.is_final()) else { return };
                if task.attempts.len() != num as usize {
                    return;
                }
                let Some(a) = task.attempts.last_mut().filter(|a| a.outcome.is_none()) else { return };
                a.outcome = outcome;
                a.duration_ms = duration_ms;
                a.error = error;
                task.status = Status::Pending;
                task.stored.lsn = seq;
                entry.overflow |= !pin(&mut task.stored, loc.seg);
            }
            Record::Forget { id } => self.remove(id),
        }
    }

    fn remove(&mut self, id: TaskId) {
        if let Some(old) = self.entries.remove(&id)
            && let Some(t) = &old.task
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
            let Some(entry) = self.entries.get_mut(&id) else { continue };
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

/// The next offset after `from` (8-byte aligned) where a valid frame starts.
fn next_valid(bytes: &[u8], from: usize) -> Option<usize> {
    let mut off = from + 8;
    while off + codec::FRAME_PREFIX_BYTES <= bytes.len() {
        if plausible(bytes, off) && matches!(codec::frame_at(&bytes[off..]), FrameAt::Valid { .. }) {
            return Some(off);
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

/// Replays every segment in `dir`, keeping at most `budget_bytes` of finished tasks in memory.
/// Cuts a torn tail off the last segment (the only write replay makes).
pub fn replay(dir: &Path, budget_bytes: usize) -> io::Result<Replayed> {
    let started = Instant::now();
    let nums = list_segments(dir)?;
    let mut state = State {
        entries: HashMap::new(),
        finished: VecDeque::new(),
        finished_count: 0,
        finished_bytes: 0,
        budget_bytes,
        max_seq: 0,
    };
    let (mut records, mut skipped, mut truncated_bytes) = (0u64, 0u64, 0u64);
    let mut segments = Vec::with_capacity(nums.len());
    for (i, &num) in nums.iter().enumerate() {
        let last = i + 1 == nums.len();
        let path = segment_path(dir, num);
        let bytes = fs::read(&path)?;
        if let Err(why) = codec::check_header(&bytes) {
            if last && bytes.len() < HEADER_BYTES {
                // Created just before a crash, its header never written whole.
                crate::log!(Level::Warn, "journal: removing an incomplete last segment", file = path.display());
                fs::remove_file(&path)?;
                truncated_bytes += bytes.len() as u64;
                continue;
            }
            skipped += 1;
            crate::log!(Level::Error, "journal: segment skipped", file = path.display(), error = why);
            continue;
        }
        let mut off = HEADER_BYTES;
        while off < bytes.len() {
            match codec::frame_at(&bytes[off..]) {
                FrameAt::Valid { seq, kind, payload, total } => {
                    let loc = Loc { seg: num, off: off as u32, len: total as u32 };
                    match codec::decode(kind, payload) {
                        Some(record) => {
                            records += 1;
                            state.apply(seq, loc, record);
                        }
                        None => {
                            skipped += 1;
                            crate::log!(
                                Level::Error,
                                "journal: record with a valid checksum but unreadable content skipped",
                                file = path.display(),
                                offset = off
                            );
                        }
                    }
                    off += total;
                }
                FrameAt::Short | FrameAt::Bad => match next_valid(&bytes, off) {
                    Some(next) => {
                        skipped += 1;
                        crate::log!(
                            Level::Error,
                            "journal: damaged record skipped; the records after it are kept",
                            file = path.display(),
                            offset = off,
                            bytes_skipped = next - off
                        );
                        off = next;
                    }
                    None if last => {
                        crate::log!(
                            Level::Warn,
                            "journal: torn tail cut off (a write interrupted by a crash)",
                            file = path.display(),
                            offset = off,
                            bytes = bytes.len() - off
                        );
                        let file = fs::OpenOptions::new().write(true).open(&path)?;
                        file.set_len(off as u64)?;
                        file.sync_all()?;
                        truncated_bytes += (bytes.len() - off) as u64;
                        break;
                    }
                    None => {
                        skipped += 1;
                        crate::log!(
                            Level::Error,
                            "journal: damaged end of a segment skipped",
                            file = path.display(),
                            offset = off,
                            bytes_skipped = bytes.len() - off
                        );
                        break;
                    }
                },
            }
        }
        segments.push(SegmentInfo {
            num,
            bytes: off.min(bytes.len()) as u64,
            modified_wall_ms: modified_wall_ms(&path),
            pins: 0,
        });
    }

    let mut pins: BTreeMap<u32, u32> = BTreeMap::new();
    let mut tasks = Vec::new();
    let mut evicted = Vec::new();
    let mut rehome = Vec::new();
    for (id, entry) in state.entries {
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
    for seg in &mut segments {
        seg.pins = pins.get(&seg.num).copied().unwrap_or(0);
    }
    Ok(Replayed {
        tasks,
        evicted,
        rehome,
        segments,
        next_lsn: state.max_seq + 1,
        records,
        skipped,
        truncated_bytes,
        elapsed: started.elapsed(),
    })
}
