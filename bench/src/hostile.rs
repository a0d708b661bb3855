//! Hostile clients for issue 10's "normal clients keep their latency" figure: slowloris
//! connections that send a request head one byte at a time and never finish it. One thread holds
//! them all on non-blocking sockets; a connection relay closes (its `HEADER_TIMEOUT`) is opened
//! again at once, as a real attacker would. Loopback only, bounded in count and time.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// What every slowloris connection starts with: a head that is never finished.
const HEAD_START: &[u8] = b"POST /tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
/// How often each connection sends its next byte (well inside relay's HEADER_TIMEOUT).
const TRICKLE: Duration = Duration::from_secs(1);
const TICK: Duration = Duration::from_millis(100);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Default, Clone, Copy)]
pub struct SlowStats {
    /// Connections opened in all (the first `n` and every reopen).
    pub opened: u64,
    /// Connections relay closed (or answered, which it does only to close).
    pub closed_by_server: u64,
    /// Open when stopped.
    pub open_at_end: usize,
    pub bytes_sent: u64,
    /// Connects that failed (relay's connection limit, or the accept queue full).
    pub connect_failures: u64,
}

pub struct Slowloris {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<SlowStats>>,
}

struct Conn {
    stream: TcpStream,
    next_at: Instant,
}

fn open(addr: SocketAddr, first_at: Instant) -> Option<Conn> {
    let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).ok()?;
    stream.write_all(HEAD_START).ok()?;
    stream.set_nonblocking(true).ok()?;
    Some(Conn { stream, next_at: first_at })
}

impl Slowloris {
    /// Opens `n` connections to `addr` (returns once they are all open, or fails) and keeps them
    /// trickling until `stop`.
    pub fn start(addr: SocketAddr, n: usize) -> Result<Slowloris, String> {
        if !addr.ip().is_loopback() {
            return Err("slowloris only targets loopback".into());
        }
        let mut stats = SlowStats::default();
        let mut conns = Vec::with_capacity(n);
        let t0 = Instant::now();
        for i in 0..n {
            // Spread the trickle evenly over the interval.
            let first = t0 + TRICKLE.mul_f64(i as f64 / n.max(1) as f64);
            let c = open(addr, first).ok_or_else(|| format!("slowloris: connection {i} of {n} failed"))?;
            stats.opened += 1;
            stats.bytes_sent += HEAD_START.len() as u64;
            conns.push(c);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let handle = thread::spawn(move || trickle(addr, conns, stats, &stop2));
        Ok(Slowloris { stop, handle: Some(handle) })
    }

    pub fn stop(mut self) -> SlowStats {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.take().and_then(|h| h.join().ok()).unwrap_or_default()
    }
}

impl Drop for Slowloris {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn trickle(addr: SocketAddr, conns: Vec<Conn>, mut stats: SlowStats, stop: &AtomicBool) -> SlowStats {
    let mut conns: Vec<Option<Conn>> = conns.into_iter().map(Some).collect();
    let mut scratch = [0u8; 512];
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        for slot in conns.iter_mut() {
            let Some(c) = slot else {
                // Opening it again failed last time: try once per tick.
                match open(addr, now + TRICKLE) {
                    Some(fresh) => {
                        stats.opened += 1;
                        stats.bytes_sent += HEAD_START.len() as u64;
                        *slot = Some(fresh);
                    }
                    None => stats.connect_failures += 1,
                }
                continue;
            };
            // Anything from relay (a 408) or EOF means it closes the connection: open another.
            let closed = match c.stream.read(&mut scratch) {
                Ok(_) => true,
                Err(e) if e.kind() == ErrorKind::WouldBlock => false,
                Err(_) => true,
            };
            let failed = !closed
                && c.next_at <= now
                && match c.stream.write(b"a") {
                    Ok(1) => {
                        stats.bytes_sent += 1;
                        c.next_at = now + TRICKLE;
                        false
                    }
                    Ok(_) => true,
                    Err(e) => e.kind() != ErrorKind::WouldBlock,
                };
            if closed || failed {
                stats.closed_by_server += 1;
                *slot = open(addr, now + TRICKLE);
                match slot {
                    Some(_) => {
                        stats.opened += 1;
                        stats.bytes_sent += HEAD_START.len() as u64;
                    }
                    None => stats.connect_failures += 1,
                }
            }
        }
        thread::sleep(TICK);
    }
    stats.open_at_end = conns.iter().filter(|c| c.is_some()).count();
    stats
}
