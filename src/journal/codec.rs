//! The journal's bytes: segment headers, frames, and the records inside them. Pure: no I/O, no
//! clock. Every decoder takes untrusted bytes (a damaged disk, a planted file) and answers
//! `None`/`Err` for anything malformed, never panics.
//!
//! Frame (8-byte aligned, little-endian):
//! `len: u32 | crc: u32 | seq: u64 | type: u8 | payload | zero padding to a multiple of 8`,
//! where `len` counts `seq`, `type` and the payload, and `crc` is CRC-32C over those `len` bytes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde_json::value::RawValue;

use super::crc::crc32c;
use crate::tasks::{Attempt, Outcome, RetryPolicy, Status, Stored, Task, TaskId};

/// Every segment file starts with these 16 bytes: magic, format version, reserved.
pub const SEGMENT_MAGIC: &[u8; 8] = b"relayjnl";
pub const FORMAT_VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 16;
/// `len | crc`.
pub const FRAME_PREFIX_BYTES: usize = 8;
/// The largest `len` a frame may declare (a task with a payload and a result of
/// MAX_MESSAGE_SIZE each stays far below; anything above is damage).
pub const MAX_FRAME_LEN: usize = 1 << 30;

/// The largest record payload the journal writes: a frame's `len` also counts `seq` and `type`.
/// Every encoder keeps within it, so replay never takes an acknowledged record for damage.
pub const MAX_RECORD_BYTES: usize = MAX_FRAME_LEN - 9;

pub use crate::tasks::{CUT_MARK, MAX_ERROR_BYTES, cut_error};

/// What an attempt's error says in a record that had to leave it out to stay within
/// [`MAX_RECORD_BYTES`] (only an attempt log of thousands of long errors gets there).
pub const ERROR_LEFT_OUT: &str = "[error text left out: the task's attempt log reached the journal's record limit]";

/// The error a restart writes into the attempt it closes.
pub const RESTART_ERROR: &str = "relay restarted while this attempt was running";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordType {
    /// The whole state of a task: on submit, when it becomes final, and when compaction
    /// carries it forward. Replaces whatever replay knew of the task.
    Task = 1,
    AttemptStart = 2,
    AttemptEnd = 3,
    /// TASK_TTL passed: the task is gone.
    Forget = 4,
    /// A kind's dispatch policy was set or removed (SPEC §14). Replaces the kind's earlier one.
    /// (A number far from the task records', which other record types may take.)
    KindPolicy = 16,
    /// A kind's `rate` bucket, or one lane's `rate_per_key` bucket, as a dispatch left it: a
    /// restart must not refill it (SPEC §14). Belongs to the kind's newest policy record.
    KindBucket = 17,
}

impl RecordType {
    fn from_u8(b: u8) -> Option<RecordType> {
        match b {
            1 => Some(RecordType::Task),
            2 => Some(RecordType::AttemptStart),
            3 => Some(RecordType::AttemptEnd),
            4 => Some(RecordType::Forget),
            16 => Some(RecordType::KindPolicy),
            17 => Some(RecordType::KindBucket),
            _ => None,
        }
    }
}

pub fn segment_header() -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h
}

/// Checks a segment's header; the error says what is wrong.
pub fn check_header(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < HEADER_BYTES {
        return Err("shorter than its header".into());
    }
    if &bytes[..8] != SEGMENT_MAGIC {
        return Err("not a relay journal segment (bad magic)".into());
    }
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if version != FORMAT_VERSION {
        return Err(format!("journal format version {version}, this relay reads {FORMAT_VERSION}"));
    }
    Ok(())
}

pub fn align8(n: usize) -> usize {
    (n + 7) & !7
}

/// Appends one frame around the payload that `fill` writes. Returns the frame's length.
pub fn put_frame(out: &mut Vec<u8>, seq: u64, kind: RecordType, fill: impl FnOnce(&mut Vec<u8>)) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_PREFIX_BYTES]);
    out.extend_from_slice(&seq.to_le_bytes());
    out.push(kind as u8);
    fill(out);
    let len = out.len() - start - FRAME_PREFIX_BYTES;
    let crc = crc32c(&out[start + FRAME_PREFIX_BYTES..]);
    out[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    out.resize(start + align8(FRAME_PREFIX_BYTES + len), 0);
    out.len() - start
}

/// What is at an offset of a segment.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameAt<'a> {
    /// A valid frame: its sequence number, type byte, payload, and total (padded) length.
    Valid { seq: u64, kind: u8, payload: &'a [u8], total: usize },
    /// Not enough bytes for the frame its length announces (or for a prefix).
    Short,
    /// The bytes are there but are not a valid frame.
    Bad,
}

/// Reads the frame at the start of `bytes`.
pub fn frame_at(bytes: &[u8]) -> FrameAt<'_> {
    if bytes.len() < FRAME_PREFIX_BYTES {
        return FrameAt::Short;
    }
    let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
    let crc = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    if !(9..=MAX_FRAME_LEN).contains(&len) {
        return FrameAt::Bad;
    }
    let total = align8(FRAME_PREFIX_BYTES + len);
    if bytes.len() < FRAME_PREFIX_BYTES + len {
        return FrameAt::Short;
    }
    let body = &bytes[FRAME_PREFIX_BYTES..FRAME_PREFIX_BYTES + len];
    if crc32c(body) != crc {
        return FrameAt::Bad;
    }
    let mut seq = [0u8; 8];
    seq.copy_from_slice(&body[..8]);
    FrameAt::Valid { seq: u64::from_le_bytes(seq), kind: body[8], payload: &body[9..], total: total.min(bytes.len()) }
}

