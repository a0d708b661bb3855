//! The task pool: a fixed number of threads behind a bounded queue. Each task runs its kind's
//! handler under `catch_unwind`, so a panicking handler fails that task only, and its result
//! message is serialised here (off the link thread). The pool never touches the socket: it
//! hands `Finished` records back to the runner over a channel.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use serde_json::value::RawValue;

use crate::log::Level;
use crate::{Error, Handler, log, protocol};

pub struct Job {
    /// The runner's number for this task (unique per process): `Finished` names it.
    pub job: u64,
    /// The attempt the task frame named (a session's; the result echoes it).
    pub attempt: Option<u64>,
    pub task_id: String,
    pub kind: String,
    pub spec: Box<RawValue>,
    /// Set by a `cancel` from relay: a task not started yet is skipped, and no result is sent.
    pub canceled: Arc<AtomicBool>,
}

pub struct Finished {
    pub job: u64,
    pub task_id: String,
    /// The result message, or `None` when the task was canceled (relay no longer wants it).
    pub message: Option<String>,
    /// Whether the task failed (for the log line of a dropped result).
    pub failed: bool,
}

pub struct Pool {
    queue: Option<SyncSender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Starts `threads` threads; at most `queue_len` tasks wait for a free thread.
    pub fn start(
        threads: usize,
        queue_len: usize,
        kinds: Arc<BTreeMap<String, Handler>>,
        finished: Sender<Finished>,
        max_message_bytes: usize,
    ) -> std::io::Result<Pool> {
        let (tx, rx) = sync_channel::<Job>(queue_len);
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let (rx, kinds, finished) = (rx.clone(), kinds.clone(), finished.clone());
            let handle = std::thread::Builder::new()
                .name(format!("relay-task-{i}"))
                .spawn(move || work(&rx, &kinds, &finished, max_message_bytes))?;
            handles.push(handle);
        }
        Ok(Pool { queue: Some(tx), threads: handles })
    }

    /// Queues a job without blocking; gives it back when the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        let Some(queue) = &self.queue else { return Err(job) };
        queue.try_send(job).map_err(|e| match e {
            TrySendError::Full(job) | TrySendError::Disconnected(job) => job,
        })
    }

    /// Closes the queue and joins the threads. Only called once no task is running, so the
    /// threads are idle and exit at once.
    pub fn join(mut self) {
        self.queue = None;
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

fn work(rx: &Mutex<Receiver<Job>>, kinds: &BTreeMap<String, Handler>, finished: &Sender<Finished>, max: usize) {
    loop {
        // The lock is held only while waiting for the next job, never while running one.
        let job = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        let Job { job, attempt, task_id, kind, spec, canceled } = job;
        if canceled.load(Ordering::SeqCst) {
            let _ = finished.send(Finished { job, task_id, message: None, failed: false });
            continue;
        }
        let started = Instant::now();
        let (outcome, hint) = match kinds.get(&kind) {
            Some(handler) => match run_one(handler, &task_id, &spec) {
                Ok(v) => (Ok(v), crate::RetryHint::default()),
                Err(e) => (Err(e.message().to_string()), e.retry_hint()),
            },
            None => (Err(format!("unknown task kind: {kind}")), crate::RetryHint::default()),
        };
        if let Err(error) = &outcome {
            log!(
                Level::Warn,
                "task failed",
                task_id = task_id,
                kind = kind,
                duration_ms = started.elapsed().as_millis(),
                error = error
            );
        }
        let failed = outcome.is_err();
        let message = if canceled.load(Ordering::SeqCst) {
            None
        } else {
            Some(protocol::result_with(&task_id, attempt, &outcome, hint, max))
        };
        if finished.send(Finished { job, task_id, message, failed }).is_err() {
            return;
        }
    }
}

/// Runs a handler; a panic becomes an error naming the panic's message.
pub fn run_one(handler: &Handler, task_id: &str, spec: &RawValue) -> Result<serde_json::Value, Error> {
    match catch_unwind(AssertUnwindSafe(|| handler(task_id, spec))) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(Error::new(format!("handler panicked: {what}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use serde_json::{Value, json};
    use std::sync::mpsc::channel;
    use std::time::Duration;

    fn handler(f: fn(&str, &RawValue) -> Result<Value, Error>) -> Handler {
        Arc::new(f)
    }

    fn check(h: fn(&str, &RawValue) -> Result<Value, Error>, expected: Result<Value, &str>) {
        let spec = RawValue::from_string("[1]".into()).expect("raw");
        let got = run_one(&handler(h), "t1", &spec).map_err(|e| e.message().to_string());
        assert_eq!(got, expected.map_err(str::to_string));
    }

    #[test]
    fn outcomes() {
        check(|id, spec| Ok(json!({"id": id, "spec": spec.get()})), Ok(json!({"id": "t1", "spec": "[1]"})));
        check(|_, _| Err(Error::new("nope")), Err("nope"));
        check(|_, _| panic!("boom"), Err("handler panicked: boom"));
        check(|_, _| panic!("{}", String::from("formatted")), Err("handler panicked: formatted"));
    }

    #[test]
    fn bounded_queue_and_cancel() {
        static STARTED: AtomicBool = AtomicBool::new(false);
        let mut kinds: BTreeMap<String, Handler> = BTreeMap::new();
        kinds.insert(
            "sleep".into(),
            handler(|_, _| {
                STARTED.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(200));
                Ok(Value::Null)
            }),
        );
        let (tx, rx) = channel();
        let pool = Pool::start(1, 1, Arc::new(kinds), tx, 1 << 20).expect("pool");
        let job = |id: &str, canceled: bool| Job {
            job: 1,
            attempt: None,
            task_id: id.into(),
            kind: "sleep".into(),
            spec: protocol::null_raw(),
            canceled: Arc::new(AtomicBool::new(canceled)),
        };
        assert!(pool.submit(job("a", false)).is_ok());
        // Wait until "a" runs (it has left the queue), so the queue has exactly one slot.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !STARTED.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(pool.submit(job("b", true)).is_ok());
        assert!(pool.submit(job("c", false)).is_err(), "queue of 1 is full while a thread is busy");
        let a = rx.recv_timeout(Duration::from_secs(5)).expect("a");
        assert_eq!(a.task_id, "a");
        assert!(a.message.is_some_and(|m| m.contains("\"done\"")));
        let b = rx.recv_timeout(Duration::from_secs(5)).expect("b");
        assert_eq!((b.task_id.as_str(), b.message), ("b", None), "canceled before it started: skipped");
        pool.join();
    }
}
