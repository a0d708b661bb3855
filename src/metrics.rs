//! Counters and the one histogram, rendered as Prometheus text. Plain integers on the loop
//! thread: no atomics, no locks.

use std::fmt::Write as _;

use crate::tasks::{Outcome, Status};

/// Upper bounds (seconds) of `relay_task_duration_seconds`.
const DURATION_BUCKETS_S: [f64; 12] = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    Late,
    Duplicate,
    Unknown,
}

#[derive(Default)]
pub struct Metrics {
    /// Submits of a paused kind: dispatches its pause held back (`relay_dispatch_held_total`).
    pub held_paused: u64,
    /// Final statuses: done, failed, canceled.
    pub tasks_final: [u64; 3],
    pub attempts: [u64; Outcome::COUNT],
    pub ignored: [u64; 3],
    /// Index = status code - 100.
    http_requests: Vec<u64>,
    duration_buckets: [u64; DURATION_BUCKETS_S.len()],
    duration_count: u64,
    duration_sum_ms: u64,
    pub connections_refused: u64,
    pub ws_messages_malformed: u64,
    /// Unwritten HTTP output over every connection (the reactor keeps it, against OUTPUT_MEMORY).
    pub output_buffered_bytes: usize,
    /// Connections closed because their output stalled while OUTPUT_MEMORY was used up.
    pub output_stalled_closed: u64,
    /// Sessions a worker took back after a lost connection (SPEC §12).
    pub sessions_resumed: u64,
    /// Held attempts a resuming worker took back.
    pub attempts_adopted: u64,
    /// Attempts held now for workers whose connection was lost (the core keeps it).
    pub attempts_held: usize,
}

/// Point-in-time values the core knows and the metrics do not keep.
#[derive(Default)]
pub struct Gauges {
    pub workers_connected: usize,
    pub workers_active: usize,
    pub tasks_pending: usize,
    pub tasks_dispatched: usize,
    pub connections_open: usize,
    /// Memory held by finished tasks (estimate), against TASK_MEMORY.
    pub finished_memory_bytes: usize,
    /// Finished tasks kept only in the journal.
    pub tasks_on_disk: usize,
    /// Finished tasks that left memory over TASK_MEMORY (to the journal, or forgotten early).
    pub tasks_evicted: u64,
    pub journal: Option<JournalGauges>,
    /// Cluster mode's database figures.
    pub cluster: Option<ClusterGauges>,
    /// Kinds with a policy (at most 1,000): (kind, running, pending) (SPEC §14).
    pub kinds: Vec<(String, u64, u64)>,
    /// Dispatches a limit or pause held back, by `flow::WaitingOn` index.
    pub held: [u64; 6],
}

/// A cluster node's traffic with PostgreSQL (absent in single-node mode).
#[derive(Default)]
pub struct ClusterGauges {
    pub up: bool,
    pub committed: u64,
    pub refused: u64,
    pub lost: u64,
    pub unreachable: u64,
    pub statements: u64,
    /// Transactions the database thread ran on its own (heartbeats, housekeeping).
    pub background: u64,
    pub tasks_inserted: u64,
    pub tasks_claimed: u64,
    pub attempts_ended: u64,
    pub fenced: u64,
}