// ----- records -------------------------------------------------------------------------------

const F_QUEUED: u16 = 1;
const F_RUN_AT: u16 = 1 << 1;
const F_KIND: u16 = 1 << 2;
const F_PAYLOAD: u16 = 1 << 3;
const F_RESULT: u16 = 1 << 4;
const F_ERROR: u16 = 1 << 5;
const F_IDEMPOTENCY: u16 = 1 << 6;
const F_FINISHED: u16 = 1 << 7;
/// A priority other than 0 follows the idempotency key (SPEC §14). High bits for flow control:
/// records written before it never set them.
const F_PRIORITY: u16 = 1 << 14;

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u128(out: &mut Vec<u8>, v: u128) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u32(out, s.len() as u32);
    out.extend_from_slice(s.as_bytes());
}
fn put_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            out.push(4);
            out.extend_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            out.push(6);
            out.extend_from_slice(&v6.octets());
        }
    }
}
fn outcome_code(o: Option<Outcome>) -> u8 {
    o.map_or(0, |o| Outcome::ALL.iter().position(|x| *x == o).map_or(0, |i| i as u8 + 1))
}

/// The whole state of `task` (the payload only while it is not final), within
/// [`MAX_RECORD_BYTES`].
pub fn put_task(out: &mut Vec<u8>, t: &Task) {
    put_task_within(out, t, MAX_RECORD_BYTES);
}

fn ip_len(ip: IpAddr) -> usize {
    if ip.is_ipv4() { 5 } else { 17 }
}

/// Bytes an error takes in a record (cut as [`cut_error`] cuts it).
fn error_len(e: &str) -> usize {
    if e.len() <= MAX_ERROR_BYTES { e.len() } else { cut_error(e).len() }
}

/// Bytes one attempt takes in a Task record, its error `error_bytes` long (if it has one).
fn attempt_len(a: &Attempt, error_bytes: Option<usize>) -> usize {
    16 + ip_len(a.client_ip) + 8 + 1 + 8 + 1 + error_bytes.map_or(0, |n| 4 + n)
}

/// Bytes of a Task record's payload without its attempts (their count included).
fn task_fixed_len(t: &Task) -> usize {
    let s = |x: Option<usize>| x.map_or(0, |n| 4 + n);
    16 + 2
        + 1
        + 8
        + 8
        + 4
        + 8
        + t.run_at_wall_ms.map_or(0, |_| 8)
        + t.finished_wall_ms.map_or(0, |_| 8)
        + s(t.kind.as_ref().map(|k| k.len()))
        + s(t.payload.as_ref().map(|p| p.get().len()))
        + s(t.result.as_ref().map(|r| r.get().len()))
        + s(t.error.as_deref().map(error_len))
        + t.idempotency.as_ref().map_or(0, |k| 8 + k.0.len() + k.1.len())
        + if t.priority != 0 { 4 } else { 0 }
        + open_session(t).map_or(0, |s| 3 + session_len(s))
        + if has_fairness(t) { 3 + fairness_len(t) } else { 0 }
        + 4
        + Ext::of(t).len()
}

/// The session of a task's open attempt, if it has one.
fn open_session(t: &Task) -> Option<&crate::tasks::SessionTag> {
    t.attempts.last().filter(|a| a.outcome.is_none()).and_then(|a| a.session.as_deref())
}

/// How a Task record fits in `limit`: the first `left_out` attempts carry [`ERROR_LEFT_OUT`]
/// instead of their error, and the first `skipped` are not written at all.
fn fit_attempts(t: &Task, limit: usize) -> (usize, usize) {
    let n = t.attempts.len();
    let fixed = task_fixed_len(t);
    // The common case at a glance: even every attempt at its largest fits.
    if fixed.saturating_add(n.saturating_mul(attempt_len_max())) <= limit {
        return (0, 0);
    }
    let mut total = fixed + t.attempts.iter().map(|a| attempt_len(a, a.error.as_deref().map(error_len))).sum::<usize>();
    let mut left_out = 0;
    while total > limit && left_out < n {
        if let Some(e) = t.attempts[left_out].error.as_deref() {
            let len = error_len(e);
            if len > ERROR_LEFT_OUT.len() {
                total -= len - ERROR_LEFT_OUT.len();
            }
        }
        left_out += 1;
    }
    // (Beyond any real attempt log: tens of millions of attempts.) The newest one stays.
    let mut skipped = 0;
    while total > limit && skipped + 1 < n {
        let a = &t.attempts[skipped];
        total -= attempt_len(a, a.error.as_deref().map(|e| error_len(e).min(ERROR_LEFT_OUT.len())));
        skipped += 1;
    }
    (left_out, skipped)
}

/// The largest an attempt can take in a record.
const fn attempt_len_max() -> usize {
    16 + 17 + 8 + 1 + 8 + 1 + 4 + MAX_ERROR_BYTES
}

fn put_error(out: &mut Vec<u8>, e: &str) {
    put_str(out, &cut_error(e));
}

