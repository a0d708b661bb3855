//! Worker sessions under failure (issue 20, SPEC §12), with the real `relay-worker`:
//!
//! - `flaky`: 16 workers reach relay through a loopback proxy that cuts each connection (no
//!   close frame) after a random time, on average every `FLAKY_MEAN_DROP`; a steady closed-loop
//!   load of `wait=true` submits of an `http` task against a local target that takes
//!   `WORK_MS` and counts the requests per task. Run with `RESUME_WINDOW=0s` (sessions held for
//!   nothing: the seed behaviour) and the default 10 s: attempts per task, tasks run more than
//!   once (the target saw them twice or more), p50/p99 of the `wait=true` call.
//! - `restart-load`: the same workers and target, connected directly, tasks submitted at a
//!   steady rate to a relay with a journal that is stopped (SIGTERM, or `kill -9`) and started
//!   again on the same port and DATA_DIR in the middle: tasks run twice, with `RESUME_WINDOW=0s`
//!   and with the default.
//!
//! Everything it starts it stops by PID; it only targets loopback.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::Opts;
use crate::httpc::{HttpConn, build_request, json_str_field};
use crate::load::percentiles;
use crate::procs::{self, Server};
use crate::scenarios::{API_TOKEN, START_TIMEOUT, WORKER_TOKEN};

const WORKERS: usize = 16;
const WORKER_CONCURRENCY: usize = 4;
const CLIENTS: usize = 16;
const WORK_MS: u64 = 300;
const FLAKY_MEAN_DROP: Duration = Duration::from_secs(10);
const FLAKY_WINDOW: Duration = Duration::from_secs(40);

/// A local HTTP target: `/t/<n>` answers after `WORK_MS`, and counts its requests per `n`.
struct Target {
    addr: SocketAddr,
    hits: Arc<Mutex<HashMap<u64, u32>>>,
    stop: Arc<AtomicBool>,
}

impl Target {
    fn start() -> Result<Target, String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let hits: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (h, s) = (hits.clone(), stop.clone());
        thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let h = h.clone();
                        thread::spawn(move || serve_target(conn, &h));
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Target { addr, hits, stop })
    }

    fn hits_of(&self, n: u64) -> u32 {
        self.hits.lock().map_or(0, |h| h.get(&n).copied().unwrap_or(0))
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn serve_target(mut conn: TcpStream, hits: &Mutex<HashMap<u64, u32>>) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end + 4);
        let n = head.split_whitespace().nth(1).and_then(|p| p.strip_prefix("/t/")).and_then(|n| n.parse().ok());
        if let (Some(n), Ok(mut h)) = (n, hits.lock()) {
            *h.entry(n).or_default() += 1;
        }
        thread::sleep(Duration::from_millis(WORK_MS));
        if conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok").is_err() {
            return;
        }
    }
}