/// The journal's figures (absent in memory-only mode).
#[derive(Default)]
pub struct JournalGauges {
    pub bytes: u64,
    pub segments: usize,
    pub backlog_bytes: u64,
    pub syncs: u64,
    pub records: u64,
    /// Damaged records or regions skipped when the journal was read at start.
    pub corrupt_records: u64,
    /// The journal cannot write now (a full disk): writes answer 503.
    pub full: bool,
    /// Segment deletions waiting for a retry after one failed.
    pub deletes_failing: u64,
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics { http_requests: vec![0; 500], ..Metrics::default() }
    }

    pub fn task_final(&mut self, status: Status, duration_ms: u64) {
        let i = match status {
            Status::Done => 0,
            Status::Failed => 1,
            Status::Canceled => 2,
            Status::Pending | Status::Dispatched => return,
        };
        self.tasks_final[i] += 1;
        let seconds = duration_ms as f64 / 1000.0;
        for (bucket, bound) in self.duration_buckets.iter_mut().zip(DURATION_BUCKETS_S) {
            if seconds <= bound {
                *bucket += 1;
            }
        }
        self.duration_count += 1;
        self.duration_sum_ms += duration_ms;
    }

    pub fn attempt(&mut self, outcome: Outcome) {
        self.attempts[outcome as usize] += 1;
    }

    pub fn ignored(&mut self, why: Ignored) {
        self.ignored[why as usize] += 1;
    }

    pub fn http_request(&mut self, status: u16) {
        if let Some(slot) = status.checked_sub(100).and_then(|i| self.http_requests.get_mut(usize::from(i))) {
            *slot += 1;
        }
    }

    pub fn render(&self, g: &Gauges) -> String {
        let mut out = String::with_capacity(4096);
        let w = &mut out;
        counter_header(w, "relay_tasks_total", "Tasks that reached a final status.");
        for (name, v) in ["done", "failed", "canceled"].iter().zip(self.tasks_final) {
            let _ = writeln!(w, "relay_tasks_total{{status=\"{name}\"}} {v}");
        }
        counter_header(w, "relay_attempts_total", "Dispatch attempts by outcome.");
        for outcome in Outcome::ALL {
            let _ = writeln!(
                w,
                "relay_attempts_total{{outcome=\"{}\"}} {}",
                outcome.as_str(),
                self.attempts[outcome as usize]
            );
        }
        counter_header(w, "relay_results_ignored_total", "Worker results that could not finish a task.");
        for (name, v) in ["late", "duplicate", "unknown"].iter().zip(self.ignored) {
            let _ = writeln!(w, "relay_results_ignored_total{{reason=\"{name}\"}} {v}");
        }
        counter(
            w,
            "relay_sessions_resumed_total",
            "Worker sessions resumed on a new connection.",
            self.sessions_resumed,
        );
        counter(w, "relay_attempts_adopted_total", "Held attempts a resuming worker took back.", self.attempts_adopted);
        gauge(
            w,
            "relay_attempts_held",
            "Attempts held for session workers whose connection was lost (RESUME_WINDOW).",
            self.attempts_held,
        );
        gauge(w, "relay_workers_connected", "Connected worker WebSockets.", g.workers_connected);
        gauge(w, "relay_workers_active", "Workers alive and not draining.", g.workers_active);
        gauge(w, "relay_tasks_pending", "Tasks waiting for a worker or their time.", g.tasks_pending);
        gauge(w, "relay_tasks_dispatched", "Tasks running on a worker.", g.tasks_dispatched);
        gauge(w, "relay_connections_open", "Open client and worker connections.", g.connections_open);
        counter(
            w,
            "relay_connections_refused_total",
            "Connections closed at once because MAX_CONNECTIONS was reached.",
            self.connections_refused,
        );
        gauge(
            w,
            "relay_output_buffered_bytes",
            "Unwritten HTTP answers held for all clients together (bounded by OUTPUT_MEMORY).",
            self.output_buffered_bytes,
        );
        counter(
            w,
            "relay_output_stalled_closed_total",
            "Connections closed because their output made no progress while OUTPUT_MEMORY was used up.",
            self.output_stalled_closed,
        );
        counter(
            w,
            "relay_ws_messages_malformed_total",
            "Worker messages that were not valid protocol JSON.",
            self.ws_messages_malformed,
        );
        counter(
            w,
            "relay_log_lines_dropped_total",
            "Log lines dropped because stderr could not keep up.",
            crate::log::dropped_lines(),
        );
        counter(w, "relay_tasks_evicted_total", "Finished tasks that left memory over TASK_MEMORY.", g.tasks_evicted);
        gauge(
            w,
            "relay_finished_tasks_memory_bytes",
            "Memory held by finished tasks (estimate).",
            g.finished_memory_bytes,
        );
        gauge(w, "relay_tasks_on_disk", "Finished tasks kept only in the journal.", g.tasks_on_disk);
        let _ = writeln!(w, "# HELP relay_kind_running Attempts running, per kind with a policy.");
        let _ = writeln!(w, "# TYPE relay_kind_running gauge");
        for (kind, running, _) in &g.kinds {
            let _ = writeln!(w, "relay_kind_running{{kind=\"{}\"}} {running}", label_value(kind));
        }
        let _ = writeln!(w, "# HELP relay_kind_pending Tasks waiting to run, per kind with a policy.");
        let _ = writeln!(w, "# TYPE relay_kind_pending gauge");
        for (kind, _, pending) in &g.kinds {
            let _ = writeln!(w, "relay_kind_pending{{kind=\"{}\"}} {pending}", label_value(kind));
        }
        counter_header(w, "relay_dispatch_held_total", "Dispatches a kind's limit or pause held back, by reason.");
        for why in [crate::flow::WaitingOn::Paused, crate::flow::WaitingOn::Concurrency, crate::flow::WaitingOn::Rate] {
            let _ = writeln!(w, "relay_dispatch_held_total{{reason=\"{}\"}} {}", why.as_str(), g.held[why.index()]);
        }
        if let Some(j) = &g.journal {
            gauge(w, "relay_journal_bytes", "Size of the journal's segments.", j.bytes as usize);
            gauge(w, "relay_journal_segments", "Journal segment files.", j.segments);
            gauge(
                w,
                "relay_journal_backlog_bytes",
                "Journal bytes written but not yet durable.",
                j.backlog_bytes as usize,
            );
            counter(w, "relay_journal_syncs_total", "fdatasync calls (one per group commit).", j.syncs);
            counter(w, "relay_journal_records_total", "Records written to the journal by this process.", j.records);
            counter(
                w,
                "relay_journal_corrupt_records_total",
                "Damaged journal records or regions skipped at start (a torn tail is not counted).",
                j.corrupt_records,
            );
            gauge(
                w,
                "relay_journal_full",
                "1 while the journal cannot write (no space or quota): writes answer 503 journal_unavailable.",
                usize::from(j.full),
            );
            gauge(
                w,
                "relay_journal_deletes_failing",
                "Compacted segments waiting for a retry of their deletion (newer ones wait behind them).",
                j.deletes_failing as usize,
            );
        }
        if let Some(c) = &g.cluster {
            gauge(w, "relay_db_up", "1 while the database can be used (cluster mode).", usize::from(c.up));
            counter_header(w, "relay_db_transactions_total", "Turn transactions by result (cluster mode).");
            for (name, v) in
                [("committed", c.committed), ("refused", c.refused), ("lost", c.lost), ("unreachable", c.unreachable)]
            {
                let _ = writeln!(w, "relay_db_transactions_total{{result=\"{name}\"}} {v}");
            }
            counter(
                w,
                "relay_db_background_transactions_total",
                "Transactions besides the turns': heartbeats, housekeeping, notifications.",
                c.background,
            );
            counter(w, "relay_db_statements_total", "Statements sent in turn transactions.", c.statements);
            counter(w, "relay_db_tasks_inserted_total", "Tasks this node wrote to the database.", c.tasks_inserted);
            counter(w, "relay_db_tasks_claimed_total", "Tasks this node claimed for its workers.", c.tasks_claimed);
            counter(w, "relay_db_attempts_ended_total", "Attempt ends this node wrote.", c.attempts_ended);
            counter(
                w,
                "relay_db_writes_fenced_total",
                "Attempt ends the database refused (the task was canceled or moved on).",
                c.fenced,
            );
        }
        counter_header(w, "relay_http_requests_total", "HTTP responses by status code.");
        for (i, v) in self.http_requests.iter().enumerate().filter(|(_, v)| **v > 0) {
            let _ = writeln!(w, "relay_http_requests_total{{code=\"{}\"}} {v}", i + 100);
        }
        let _ = writeln!(w, "# HELP relay_task_duration_seconds Time from submit to a final status.");
        let _ = writeln!(w, "# TYPE relay_task_duration_seconds histogram");
        for (bound, v) in DURATION_BUCKETS_S.iter().zip(self.duration_buckets) {
            let _ = writeln!(w, "relay_task_duration_seconds_bucket{{le=\"{bound}\"}} {v}");
        }
        let _ = writeln!(w, "relay_task_duration_seconds_bucket{{le=\"+Inf\"}} {}", self.duration_count);
        let _ = writeln!(w, "relay_task_duration_seconds_sum {}", self.duration_sum_ms as f64 / 1000.0);
        let _ = writeln!(w, "relay_task_duration_seconds_count {}", self.duration_count);
        out
    }
}

