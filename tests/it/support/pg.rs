//! A private PostgreSQL server per test: Debian's binaries (`/usr/lib/postgresql/*/bin`, or
//! `PG_BIN`), a data directory copied from one `initdb` template made once per test process, a
//! unix socket directory of its own and a free loopback port. Stopped by PID when dropped; its
//! directory is removed.
//!
//! As root, PostgreSQL refuses to run, so `initdb` and `postgres` run as the `postgres` OS user
//! through `setpriv` (which execs, so the PID we hold is the postmaster's own).
//!
//! Without PostgreSQL, [`Pg::start`] returns `None` after printing a loud SKIPPED line, unless
//! `RELAY_REQUIRE_POSTGRES=1` (set by `.ci/run`) or `CI=true`: then the test fails.

use std::io::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How the server should be tuned.
#[derive(Debug, Clone, Copy, Default)]
pub struct PgOptions {
    /// `fsync=on` and `synchronous_commit=on`: for tests that crash the server and expect
    /// committed data back. Off by default (faster, and nothing here survives the test anyway).
    pub durable: bool,
    /// The process-wide server of [`shared`]: more connections (the tests running side by side
    /// each start nodes of three connections on it).
    pub shared: bool,
}

/// One running (or stopped, between `stop` and `start_again`) private server.
pub struct Pg {
    root: PathBuf,
    pub data: PathBuf,
    pub socket_dir: PathBuf,
    pub port: u16,
    options: PgOptions,
    child: Option<Child>,
}

