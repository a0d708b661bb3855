//! Child processes the harness starts (relay, nats-server, the floor) and what /proc says about
//! them. Every child lives in a `Server` guard that stops it by its PID (SIGTERM, then SIGKILL)
//! when dropped, so a failed or interrupted scenario never leaves a process behind. Nothing here
//! generates load.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Lines of a child's stderr kept for the error message when it misbehaves.
const LOG_TAIL_LINES: usize = 40;
/// How long a child gets after SIGTERM before SIGKILL.
const STOP_GRACE_MS: u64 = 3000;

/// PIDs of the children alive now, for the watchdog's last resort.
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// SIGKILLs every child still registered (the run overstayed its limit).
pub fn kill_all_children() {
    let pids = CHILDREN.lock().map(|c| c.clone()).unwrap_or_default();
    for pid in pids {
        // SAFETY: kill(2) on a PID registered at spawn and unregistered only after it was reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
}

/// Registers a child started elsewhere (not through `Server`) for the watchdog's last resort.
pub fn track_child(pid: u32) {
    if let Ok(mut c) = CHILDREN.lock() {
        c.push(pid);
    }
}

/// Forgets a child registered with `track_child`, once it has been reaped.
pub fn untrack_child(pid: u32) {
    if let Ok(mut c) = CHILDREN.lock() {
        c.retain(|&p| p != pid);
    }
}

/// A started server: its PID, the address it listens on, and how long it took to say so.
pub struct Server {
    pub name: String,
    pub addr: SocketAddr,
    /// From just before `spawn` to the moment its "listening" line was read.
    pub startup: Duration,
    child: Option<Child>,
    reader: Option<JoinHandle<()>>,
    tail: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Spawns `cmd` with stderr piped and waits up to `timeout` for a line from which
    /// `listening` extracts the address.
    pub fn start(
        name: &str,
        mut cmd: Command,
        listening: fn(&str) -> Option<SocketAddr>,
        timeout: Duration,
    ) -> Result<Server, String> {
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        let began = Instant::now();
        let mut child = cmd.spawn().map_err(|e| format!("cannot start {name} ({:?}): {e}", cmd.get_program()))?;
        if let Ok(mut c) = CHILDREN.lock() {
            c.push(child.id());
        }
        let stderr = child.stderr.take().expect("stderr was piped");
        let tail = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let tail2 = tail.clone();
        // BENCH_SERVER_LOG=<dir>: every server's whole stderr is also kept there, one file each.
        let mut copy = std::env::var_os("BENCH_SERVER_LOG").and_then(|dir| {
            let path = std::path::Path::new(&dir).join(format!("{name}-{}.log", child.id()));
            std::fs::File::create(path).ok()
        });
        let reader = std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(f) = copy.as_mut() {
                    use std::io::Write as _;
                    let _ = writeln!(f, "{line}");
                }
                if !sent && let Some(addr) = listening(&line) {
                    let _ = tx.send((addr, Instant::now()));
                    sent = true;
                    continue;
                }
                let mut t = tail2.lock().expect("log tail lock");
                if t.len() == LOG_TAIL_LINES {
                    t.remove(0);
                }
                t.push(line);
            }
        });
        let mut server = Server {
            name: name.to_string(),
            addr: ([0, 0, 0, 0], 0).into(),
            startup: Duration::ZERO,
            child: Some(child),
            reader: Some(reader),
            tail,
        };
        match rx.recv_timeout(timeout) {
            Ok((addr, at)) => {
                server.addr = addr;
                server.startup = at - began;
                Ok(server)
            }
            Err(_) => {
                server.stop();
                Err(format!(
                    "{name} did not report a listening address within {timeout:?}; stderr:\n{}",
                    server.log_tail()
                ))
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The last lines the child wrote on stderr (besides its listening line).
    pub fn log_tail(&self) -> String {
        self.tail.lock().map(|t| t.join("\n")).unwrap_or_default()
    }

    /// SIGTERM, wait up to the grace period, then SIGKILL; reaps the child and its log reader.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(None) = child.try_wait() {
                let pid = child.id() as libc::pid_t;
                // SAFETY: kill(2) on the PID of a child we have not reaped yet, so it is ours.
                unsafe { libc::kill(pid, libc::SIGTERM) };
                let deadline = Instant::now() + Duration::from_millis(STOP_GRACE_MS);
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                if let Ok(None) = child.try_wait() {
                    eprintln!("bench: {} did not stop on SIGTERM; killing it", self.name);
                    let _ = child.kill();
                }
            }
            let _ = child.wait();
            if let Ok(mut c) = CHILDREN.lock() {
                c.retain(|&p| p != child.id());
            }
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }

    /// Whether the child is still running (a crash mid-scenario must not read as a result).
    pub fn alive(&mut self) -> bool {
        matches!(self.child.as_mut().map(Child::try_wait), Some(Ok(None)))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// relay's `msg=listening addr=127.0.0.1:41234 ...` line; the floor prints the same shape.
pub fn relay_listening(line: &str) -> Option<SocketAddr> {
    if !line.contains("msg=listening") {
        return None;
    }
    let addr = line.split_whitespace().find_map(|f| f.strip_prefix("addr="))?;
    addr.trim_matches('"').parse().ok()
}

/// nats-server's `[INF] Listening for client connections on 127.0.0.1:4222`.
pub fn nats_listening(line: &str) -> Option<SocketAddr> {
    let (_, rest) = line.split_once("Listening for client connections on ")?;
    rest.trim().parse().ok()
}

/// CPU time (user + system, all threads) the process has used so far, from /proc/<pid>/stat.
pub fn cpu_time(pid: u32) -> Result<Duration, String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| format!("/proc/{pid}/stat: {e}"))?;
    let ticks = parse_stat_ticks(&text).ok_or_else(|| format!("/proc/{pid}/stat: unexpected format"))?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Ok(Duration::from_nanos(ticks.saturating_mul(1_000_000_000) / hz))
}