fn counter_header(w: &mut String, name: &str, help: &str) {
    let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} counter");
}

fn counter(w: &mut String, name: &str, help: &str, value: impl std::fmt::Display) {
    counter_header(w, name, help);
    let _ = writeln!(w, "{name} {value}");
}

fn gauge(w: &mut String, name: &str, help: &str, value: usize) {
    let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}");
}

/// A label value as the exposition format writes it (`\\`, `\"` and newlines escaped).
fn label_value(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return std::borrow::Cow::Borrowed(v);
    }
    let mut s = String::with_capacity(v.len() + 8);
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    std::borrow::Cow::Owned(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family() {
        let mut m = Metrics::new();
        m.task_final(Status::Done, 3);
        m.attempt(Outcome::Timeout);
        m.ignored(Ignored::Duplicate);
        m.http_request(202);
        let g = Gauges {
            workers_connected: 2,
            workers_active: 1,
            tasks_pending: 3,
            tasks_dispatched: 4,
            connections_open: 5,
            finished_memory_bytes: 6,
            tasks_on_disk: 7,
            tasks_evicted: 0,
            journal: Some(JournalGauges { corrupt_records: 8, ..JournalGauges::default() }),
            cluster: Some(ClusterGauges { up: true, committed: 9, fenced: 10, ..ClusterGauges::default() }),
            kinds: vec![("a\"b".into(), 2, 3)],
            held: [0, 0, 4, 5, 6, 0],
        };
        let text = m.render(&g);
        for line in [
            "relay_tasks_total{status=\"done\"} 1",
            "relay_attempts_total{outcome=\"timeout\"} 1",
            "relay_results_ignored_total{reason=\"duplicate\"} 1",
            "relay_workers_connected 2",
            "relay_workers_active 1",
            "relay_tasks_pending 3",
            "relay_tasks_dispatched 4",
            "relay_connections_open 5",
            "relay_finished_tasks_memory_bytes 6",
            "relay_tasks_on_disk 7",
            "relay_journal_corrupt_records_total 8",
            "relay_db_up 1",
            "relay_db_transactions_total{result=\"committed\"} 9",
            "relay_db_writes_fenced_total 10",
            "relay_http_requests_total{code=\"202\"} 1",
            "relay_task_duration_seconds_bucket{le=\"0.005\"} 1",
            "relay_task_duration_seconds_bucket{le=\"0.001\"} 0",
            "relay_task_duration_seconds_count 1",
            "relay_kind_running{kind=\"a\\\"b\"} 2",
            "relay_kind_pending{kind=\"a\\\"b\"} 3",
            "relay_dispatch_held_total{reason=\"paused\"} 4",
            "relay_dispatch_held_total{reason=\"concurrency\"} 5",
            "relay_dispatch_held_total{reason=\"rate\"} 6",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
}
