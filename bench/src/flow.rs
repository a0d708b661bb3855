//! Flow control (issue 22, SPEC §14): what a kind policy costs a sync task when it does not
//! bind — relay's CPU per task with no policy, with a `max_running` far above what runs, and
//! with a `rate` far above what arrives, each in its own relay, round after round — and the
//! limit accuracy on one node: the most tasks running at once and the dispatch rate observed
//! by the workers against a binding `max_running` and `rate`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Opts;
use crate::httpc::{HttpConn, build_request};
use crate::scenarios::{
    API_TOKEN, IO_TIMEOUT, Keep, PipeClient, WORKER_CONCURRENCY, WORKER_TOKEN, check_alive, payload, start_relay,
    wait_workers, window,
};
use crate::workers::Pool;

const KIND: &str = "b";

/// The policy variants: (name, `PUT /kinds/b` body; `None`: no policy).
const VARIANTS: [(&str, Option<&str>); 3] = [
    ("no policy", None),
    ("max_running 1000000 (does not bind)", Some(r#"{"max_running":1000000}"#)),
    ("rate 10000000/s (does not bind)", Some(r#"{"rate":"10000000/s"}"#)),
];

fn put_policy(addr: std::net::SocketAddr, body: &str) -> Result<(), String> {
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?;
    let req = build_request("PUT", &format!("/kinds/{KIND}"), Some(API_TOKEN), body.as_bytes());
    let r = conn.request(&req)?;
    if r.status != 200 {
        return Err(format!("PUT /kinds/{KIND} answered {}: {}", r.status, String::from_utf8_lossy(r.body)));
    }
    Ok(())
}

/// Relay's CPU per sync task (µs) and tasks/s with one policy variant.
fn sync_with(opts: &Opts, policy: Option<&str>) -> Result<(f64, f64), String> {
    let mut relay = start_relay(opts, &opts.relay, &[])?;
    if let Some(p) = policy {
        put_policy(relay.addr, p)?;
    }
    let pool = Pool::ws(relay.addr, WORKER_TOKEN, opts.workers, WORKER_CONCURRENCY, crate::RESULT_DATA)?;
    wait_workers(relay.addr, opts.workers)?;
    let p = payload(opts.payload_bytes);
    let body = format!("{{\"payload\":{{\"kind\":\"{KIND}\",\"p\":{p}}}}}");
    let req = Arc::new(vec![build_request("POST", "/tasks?wait=true", Some(API_TOKEN), body.as_bytes())]);
    let cs: Vec<_> =
        (0..opts.clients).map(|_| PipeClient::new(relay.addr, 1, req.clone(), 200, Keep::Nothing)).collect();
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

/// `relay-bench flow`: prints a Markdown table for bench/README.md.
pub fn run(opts: &Opts) -> Result<(), String> {
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    let mut rate: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    for round in 1..=opts.rounds {
        // (Variants interleaved within each round: drift of the machine hits them alike.)
        for (i, (name, policy)) in VARIANTS.iter().enumerate() {
            eprintln!("bench: flow round {round}/{}: {name}", opts.rounds);
            let (c, r) = sync_with(opts, *policy)?;
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
    let _ = writeln!(t, "| policy | tasks/s | relay CPU µs/task | ÷ no policy |");
    let _ = writeln!(t, "|---|---:|---:|---:|");
    for (i, (name, _)) in VARIANTS.iter().enumerate() {
        let c = median(cpu[i].clone());
        let _ = writeln!(t, "| {name} | {:.0} | {c:.1} | {:.3} |", median(rate[i].clone()), c / base);
    }
    println!("{t}");
    accuracy(opts)
}

/// One node: 64 queued tasks through 4 workers of 16 slots, answering after 20 ms, against
/// `max_running 5`; then 60 tasks against `rate 20/s` with a burst of 5 — observed by the workers.
fn accuracy(opts: &Opts) -> Result<(), String> {
    let mut relay = start_relay(opts, &opts.relay, &[])?;
    put_policy(relay.addr, r#"{"max_running":5}"#)?;
    let pool = crate::workers::Recorder::ws(relay.addr, WORKER_TOKEN, 4, 16, Duration::from_millis(20))?;
    wait_workers(relay.addr, 4)?;
    submit(relay.addr, 64)?;
    let most = pool.wait_done(64, Duration::from_secs(30))?.max_running;
    put_policy(relay.addr, r#"{"rate":"20/s","burst":5}"#)?;
    pool.reset();
    let started = Instant::now();
    submit(relay.addr, 60)?;
    let starts = pool.wait_done(60, Duration::from_secs(30))?.starts;
    check_alive(&mut relay)?;
    pool.stop()?;
    // Observed rate after the burst: starts 6..60 over their span.
    let span = starts.last().copied().unwrap_or_default().saturating_sub(starts.get(5).copied().unwrap_or_default());
    let observed = 54.0 / span.as_secs_f64().max(1e-9);
    let first_second = starts.iter().filter(|s| **s <= Duration::from_secs(1)).count();
    println!(
        "limit accuracy, one node (memory store): max_running 5 → observed at most {most} running at once; \
         rate 20/s burst 5 → {observed:.1}/s after the burst, {first_second} started in the first second \
         (bound: 5 + 20 = 25), all 60 in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn submit(addr: std::net::SocketAddr, n: usize) -> Result<(), String> {
    let items: Vec<String> = (0..n).map(|i| format!("{{\"payload\":{{\"kind\":\"{KIND}\",\"n\":{i}}}}}")).collect();
    let body = format!("{{\"tasks\":[{}]}}", items.join(","));
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?;
    let r = conn.request(&build_request("POST", "/tasks/batch", Some(API_TOKEN), body.as_bytes()))?;
    if r.status != 202 {
        return Err(format!("batch answered {}", r.status));
    }
    Ok(())
}