/// utime + stime in clock ticks. The command name in field 2 may hold spaces and parentheses,
/// so the fields are counted from the last `)`.
fn parse_stat_ticks(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After ')': field 3 (state) is index 0, so utime (14) is index 11 and stime (15) index 12.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Syscall and scheduler events `perf stat` counts for the syscall window (tracepoints; this
/// machine has no hardware counters). Reads, writes and waits are summed by kind in the report.
pub const PERF_EVENTS: &[&str] = &[
    "raw_syscalls:sys_enter",
    "syscalls:sys_enter_read",
    "syscalls:sys_enter_recvfrom",
    "syscalls:sys_enter_write",
    "syscalls:sys_enter_sendto",
    "syscalls:sys_enter_writev",
    "syscalls:sys_enter_epoll_wait",
    "syscalls:sys_enter_epoll_pwait",
    "syscalls:sys_enter_futex",
    "context-switches",
];

/// Reads that found nothing (EAGAIN, -11): the price of reading until WouldBlock.
pub const PERF_EAGAIN_EVENTS: &[&str] = &["syscalls:sys_exit_recvfrom", "syscalls:sys_exit_read"];

/// Counts `PERF_EVENTS` and `PERF_EAGAIN_EVENTS` for `pid` (all its threads) over `window`.
pub fn perf_stat(pid: u32, window: Duration) -> Result<Vec<(String, u64)>, String> {
    let mut cmd = Command::new("perf");
    cmd.args(["stat", "-x,", "-e", &PERF_EVENTS.join(",")]);
    for e in PERF_EAGAIN_EVENTS {
        cmd.args(["-e", e, "--filter", "ret == -11"]);
    }
    let out = cmd
        .args(["-p", &pid.to_string(), "--", "sleep"])
        .arg(format!("{:.3}", window.as_secs_f64()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("perf: {e}"))?;
    let text = String::from_utf8_lossy(&out.stderr);
    let counts = parse_perf_csv(&text);
    if counts.is_empty() {
        return Err(format!("perf stat counted nothing: {}", text.trim()));
    }
    Ok(counts)
}

/// Whether `perf stat` can count syscall tracepoints here (perf installed, tracepoints allowed).
pub fn perf_works() -> Result<(), String> {
    let out = Command::new("perf")
        .args(["stat", "-x,", "-e", "raw_syscalls:sys_enter", "--", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("perf: {e}"))?;
    let text = String::from_utf8_lossy(&out.stderr);
    if parse_perf_csv(&text).is_empty() { Err(text.trim().to_string()) } else { Ok(()) }
}

/// `value,unit,event,...` lines; `<not counted>`/`<not supported>` lines are left out.
fn parse_perf_csv(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(',');
            let value = f.next()?.trim().parse().ok()?;
            let event = f.nth(1)?.trim();
            (!event.is_empty()).then(|| (event.to_string(), value))
        })
        .collect()
}

/// Machine-wide CPU time from the `cpu` line of /proc/stat: (busy, steal). Busy is user + nice
/// + system + irq + softirq of every process; steal is time the hypervisor gave to others.
pub fn machine_cpu() -> (Duration, Duration) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> =
        text.lines().next().unwrap_or_default().split_whitespace().skip(1).map(|v| v.parse().unwrap_or(0)).collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    let d = |ticks: u64| Duration::from_nanos(ticks.saturating_mul(1_000_000_000) / hz);
    (d(at(0) + at(1) + at(2) + at(5) + at(6)), d(at(7)))
}

/// Memory figures from /proc/<pid>/status, in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mem {
    pub rss_kib: u64,
    pub hwm_kib: u64,
}