/// A loopback proxy that cuts each connection after a random time (mean `mean`; `None`: never).
struct Proxy {
    addr: SocketAddr,
    cuts: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    fn start(target: SocketAddr, mean: Option<Duration>) -> Result<Proxy, String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let (cuts, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (c, s) = (cuts.clone(), stop.clone());
        thread::spawn(move || {
            let mut rng = Rng::new();
            while !s.load(Ordering::Relaxed) {
                let Ok((down, _)) = listener.accept() else {
                    thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let Ok(up) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = down.set_nonblocking(false);
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                pipe(&down, &up);
                pipe(&up, &down);
                if let Some(mean) = mean {
                    // Exponential: memoryless, so every connection is cut ~once per `mean`.
                    let after = mean.mul_f64(-(1.0 - rng.unit()).ln());
                    let (d, u, c, s) = (down.try_clone(), up.try_clone(), c.clone(), s.clone());
                    thread::spawn(move || {
                        let until = Instant::now() + after;
                        while Instant::now() < until && !s.load(Ordering::Relaxed) {
                            thread::sleep(Duration::from_millis(50));
                        }
                        if let (Ok(d), Ok(u)) = (d, u) {
                            let _ = (d.shutdown(Shutdown::Both), u.shutdown(Shutdown::Both));
                            c.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
            }
        });
        Ok(Proxy { addr, cuts, stop })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else { return };
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = (from.shutdown(Shutdown::Both), to.shutdown(Shutdown::Both));
    });
}

/// xorshift64*, seeded from the clock: the proxy's cut times.
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        Rng(seed | 1)
    }
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The relay-worker processes, killed by PID on drop.
struct Workers(Vec<Child>);

impl Workers {
    fn start(bin: &Path, url: &str) -> Result<Workers, String> {
        let mut v = Vec::new();
        for i in 0..WORKERS {
            let child = Command::new(bin)
                .env_clear()
                .env("RELAY_URL", url)
                .env("TOKEN", WORKER_TOKEN)
                .env("CONCURRENCY", WORKER_CONCURRENCY.to_string())
                .env("HTTP_TIMEOUT", "20s")
                .env("WORKER_ID", format!("bench-worker-{i}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
            procs::track_child(child.id());
            v.push(child);
        }
        Ok(Workers(v))
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
            procs::untrack_child(c.id());
        }
    }
}

fn start_relay(opts: &Opts, port: u16, data_dir: Option<&Path>, window: &str) -> Result<Server, String> {
    let mut cmd = Command::new(&opts.relay);
    let scratch = std::env::temp_dir().join(format!("relay-bench-flaky-{}", std::process::id()));
    cmd.env_clear()
        .env("PORT", port.to_string())
        .env("BIND", "127.0.0.1")
        .env("API_TOKEN", API_TOKEN)
        .env("WORKER_TOKEN", WORKER_TOKEN)
        .env("DATA_DIR", data_dir.map_or(PathBuf::new(), Path::to_path_buf))
        .env("LOG_LEVEL", "warn")
        .env("TASK_TIMEOUT", "20s")
        .env("MAX_RETRIES", "10")
        .env("WAIT_TIMEOUT", "60s")
        .env("PING_INTERVAL", "1s")
        .env("PONG_WAIT", "3s")
        .env("SHUTDOWN_TIMEOUT", "2s")
        .env("RESUME_WINDOW", window)
        .env("BLOB_DIR", scratch.join("blobs"))
        .env("TOKEN_STORE", scratch.join("tokens.json"));
    for (k, v) in &opts.relay_env {
        cmd.env(k, v);
    }
    Server::start("relay", cmd, procs::relay_listening, START_TIMEOUT)
}

/// Waits until `/clients` lists `n` active workers.
fn wait_workers(addr: SocketAddr, n: usize) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let req = build_request("GET", "/healthz", None, b"");
    while Instant::now() < deadline {
        if let Ok(mut c) = HttpConn::connect(addr, Duration::from_secs(2))
            && let Ok(r) = c.request(&req)
            && let Some(active) = number_field(r.body, "active_clients")
            && active >= n as u64
        {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(100));
    }
    Err(format!("fewer than {n} workers connected within 30 s"))
}

fn number_field(text: &[u8], key: &str) -> Option<u64> {
    let pat = format!("\"{key}\":");
    let at = text.windows(pat.len()).position(|w| w == pat.as_bytes())? + pat.len();
    let digits: String = text[at..].iter().take_while(|b| b.is_ascii_digit()).map(|&b| b as char).collect();
    digits.parse().ok()
}

fn task_body(target: SocketAddr, n: u64) -> Vec<u8> {
    format!(r#"{{"payload":{{"kind":"http","spec":{{"url":"http://{target}/t/{n}"}}}}}}"#).into_bytes()
}

/// A `wait=true` call: the task's number at the target, status code, attempts, latency.
type Answered = (u64, u16, u64, Duration);

/// One configuration's figures.
struct Figures {
    tasks: u64,
    done: u64,
    attempts: u64,
    twice: u64,
    p50: Duration,
    p99: Duration,
    cuts: u64,
}

pub fn run(opts: &Opts) -> Result<(), String> {
    for bin in [&opts.relay, &opts.relay_worker] {
        if !bin.exists() {
            return Err(format!("{} not found (build it: cargo build --release --workspace)", bin.display()));
        }
    }
    let want = |s: &str| opts.scenarios.iter().any(|x| x == s || x == "sessions");
    if want("flaky") {
        println!(
            "flaky link: {WORKERS} relay-workers x {WORKER_CONCURRENCY} through a proxy cutting each connection ~every {}s, {CLIENTS} clients wait=true, tasks of {WORK_MS} ms, {}s",
            FLAKY_MEAN_DROP.as_secs(),
            FLAKY_WINDOW.as_secs()
        );
        println!(
            "{:<16} {:>7} {:>7} {:>10} {:>12} {:>9} {:>9} {:>6}",
            "RESUME_WINDOW", "tasks", "done", "att/task", "ran >1 time", "p50", "p99", "cuts"
        );
        for window in ["0s", "10s"] {
            let f = flaky(opts, window)?;
            println!(
                "{:<16} {:>7} {:>7} {:>10.3} {:>12} {:>9.0?} {:>9.0?} {:>6}",
                window,
                f.tasks,
                f.done,
                f.attempts as f64 / f.tasks.max(1) as f64,
                f.twice,
                f.p50,
                f.p99,
                f.cuts
            );
        }
    }
    if want("restart-load") {
        println!(
            "relay restart under load: {WORKERS} relay-workers x {WORKER_CONCURRENCY}, 40 tasks/s of {WORK_MS} ms for 12 s, relay stopped at 6 s and started again on its DATA_DIR"
        );
        println!(
            "{:<16} {:<8} {:>7} {:>7} {:>10} {:>12}",
            "RESUME_WINDOW", "stop", "tasks", "done", "att/task", "ran >1 time"
        );
        for window in ["0s", "10s"] {
            for how in ["TERM", "KILL"] {
                if std::env::var("BENCH_ONLY").is_ok_and(|o| o != format!("{window}:{how}")) {
                    continue;
                }
                let f = restart(opts, window, how)?;
                println!(
                    "{:<16} {:<8} {:>7} {:>7} {:>10.3} {:>12}",
                    window,
                    how,
                    f.tasks,
                    f.done,
                    f.attempts as f64 / f.tasks.max(1) as f64,
                    f.twice
                );
            }
        }
    }
    Ok(())
}

fn flaky(opts: &Opts, window: &str) -> Result<Figures, String> {
    let target = Target::start()?;
    let mut relay = start_relay(opts, 0, None, window)?;
    let proxy = Proxy::start(relay.addr, Some(FLAKY_MEAN_DROP))?;
    let workers = Workers::start(&opts.relay_worker, &format!("ws://{}/ws", proxy.addr))?;
    wait_workers(relay.addr, WORKERS)?;
    let next = Arc::new(AtomicU64::new(0));
    let results: Arc<Mutex<Vec<Answered>>> = Arc::default();
    let stop_at = Instant::now() + FLAKY_WINDOW;
    let mut joins = Vec::new();
    for _ in 0..CLIENTS {
        let (next, results, addr, target) = (next.clone(), results.clone(), relay.addr, target.addr);
        joins.push(thread::spawn(move || {
            let mut conn: Option<HttpConn> = None;
            while Instant::now() < stop_at {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let req = build_request("POST", "/tasks?wait=true", Some(API_TOKEN), &task_body(target, n));
                let began = Instant::now();
                let c = match conn.as_mut() {
                    Some(c) => c,
                    None => match HttpConn::connect(addr, Duration::from_secs(70)) {
                        Ok(c) => conn.insert(c),
                        Err(_) => continue,
                    },
                };
                match c.request(&req) {
                    Ok(r) => {
                        let attempts = number_field(r.body, "attempts").unwrap_or(0);
                        let entry = (n, r.status, attempts, began.elapsed());
                        if let Ok(mut v) = results.lock() {
                            v.push(entry);
                        }
                    }
                    Err(_) => conn = None,
                }
            }
        }));
    }
    for j in joins {
        let _ = j.join();
    }
    let cuts = proxy.cuts.load(Ordering::Relaxed);
    drop(workers);
    relay.stop();
    let results = results.lock().map(|v| v.clone()).unwrap_or_default();
    let mut lat: Vec<u64> = results.iter().map(|r| r.3.as_nanos() as u64).collect();
    let p = percentiles(&mut lat);
    Ok(Figures {
        tasks: results.len() as u64,
        done: results.iter().filter(|r| r.1 == 200).count() as u64,
        attempts: results.iter().map(|r| r.2).sum(),
        twice: results.iter().filter(|r| target.hits_of(r.0) > 1).count() as u64,
        p50: p.p50,
        p99: p.p99,
        cuts,
    })
}

fn restart(opts: &Opts, window: &str, how: &str) -> Result<Figures, String> {
    let target = Target::start()?;
    let data = opts
        .data_root
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("relay-bench-restart-{}-{window}-{how}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let mut relay = start_relay(opts, 0, Some(&data), window)?;
    let port = relay.addr.port();
    let addr = relay.addr;
    let workers = Workers::start(&opts.relay_worker, &format!("ws://{addr}/ws"))?;
    wait_workers(addr, WORKERS)?;
    // Steady submits (async, 40/s), through the restart: a refused submit is tried again.
    let ids: Arc<Mutex<Vec<(u64, String)>>> = Arc::default();
    let began = Instant::now();
    let (stop_submits, restart_at) = (began + Duration::from_secs(12), began + Duration::from_secs(6));
    let submitter = {
        let (ids, target) = (ids.clone(), target.addr);
        thread::spawn(move || {
            let mut n = 0u64;
            while Instant::now() < stop_submits {
                let due = began + Duration::from_millis(n * 25);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    thread::sleep(wait);
                }
                let req = build_request("POST", "/tasks", Some(API_TOKEN), &task_body(target, n));
                if let Ok(mut c) = HttpConn::connect(addr, Duration::from_secs(5))
                    && let Ok(r) = c.request(&req)
                    && r.status == 202
                    && let Some(id) = json_str_field(r.body, "task_id")
                {
                    if let Ok(mut v) = ids.lock() {
                        v.push((n, id.to_string()));
                    }
                    n += 1;
                }
            }
        })
    };
    if let Some(wait) = restart_at.checked_duration_since(Instant::now()) {
        thread::sleep(wait);
    }
    let _ = Command::new("kill").arg(format!("-{how}")).arg(relay.pid().to_string()).status();
    let gone = Instant::now() + Duration::from_secs(10);
    while relay.alive() && Instant::now() < gone {
        thread::sleep(Duration::from_millis(10));
    }
    relay.stop();
    let mut relay = start_relay(opts, port, Some(&data), window)?;
    let _ = submitter.join();
    // Every submitted task final (bounded), then its attempts and the target's count.
    let ids = ids.lock().map(|v| v.clone()).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(90);
    let (mut done, mut attempts, mut finals) = (0u64, 0u64, 0u64);
    for (_, id) in &ids {
        loop {
            let req = build_request("GET", &format!("/tasks/{id}"), Some(API_TOKEN), b"");
            let r = HttpConn::connect(relay.addr, Duration::from_secs(5)).and_then(|mut c| {
                let r = c.request(&req)?;
                if std::env::var_os("BENCH_DEBUG").is_some() && json_str_field(r.body, "status") == Some("failed") {
                    eprintln!("failed: {}", String::from_utf8_lossy(r.body));
                }
                Ok((json_str_field(r.body, "status").unwrap_or("").to_string(), number_field(r.body, "attempts")))
            });
            if let Ok((status, a)) = &r
                && matches!(status.as_str(), "done" | "failed" | "canceled")
            {
                finals += 1;
                done += u64::from(status == "done");
                attempts += a.unwrap_or(0);
                break;
            }
            if Instant::now() > deadline {
                if std::env::var_os("BENCH_DEBUG").is_some() {
                    eprintln!("not final: {id} {r:?}");
                }
                break;
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
    drop(workers);
    relay.stop();
    let _ = std::fs::remove_dir_all(&data);
    let twice = ids.iter().filter(|(n, _)| target.hits_of(*n) > 1).count() as u64;
    let _ = finals;
    Ok(Figures { tasks: ids.len() as u64, done, attempts, twice, p50: Duration::ZERO, p99: Duration::ZERO, cuts: 0 })
}