/// Where the server binaries are, or `None`.
fn bin_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Some(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("postgres").exists()).then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// True when a missing PostgreSQL must fail the test rather than skip it.
pub fn required() -> bool {
    let set = std::env::var("RELAY_REQUIRE_POSTGRES").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
    set || super::in_ci()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A command that runs `program` as the `postgres` user when we are root, as ourselves otherwise.
fn as_pg_user(program: &Path) -> Command {
    if is_root() {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

fn chown_to_pg(path: &Path) {
    if is_root() {
        let status = Command::new("chown").args(["-R", "postgres:postgres"]).arg(path).status().expect("chown");
        assert!(status.success(), "chown {}", path.display());
    }
}

const TEMPLATE_PREFIX: &str = "relay-pg-template-";

/// The template data directory: one `initdb` per test process (about 1.5 s), copied per test.
/// The test harness runs no destructor at exit, so each process first removes the templates of
/// processes that are gone: at most one template per running test process is ever left.
fn template() -> &'static Result<PathBuf, String> {
    static TEMPLATE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let bin = bin_dir().ok_or("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin (or PG_BIN)")?;
        remove_stale_templates();
        let root = std::env::temp_dir().join(format!("{TEMPLATE_PREFIX}{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        chown_to_pg(&root);
        let data = root.join("data");
        let started = Instant::now();
        let out = as_pg_user(&bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync", "-D"])
            .arg(&data)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!("initdb failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        eprintln!("pg: initdb template in {:?}", started.elapsed());
        Ok(root)
    })
}

fn remove_stale_templates() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(TEMPLATE_PREFIX)) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

impl Pg {
    /// A fresh server with the default options, or `None` (after a loud SKIPPED) when
    /// PostgreSQL is not installed and not required.
    pub fn start(test: &str) -> Option<Pg> {
        Pg::start_with(test, PgOptions::default())
    }

    pub fn start_with(test: &str, options: PgOptions) -> Option<Pg> {
        let root = match template() {
            Ok(t) => t,
            Err(why) => {
                if required() {
                    panic!("{test}: PostgreSQL is required here (RELAY_REQUIRE_POSTGRES or CI is set): {why}");
                }
                let mut err = std::io::stderr().lock();
                let _ = writeln!(err, "\n*** SKIPPED {test}: PostgreSQL is not available ({why}) ***\n");
                return None;
            }
        };
        Some(Pg::from_template(test, root, options))
    }

    fn from_template(test: &str, root: &Path, options: PgOptions) -> Pg {
        let started = Instant::now();
        let dir = std::env::temp_dir().join(format!("relay-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("pg temp dir");
        let data = dir.join("data");
        let status = Command::new("cp").arg("-a").arg(root.join("data")).arg(&data).status().expect("cp");
        assert!(status.success(), "copy the template");
        let socket_dir = dir.join("sock");
        std::fs::create_dir_all(&socket_dir).expect("socket dir");
        chown_to_pg(&dir);
        let mut pg = Pg { root: dir, data, socket_dir, port: 0, options, child: None };
        pg.start_again();
        eprintln!("pg: {test}: server ready on port {} in {:?}", pg.port, started.elapsed());
        pg
    }

    /// Starts the server on its data directory (again, after `stop` or `kill`). A new port is
    /// tried if the old one was taken meanwhile.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "already running");
        let bin = bin_dir().expect("server binaries");
        for _ in 0..5 {
            let port = if self.port == 0 { free_port() } else { self.port };
            let durable = if self.options.durable { "on" } else { "off" };
            let mut cmd = as_pg_user(&bin.join("postgres"));
            cmd.arg("-D").arg(&self.data).arg("-k").arg(&self.socket_dir).arg("-p").arg(port.to_string());
            for setting in [
                "listen_addresses=127.0.0.1".to_string(),
                format!("fsync={durable}"),
                format!("synchronous_commit={durable}"),
                format!("full_page_writes={durable}"),
                "shared_buffers=16MB".into(),
                format!("max_connections={}", if self.options.shared { 120 } else { 40 }),
                "max_wal_senders=0".into(),
                "wal_level=minimal".into(),
                "autovacuum=on".into(),
                "log_min_messages=warning".into(),
                "logging_collector=off".into(),
            ] {
                cmd.arg("-c").arg(setting);
            }
            let log = std::fs::File::create(self.root.join("server.log")).expect("log file");
            cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
            let mut child = cmd.spawn().expect("spawn postgres");
            self.port = port;
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if self.is_ready(child.id()) {
                    self.child = Some(child);
                    return;
                }
                if let Ok(Some(status)) = child.try_wait() {
                    let log = self.log();
                    if log.contains("could not bind") || log.contains("already in use") {
                        self.port = 0;
                        break;
                    }
                    panic!("postgres exited ({status}) at start:\n{log}");
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("postgres not ready within 20 s:\n{}", self.log());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        panic!("postgres could not find a free port");
    }

    /// `postmaster.pid` names `pid` and says `ready` once the server accepts connections (a
    /// file left by a killed server names another PID).
    fn is_ready(&self, pid: u32) -> bool {
        std::fs::read_to_string(self.data.join("postmaster.pid")).is_ok_and(|s| {
            let mut lines = s.lines();
            lines.next().is_some_and(|l| l.trim() == pid.to_string())
                && lines.nth(6).is_some_and(|l| l.trim() == "ready")
        })
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("server.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `DATABASE_URL` over the unix socket.
    pub fn url(&self) -> String {
        format!("postgres://postgres@/postgres?host={}&port={}", self.socket_dir.display(), self.port)
    }

    /// `DATABASE_URL` over TCP on loopback.
    pub fn url_tcp(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs SQL through `psql` (for checks from outside relay); returns its unaligned output.
    pub fn psql(&self, sql: &str) -> String {
        let bin = bin_dir().expect("server binaries");
        let psql = if bin.join("psql").exists() { bin.join("psql") } else { PathBuf::from("psql") };
        let out = Command::new(psql)
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-U", "postgres", "-h"])
            .arg(&self.socket_dir)
            .args(["-p", &self.port.to_string(), "-d", "postgres", "-c", sql])
            .stdin(Stdio::null())
            .output()
            .expect("psql");
        assert!(out.status.success(), "psql {sql:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Replaces `pg_hba.conf` and reloads the server (SIGHUP). The reload is asynchronous:
    /// callers poll for its effect.
    pub fn set_hba(&self, content: &str) {
        std::fs::write(self.data.join("pg_hba.conf"), content).expect("write pg_hba.conf");
        self.signal(libc::SIGHUP);
    }

    fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on the PID of a child we spawned and have not reaped.
            unsafe {
                libc::kill(pid as libc::pid_t, sig);
            }
        }
    }

    /// Fast shutdown (SIGINT): sessions are ended, the server exits cleanly.
    pub fn stop(&mut self) {
        self.signal(libc::SIGINT);
        self.reap(Duration::from_secs(10));
    }

    /// `kill -9` of the postmaster: a crash. Its backends notice and exit by themselves.
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        self.reap(Duration::from_secs(10));
        // Orphaned backends hold the shared memory and the port until they notice; wait until
        // nothing answers on the port, and no process of the server is left (each one works in
        // the data directory), before a restart may reuse them: a restart while a backend
        // still lives fails with "pre-existing shared memory block is still in use".
        let deadline = Instant::now() + Duration::from_secs(10);
        while (std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() || self.has_processes())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether a process still works in this server's data directory (its cwd).
    fn has_processes(&self) -> bool {
        let Ok(procs) = std::fs::read_dir("/proc") else { return false };
        procs.filter_map(Result::ok).any(|p| std::fs::read_link(p.path().join("cwd")).is_ok_and(|cwd| cwd == self.data))
    }

    fn reap(&mut self, within: Duration) {
        let Some(mut child) = self.child.take() else { return };
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The one server of this test process that the tests of both modes (`support::modes`) share,
/// each on a database of its own ([`TestDb`]): started on first use (about 0.3 s from the
/// template), never by a test that does not need it. `Err` says why PostgreSQL is not there.
///
/// The harness runs no destructor at exit, so a watchdog (a small shell loop, detached from
/// the terminal's signals) waits for this process to end, then stops the server by its PID
/// (fast shutdown) and removes its directory: an aborted or killed run leaves nothing behind.
pub fn shared() -> Result<&'static Pg, String> {
    static SHARED: OnceLock<Result<Pg, String>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let root = template().as_ref().map_err(Clone::clone)?;
            let pg = Pg::from_template("shared server", root, PgOptions { shared: true, ..PgOptions::default() });
            let pid = pg.pid().ok_or("the shared server is not running")?;
            let script = "trap '' INT TERM HUP; \
                while kill -0 \"$1\" 2>/dev/null; do sleep 0.2; done; \
                kill -INT \"$2\" 2>/dev/null; \
                while kill -0 \"$2\" 2>/dev/null; do sleep 0.1; done; \
                rm -rf \"$3\"";
            Command::new("sh")
                .args(["-c", script, "relay-it-pg-watchdog"])
                .arg(std::process::id().to_string())
                .arg(pid.to_string())
                .arg(&pg.root)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("the shared server's watchdog: {e}"))?;
            Ok(pg)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// A database of its own on the [`shared`] server, dropped (`WITH (FORCE)`) when this is
/// dropped; the nodes that used it are stopped first (a `Relay` holds its `TestDb`).
pub struct TestDb {
    pub name: String,
    pg: &'static Pg,
}

impl TestDb {
    pub fn create(pg: &'static Pg) -> TestDb {
        let name = format!("relay_it_{}", uuid::Uuid::new_v4().simple());
        pg.admin(&format!("CREATE DATABASE {name}"));
        TestDb { name, pg }
    }

    /// `DATABASE_URL` of this database, over the unix socket.
    pub fn url(&self) -> String {
        format!("postgres://postgres@/{}?host={}&port={}", self.name, self.pg.socket_dir.display(), self.pg.port)
    }

    /// Runs one SQL text on this database; returns the first column of the last statement's
    /// rows (NULL as an empty string).
    pub fn query(&self, sql: &str) -> Vec<String> {
        let params = relay::pg::url::parse(&self.url()).expect("test database url");
        let mut conn = relay::pg::wire::Conn::connect(&params, relay::pg::wire::Timeouts::default())
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.name));
        let out = conn.simple(sql).unwrap_or_else(|e| panic!("{sql:?} on {}: {e}", self.name));
        conn.close();
        out.last().map(|r| r.rows.iter().map(|row| row.text(0).unwrap_or("").to_string()).collect()).unwrap_or_default()
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        self.pg.admin(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
    }
}

impl Pg {
    /// One statement on the `postgres` database through relay's own wire client (no `psql`
    /// process per call). A failure fails the test, unless it is failing already (a drop
    /// while unwinding must not panic again).
    fn admin(&self, sql: &str) {
        let params = relay::pg::url::parse(&self.url()).expect("server url");
        let done = relay::pg::wire::Conn::connect(&params, relay::pg::wire::Timeouts::default())
            .and_then(|mut conn| conn.simple(sql).map(|_| conn.close()));
        if let Err(e) = done
            && !std::thread::panicking()
        {
            panic!("{sql}: {e}");
        }
    }
}
