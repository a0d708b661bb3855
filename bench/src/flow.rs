//! Flow control (issue 22, SPEC §14): what a kind policy and fairness keys cost a sync task —
//! relay's CPU per task with no policy, with a `max_running` far above what runs, with a `rate`
//! far above what arrives, and with each task on one of 1,000 keys, each in its own relay, round
//! after round; fair shares: a flood of queued tasks from one submitter (or on one key) against
//! a probe task a second from another submitter (or key), the probe's wait from submit to
//! dispatch as the workers saw it; and the limit accuracy on one node and on two nodes sharing
//! one private PostgreSQL: the most tasks running at once (in all and per key) and the dispatch
//! rate observed by the workers against a binding `max_running`, `rate` and
//! `max_running_per_key`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Opts;
use crate::httpc::{HttpConn, build_request, json_str_field};
use crate::procs::Server;
use crate::scenarios::{
    API_TOKEN, IO_TIMEOUT, Keep, PipeClient, WORKER_CONCURRENCY, WORKER_TOKEN, check_alive, payload, start_relay,
    wait_workers, window,
};
use crate::workers::{Pool, Recorder, Seen};

const KIND: &str = "b";

/// One row of the CPU table: a policy (`PUT /kinds/b` body; `None`: no policy) and how many
/// distinct `"key"`s the tasks carry, round robin (0: none).
struct Variant {
    name: &'static str,
    policy: Option<&'static str>,
    keys: usize,
}

