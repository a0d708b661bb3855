//! Retries (issue 21, SPEC §13), two scenarios on one relay each:
//!
//! - `retry-outage`: steady sync load (C clients, `POST /tasks?wait=true`) on W workers whose
//!   shared upstream is down for 2 s in the middle of the window: every attempt during the outage
//!   fails. Reported: tasks, how many failed, attempts per task — with the seed policy (retry at
//!   once), and with `RETRY_BACKOFF=200ms` (and with MAX_RETRIES=5 beside it).
//! - `retry-degraded`: the same load on 8 workers of which one fails everything (a worker that lost
//!   its route): attempts per task, and the share of first attempts it got.
//!
//! Workers are threads of this process speaking the worker protocol; they answer at once.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tungstenite::Message;

use crate::Opts;
use crate::httpc::{HttpConn, build_request};
use crate::scenarios::{API_TOKEN, WORKER_TOKEN, start_relay};
use crate::workers::{is_timeout, ws_connect};

/// How a fake worker answers a task, given when the run started.
#[derive(Clone)]
enum Behaviour {
    /// Done, but failed while the shared upstream is down (`from..until` after the start).
    Upstream {
        start: Instant,
        from: Duration,
        until: Duration,
    },
    /// Failed, always.
    Broken,
    Done,
}

