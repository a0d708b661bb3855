//! The load driver: C client threads, each calling its `Client` in a loop, a warm-up, then a
//! measured window during which completions, latencies and the server's CPU time are taken. A call
//! completes one operation: a closed-loop client does one request-reply per call, a pipelined one
//! takes one answer of the several it keeps in flight. It knows nothing about HTTP or NATS: a
//! scenario hands it one `Client` per thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::procs;

/// One client: `call` completes one operation and returns when its answer is in.
pub trait Client: Send + 'static {
    fn call(&mut self) -> Result<(), String>;
    /// Latency of the operation the last `call` completed, when it is not the time the call
    /// took (a pipelined client: from the write of the request to its answer).
    fn latency(&self) -> Option<Duration> {
        None
    }
    /// Nothing more to do (a fixed budget of operations is used up): the thread stops calling,
    /// and when every thread has stopped the measured window ends early.
    fn finished(&self) -> bool {
        false
    }
    /// Called once after the last call, outside every window: e.g. read answers still in flight.
    fn finish(&mut self) {}
}

const WARMUP: u8 = 0;
const MEASURE: u8 = 1;
/// After the measured window: completions are only counted, while `perf stat` counts syscalls.
const COUNT: u8 = 2;
const STOP: u8 = 3;
/// A client thread gives up after this many failed calls (a broken scenario, not noise).
const MAX_ERRORS_PER_CLIENT: u64 = 20;

#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub warmup: Duration,
    pub measure: Duration,
    /// A window after the measured one in which `perf stat` counts the server's syscalls and
    /// context switches (kept apart so tracing cannot inflate the CPU figures).
    pub syscalls: Option<Duration>,
}

/// What one run measured. `cpu` is the server's CPU time (user + system) over the window.
#[derive(Debug)]
pub struct Outcome {
    pub completed: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub elapsed: Duration,
    pub cpu: Duration,
    /// The load generator's own CPU time over the window (this process: clients and workers).
    pub bench_cpu: Duration,
    /// CPU used by every other process on the machine over the window, and hypervisor steal:
    /// when these are high the row is not comparable with the others.
    pub others_cpu: Duration,
    pub steal: Duration,
    pub peak_rss_kib: u64,
    pub latency: Percentiles,
    /// Deltas over the window of the counters the scenario passed in (e.g. worker answers).
    pub counters: Vec<u64>,
    /// perf events per completed call in the syscall window, or why there are none.
    pub per_op_events: Result<Vec<(String, f64)>, String>,
}