const VARIANTS: [Variant; 4] = [
    Variant { name: "no policy", policy: None, keys: 0 },
    Variant { name: "max_running 1000000 (does not bind)", policy: Some(r#"{"max_running":1000000}"#), keys: 0 },
    Variant { name: "rate 10000000/s (does not bind)", policy: Some(r#"{"rate":"10000000/s"}"#), keys: 0 },
    Variant { name: "1,000 keys (round robin), no policy", policy: None, keys: 1000 },
];

fn put_policy(addr: SocketAddr, body: &str) -> Result<(), String> {
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?;
    let req = build_request("PUT", &format!("/kinds/{KIND}"), Some(API_TOKEN), body.as_bytes());
    let r = conn.request(&req)?;
    if r.status != 200 {
        return Err(format!("PUT /kinds/{KIND} answered {}: {}", r.status, String::from_utf8_lossy(r.body)));
    }
    Ok(())
}

/// The sync requests of client `c` of `clients`: one, or one per key starting at the client's
/// share of the keys (so that the clients together go round all keys evenly).
fn sync_requests(p: &str, keys: usize, c: usize, clients: usize) -> Vec<Vec<u8>> {
    if keys == 0 {
        let body = format!("{{\"payload\":{{\"kind\":\"{KIND}\",\"p\":{p}}}}}");
        return vec![build_request("POST", "/tasks?wait=true", Some(API_TOKEN), body.as_bytes())];
    }
    let first = c * keys / clients.max(1);
    (0..keys)
        .map(|i| {
            let key = (first + i) % keys;
            let body = format!("{{\"payload\":{{\"kind\":\"{KIND}\",\"p\":{p}}},\"key\":\"k{key}\"}}");
            build_request("POST", "/tasks?wait=true", Some(API_TOKEN), body.as_bytes())
        })
        .collect()
}

/// Relay's CPU per sync task (µs) and tasks/s with one variant.
fn sync_with(opts: &Opts, v: &Variant) -> Result<(f64, f64), String> {
    let mut relay = start_relay(opts, &opts.relay, &[])?;
    if let Some(p) = v.policy {
        put_policy(relay.addr, p)?;
    }
    let pool = Pool::ws(relay.addr, WORKER_TOKEN, opts.workers, WORKER_CONCURRENCY, crate::RESULT_DATA)?;
    wait_workers(relay.addr, opts.workers)?;
    let p = payload(opts.payload_bytes);
    let cs: Vec<_> = (0..opts.clients)
        .map(|c| {
            let reqs = Arc::new(sync_requests(&p, v.keys, c, opts.clients));
            PipeClient::new(relay.addr, 1, reqs, 200, Keep::Nothing)
        })
        .collect();
    let (out, _) = crate::load::run(cs, relay.pid(), window(opts), std::slice::from_ref(&pool.answered));
    check_alive(&mut relay)?;
    pool.stop()?;
    if out.errors > 0 {
        return Err(format!("{} errors: {:?}", out.errors, out.first_error));
    }
    Ok((out.cpu_us_per_op(), out.per_sec()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `relay-bench flow`: prints Markdown tables for bench/README.md.
pub fn run(opts: &Opts) -> Result<(), String> {
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    let mut rate: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    for round in 1..=opts.rounds {
        // (Variants interleaved within each round: drift of the machine hits them alike.)
        for (i, v) in VARIANTS.iter().enumerate() {
            eprintln!("bench: flow round {round}/{}: {}", opts.rounds, v.name);
            let (c, r) = sync_with(opts, v)?;
            cpu[i].push(c);
            rate[i].push(r);
        }
    }
    let base = median(cpu[0].clone());
    let mut t = String::new();
    let _ = writeln!(
        t,
        "relay sync, {} clients, {} workers, {}-byte payload of kind {KIND:?}, {} rounds (medians)\n",
        opts.clients, opts.workers, opts.payload_bytes, opts.rounds
    );
    let _ = writeln!(t, "| policy | tasks/s | relay CPU µs/task | ÷ no policy | ÷ no policy, each round |");
    let _ = writeln!(t, "|---|---:|---:|---:|---|");
    for (i, v) in VARIANTS.iter().enumerate() {
        let c = median(cpu[i].clone());
        let each: Vec<String> = cpu[i].iter().zip(&cpu[0]).map(|(x, b)| format!("{:.3}", x / b)).collect();
        let _ = writeln!(
            t,
            "| {} | {:.0} | {c:.1} | {:.3} | {} |",
            v.name,
            median(rate[i].clone()),
            c / base,
            each.join(" ")
        );
    }
    println!("{t}");
    fairness(opts)?;
    accuracy_one_node(opts)?;
    accuracy_two_nodes(opts)
}

// ---------------------------------------------------------------- fair shares

/// The HS256 secret of the fairness relay and the `relay token` CLI (at least 32 bytes).
const TOKEN_SECRET: &str = "relay-bench-flow-secret-0123456789abcdef";
/// Tasks per flood batch.
const FLOOD_BATCH: usize = 1000;
/// The draining workers: this many, of this many slots each; the hold of each task, and the
/// pace of each worker's answers (one per DRAIN_WORKERS / rate: a steady drain, not waves of
/// every slot at once), are set so that they drain the flood in 1.25 × the probe window (the
/// flood outlasts the probes).
const DRAIN_WORKERS: usize = 8;
const DRAIN_SLOTS: u32 = 25;

#[derive(Clone, Copy, PartialEq)]
enum Fair {
    /// The flood by the root token, the probe by a scoped token (two submitters, no keys).
    Submitters,
    /// Both by the root token: the flood on key "flood", the probe on key "probe".
    Keys,
}

impl Fair {
    fn name(self) -> &'static str {
        match self {
            Fair::Submitters => "two submitters: flood by the root token, probe by a scoped token",
            Fair::Keys => "one submitter, two keys: flood on key \"flood\", probe on key \"probe\"",
        }
    }
}

/// Where the fairness scenario runs.
#[derive(Clone, Copy, PartialEq)]
enum Setup {
    /// One node, memory store, the flood as given.
    OneNode,
    /// Two nodes on one private PostgreSQL, workers, flood batches and probes alternating over
    /// both; a fifth of the flood (the cluster drains slower on this machine).
    TwoNodes,
}

impl Setup {
    fn flood(self, opts: &Opts) -> usize {
        match self {
            Setup::OneNode => opts.flood_tasks,
            Setup::TwoNodes => (opts.flood_tasks / 5).max(1),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Setup::OneNode => "one node (memory store)",
            Setup::TwoNodes => "two nodes on one PostgreSQL",
        }
    }
}

/// The drain: tasks/s and the hold per task that makes the workers drain `flood` in 1.25 × the
/// probe window.
fn drain(opts: &Opts, flood: usize) -> (f64, Duration) {
    let rate = flood as f64 / (opts.probe_secs as f64 * 1.25);
    let slots = DRAIN_WORKERS as f64 * f64::from(DRAIN_SLOTS);
    (rate, Duration::from_secs_f64(slots / rate))
}

/// What one fairness run saw: submit → dispatch of each probe and each flood task.
#[derive(Default)]
struct FairRun {
    probe: Vec<Duration>,
    /// Each probe's submit → its 202.
    probe_ack: Vec<Duration>,
    /// Each probe's dispatches ahead: tasks the workers saw start after it was submitted and
    /// before it started.
    probe_ahead: Vec<usize>,
    /// Each probe's wait as relay saw it: its first attempt's `started_at` − its `created_at`
    /// (milliseconds, from the task JSON).
    probe_relay: Vec<Duration>,
    flood: Vec<Duration>,
    queued_in: Duration,
    drained_in: Duration,
}

/// `relay token create` with the bench's secret and registry (`TOKEN_STORE` or `DATABASE_URL`):
/// the token.
fn mint_token(relay: &Path, registry: (&str, &str)) -> Result<String, String> {
    let out = Command::new(relay)
        .env_clear()
        .env("TOKEN_SECRET", TOKEN_SECRET)
        .env(registry.0, registry.1)
        .args(["token", "create", "--name", "bench-probe", "--kinds", KIND, "--ttl", "1h"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("relay token create: {e}"))?;
    if !out.status.success() {
        return Err(format!("relay token create: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("token: "))
        .map(|t| t.trim().to_string())
        .ok_or_else(|| format!("relay token create printed no token: {text}"))
}

fn fair_run(opts: &Opts, setup: Setup, fair: Fair) -> Result<FairRun, String> {
    let dir = crate::scenarios::scratch_dir().join(format!("flow-fair-{}", unique()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = (|| {
        let pg = match setup {
            Setup::OneNode => None,
            Setup::TwoNodes => Some(crate::cluster::Postgres::start()?),
        };
        let registry = match &pg {
            None => ("TOKEN_STORE", dir.join("tokens.json").display().to_string()),
            Some(pg) => ("DATABASE_URL", pg.url()),
        };
        let mut nodes: Vec<Server> = Vec::new();
        // (Finished tasks stay in memory, so the probes' task JSON can be read at the end.)
        let env = [
            ("TOKEN_SECRET", TOKEN_SECRET.to_string()),
            (registry.0, registry.1.clone()),
            ("TASK_MEMORY", (1u64 << 30).to_string()),
        ];
        for _ in 0..if pg.is_some() { 2 } else { 1 } {
            nodes.push(start_relay(opts, &opts.relay, &env)?);
        }
        if pg.is_some() {
            for node in &nodes {
                crate::cluster::wait_health(node.addr)?;
            }
        }
        // (Minted once the nodes made the schema: the cluster's registry is a table.)
        let probe_token = match fair {
            Fair::Submitters => mint_token(&opts.relay, (registry.0, &registry.1))?,
            Fair::Keys => API_TOKEN.to_string(),
        };
        let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
        let r = fair_load(opts, setup.flood(opts), fair, &addrs, &probe_token);
        for node in &mut nodes {
            check_alive(node)?;
        }
        drop(nodes); // (the nodes end their sessions before PostgreSQL stops)
        r
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn fair_load(
    opts: &Opts,
    flood: usize,
    fair: Fair,
    nodes: &[SocketAddr],
    probe_token: &str,
) -> Result<FairRun, String> {
    let probes = opts.probe_secs as usize;
    let (drain_rate, hold) = drain(opts, flood);
    let pace = Duration::from_secs_f64(DRAIN_WORKERS as f64 / drain_rate);
    let pool = Recorder::ws_on(nodes, WORKER_TOKEN, DRAIN_WORKERS, DRAIN_SLOTS, hold, pace)?;
    let r = (|| {
        for (i, node) in nodes.iter().enumerate() {
            let own = (0..DRAIN_WORKERS).filter(|w| w % nodes.len() == i).count();
            if nodes.len() == 1 { wait_workers(*node, own)? } else { crate::cluster::wait_active(*node, own)? }
        }
        pool.reset();
        let flood_key = if fair == Fair::Keys { r#","key":"flood""# } else { "" };
        let probe_key = if fair == Fair::Keys { r#","key":"probe""# } else { "" };
        let mut conns = Vec::new();
        for node in nodes {
            conns.push(HttpConn::connect(*node, IO_TIMEOUT)?.with_max_response(8 << 20));
        }
        // The flood: batches of 1,000, each task's submit time that of its batch.
        let mut submitted: HashMap<Box<str>, (bool, Instant)> = HashMap::with_capacity(flood + probes);
        let began = Instant::now();
        let mut n = 0;
        while n < flood {
            let m = FLOOD_BATCH.min(flood - n);
            let items: Vec<String> =
                (n..n + m).map(|i| format!("{{\"payload\":{{\"kind\":\"{KIND}\",\"n\":{i}}}{flood_key}}}")).collect();
            let body = format!("{{\"tasks\":[{}]}}", items.join(","));
            let at = Instant::now();
            let conn = &mut conns[(n / FLOOD_BATCH) % nodes.len()];
            let resp = conn.request(&build_request("POST", "/tasks/batch", Some(API_TOKEN), body.as_bytes()))?;
            if resp.status != 202 {
                return Err(format!("flood batch answered {}: {}", resp.status, String::from_utf8_lossy(resp.body)));
            }
            let ids = task_ids(resp.body);
            if ids.len() != m {
                return Err(format!(
                    "flood batch of {m} accepted {}: {}",
                    ids.len(),
                    String::from_utf8_lossy(resp.body)
                ));
            }
            submitted.extend(ids.into_iter().map(|id| (id.into(), (false, at))));
            n += m;
        }
        let queued_in = began.elapsed();
        // The probe: one task a second.
        let probe_started = Instant::now();
        let mut probe_ack = Vec::with_capacity(probes);
        let mut probe_ids = Vec::with_capacity(probes);
        for i in 0..probes {
            let tick = probe_started + Duration::from_secs(i as u64);
            std::thread::sleep(tick.saturating_duration_since(Instant::now()));
            let body = format!("{{\"payload\":{{\"kind\":\"{KIND}\",\"probe\":{i}}},\"queue\":true{probe_key}}}");
            let at = Instant::now();
            let conn = &mut conns[i % nodes.len()];
            let resp = conn.request(&build_request("POST", "/tasks", Some(probe_token), body.as_bytes()))?;
            let id = json_str_field(resp.body, "task_id").filter(|_| resp.status == 202).ok_or_else(|| {
                format!("probe submit answered {}: {}", resp.status, String::from_utf8_lossy(resp.body))
            })?;
            submitted.insert(id.into(), (true, at));
            probe_ack.push(at.elapsed());
            probe_ids.push(id.to_string());
        }
        let within = Duration::from_secs_f64(flood as f64 / drain_rate * 2.0) + Duration::from_secs(60);
        let seen: Seen = pool.wait_done(flood + probes, within)?;
        let mut run = FairRun { queued_in, drained_in: began.elapsed(), probe_ack, ..FairRun::default() };
        for (j, (id, at)) in seen.dispatched.iter().enumerate() {
            // (The first dispatch of each task; a task is taken out once it was counted.)
            if let Some((is_probe, sent)) = submitted.remove(id) {
                let wait = at.saturating_duration_since(sent);
                if is_probe {
                    run.probe.push(wait);
                    // (`dispatched` is in time order: each start is stamped under the lock.)
                    let before = &seen.dispatched[..j];
                    run.probe_ahead.push(j - before.partition_point(|(_, t)| *t <= sent));
                } else {
                    run.flood.push(wait);
                }
            }
        }
        let mut conn = HttpConn::connect(nodes[0], IO_TIMEOUT)?;
        for id in &probe_ids {
            let resp = conn.request(&build_request("GET", &format!("/tasks/{id}"), Some(API_TOKEN), b""))?;
            let created = json_str_field(resp.body, "created_at").and_then(time_of_day_ms);
            let started = json_str_field(resp.body, "started_at").and_then(time_of_day_ms);
            let (Some(c), Some(s)) = (created, started) else {
                return Err(format!("probe {id}: no created_at / started_at: {}", String::from_utf8_lossy(resp.body)));
            };
            run.probe_relay.push(Duration::from_millis((s + DAY_MS - c) % DAY_MS));
        }
        if run.probe.len() != probes || run.flood.len() != flood {
            return Err(format!(
                "dispatches seen: {} of {probes} probes, {} of {flood} flood tasks",
                run.probe.len(),
                run.flood.len()
            ));
        }
        Ok(run)
    })();
    pool.stop()?;
    r
}

const DAY_MS: u64 = 86_400_000;

/// Milliseconds into the day of an RFC 3339 UTC time with milliseconds (relay's task times).
fn time_of_day_ms(t: &str) -> Option<u64> {
    let (_, time) = t.split_once('T')?;
    let time = time.strip_suffix('Z')?;
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut parts = hms.split(':').map(|p| p.parse::<u64>().ok());
    let (h, m, s) = (parts.next()??, parts.next()??, parts.next()??);
    let frac: String = frac.chars().chain("000".chars()).take(3).collect();
    Some(((h * 60 + m) * 60 + s) * 1000 + frac.parse::<u64>().ok()?)
}

/// Every `"task_id":"..."` of a batch answer, in order.
fn task_ids(body: &[u8]) -> Vec<&str> {
    let mut ids = Vec::new();
    let mut rest = body;
    while let Some(id) = json_str_field(rest, "task_id") {
        ids.push(id);
        let end = id.as_ptr() as usize - rest.as_ptr() as usize + id.len();
        rest = &rest[end..];
    }
    ids
}

/// The `p`-quantile (0 < p ≤ 1) of sorted durations, nearest rank.
fn quantile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms < 10.0 {
        format!("{ms:.2} ms")
    } else if ms < 10_000.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{:.1} s", ms / 1e3)
    }
}

fn fairness(opts: &Opts) -> Result<(), String> {
    let mut setups = vec![Setup::OneNode];
    match crate::cluster::available() {
        Ok(()) => setups.push(Setup::TwoNodes),
        Err(e) => println!("fair shares, two nodes on PostgreSQL: SKIPPED ({e})\n"),
    }
    for setup in setups {
        fairness_on(opts, setup)?;
    }
    Ok(())
}

fn fairness_on(opts: &Opts, setup: Setup) -> Result<(), String> {
    let kinds = [Fair::Submitters, Fair::Keys];
    let mut runs: Vec<Vec<FairRun>> = kinds.iter().map(|_| Vec::new()).collect();
    for round in 1..=opts.rounds {
        for (i, fair) in kinds.iter().enumerate() {
            eprintln!("bench: flow fairness, {}, round {round}/{}: {}", setup.name(), opts.rounds, fair.name());
            runs[i].push(fair_run(opts, setup, *fair)?);
        }
    }
    let flood = setup.flood(opts);
    let (drain_rate, hold) = drain(opts, flood);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "fair shares, {}: {flood} tasks queued by batches of {FLOOD_BATCH}, then one probe task a second for {} s; \
         {DRAIN_WORKERS} workers × {DRAIN_SLOTS} slots holding each task {:.0} ms and each answering one every \
         {:.2} ms (paced for a steady {:.0} tasks/s, one dispatch every {:.2} ms); wait = submit → dispatch as the workers saw it; {} rounds, samples pooled\n",
        setup.name(),
        opts.probe_secs,
        hold.as_secs_f64() * 1e3,
        DRAIN_WORKERS as f64 * 1e3 / drain_rate,
        drain_rate,
        1e3 / drain_rate,
        opts.rounds,
    );
    let _ = writeln!(
        t,
        "| scenario | probe tasks | probe p50 | probe p99 | probe max | dispatches ahead p50 / max | relay's view p50 / max | probe 202 p50 / max | flood tasks | flood p50 | flood p99 | flood max | flood queued in | all drained in |"
    );
    let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (i, fair) in kinds.iter().enumerate() {
        let mut probe: Vec<Duration> = runs[i].iter().flat_map(|r| r.probe.iter().copied()).collect();
        let mut flood: Vec<Duration> = runs[i].iter().flat_map(|r| r.flood.iter().copied()).collect();
        let mut ack: Vec<Duration> = runs[i].iter().flat_map(|r| r.probe_ack.iter().copied()).collect();
        probe.sort();
        flood.sort();
        ack.sort();
        let mut ahead: Vec<usize> = runs[i].iter().flat_map(|r| r.probe_ahead.iter().copied()).collect();
        let mut relay_view: Vec<Duration> = runs[i].iter().flat_map(|r| r.probe_relay.iter().copied()).collect();
        ahead.sort();
        relay_view.sort();
        let ahead_q = |p: f64| {
            let rank = ((p * ahead.len() as f64).ceil() as usize).clamp(1, ahead.len().max(1));
            ahead.get(rank - 1).copied().unwrap_or(0)
        };
        let med = |f: &dyn Fn(&FairRun) -> Duration| {
            Duration::from_secs_f64(median(runs[i].iter().map(|r| f(r).as_secs_f64()).collect()))
        };
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} / {} | {} / {} | {} / {} | {} | {} | {} | {} | {} | {} |",
            fair.name(),
            probe.len(),
            ms(quantile(&probe, 0.5)),
            ms(quantile(&probe, 0.99)),
            ms(quantile(&probe, 1.0)),
            ahead_q(0.5),
            ahead_q(1.0),
            ms(quantile(&relay_view, 0.5)),
            ms(quantile(&relay_view, 1.0)),
            ms(quantile(&ack, 0.5)),
            ms(quantile(&ack, 1.0)),
            flood.len(),
            ms(quantile(&flood, 0.5)),
            ms(quantile(&flood, 0.99)),
            ms(quantile(&flood, 1.0)),
            ms(med(&|r| r.queued_in)),
            ms(med(&|r| r.drained_in)),
        );
    }
    println!("{t}");
    Ok(())
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

// ---------------------------------------------------------------- limit accuracy

/// What the workers saw against the binding policies.
struct Accuracy {
    max_running: usize,
    rate: f64,
    first_second: usize,
    rate_all_in: Duration,
    per_key_max: usize,
    per_key_total_max: usize,
}

/// Tasks and keys of the per-key run: `max_running_per_key 2` over 10 keys.
const PER_KEY_TASKS: usize = 200;
const PER_KEYS: usize = 10;

/// On `nodes` (workers and submits spread over them; policies put on the first, then `settle`
/// for the others to apply them): 64 queued tasks through 4 workers of 16 slots, answering after
/// 20 ms, against `max_running 5`; 60 tasks against `rate 20/s` with a burst of 5; 200 tasks on
/// 10 keys against `max_running_per_key 2` — observed by the workers.
fn limits(nodes: &[SocketAddr], settle: Duration) -> Result<Accuracy, String> {
    let pool = Recorder::ws_on(nodes, WORKER_TOKEN, 4, 16, Duration::from_millis(20), Duration::ZERO)?;
    let r = (|| {
        for (i, node) in nodes.iter().enumerate() {
            let own = (0..4).filter(|w| w % nodes.len() == i).count();
            if nodes.len() == 1 { wait_workers(*node, own)? } else { crate::cluster::wait_active(*node, own)? }
        }
        let policy = |body: &str| -> Result<(), String> {
            put_policy(nodes[0], body)?;
            std::thread::sleep(settle);
            Ok(())
        };
        policy(r#"{"max_running":5}"#)?;
        pool.reset();
        submit(nodes, 64, |_| String::new())?;
        let max_running = pool.wait_done(64, Duration::from_secs(60))?.max_running;

        policy(r#"{"rate":"20/s","burst":5}"#)?;
        pool.reset();
        let started = Instant::now();
        submit(nodes, 60, |_| String::new())?;
        let mut starts = pool.wait_done(60, Duration::from_secs(60))?.starts;
        let rate_all_in = started.elapsed();
        starts.sort();
        // Observed rate after the burst: starts 6..60 over their span.
        let span =
            starts.last().copied().unwrap_or_default().saturating_sub(starts.get(5).copied().unwrap_or_default());
        let rate = 54.0 / span.as_secs_f64().max(1e-9);
        let first_second = starts.iter().filter(|s| **s <= Duration::from_secs(1)).count();

        policy(r#"{"max_running_per_key":2}"#)?;
        pool.reset();
        submit(nodes, PER_KEY_TASKS, |i| format!("k{}", i % PER_KEYS))?;
        let seen = pool.wait_done(PER_KEY_TASKS, Duration::from_secs(60))?;
        Ok(Accuracy {
            max_running,
            rate,
            first_second,
            rate_all_in,
            per_key_max: seen.max_running_per_key,
            per_key_total_max: seen.max_running,
        })
    })();
    pool.stop()?;
    r
}

fn print_accuracy(setup: &str, a: &Accuracy) {
    println!(
        "limit accuracy, {setup}: max_running 5 → observed at most {} running at once; \
         rate 20/s burst 5 → {:.1}/s after the burst, {} started in the first second \
         (bound: 5 + 20 = 25), all 60 in {:.2} s (bound: (60 − 5) / 20 = 2.75 s); \
         max_running_per_key 2 over {PER_KEYS} keys ({PER_KEY_TASKS} tasks) → at most {} of one key and {} in all \
         running at once (bound: 2 and {})",
        a.max_running,
        a.rate,
        a.first_second,
        a.rate_all_in.as_secs_f64(),
        a.per_key_max,
        a.per_key_total_max,
        2 * PER_KEYS,
    );
}

fn accuracy_one_node(opts: &Opts) -> Result<(), String> {
    eprintln!("bench: flow limit accuracy, one node");
    let mut relay = start_relay(opts, &opts.relay, &[])?;
    let a = limits(&[relay.addr], Duration::ZERO)?;
    check_alive(&mut relay)?;
    print_accuracy("one node (memory store)", &a);
    Ok(())
}

fn accuracy_two_nodes(opts: &Opts) -> Result<(), String> {
    if let Err(e) = crate::cluster::available() {
        println!("limit accuracy, two nodes on PostgreSQL: SKIPPED ({e})");
        return Ok(());
    }
    eprintln!("bench: flow limit accuracy, two nodes on one PostgreSQL");
    let pg = crate::cluster::Postgres::start()?;
    let url = pg.url();
    let mut nodes: Vec<Server> = Vec::new();
    for _ in 0..2 {
        nodes.push(start_relay(opts, &opts.relay, &[("DATABASE_URL", url.clone())])?);
    }
    for node in &nodes {
        crate::cluster::wait_health(node.addr)?;
    }
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
    // A policy applies at once on the node that answered, within 1 s on the others (SPEC §14).
    let a = limits(&addrs, Duration::from_millis(1500));
    for node in &mut nodes {
        check_alive(node)?;
    }
    drop(nodes); // (the nodes end their sessions before PostgreSQL stops)
    print_accuracy("two nodes on one PostgreSQL (workers and submits split over both)", &a?);
    Ok(())
}

/// `n` queued tasks by batch, spread over `nodes`; task `i` on key `key(i)` ("": none), which
/// its payload repeats as `"fk"` for the recording workers.
fn submit(nodes: &[SocketAddr], n: usize, key: impl Fn(usize) -> String) -> Result<(), String> {
    for (j, node) in nodes.iter().enumerate() {
        let items: Vec<String> = (0..n)
            .filter(|i| i % nodes.len() == j)
            .map(|i| match key(i) {
                k if k.is_empty() => format!("{{\"payload\":{{\"kind\":\"{KIND}\",\"n\":{i}}}}}"),
                k => format!("{{\"payload\":{{\"kind\":\"{KIND}\",\"n\":{i},\"fk\":\"{k}\"}},\"key\":\"{k}\"}}"),
            })
            .collect();
        let body = format!("{{\"tasks\":[{}]}}", items.join(","));
        let mut conn = HttpConn::connect(*node, IO_TIMEOUT)?;
        let r = conn.request(&build_request("POST", "/tasks/batch", Some(API_TOKEN), body.as_bytes()))?;
        if r.status != 202 || task_ids(r.body).len() != items.len() {
            return Err(format!("batch answered {}: {}", r.status, String::from_utf8_lossy(r.body)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_answer_ids() {
        fn check(body: &str, expected: &[&str]) {
            assert_eq!(task_ids(body.as_bytes()), expected, "{body}");
        }
        check(r#"{"tasks":[]}"#, &[]);
        check(r#"{"tasks":[{"task_id":"a","status":"pending"},{"task_id":"b-2","status":"pending"}]}"#, &["a", "b-2"]);
        check(r#"{"tasks":[{"task_id":"a"},{"error":"queue_full","message":"x"}]}"#, &["a"]);
    }

    #[test]
    fn times_of_day() {
        fn check(t: &str, expected: Option<u64>) {
            assert_eq!(time_of_day_ms(t), expected, "{t}");
        }
        check("2026-12-02T18:54:14.123Z", Some(((18 * 60 + 54) * 60 + 14) * 1000 + 123));
        check("2026-12-02T00:00:01Z", Some(1000));
        check("2026-12-02T00:00:01.5Z", Some(1500));
        check("2026-12-02 00:00:01Z", None);
        check("2026-12-02T00:00:01", None);
    }

    #[test]
    fn quantiles() {
        fn check(xs: &[u64], p: f64, expected: u64) {
            let v: Vec<Duration> = xs.iter().map(|&x| Duration::from_millis(x)).collect();
            assert_eq!(quantile(&v, p), Duration::from_millis(expected), "{xs:?} {p}");
        }
        check(&[], 0.5, 0);
        check(&[7], 0.99, 7);
        check(&[1, 2, 3, 4], 0.5, 2);
        check(&[1, 2, 3, 4], 1.0, 4);
        check(&(1..=100).collect::<Vec<_>>(), 0.99, 99);
    }

    #[test]
    fn keyed_requests_go_round_all_keys() {
        let reqs = sync_requests("{}", 4, 1, 2);
        let keys: Vec<String> = reqs.iter().map(|r| json_str_field(r, "key").unwrap_or_default().to_string()).collect();
        assert_eq!(keys, ["k2", "k3", "k0", "k1"]);
        assert_eq!(sync_requests("{}", 0, 1, 2).len(), 1);
    }
}