/// [`put_task`] within `limit` bytes of payload: an attempt log too long for it loses the
/// error texts of its oldest attempts first, then its oldest attempts. Payload and result are
/// bounded by MAX_MESSAGE_SIZE (256 MiB) and errors by [`MAX_ERROR_BYTES`], so only a log of
/// many thousands of attempts can reach the limit.
pub fn put_task_within(out: &mut Vec<u8>, t: &Task, limit: usize) {
    let (left_out, skipped) = fit_attempts(t, limit);
    let mut flags = 0u16;
    let set = |flags: &mut u16, bit: u16, on: bool| {
        if on {
            *flags |= bit;
        }
    };
    set(&mut flags, F_QUEUED, t.queued);
    set(&mut flags, F_RUN_AT, t.run_at_wall_ms.is_some());
    set(&mut flags, F_KIND, t.kind.is_some());
    set(&mut flags, F_PAYLOAD, t.payload.is_some());
    set(&mut flags, F_RESULT, t.result.is_some());
    set(&mut flags, F_ERROR, t.error.is_some());
    set(&mut flags, F_IDEMPOTENCY, t.idempotency.is_some());
    set(&mut flags, F_FINISHED, t.finished_wall_ms.is_some());
    set(&mut flags, F_PRIORITY, t.priority != 0);
    put_u128(out, t.id);
    out.extend_from_slice(&flags.to_le_bytes());
    out.push(t.status as u8);
    put_u64(out, t.submit_seq);
    put_u64(out, t.created_wall_ms);
    put_u32(out, t.max_retries);
    put_u64(out, t.timeout_ms);
    if let Some(at) = t.run_at_wall_ms {
        put_u64(out, at);
    }
    if let Some(at) = t.finished_wall_ms {
        put_u64(out, at);
    }
    if let Some(k) = &t.kind {
        put_str(out, k);
    }
    if let Some(p) = &t.payload {
        put_str(out, p.get());
    }
    if let Some(r) = &t.result {
        put_str(out, r.get());
    }
    if let Some(e) = &t.error {
        put_error(out, e);
    }
    if let Some(idem) = &t.idempotency {
        put_str(out, &idem.0);
        put_str(out, &idem.1);
    }
    if t.priority != 0 {
        out.extend_from_slice(&t.priority.to_le_bytes());
    }
    put_u32(out, (t.attempts.len() - skipped) as u32);
    for (i, a) in t.attempts.iter().enumerate().skip(skipped) {
        put_u128(out, a.client_id);
        put_ip(out, a.client_ip);
        put_u64(out, a.started_wall_ms);
        out.push(outcome_code(a.outcome));
        put_u64(out, a.duration_ms);
        match &a.error {
            Some(e) if i < left_out && error_len(e) > ERROR_LEFT_OUT.len() => {
                out.push(1);
                put_str(out, ERROR_LEFT_OUT);
            }
            Some(e) => {
                out.push(1);
                put_error(out, e);
            }
            None => out.push(0),
        }
    }
    Ext::of(t).put(out);
    if let Some(s) = open_session(t) {
        put_session(out, s);
    }
    if has_fairness(t) {
        out.push(EXT_FAIRNESS);
        out.extend_from_slice(&(fairness_len(t) as u16).to_le_bytes());
        put_str(out, &t.submitter);
        put_str(out, &t.key);
    }
}

/// A task submitted by a scoped token or with a key carries both (tag [`EXT_FAIRNESS`]).
fn has_fairness(t: &Task) -> bool {
    !t.submitter.is_empty() || !t.key.is_empty()
}

/// Bytes of the fairness field's value (a jti and a key are short: at most a few hundred).
fn fairness_len(t: &Task) -> usize {
    8 + t.submitter.len() + t.key.len()
}

/// The session field of the optional fields (tag [`EXT_SESSION`]): worker id and secret.
fn put_session(out: &mut Vec<u8>, s: &crate::tasks::SessionTag) {
    out.push(EXT_SESSION);
    out.extend_from_slice(&(session_len(s) as u16).to_le_bytes());
    put_str(out, &s.worker_id);
    put_str(out, &s.secret);
}

/// Bytes of a session field's value (worker ids and secrets are at most 128 bytes each).
fn session_len(s: &crate::tasks::SessionTag) -> usize {
    8 + s.worker_id.len() + s.secret.len()
}

/// Optional fields after a record's fixed ones (added after the format's first release, so a
/// journal written before them still replays): zero or more `tag: u8 | len: u16 | bytes`. A
/// decoder skips a tag it does not know. Tags: 1 `next_attempt_wall_ms` (u64), 2 `again`
/// (u128), 3 the retry policy (flags u8: 1 backoff, 2 backoff_max, 4 any_worker given,
/// 8 any_worker; then backoff u64, backoff_max u64), 4 the session of the open attempt (in a
/// Task or AttemptStart record: worker id and secret, two strings; SPEC §12), 5 re-runs (reruns
/// u32, rerun_base u32), 6 fairness (Task records: submitter and key, two strings; SPEC §14).
/// Further fields take further tags.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Ext {
    pub next_attempt_wall_ms: Option<u64>,
    pub again: Option<u128>,
    pub retry: RetryPolicy,
    /// (Task records only) `POST /tasks/{id}/retry`: how many, and the attempts before this run.
    pub reruns: u32,
    pub rerun_base: u32,
}

