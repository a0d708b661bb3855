//! The journal's two threads. The writer takes every batch the loop queued since its last
//! write, appends them, `fdatasync`s once, publishes the durable sequence number and wakes the
//! loop (group commit). The reader answers the loop's reads of records of tasks that left
//! memory, so a `GET` never waits behind a sync. The loop never touches the journal's files.

use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSlice, Write};
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
    let handle = std::thread::Builder::new().name("relay-journal".into()).spawn(move || {
        let mut w = Writer { dir, head: None, shared, wake };
        w.run(rx);
    })?;
    Ok((tx, handle))
}

struct Writer {
    dir: PathBuf,
    /// The segment being appended to.
    head: Option<(u32, File)>,
    shared: Arc<Shared>,
    wake: Wake,
}

impl Writer {
    fn run(&mut self, rx: Receiver<Msg>) {
        loop {
            let mut batches = Vec::new();
            let mut stop = false;
            match rx.recv() {
                Ok(Msg::Batch(b)) => batches.push(b),
                Ok(Msg::Stop) | Err(_) => stop = true,
            }
            // Group commit: everything queued meanwhile goes into the same write and sync.
            while !stop {
                match rx.try_recv() {
                    Ok(Msg::Batch(b)) => batches.push(b),
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
            if self.head.as_ref().is_none_or(|(s, _)| *s != seg) {
                // The previous segment is complete: make it durable before moving on.
                if let Some((_, old)) = self.head.take() {
                    old.sync_data()?;
                }
                let path = segment_path(&self.dir, seg);
                let mut file = OpenOptions::new().append(true).create(true).mode(0o600).open(&path)?;
                if file.metadata()?.len() == 0 {
                    file.write_all(&codec::segment_header())?;
                    dir_dirty = true;
                }
                self.head = Some((seg, file));
            }
            if let Some((_, file)) = self.head.as_mut() {
                let slices: Vec<&[u8]> = chunks[i..j].iter().map(|c| c.1.as_slice()).collect();
                write_all_vectored(file, &slices)?;
                bytes += slices.iter().map(|s| s.len() as u64).sum::<u64>();
            }
            i = j;
        }
        if let Some((_, file)) = &self.head {
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

fn write_all_vectored(file: &mut File, parts: &[&[u8]]) -> io::Result<()> {
    let mut idx = 0;
    let mut skip = 0;
    while idx < parts.len() {
        let slices: Vec<IoSlice<'_>> = std::iter::once(&parts[idx][skip..])
            .chain(parts[idx + 1..].iter().copied())
            .take(1024)
            .map(IoSlice::new)
            .collect();
        let mut n = match file.write_vectored(&slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        while idx < parts.len() && n >= parts[idx].len() - skip {
            n -= parts[idx].len() - skip;
            idx += 1;
            skip = 0;
        }
        skip += n;
    }
    Ok(())
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