fn spawn_worker(
    addr: SocketAddr,
    how: Behaviour,
    stop: Arc<AtomicBool>,
    ready: Arc<AtomicU64>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let mut ws = ws_connect(addr, WORKER_TOKEN, None)?;
    ws.get_mut().set_read_timeout(Some(Duration::from_millis(50))).map_err(|e| e.to_string())?;
    ws.send(Message::text(r#"{"type":"hello","concurrency":64,"version":"bench"}"#)).map_err(|e| e.to_string())?;
    ready.fetch_add(1, Ordering::SeqCst);
    Ok(std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            let msg = match ws.read() {
                Ok(m) => m,
                Err(e) if is_timeout(&e) => continue,
                Err(_) => return,
            };
            let Message::Text(text) = msg else { continue };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(text.as_str()) else { continue };
            if v["type"] != "task" {
                continue;
            }
            let id = v["task_id"].as_str().unwrap_or_default();
            let fail = match &how {
                Behaviour::Upstream { start, from, until } => {
                    let t = start.elapsed();
                    t >= *from && t < *until
                }
                Behaviour::Broken => true,
                Behaviour::Done => false,
            };
            let answer = if fail {
                format!(r#"{{"type":"result","task_id":"{id}","status":"failed","error":"upstream unreachable"}}"#)
            } else {
                format!(r#"{{"type":"result","task_id":"{id}","status":"done","data":{}}}"#, crate::RESULT_DATA)
            };
            if ws.send(Message::text(answer)).is_err() {
                return;
            }
        }
        let _ = ws.close(None);
    }))
}

/// What the clients saw.
#[derive(Default)]
struct Tally {
    tasks: AtomicU64,
    failed: AtomicU64,
    attempts: AtomicU64,
    /// Tasks whose first attempt ran on the worker `first_on` names.
    first_on_marked: AtomicU64,
}

fn number_after(body: &[u8], key: &str) -> Option<u64> {
    let text = std::str::from_utf8(body).ok()?;
    let at = text.find(key)? + key.len();
    let digits: String = text[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// C closed-loop clients for `window`; `marked`: a client id whose first attempts are counted.
fn load(addr: SocketAddr, clients: usize, window: Duration, marked: Option<String>) -> Result<Tally, String> {
    let tally = Arc::new(Tally::default());
    let deadline = Instant::now() + window;
    let req = Arc::new(build_request("POST", "/tasks?wait=true", Some(API_TOKEN), br#"{"payload":{"n":1}}"#));
    let marked = Arc::new(marked);
    let mut joins = Vec::new();
    for _ in 0..clients {
        let (tally, req, marked) = (tally.clone(), req.clone(), marked.clone());
        joins.push(std::thread::spawn(move || -> Result<(), String> {
            let mut c = HttpConn::connect(addr, Duration::from_secs(40))?;
            while Instant::now() < deadline {
                let r = c.request(&req)?;
                match r.status {
                    200 => {}
                    502 => {
                        tally.failed.fetch_add(1, Ordering::Relaxed);
                    }
                    s => return Err(format!("unexpected status {s}: {}", String::from_utf8_lossy(r.body))),
                }
                tally.tasks.fetch_add(1, Ordering::Relaxed);
                tally.attempts.fetch_add(number_after(r.body, "\"attempts\":").unwrap_or(0), Ordering::Relaxed);
                if let Some(m) = marked.as_deref() {
                    let text = String::from_utf8_lossy(r.body);
                    // The attempt_log's first entry names the worker of the first attempt.
                    let key = "\"attempt_log\":[{\"num\":1,\"client_id\":\"";
                    let first = text.find(key).map(|i| i + key.len());
                    if first.is_some_and(|i| text.get(i..i + 36) == Some(m)) {
                        tally.first_on_marked.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Ok(())
        }));
    }
    for j in joins {
        j.join().map_err(|_| "a client panicked")??;
    }
    Arc::try_unwrap(tally).map_err(|_| "tally still shared".to_string())
}

fn clients_of(addr: SocketAddr) -> Result<Vec<(String, String)>, String> {
    let mut c = HttpConn::connect(addr, Duration::from_secs(5))?;
    let r = c.request(&build_request("GET", "/clients", Some(API_TOKEN), b""))?;
    let v: serde_json::Value = serde_json::from_slice(r.body).map_err(|e| e.to_string())?;
    Ok(v["clients"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    (c["client_id"].as_str().unwrap_or("").to_string(), c["ip"].as_str().unwrap_or("").to_string())
                })
                .collect()
        })
        .unwrap_or_default())
}

/// A relay, the stop flag of its workers, their threads, and their client ids in connection order.
type Running = (crate::procs::Server, Arc<AtomicBool>, Vec<std::thread::JoinHandle<()>>, Vec<String>);

/// Starts relay (`binary`, with `env`) and `behaviours` workers, waits until all are listed.
fn setup(opts: &Opts, binary: &Path, env: &[(&str, String)], behaviours: Vec<Behaviour>) -> Result<Running, String> {
    let relay = start_relay(opts, binary, env)?;
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicU64::new(0));
    let mut joins = Vec::new();
    let mut order = Vec::new();
    for how in behaviours {
        let before: Vec<String> = clients_of(relay.addr)?.into_iter().map(|c| c.0).collect();
        joins.push(spawn_worker(relay.addr, how, stop.clone(), ready.clone())?);
        // (One at a time: the client id of each worker, in connection order.)
        let t0 = Instant::now();
        loop {
            let now: Vec<String> = clients_of(relay.addr)?.into_iter().map(|c| c.0).collect();
            if let Some(new) = now.iter().find(|c| !before.contains(c)) {
                order.push(new.clone());
                break;
            }
            if t0.elapsed() > Duration::from_secs(5) {
                return Err("a worker never showed up in /clients".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    // Past the hello grace: every worker greeted (its hello was read).
    std::thread::sleep(Duration::from_millis(200));
    Ok((relay, stop, joins, order))
}

fn teardown(mut relay: crate::procs::Server, stop: Arc<AtomicBool>, joins: Vec<std::thread::JoinHandle<()>>) {
    stop.store(true, Ordering::SeqCst);
    for j in joins {
        let _ = j.join();
    }
    relay.stop();
}

/// `retry-outage` and `retry-degraded`; `old`: a relay build from before issue 21, for the
/// degraded rule's "before".
pub fn run(opts: &Opts, which: &str) -> Result<(), String> {
    let clients = opts.clients.min(32);
    if which == "retry-outage" || which == "retries" {
        println!("\n### Upstream down for 2 s under steady load ({clients} clients, 8 workers, 6 s window)\n");
        println!("| policy | tasks | failed | attempts per task |");
        println!("|---|---:|---:|---:|");
        let policies: [(&str, Vec<(&str, String)>); 3] = [
            ("seed: retry at once, MAX_RETRIES=2", vec![]),
            ("RETRY_BACKOFF=200ms, MAX_RETRIES=2", vec![("RETRY_BACKOFF", "200ms".into())]),
            (
                "RETRY_BACKOFF=200ms, MAX_RETRIES=5",
                vec![("RETRY_BACKOFF", "200ms".into()), ("MAX_RETRIES", "5".into())],
            ),
        ];
        for (name, env) in policies {
            let start = Instant::now() + Duration::from_millis(300);
            let how = Behaviour::Upstream { start, from: Duration::from_secs(2), until: Duration::from_secs(4) };
            let (relay, stop, joins, _) = setup(opts, &opts.relay, &env, vec![how; 8])?;
            let wait = start.saturating_duration_since(Instant::now());
            std::thread::sleep(wait);
            let t = load(relay.addr, clients, Duration::from_secs(6), None)?;
            teardown(relay, stop, joins);
            let (n, f, a) = (t.tasks.into_inner(), t.failed.into_inner(), t.attempts.into_inner());
            println!(
                "| {name} | {n} | {f} ({:.2} %) | {:.3} |",
                100.0 * f as f64 / n.max(1) as f64,
                a as f64 / n.max(1) as f64
            );
        }
    }
    if which == "retry-degraded" || which == "retries" {
        println!("\n### One worker of eight failing everything ({clients} clients, 6 s window)\n");
        println!("| relay | tasks | failed | attempts per task | first attempts on the failing worker |");
        println!("|---|---:|---:|---:|---:|");
        let mut builds = vec![("this build (degraded workers avoided)", opts.relay.clone())];
        if let Ok(old) = std::env::var("BENCH_RELAY_BEFORE") {
            builds.insert(0, ("before issue 21 (0d5486e)", old.into()));
        }
        for (name, binary) in builds {
            let mut hows = vec![Behaviour::Broken];
            hows.extend(std::iter::repeat_n(Behaviour::Done, 7));
            let (relay, stop, joins, order) = setup(opts, &binary, &[], hows)?;
            let t = load(relay.addr, clients, Duration::from_secs(6), order.first().cloned())?;
            teardown(relay, stop, joins);
            let (n, f, a) = (t.tasks.into_inner(), t.failed.into_inner(), t.attempts.into_inner());
            let m = t.first_on_marked.into_inner();
            println!(
                "| {name} | {n} | {f} | {:.4} | {m} ({:.2} %) |",
                a as f64 / n.max(1) as f64,
                100.0 * m as f64 / n.max(1) as f64
            );
        }
    }
    Ok(())
}