impl Outcome {
    pub fn per_sec(&self) -> f64 {
        self.completed as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    /// Server CPU microseconds per completed call.
    pub fn cpu_us_per_op(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / (self.completed.max(1) as f64)
    }
    /// Load generator CPU microseconds per completed call.
    pub fn bench_cpu_us_per_op(&self) -> f64 {
        self.bench_cpu.as_secs_f64() * 1e6 / (self.completed.max(1) as f64)
    }
    /// Share of one core the server used during the window.
    pub fn cpu_share(&self) -> f64 {
        self.cpu.as_secs_f64() / self.elapsed.as_secs_f64().max(1e-9)
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct Percentiles {
    pub p50: Duration,
    pub p99: Duration,
    pub p999: Duration,
    pub max: Duration,
}

/// Runs `clients` against the server `pid` for the window; returns the clients afterwards so a
/// scenario can read what they collected (e.g. task ids to fetch).
pub fn run<C: Client>(clients: Vec<C>, pid: u32, window: Window, counters: &[Arc<AtomicU64>]) -> (Outcome, Vec<C>) {
    let phase = Arc::new(AtomicU8::new(WARMUP));
    let counted = Arc::new(AtomicU64::new(0));
    let stopped = Arc::new(AtomicUsize::new(0));
    let n_clients = clients.len();
    let handles: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let (phase, counted, stopped) = (phase.clone(), counted.clone(), stopped.clone());
            thread::spawn(move || {
                let mut lat_ns: Vec<u64> = Vec::with_capacity(1 << 16);
                let (mut errors, mut first_error) = (0u64, None);
                while phase.load(Ordering::Relaxed) != STOP && !client.finished() {
                    let t0 = Instant::now();
                    match client.call() {
                        Ok(()) => {
                            // Counted when it completes inside the window, whenever it started.
                            match phase.load(Ordering::Relaxed) {
                                MEASURE => {
                                    let lat = client.latency().unwrap_or_else(|| t0.elapsed());
                                    lat_ns.push(lat.as_nanos() as u64);
                                }
                                COUNT => {
                                    counted.fetch_add(1, Ordering::Relaxed);
                                }
                                _ => {}
                            }
                        }
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(e);
                            if errors >= MAX_ERRORS_PER_CLIENT {
                                break;
                            }
                            thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
                stopped.fetch_add(1, Ordering::Relaxed);
                client.finish();
                (client, lat_ns, errors, first_error)
            })
        })
        .collect();

    thread::sleep(window.warmup);
    let before: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let _ = procs::reset_peak_rss(pid);
    let cpu0 = procs::cpu_time(pid).unwrap_or_default();
    let bench0 = procs::cpu_time(std::process::id()).unwrap_or_default();
    let (busy0, steal0) = procs::machine_cpu();
    phase.store(MEASURE, Ordering::Relaxed);
    let t0 = Instant::now();
    // The window ends early when every client has stopped (budgets used up, or failing).
    while t0.elapsed() < window.measure && stopped.load(Ordering::Relaxed) < n_clients {
        thread::sleep((window.measure - t0.elapsed().min(window.measure)).min(Duration::from_millis(10)));
    }
    phase.store(if window.syscalls.is_some() { COUNT } else { STOP }, Ordering::Relaxed);
    let elapsed = t0.elapsed();
    let cpu1 = procs::cpu_time(pid).unwrap_or_default();
    let bench1 = procs::cpu_time(std::process::id()).unwrap_or_default();
    let (busy1, steal1) = procs::machine_cpu();
    let deltas = counters.iter().zip(before).map(|(c, b)| c.load(Ordering::Relaxed) - b).collect();
    let peak_rss_kib = procs::mem(pid).map(|m| m.hwm_kib).unwrap_or(0);
    let per_op_events = match window.syscalls {
        Some(span) => {
            let t = Instant::now();
            let counts = procs::perf_stat(pid, span);
            // perf counts for `span`; the calls are counted from before it starts to after it
            // ends, so scale them to `span`.
            let calls = counted.load(Ordering::Relaxed) as f64 * span.as_secs_f64() / t.elapsed().as_secs_f64();
            phase.store(STOP, Ordering::Relaxed);
            counts.map(|c| c.into_iter().map(|(e, n)| (e, n as f64 / calls.max(1.0))).collect())
        }
        None => Err("not counted".into()),
    };

    let mut all = Vec::new();
    let mut clients = Vec::new();
    let mut outcome = Outcome {
        completed: 0,
        errors: 0,
        first_error: None,
        elapsed,
        cpu: cpu1.saturating_sub(cpu0),
        bench_cpu: bench1.saturating_sub(bench0),
        others_cpu: busy1
            .saturating_sub(busy0)
            .saturating_sub(cpu1.saturating_sub(cpu0))
            .saturating_sub(bench1.saturating_sub(bench0)),
        steal: steal1.saturating_sub(steal0),
        peak_rss_kib,
        latency: Percentiles::default(),
        counters: deltas,
        per_op_events,
    };
    for h in handles {
        let (client, lat, errors, first_error) = h.join().expect("client thread panicked");
        all.extend(lat);
        outcome.errors += errors;
        if outcome.first_error.is_none() {
            outcome.first_error = first_error;
        }
        clients.push(client);
    }
    outcome.completed = all.len() as u64;
    outcome.latency = percentiles(&mut all);
    (outcome, clients)
}

/// Nearest-rank percentiles of the samples (nanoseconds); sorts them.
pub fn percentiles(samples: &mut [u64]) -> Percentiles {
    if samples.is_empty() {
        return Percentiles::default();
    }
    samples.sort_unstable();
    let at = |q: f64| {
        let rank = (q * samples.len() as f64).ceil() as usize;
        Duration::from_nanos(samples[rank.clamp(1, samples.len()) - 1])
    };
    Percentiles { p50: at(0.50), p99: at(0.99), p999: at(0.999), max: at(1.0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        fn check(mut samples: Vec<u64>, expected: (u64, u64, u64, u64)) {
            let p = percentiles(&mut samples);
            let got =
                (p.p50.as_nanos() as u64, p.p99.as_nanos() as u64, p.p999.as_nanos() as u64, p.max.as_nanos() as u64);
            assert_eq!(got, expected);
        }
        check(vec![], (0, 0, 0, 0));
        check(vec![7], (7, 7, 7, 7));
        check((1..=100).rev().collect(), (50, 99, 100, 100));
        check((1..=1000).collect(), (500, 990, 999, 1000));
    }
}
