//! One test body, both modes (issue 18): [`for_each_mode`] runs it against a single-node relay
//! (memory, as `Relay::start`) and then against a cluster-mode relay (`DATABASE_URL` naming a
//! fresh database of its own on the test process's one shared PostgreSQL server,
//! `pg::shared`), wherever SPEC promises the same behaviour (SPEC §11: "every rule of §4–§9
//! holds across nodes").
//!
//! `RELAY_IT_MODE=single` or `=cluster` runs only that half (for local runs); unset, `both` or
//! empty runs both. Without PostgreSQL the cluster half is a loud SKIPPED line, or a failure
//! where PostgreSQL is required (`CI`, `RELAY_REQUIRE_POSTGRES`: `pg::required`).
//! [`for_each_mode_known_cluster_defect`] runs its cluster half only with
//! `RELAY_IT_KNOWN_DEFECTS=1`: a defect found and not fixed yet, named where it is used.

use std::io::Write as _;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::time::Duration;

use super::pg::{self, TestDb};
use super::{Relay, poll_until, request};

/// The mode one half of a test runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One node: tasks in memory (`DATA_DIR` empty), files in `BLOB_DIR`, tokens in `TOKEN_STORE`.
    Single,
    /// One cluster node on a database of its own: tasks, files and tokens in PostgreSQL.
    Cluster,
}

impl Mode {
    pub fn is_cluster(self) -> bool {
        self == Mode::Cluster
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Single => "single-node",
            Mode::Cluster => "cluster",
        }
    }

    pub fn start(self) -> Relay {
        self.start_with(&[])
    }

    /// A relay of this mode with the test defaults overridden by `env`. In cluster mode each
    /// call makes a fresh database, so the relays of one test never share tasks or workers, as
    /// on one node; [`Mode::start_on`] starts another node on the same database.
    pub fn start_with(self, env: &[(&str, &str)]) -> Relay {
        match self {
            Mode::Single => Relay::start_with(env),
            Mode::Cluster => {
                let pg = pg::shared().unwrap_or_else(|why| panic!("the cluster half needs PostgreSQL: {why}"));
                Mode::start_on(Arc::new(TestDb::create(pg)), env)
            }
        }
    }

    /// A cluster node on `db` (a restart, or a second node of the same cluster), once it has
    /// reached the database (`/healthz` 200).
    pub fn start_on(db: Arc<TestDb>, env: &[(&str, &str)]) -> Relay {
        let url = db.url();
        let mut all: Vec<(&str, &str)> = vec![("DATABASE_URL", url.as_str())];
        all.extend_from_slice(env);
        let mut relay = Relay::start_with(&all);
        relay.db = Some(db);
        let up =
            poll_until(Duration::from_secs(15), || request(relay.addr, "GET", "/healthz", &[], None).status == 200);
        assert!(up, "the cluster node never reached its database: {}", relay.log_text());
        relay
    }
}

/// Which halves `RELAY_IT_MODE` asks for.
fn wanted() -> &'static [Mode] {
    let v = std::env::var("RELAY_IT_MODE").ok();
    modes_for(v.as_deref()).unwrap_or_else(|| panic!("RELAY_IT_MODE={v:?}: use single, cluster or both"))
}

fn modes_for(v: Option<&str>) -> Option<&'static [Mode]> {
    match v.map(str::trim) {
        None | Some("") | Some("both") => Some(&[Mode::Single, Mode::Cluster]),
        Some("single") => Some(&[Mode::Single]),
        Some("cluster") => Some(&[Mode::Cluster]),
        Some(_) => None,
    }
}

#[test]
fn relay_it_mode_picks_the_halves() {
    assert_eq!(modes_for(None), Some(&[Mode::Single, Mode::Cluster][..]));
    assert_eq!(modes_for(Some("both")), modes_for(Some("")));
    assert_eq!(modes_for(Some("single")), Some(&[Mode::Single][..]));
    assert_eq!(modes_for(Some(" cluster")), Some(&[Mode::Cluster][..]));
    assert_eq!(modes_for(Some("postgres")), None);
}

/// The running test's name (the harness names each test's thread after it).
fn test_name() -> String {
    std::thread::current().name().unwrap_or("test").to_string()
}

fn loud(line: &str) {
    // The process's stderr, not `eprintln!`, which the harness captures.
    let _ = writeln!(std::io::stderr().lock(), "\n*** {line} ***\n");
}

/// Runs `body` once per mode (single-node first). A failing half fails the test, its message
/// naming the mode.
pub fn for_each_mode(body: impl Fn(Mode)) {
    run(body, None);
}

/// As [`for_each_mode`], for a test whose cluster half fails because of the known, not yet
/// fixed `defect`: that half runs only with `RELAY_IT_KNOWN_DEFECTS=1`. Call it by its path
/// (`support::modes::...`), naming the defect. (No test needs it while no such defect is known.)
#[allow(dead_code)]
pub fn for_each_mode_known_cluster_defect(defect: &str, body: impl Fn(Mode)) {
    run(body, Some(defect));
}

fn run(body: impl Fn(Mode), defect: Option<&str>) {
    let test = test_name();
    for &mode in wanted() {
        if mode.is_cluster() {
            if let Some(defect) = defect
                && std::env::var("RELAY_IT_KNOWN_DEFECTS").as_deref() != Ok("1")
            {
                loud(&format!(
                    "KNOWN DEFECT {test}: cluster half not run ({defect}); RELAY_IT_KNOWN_DEFECTS=1 runs it"
                ));
                continue;
            }
            if let Err(why) = pg::shared() {
                if pg::required() {
                    panic!("{test}: the cluster half needs PostgreSQL (RELAY_REQUIRE_POSTGRES or CI is set): {why}");
                }
                loud(&format!("SKIPPED {test} (cluster half): PostgreSQL is not available ({why})"));
                continue;
            }
        }
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| body(mode))) {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .map(str::to_string);
            match msg {
                Some(msg) => panic!("[{} half] {msg}", mode.name()),
                None => resume_unwind(panic),
            }
        }
    }
}