const EXT_NEXT_ATTEMPT: u8 = 1;
const EXT_AGAIN: u8 = 2;
const EXT_RETRY: u8 = 3;
const EXT_SESSION: u8 = 4;
const EXT_RERUNS: u8 = 5;
const EXT_FAIRNESS: u8 = 6;

impl Ext {
    pub fn of(t: &Task) -> Ext {
        Ext {
            next_attempt_wall_ms: t.next_attempt_wall_ms,
            again: t.again,
            retry: t.retry,
            reruns: t.reruns,
            rerun_base: t.rerun_base,
        }
    }

    /// Bytes it takes in a record.
    fn len(&self) -> usize {
        self.next_attempt_wall_ms.map_or(0, |_| 3 + 8)
            + self.again.map_or(0, |_| 3 + 16)
            + if self.retry.is_default() { 0 } else { 3 + 17 }
            + if self.reruns == 0 { 0 } else { 3 + 8 }
    }

    fn put(&self, out: &mut Vec<u8>) {
        if let Some(at) = self.next_attempt_wall_ms {
            out.push(EXT_NEXT_ATTEMPT);
            out.extend_from_slice(&8u16.to_le_bytes());
            put_u64(out, at);
        }
        if let Some(c) = self.again {
            out.push(EXT_AGAIN);
            out.extend_from_slice(&16u16.to_le_bytes());
            put_u128(out, c);
        }
        if !self.retry.is_default() {
            let r = self.retry;
            let flags = u8::from(r.backoff_ms.is_some())
                | u8::from(r.backoff_max_ms.is_some()) << 1
                | u8::from(r.any_worker.is_some()) << 2
                | u8::from(r.any_worker == Some(true)) << 3;
            out.push(EXT_RETRY);
            out.extend_from_slice(&17u16.to_le_bytes());
            out.push(flags);
            put_u64(out, r.backoff_ms.unwrap_or(0));
            put_u64(out, r.backoff_max_ms.unwrap_or(0));
        }
        if self.reruns > 0 {
            out.push(EXT_RERUNS);
            out.extend_from_slice(&8u16.to_le_bytes());
            put_u32(out, self.reruns);
            put_u32(out, self.rerun_base);
        }
    }

    /// Reads what is left of a record (nothing: no extension).
    fn decode(d: &mut Dec<'_>) -> Option<Ext> {
        Ext::decode_with_session(d).map(|(ext, _)| ext)
    }

    /// [`Ext::decode`], and the session field (which is not `Copy`, so kept apart).
    fn decode_with_session(d: &mut Dec<'_>) -> Option<(Ext, Option<crate::tasks::SessionTag>)> {
        Ext::decode_all(d).map(|(ext, session, _)| (ext, session))
    }

    /// [`Ext::decode_with_session`], and the fairness field (submitter, key).
    fn decode_all(d: &mut Dec<'_>) -> Option<(Ext, Option<crate::tasks::SessionTag>, Fairness)> {
        let mut ext = Ext::default();
        let mut session = None;
        let mut fairness = Fairness::default();
        while !d.done() {
            let tag = d.u8()?;
            let len = d.u16()? as usize;
            let mut f = Dec { b: d.take(len)? };
            match tag {
                EXT_NEXT_ATTEMPT => ext.next_attempt_wall_ms = Some(f.u64()?),
                EXT_AGAIN => ext.again = Some(f.u128()?),
                EXT_RETRY => {
                    let flags = f.u8()?;
                    let (backoff, max) = (f.u64()?, f.u64()?);
                    ext.retry = RetryPolicy {
                        backoff_ms: (flags & 1 != 0).then_some(backoff),
                        backoff_max_ms: (flags & 2 != 0).then_some(max),
                        any_worker: (flags & 4 != 0).then_some(flags & 8 != 0),
                    };
                }
                EXT_RERUNS => {
                    ext.reruns = f.u32()?;
                    ext.rerun_base = f.u32()?;
                }
                EXT_SESSION => session = Some(f.session()?),
                EXT_FAIRNESS => fairness = (Box::from(f.str()?), Box::from(f.str()?)),
                _ => continue,
            }
            if !f.done() {
                return None;
            }
        }
        Some((ext, session, fairness))
    }
}

/// A task's submitter and key (SPEC §14; empty: the root token, no key).
type Fairness = (Box<str>, Box<str>);

/// An attempt's start; a session worker's carries its worker id and secret after the fields
/// older records have (which decode as before: no session).
pub fn put_attempt_start(out: &mut Vec<u8>, id: TaskId, num: u32, a: &Attempt) {
    put_u128(out, id);
    put_u32(out, num);
    put_u128(out, a.client_id);
    put_ip(out, a.client_ip);
    put_u64(out, a.started_wall_ms);
    if let Some(s) = &a.session {
        put_session(out, s);
    }
}

pub fn put_attempt_end(out: &mut Vec<u8>, id: TaskId, num: u32, a: &Attempt) {
    put_attempt_end_with(out, id, num, a, &Ext::default());
}

/// [`put_attempt_end`] with what a retry waits for (`ext`: its backoff and `again`).
pub fn put_attempt_end_with(out: &mut Vec<u8>, id: TaskId, num: u32, a: &Attempt, ext: &Ext) {
    put_u128(out, id);
    put_u32(out, num);
    out.push(outcome_code(a.outcome));
    put_u64(out, a.duration_ms);
    match &a.error {
        Some(e) => {
            out.push(1);
            put_error(out, e);
        }
        None => out.push(0),
    }
    // (The policy is the task's, in its Task record; an attempt's end says how its retry waits.)
    Ext { next_attempt_wall_ms: ext.next_attempt_wall_ms, again: ext.again, ..Ext::default() }.put(out);
}

