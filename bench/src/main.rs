//! `relay-bench`: runs relay and its peers (nats-server request-reply, a one-hop HTTP floor) under
//! the same closed-loop load in one run and prints one table with server CPU per operation,
//! throughput, latency, memory and the ratios the performance targets are stated in.
//! Everything it starts it stops by PID; every phase is bounded in time; it only targets loopback.

mod cluster;
mod durable;
mod flaky;
mod floor;
mod flow;
mod hostile;
mod httpc;
mod jetstream;
mod load;
mod nats;
mod procs;
mod retries;
mod scenarios;
mod soak;
mod workers;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The fixed ~100-byte result every fake worker and responder sends back.
pub const RESULT_DATA: &str =
    r#"{"ok":true,"pad":"rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr"}"#;

const USAGE: &str = "\
usage: relay-bench [SCENARIO...] [OPTIONS]

scenarios (default: all):
  sync      relay POST /tasks?wait=true, C clients, W workers
  async     relay POST /tasks (202), then GET /tasks/{id}: closed loop, and pipelined
            (--pipeline-depth requests in flight per connection), in every round
  nats      nats-server request-reply, C requesters, W queue-group responders
  floor     one-hop HTTP server answering at once
  latency   1 client 1 worker, relay then NATS back to back
  memory    N idle worker connections: relay RSS per connection
  startup   relay start-up time to listening and idle RSS
  pending   scheduled tasks (delay 1h), --pending-tasks of them: relay RSS per task
  cluster   sync load on 1 node with its journal, 1 node on PostgreSQL, 2 nodes on one
            PostgreSQL (issue 11; needs Debian's postgresql, skipped without it)
  durable   relay sync with the journal on a real disk (DATA_DIR in a fresh directory)
  js        NATS JetStream work queue (file storage, pull consumer, explicit ack), default sync
  js-new    the same on the --nats-server-new server, default sync (the version's share)
  js-sync   the same with `sync_interval: always` (needs --nats-server-new)
  slowloris relay sync without, then with --slowloris connections trickling a request head
  batch     --replay-tasks tasks in batches of --batch-tasks into a durable relay, each timed;
            then a restart on that journal (replay time)
  finished  --finished-tasks tasks run to done on a durable relay: RSS per finished task,
            with TASK_MEMORY at 16 GiB, then at its default
  flow      relay sync with no kind policy, a max_running and a rate that do not bind, and 1,000
            keys (CPU per task); fair shares (a flood of --flood-tasks from one submitter, or on
            one key, and a probe task a second for --probe-secs); the limit accuracy of a binding
            max_running, rate and max_running_per_key on one node and on two nodes on one
            PostgreSQL (issue 22; by name only)
  restarts  a durable relay started 6 times on one DATA_DIR with 3 tasks submitted each time:
            spawn to listening, replay time and DATA_DIR's size after each stop
  all       every one of the above
  retries   (not in all) retry-outage and retry-degraded (issue 21):
  retry-outage    sync load while the workers' upstream is down for 2 s: seed policy, RETRY_BACKOFF=200ms
  retry-degraded  sync load on 8 workers, one failing everything (BENCH_RELAY_BEFORE=<relay>: also
                  a build from before the avoidance rule)

options:
  --rounds N            rounds of the sync/NATS/floor and 1-client comparisons (default 3)
  --warmup-ms N         warm-up before each measured window (default 1000)
  --measure-ms N        measured window (default 4000)
  --clients N           concurrent clients (default 64)
  --workers N           workers / responders (default 8)
  --payload-bytes N     task payload size (default 100)
  --pipeline-depth N    requests in flight per connection in pipelined async and pending (default 16)
  --pending-tasks N     scheduled tasks `pending` submits (default 1000000)
  --pending-max-secs N  time limit on those submits; fewer are held if it runs out (default 120)
  --idle-conns N        idle worker connections in `memory` (default 19000)
  --startup-runs N      relay starts in `startup` (default 10)
  --relay PATH          relay binary (default: `relay` beside this executable)
  --relay-static PATH   static relay binary to size and start (default: target/x86_64-unknown-linux-gnu/release/relay)
  --relay-env K=V       extra environment for every relay started (repeatable), e.g. TASK_TTL=5s
  --nats-server PATH    nats-server binary (default: nats-server on PATH); also JetStream's default run
  --nats-server-new PATH  a nats-server that knows `sync_interval` (≥ 2.10) for js-sync
  --data-root PATH      where journals and JetStream stores go (default: the temp dir, unless it
                        is tmpfs; then beside this executable); never tmpfs
  --batch-tasks N       tasks per batch in `batch` (default 100000)
  --replay-tasks N      tasks journaled before the restart in `batch` (default 1000000)
  --finished-tasks N    tasks run to done in `finished` (default 500000)
  --slowloris N         slowloris connections (default 1000)
  --flood-tasks N       tasks the flood queues in `flow`'s fairness scenario (default 100000)
  --probe-secs N        seconds of one probe task a second in that scenario (default 20)
  --syscall-ms N        after each measured window, count the server's syscalls and context
                        switches per operation with `perf stat` for this long (default 1500; 0 = off)
  --max-total-secs N    hard limit on the whole run; children are killed past it (default 1800)

internal:
  flaky | restart-load | sessions [--relay-worker PATH]
                                         worker sessions (issue 20): a proxy cutting the real
                                         relay-workers' connections, RESUME_WINDOW 0s vs 10s; a
                                         relay restart under load; `sessions` runs both
  soak [--soak-secs N] [--soak-clients N] [--relay-worker PATH]
                                         mixed load with workers joining, dying and misbehaving
                                         (default 600 s, 8 clients); see scripts/soak.sh
  serve-floor [--seconds N]              run the floor server (prints msg=listening addr=...)
  drive --addr HOST:PORT [--seconds N]   load an already running relay (for perf); tokens as below
  fill --addr HOST:PORT [--replay-tasks N] [--batch-tasks N]   submit N tasks in batches (a journal
                                         to restart on, for bench/profile.sh's replay mode)
";

/// Everything a run is configured by; durations and sizes come from the command line.
#[derive(Debug, Clone)]
pub struct Opts {
    pub scenarios: Vec<String>,
    pub rounds: usize,
    pub warmup: Duration,
    pub measure: Duration,
    pub clients: usize,
    pub workers: usize,
    pub payload_bytes: usize,
    pub pipeline_depth: usize,
    pub pending_tasks: u64,
    pub pending_max: Duration,
    pub idle_conns: usize,
    pub startup_runs: usize,
    pub relay: PathBuf,
    pub relay_static: PathBuf,
    pub relay_env: Vec<(String, String)>,
    pub nats_server: PathBuf,
    pub nats_server_new: Option<PathBuf>,
    pub data_root: Option<PathBuf>,
    pub batch_tasks: u64,
    pub replay_tasks: u64,
    pub finished_tasks: u64,
    pub slowloris: usize,
    pub flood_tasks: usize,
    pub probe_secs: u64,
    pub max_total: Duration,
    pub syscalls: Option<Duration>,
    pub addr: Option<String>,
    pub seconds: u64,
    pub soak_secs: u64,
    pub soak_clients: usize,
    pub relay_worker: PathBuf,
}

fn parse_args(args: &[String]) -> Result<Opts, String> {
    let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(PathBuf::from)).unwrap_or_default();
    let mut o = Opts {
        scenarios: Vec::new(),
        rounds: 3,
        warmup: Duration::from_millis(1000),
        measure: Duration::from_millis(4000),
        clients: 64,
        workers: 8,
        payload_bytes: 100,
        pipeline_depth: 16,
        pending_tasks: 1_000_000,
        pending_max: Duration::from_secs(120),
        idle_conns: 19_000,
        startup_runs: 10,
        relay: exe_dir.join("relay"),
        relay_static: exe_dir.join("../x86_64-unknown-linux-gnu/release/relay"),
        relay_env: Vec::new(),
        nats_server: PathBuf::from("nats-server"),
        nats_server_new: None,
        data_root: None,
        batch_tasks: 100_000,
        replay_tasks: 1_000_000,
        finished_tasks: 500_000,
        slowloris: 1000,
        flood_tasks: 100_000,
        probe_secs: 20,
        max_total: Duration::from_secs(1800),
        syscalls: Some(Duration::from_millis(1500)),
        addr: None,
        seconds: 10,
        soak_secs: 600,
        soak_clients: 8,
        relay_worker: exe_dir.join("relay-worker"),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or_else(|| format!("{a} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|_| format!("{a}: not a number: {v:?}"));
        match a.as_str() {
            "--rounds" => o.rounds = num(value()?)?.max(1) as usize,
            "--warmup-ms" => o.warmup = Duration::from_millis(num(value()?)?),
            "--measure-ms" => o.measure = Duration::from_millis(num(value()?)?.max(1)),
            "--clients" => o.clients = num(value()?)?.max(1) as usize,
            "--workers" => o.workers = num(value()?)?.max(1) as usize,
            "--payload-bytes" => o.payload_bytes = num(value()?)?.max(16) as usize,
            "--pipeline-depth" => o.pipeline_depth = num(value()?)?.clamp(1, 1024) as usize,
            "--pending-tasks" => o.pending_tasks = num(value()?)?.max(1),
            "--pending-max-secs" => o.pending_max = Duration::from_secs(num(value()?)?.max(1)),
            "--idle-conns" => o.idle_conns = num(value()?)? as usize,
            "--startup-runs" => o.startup_runs = num(value()?)?.max(1) as usize,
            "--relay" => o.relay = PathBuf::from(value()?),
            "--relay-static" => o.relay_static = PathBuf::from(value()?),
            "--relay-env" => {
                let kv = value()?;
                let (k, v) = kv.split_once('=').ok_or_else(|| format!("--relay-env wants K=V, got {kv:?}"))?;
                o.relay_env.push((k.to_string(), v.to_string()));
            }
            "--nats-server" => o.nats_server = PathBuf::from(value()?),
            "--nats-server-new" => o.nats_server_new = Some(PathBuf::from(value()?)),
            "--data-root" => o.data_root = Some(PathBuf::from(value()?)),
            "--batch-tasks" => o.batch_tasks = num(value()?)?.max(1),
            "--replay-tasks" => o.replay_tasks = num(value()?)?.max(1),
            "--finished-tasks" => o.finished_tasks = num(value()?)?.max(1),
            "--slowloris" => o.slowloris = num(value()?)? as usize,
            "--flood-tasks" => o.flood_tasks = num(value()?)?.clamp(1, 1_000_000) as usize,
            "--probe-secs" => o.probe_secs = num(value()?)?.clamp(1, 600),
            "--max-total-secs" => o.max_total = Duration::from_secs(num(value()?)?.max(1)),
            "--syscall-ms" => o.syscalls = Some(Duration::from_millis(num(value()?)?)).filter(|d| !d.is_zero()),
            "--addr" => o.addr = Some(value()?),
            "--seconds" => o.seconds = num(value()?)?.max(1),
            "--soak-secs" => o.soak_secs = num(value()?)?.max(2),
            "--soak-clients" => o.soak_clients = num(value()?)?.max(1) as usize,
            "--relay-worker" => o.relay_worker = PathBuf::from(value()?),
            "-h" | "--help" => return Err(String::new()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s => o.scenarios.push(s.to_string()),
        }
    }
    if o.scenarios.is_empty() {
        o.scenarios.push("all".into());
    }
    Ok(o)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("relay-bench: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match opts.scenarios[0].as_str() {
        "serve-floor" => floor::serve(([127, 0, 0, 1], 0).into(), Duration::from_secs(opts.seconds)),
        "drive" => scenarios::drive(&opts),
        "soak" => soak::run(&opts),
        "flaky" | "restart-load" | "sessions" => flaky::run(&opts),
        "fill" => durable::fill(&opts),
        s @ ("retries" | "retry-outage" | "retry-degraded") => retries::run(&opts, s),
        _ => scenarios::run_all(&opts),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("relay-bench: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args() {
        fn check(args: &[&str], expected: Result<(Vec<&str>, u64, usize), ()>) {
            let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            let got = parse_args(&args).map(|o| (o.scenarios, o.measure.as_millis() as u64, o.clients)).map_err(|_| ());
            let expected = expected.map(|(s, m, c)| (s.into_iter().map(String::from).collect::<Vec<_>>(), m, c));
            assert_eq!(got, expected, "{args:?}");
        }
        check(&[], Ok((vec!["all"], 4000, 64)));
        check(&["sync", "nats", "--measure-ms", "500", "--clients", "8"], Ok((vec!["sync", "nats"], 500, 8)));
        check(&["async", "--pipeline-depth", "8"], Ok((vec!["async"], 4000, 64)));
        check(&["--pipeline-depth", "x"], Err(()));
        check(&["--clients"], Err(()));
        check(&["--clients", "x"], Err(()));
        check(&["--bogus"], Err(()));
        check(&["--help"], Err(()));
    }

    #[test]
    fn result_data_is_about_100_bytes() {
        assert!((90..=110).contains(&RESULT_DATA.len()), "{}", RESULT_DATA.len());
    }
}