pub fn mem(pid: u32) -> Result<Mem, String> {
    let text =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    Ok(Mem { rss_kib: status_kib(&text, "VmRSS:").unwrap_or(0), hwm_kib: status_kib(&text, "VmHWM:").unwrap_or(0) })
}

fn status_kib(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

/// Resets the peak RSS (VmHWM) to the current RSS, so the next reading is the window's peak.
pub fn reset_peak_rss(pid: u32) -> Result<(), String> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").map_err(|e| format!("/proc/{pid}/clear_refs: {e}"))
}

/// Raises this process's open-file soft limit to the hard limit; returns the new soft limit.
pub fn raise_nofile() -> u64 {
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
        lim.rlim_cur as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks() {
        fn check(text: &str, expected: Option<u64>) {
            assert_eq!(parse_stat_ticks(text), expected, "{text}");
        }
        check("42 (relay) S 1 42 42 0 -1 4194560 100 0 0 0 250 31 0 0 20 0 3 0 1000 2000", Some(281));
        check("42 (a) b) (c) R 1 42 42 0 -1 0 0 0 0 0 7 3 0 0", Some(10));
        check("42 (relay) S 1 2", None);
        check("garbage", None);
    }

    #[test]
    fn listening_lines() {
        fn check(f: fn(&str) -> Option<SocketAddr>, line: &str, expected: Option<&str>) {
            assert_eq!(f(line), expected.map(|a| a.parse().expect("test address")), "{line}");
        }
        check(
            relay_listening,
            "ts=2026-01-01T00:00:00.000Z level=info msg=listening addr=127.0.0.1:4100 version=0.1.0",
            Some("127.0.0.1:4100"),
        );
        check(relay_listening, "ts=x level=warn msg=\"open-file limit\" addr=1.2.3.4:5", None);
        check(
            nats_listening,
            "[7] 2026/01/01 [INF] Listening for client connections on 127.0.0.1:38001",
            Some("127.0.0.1:38001"),
        );
        check(nats_listening, "[7] 2026/01/01 [INF] Server is ready", None);
    }

    #[test]
    fn perf_csv() {
        let text = "109,,raw_syscalls:sys_enter,895043,100.00,,\n<not supported>,,cycles,0,100.00,,\n\n3,,context-switches,1,100.00,,\n";
        assert_eq!(
            parse_perf_csv(text),
            vec![("raw_syscalls:sys_enter".to_string(), 109), ("context-switches".to_string(), 3)]
        );
    }

    #[test]
    fn status_fields() {
        let text = "Name:\trelay\nVmHWM:\t    4100 kB\nVmRSS:\t    3900 kB\n";
        assert_eq!(status_kib(text, "VmHWM:"), Some(4100));
        assert_eq!(status_kib(text, "VmRSS:"), Some(3900));
        assert_eq!(status_kib(text, "VmSwap:"), None);
    }
}