pub fn put_forget(out: &mut Vec<u8>, id: TaskId) {
    put_u128(out, id);
}

/// A kind's policy (its JSON), or its removal (`None`).
pub fn put_kind_policy(out: &mut Vec<u8>, kind: &str, policy: Option<&str>) {
    put_str(out, kind);
    match policy {
        Some(p) => {
            out.push(1);
            put_str(out, p);
        }
        None => out.push(0),
    }
}

/// A kind's bucket (`lane`: a lane's, by submitter and key): its tokens when counted at `at_ms`.
pub fn put_kind_bucket(out: &mut Vec<u8>, kind: &str, lane: Option<(&str, &str)>, tokens: f64, at_ms: u64) {
    put_str(out, kind);
    match lane {
        Some((submitter, key)) => {
            out.push(1);
            put_str(out, submitter);
            put_str(out, key);
        }
        None => out.push(0),
    }
    put_u64(out, tokens.to_bits());
    put_u64(out, at_ms);
}

/// A task as a Task record holds it.
#[derive(Debug)]
pub struct TaskImage {
    pub id: TaskId,
    pub status: Status,
    pub queued: bool,
    pub submit_seq: u64,
    pub created_wall_ms: u64,
    pub max_retries: u32,
    pub timeout_ms: u64,
    pub run_at_wall_ms: Option<u64>,
    pub finished_wall_ms: Option<u64>,
    pub kind: Option<Box<str>>,
    pub payload: Option<Box<RawValue>>,
    pub result: Option<Box<RawValue>>,
    pub error: Option<Box<str>>,
    pub idempotency: Option<Box<(Box<str>, Box<str>)>>,
    pub priority: i32,
    pub submitter: Box<str>,
    pub key: Box<str>,
    pub attempts: Vec<Attempt>,
    pub ext: Ext,
}

impl TaskImage {
    /// The task as the core holds it; clocks and queue places are the core's to set.
    pub fn into_task(self, stored: Stored) -> Task {
        Task {
            id: self.id,
            status: self.status,
            kind: self.kind,
            payload: self.payload.map(Into::into),
            created_wall_ms: self.created_wall_ms,
            run_at_wall_ms: self.run_at_wall_ms,
            due_wall_ms: self.run_at_wall_ms.unwrap_or(self.created_wall_ms),
            finished_wall_ms: self.finished_wall_ms,
            result: self.result,
            error: self.error,
            attempts: self.attempts,
            max_retries: self.max_retries,
            timeout_ms: self.timeout_ms,
            queued: self.queued,
            submit_seq: self.submit_seq,
            idempotency: self.idempotency,
            retry: self.ext.retry,
            next_attempt_wall_ms: self.ext.next_attempt_wall_ms,
            again: self.ext.again,
            reruns: self.ext.reruns,
            rerun_base: self.ext.rerun_base,
            priority: self.priority,
            submitter: self.submitter,
            key: self.key,
            stored,
            ..Task::default()
        }
    }
}

#[derive(Debug)]
pub enum Record {
    Task(Box<TaskImage>),
    AttemptStart {
        id: TaskId,
        num: u32,
        attempt: Attempt,
    },
    AttemptEnd {
        id: TaskId,
        num: u32,
        outcome: Option<Outcome>,
        duration_ms: u64,
        error: Option<Box<str>>,
        ext: Ext,
    },
    Forget {
        id: TaskId,
    },
    /// `policy`: the policy's JSON (`None`: removed).
    KindPolicy {
        kind: Box<str>,
        policy: Option<Box<str>>,
    },
    /// `lane`: (submitter, key), or `None` for the kind's own bucket.
    KindBucket {
        kind: Box<str>,
        lane: Option<(Box<str>, Box<str>)>,
        tokens: f64,
        at_ms: u64,
    },
}

/// A cursor over a record's payload.
struct Dec<'a> {
    b: &'a [u8],
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Some(u64::from_le_bytes(a))
    }
    fn u128(&mut self) -> Option<u128> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16)?);
        Some(u128::from_le_bytes(a))
    }
    fn str(&mut self) -> Option<&'a str> {
        let n = self.u32()? as usize;
        std::str::from_utf8(self.take(n)?).ok()
    }
    fn json(&mut self) -> Option<Box<RawValue>> {
        RawValue::from_string(self.str()?.to_owned()).ok()
    }
    fn ip(&mut self) -> Option<IpAddr> {
        match self.u8()? {
            4 => {
                let b = self.take(4)?;
                Some(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])))
            }
            6 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(self.take(16)?);
                Some(IpAddr::V6(Ipv6Addr::from(a)))
            }
            _ => None,
        }
    }
    fn outcome(&mut self) -> Option<Option<Outcome>> {
        match self.u8()? {
            0 => Some(None),
            n => Outcome::ALL.get(n as usize - 1).copied().map(Some),
        }
    }
    fn opt_error(&mut self) -> Option<Option<Box<str>>> {
        match self.u8()? {
            0 => Some(None),
            1 => Some(Some(Box::from(self.str()?))),
            _ => None,
        }
    }
    fn done(&self) -> bool {
        self.b.is_empty()
    }
    fn session(&mut self) -> Option<crate::tasks::SessionTag> {
        let worker_id = Box::from(self.str()?);
        let secret = Box::from(self.str()?);
        Some(crate::tasks::SessionTag { worker_id, secret })
    }
}

/// An attempt read back from the journal: no connection, and marked when a restart closed it.
fn restored_attempt(client_id: u128, ip: IpAddr, started_wall_ms: u64) -> Attempt {
    Attempt::new(client_id, ip, started_wall_ms)
}

fn status_from(b: u8) -> Option<Status> {
    [Status::Pending, Status::Dispatched, Status::Done, Status::Failed, Status::Canceled].get(b as usize).copied()
}

fn decode_task(d: &mut Dec<'_>) -> Option<TaskImage> {
    let id = d.u128()?;
    let flags = d.u16()?;
    let status = status_from(d.u8()?)?;
    let submit_seq = d.u64()?;
    let created_wall_ms = d.u64()?;
    let max_retries = d.u32()?;
    let timeout_ms = d.u64()?;
    let run_at_wall_ms = if flags & F_RUN_AT != 0 { Some(d.u64()?) } else { None };
    let finished_wall_ms = if flags & F_FINISHED != 0 { Some(d.u64()?) } else { None };
    let kind = if flags & F_KIND != 0 { Some(Box::from(d.str()?)) } else { None };
    let payload = if flags & F_PAYLOAD != 0 { Some(d.json()?) } else { None };
    let result = if flags & F_RESULT != 0 { Some(d.json()?) } else { None };
    let error = if flags & F_ERROR != 0 { Some(Box::from(d.str()?)) } else { None };
    let idempotency =
        if flags & F_IDEMPOTENCY != 0 { Some(Box::new((Box::from(d.str()?), Box::from(d.str()?)))) } else { None };
    let priority = if flags & F_PRIORITY != 0 { d.u32()? as i32 } else { 0 };
    let n = d.u32()? as usize;
    // Each attempt takes at least 38 bytes: a count beyond what is left is damage.
    if n > d.b.len() / 38 {
        return None;
    }
    let mut attempts = Vec::with_capacity(n);
    for _ in 0..n {
        let mut a = restored_attempt(d.u128()?, d.ip()?, d.u64()?);
        a.outcome = d.outcome()?;
        a.duration_ms = d.u64()?;
        a.error = d.opt_error()?;
        a.restarted = a.outcome == Some(Outcome::Disconnect) && a.error.as_deref() == Some(RESTART_ERROR);
        attempts.push(a);
    }
    let (ext, session, (submitter, key)) = Ext::decode_all(d)?;
    if let Some(s) = session
        && let Some(a) = attempts.last_mut().filter(|a| a.outcome.is_none())
    {
        a.session = Some(Box::new(s));
    }
    Some(TaskImage {
        id,
        status,
        queued: flags & F_QUEUED != 0,
        submit_seq,
        created_wall_ms,
        max_retries,
        timeout_ms,
        run_at_wall_ms,
        finished_wall_ms,
        kind,
        payload,
        result,
        error,
        idempotency,
        priority,
        submitter,
        key,
        attempts,
        ext,
    })
}

/// Decodes a record of type `kind`. `None`: unknown type or malformed payload.
pub fn decode(kind: u8, payload: &[u8]) -> Option<Record> {
    let mut d = Dec { b: payload };
    let record = match RecordType::from_u8(kind)? {
        RecordType::Task => Record::Task(Box::new(decode_task(&mut d)?)),
        RecordType::AttemptStart => {
            let id = d.u128()?;
            let num = d.u32()?;
            let mut attempt = restored_attempt(d.u128()?, d.ip()?, d.u64()?);
            // (Optional fields: the session; a start written without them has none.)
            let (_, session) = Ext::decode_with_session(&mut d)?;
            attempt.session = session.map(Box::new);
            Record::AttemptStart { id, num, attempt }
        }
        RecordType::AttemptEnd => Record::AttemptEnd {
            id: d.u128()?,
            num: d.u32()?,
            outcome: d.outcome()?,
            duration_ms: d.u64()?,
            error: d.opt_error()?,
            ext: Ext::decode(&mut d)?,
        },
        RecordType::Forget => Record::Forget { id: d.u128()? },
        RecordType::KindPolicy => {
            let kind = Box::from(d.str()?);
            let policy = match d.u8()? {
                0 => None,
                1 => Some(Box::from(d.str()?)),
                _ => return None,
            };
            Record::KindPolicy { kind, policy }
        }
        RecordType::KindBucket => {
            let kind = Box::from(d.str()?);
            let lane = match d.u8()? {
                0 => None,
                1 => Some((Box::from(d.str()?), Box::from(d.str()?))),
                _ => return None,
            };
            let tokens = f64::from_bits(d.u64()?);
            Record::KindBucket { kind, lane, tokens, at_ms: d.u64()? }
        }
    };
    d.done().then_some(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_detect_damage() {
        let mut buf = Vec::new();
        let n = put_frame(&mut buf, 42, RecordType::Forget, |out| put_forget(out, 7));
        assert_eq!(n % 8, 0);
        assert_eq!(n, buf.len());
        match frame_at(&buf) {
            FrameAt::Valid { seq, kind, payload, total } => {
                assert_eq!((seq, kind, total), (42, RecordType::Forget as u8, n));
                assert!(matches!(decode(kind, payload), Some(Record::Forget { id: 7 })));
            }
            other => panic!("{other:?}"),
        }
        for cut in 0..FRAME_PREFIX_BYTES + 9 + 16 {
            assert_eq!(frame_at(&buf[..cut]), FrameAt::Short, "cut at {cut}");
        }
        for i in 4..FRAME_PREFIX_BYTES + 9 + 16 {
            let mut bad = buf.clone();
            bad[i] ^= 0x40;
            assert_eq!(frame_at(&bad), FrameAt::Bad, "flip at {i}");
        }
        assert_eq!(frame_at(&[0u8; 64]), FrameAt::Bad);
    }

    #[test]
    fn decoders_refuse_trailing_bytes_and_unknown_types() {
        let mut p = Vec::new();
        put_forget(&mut p, 1);
        p.push(0);
        assert!(decode(RecordType::Forget as u8, &p).is_none());
        assert!(decode(99, &[]).is_none());
        assert!(decode(RecordType::Task as u8, &[1, 2, 3]).is_none());
    }

    #[test]
    fn a_long_error_is_cut_to_64_kib_at_a_character_boundary_and_says_so() {
        assert!(matches!(cut_error("short"), std::borrow::Cow::Borrowed("short")));
        let exact = "x".repeat(MAX_ERROR_BYTES);
        assert!(matches!(cut_error(&exact), std::borrow::Cow::Borrowed(_)), "64 KiB exactly is kept whole");
        for pad in 0..4 {
            // Multi-byte characters at every alignment: the cut never splits one.
            let long = format!("{}{}", "a".repeat(pad), "é€😀".repeat(MAX_ERROR_BYTES / 4));
            let cut = cut_error(&long);
            assert!(cut.len() <= MAX_ERROR_BYTES, "{}", cut.len());
            let (kept, note) = cut.split_once(CUT_MARK).expect("marked");
            assert!(long.starts_with(kept) && kept.len() > MAX_ERROR_BYTES - 64);
            assert_eq!(note, format!("{} bytes]", long.len() - kept.len()));
            // Cutting what was cut changes nothing: memory and journal agree.
            assert_eq!(cut_error(&cut), cut);
        }
    }

    fn task_with_attempts(n: usize, error_bytes: usize) -> Task {
        let mut t = TaskImage {
            id: 9,
            status: Status::Failed,
            queued: false,
            submit_seq: 1,
            created_wall_ms: 1,
            max_retries: 100,
            timeout_ms: 1000,
            run_at_wall_ms: None,
            finished_wall_ms: Some(2),
            kind: Some(Box::from("k")),
            payload: None,
            result: None,
            error: Some(Box::from("last")),
            idempotency: None,
            priority: 0,
            submitter: "".into(),
            key: "".into(),
            attempts: Vec::new(),
            ext: Ext::default(),
        }
        .into_task(Stored::default());
        for i in 0..n {
            let mut a = restored_attempt(i as u128, IpAddr::V4(Ipv4Addr::LOCALHOST), i as u64);
            a.outcome = Some(Outcome::Failed);
            a.error = (error_bytes > 0).then(|| Box::from(format!("{i:06}{}", "e".repeat(error_bytes))));
            t.attempts.push(a);
        }
        t
    }

    /// A session worker's open attempt keeps its worker id and secret, in the attempt's start
    /// and in the task's record (SPEC §12); a start written without them (older records) still
    /// decodes, without a session.
    #[test]
    fn an_open_attempt_keeps_its_session() {
        let tag = crate::tasks::SessionTag { worker_id: "w-1".into(), secret: "s".repeat(64).into() };
        let mut t = task_with_attempts(2, 10);
        t.status = Status::Dispatched;
        t.finished_wall_ms = None;
        t.error = None;
        let mut open = restored_attempt(7, IpAddr::V4(Ipv4Addr::LOCALHOST), 5);
        open.session = Some(Box::new(tag.clone()));
        t.attempts.push(open);
        let (len, image) = round_trip(&t, MAX_RECORD_BYTES);
        assert_eq!(image.attempts.len(), 3);
        assert_eq!(image.attempts[2].session.as_deref(), Some(&tag));
        assert!(image.attempts[1].session.is_none());
        assert_eq!(
            len,
            task_fixed_len(&t)
                + t.attempts.iter().map(|a| attempt_len(a, a.error.as_deref().map(error_len))).sum::<usize>()
        );

        let mut buf = Vec::new();
        put_attempt_start(&mut buf, 9, 3, &t.attempts[2]);
        let Some(Record::AttemptStart { attempt, .. }) = decode(RecordType::AttemptStart as u8, &buf) else {
            panic!("decodes")
        };
        assert_eq!(attempt.session.as_deref(), Some(&tag));
        let mut old = Vec::new();
        put_attempt_start(&mut old, 9, 1, &t.attempts[0]);
        let Some(Record::AttemptStart { attempt, .. }) = decode(RecordType::AttemptStart as u8, &old) else {
            panic!("decodes")
        };
        assert!(attempt.session.is_none());
        old.push(2);
        assert!(decode(RecordType::AttemptStart as u8, &old).is_none(), "an unknown trailer is damage");
    }

    fn round_trip(t: &Task, limit: usize) -> (usize, TaskImage) {
        let mut buf = Vec::new();
        put_frame(&mut buf, 1, RecordType::Task, |out| put_task_within(out, t, limit));
        let FrameAt::Valid { kind, payload, .. } = frame_at(&buf) else { panic!("not a valid frame") };
        let Some(Record::Task(image)) = decode(kind, payload) else { panic!("does not decode") };
        (payload.len(), *image)
    }

    /// A record replay would reject must never be written: a Task record holds the whole
    /// attempt log, which retries and re-runs can grow without end, so past the limit the
    /// oldest attempts' errors are left out (then, far beyond any real log, the oldest
    /// attempts), and the record still reads back.
    #[test]
    fn a_kind_policy_record_round_trips() {
        for policy in [Some(r#"{"max_running":2}"#), None] {
            let mut p = Vec::new();
            put_kind_policy(&mut p, "http", policy);
            let Some(Record::KindPolicy { kind, policy: back }) = decode(RecordType::KindPolicy as u8, &p) else {
                panic!("decodes")
            };
            assert_eq!((&*kind, back.as_deref()), ("http", policy));
        }
        assert!(decode(RecordType::KindPolicy as u8, &[1, 0, 0, 0, b'k', 2]).is_none());
    }

    #[test]
    fn a_kind_bucket_record_round_trips() {
        for lane in [None, Some(("jti-1", "customer-7")), Some(("", ""))] {
            let mut p = Vec::new();
            put_kind_bucket(&mut p, "http", lane, 2.5, 1_700_000_000_123);
            let Some(Record::KindBucket { kind, lane: back, tokens, at_ms }) = decode(RecordType::KindBucket as u8, &p)
            else {
                panic!("decodes")
            };
            let back = back.as_ref().map(|(s, k)| (&**s, &**k));
            assert_eq!((&*kind, back, tokens, at_ms), ("http", lane, 2.5, 1_700_000_000_123));
            assert!(decode(RecordType::KindBucket as u8, &p[..p.len() - 1]).is_none(), "cut short");
        }
    }

    #[test]
    fn a_priority_round_trips_and_a_record_without_one_reads_as_zero() {
        for p in [-86_400, -1, 0, 1, 86_400] {
            let mut t = task_with_attempts(2, 10);
            t.priority = p;
            let (len, back) = round_trip(&t, usize::MAX);
            assert_eq!(back.priority, p);
            assert_eq!(
                len,
                task_fixed_len(&t)
                    + t.attempts.iter().map(|a| attempt_len(a, a.error.as_deref().map(error_len))).sum::<usize>()
            );
        }
    }

    #[test]
    fn a_submitter_and_key_round_trip_and_a_record_without_them_reads_as_empty() {
        for (submitter, key) in [("", ""), ("jti-1", ""), ("", "customer-7"), ("jti-2", "k\u{e9}")] {
            let mut t = task_with_attempts(1, 10);
            t.submitter = submitter.into();
            t.key = key.into();
            let (len, back) = round_trip(&t, usize::MAX);
            assert_eq!((&*back.submitter, &*back.key), (submitter, key));
            assert_eq!(
                len,
                task_fixed_len(&t)
                    + t.attempts.iter().map(|a| attempt_len(a, a.error.as_deref().map(error_len))).sum::<usize>()
            );
        }
    }

    #[test]
    fn a_task_record_stays_within_the_limit_replay_accepts_and_reads_back() {
        let t = task_with_attempts(40, 100_000);
        let whole = round_trip(&t, usize::MAX).0;
        assert!(whole > 40 * MAX_ERROR_BYTES, "errors are cut to 64 KiB in the record: {whole}");
        let limit = 1 << 20;
        let (len, back) = round_trip(&t, limit);
        assert!(len <= limit, "{len} bytes over a limit of {limit}");
        assert_eq!(back.attempts.len(), 40, "every attempt is still there");
        let errors: Vec<&str> = back.attempts.iter().map(|a| a.error.as_deref().unwrap_or("")).collect();
        let left_out = errors.iter().take_while(|e| **e == ERROR_LEFT_OUT).count();
        assert!(left_out > 0 && errors[left_out..].iter().all(|e| e.len() > 60_000), "oldest first: {left_out}");
        assert!(errors[39].starts_with("000039"), "the newest attempt keeps its error");
        // Far beyond: attempts without errors that cannot all fit; the newest ones stay.
        let t = task_with_attempts(1000, 0);
        let (len, back) = round_trip(&t, 4096);
        assert!(len <= 4096);
        assert!(!back.attempts.is_empty() && back.attempts.len() < 1000);
        assert_eq!(back.attempts.last().map(|a| a.client_id), Some(999));
        // Within the limit, nothing changes.
        let t = task_with_attempts(3, 10);
        assert_eq!(round_trip(&t, MAX_RECORD_BYTES).1.attempts.len(), 3);
    }

    #[test]
    fn headers() {
        assert!(check_header(&segment_header()).is_ok());
        assert!(check_header(b"relayjnl").is_err());
        let mut h = segment_header();
        h[8] = 9;
        assert!(check_header(&h).unwrap_err().contains("version 9"));
        assert!(check_header(b"xxxxxxxxxxxxxxxx").unwrap_err().contains("magic"));
    }
}
