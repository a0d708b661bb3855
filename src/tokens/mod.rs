//! Scoped tokens' registry (SPEC §6) and the `relay token` CLI, by where the registry lives:
//! `record` (the shared types), `file` (`TOKEN_STORE`: the server's view and the writers),
//! `pg` (the database, with `DATABASE_URL`: the CLI's statements and each node's cache), `cli`.
//! The registry holds no token material: a token is only ever printed once, by `create`. The
//! JWT math is in `jwt`; nothing here sees a socket.

pub mod cli;
pub mod file;
pub mod pg;
pub mod record;

pub use cli::{CliError, HELP, main, run};
pub use file::RegistryView;
pub use record::{Lookup, MAX_REGISTRY_BYTES, Record, Registry, Status, parse_registry};

#[cfg(test)]
mod tests {
    use super::cli::*;
    use super::file::*;
    use super::record::*;
    use crate::config::TokenConfig;
    use crate::jwt;
    use crate::timefmt::rfc3339_ms;
    use std::collections::HashMap;
    use std::fs::File;
    use std::path::{Path, PathBuf};

    /// A fresh directory under the system temp dir, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!("relay-tokens-{tag}-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const SECRET: &str = "0123456789abcdef0123456789abcdef";
    const NOW_MS: u64 = 1_800_000_000_000;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn cli(store: &Path, line: &str, now_ms: u64) -> (Result<(), CliError>, String) {
        let mut out = String::new();
        let cfg = || Ok(TokenConfig { secret: Some(SECRET.into()), store: store.to_path_buf(), database: None });
        let r = run(&args(line), cfg, now_ms, &mut out);
        (r, out)
    }

    fn check_create(line: &str, expected: Result<CreateRequest, ()>) {
        assert_eq!(parse_create(&args(line)).map_err(|_| ()), expected, "parse_create({line:?})");
    }

    #[test]
    fn create_arguments() {
        let req = |name: &str, kinds: &[&str], ttl_ms, json| CreateRequest {
            name: name.into(),
            kinds: kinds.iter().map(|k| k.to_string()).collect(),
            ttl_ms,
            json,
        };
        let table: Vec<(&str, Result<CreateRequest, ()>)> = vec![
            ("--name a --kinds http,file --ttl 720h", Ok(req("a", &["http", "file"], 2_592_000_000, false))),
            ("--json --ttl=1s --kinds=http --name=b", Ok(req("b", &["http"], 1_000, true))),
            ("--name a --kinds http,http,file --ttl 1s", Ok(req("a", &["http", "file"], 1_000, false))),
            ("--name a --kinds http", Err(())),
            ("--kinds http --ttl 1s", Err(())),
            ("--name a --ttl 1s", Err(())),
            ("--name a --kinds http --ttl", Err(())),
            ("--name a --kinds http --ttl 0s", Err(())),
            ("--name a --kinds http --ttl soon", Err(())),
            ("--name a --kinds http, --ttl 1s", Err(())),
            ("--name a --kinds ,http --ttl 1s", Err(())),
            ("--name a --name b --kinds http --ttl 1s", Err(())),
            ("--name a --kinds http --ttl 1s --color", Err(())),
            ("--name a --kinds http --ttl 1s extra", Err(())),
            ("--json=yes --name a --kinds http --ttl 1s", Err(())),
        ];
        for (line, expected) in table {
            check_create(line, expected);
        }
    }

    #[test]
    fn status_table() {
        let rec = |expires_at: &str, revoked_at: Option<&str>| Record {
            jti: "j".into(),
            name: "n".into(),
            kinds: vec![],
            created_at: rfc3339_ms(0),
            expires_at: expires_at.into(),
            revoked_at: revoked_at.map(String::from),
        };
        let later = rfc3339_ms(NOW_MS + 1);
        let now = rfc3339_ms(NOW_MS);
        for (r, expected) in [
            (rec(&later, None), Status::Active),
            (rec(&now, None), Status::Expired),
            (rec(&later, Some(&now)), Status::Revoked),
            (rec(&now, Some(&now)), Status::Revoked),
            (rec("garbage", None), Status::Expired),
        ] {
            assert_eq!(r.status(NOW_MS), expected, "{r:?}");
        }
    }

    #[test]
    fn create_list_revoke_and_the_view() {
        let dir = TempDir::new("cli");
        let store = dir.0.join("tokens.json");
        let mut view = RegistryView::new(&store);
        assert_eq!(view.lookup("x"), Lookup::Unavailable, "missing registry fails closed");

        let (r, out) = cli(&store, "create --name billing --kinds http,file --ttl 1h", NOW_MS);
        assert_eq!(r, Ok(()));
        let fields: HashMap<&str, &str> = out.lines().filter_map(|l| l.split_once(": ")).collect();
        let jti = fields["jti"];
        assert_eq!(fields["name"], "billing");
        assert_eq!(fields["kinds"], "http,file");
        assert_eq!(fields["expires"], rfc3339_ms(NOW_MS + 3_600_000));
        let claims = jwt::verify(SECRET.as_bytes(), fields["token"], NOW_MS).expect("the printed token verifies");
        assert_eq!((claims.jti.as_str(), claims.kinds.len()), (jti, 2));
        let on_disk = std::fs::read_to_string(&store).expect("registry");
        assert!(!on_disk.contains(fields["token"]), "the registry holds no token material");
        assert!(!on_disk.contains(SECRET));

        assert_eq!(view.lookup(jti), Lookup::Active);
        assert_eq!(view.lookup("other"), Lookup::Unknown);

        let (r, out) = cli(&store, "list", NOW_MS);
        assert_eq!(r, Ok(()));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert!(lines[0].starts_with("JTI") && lines[0].contains("STATUS"), "{out}");
        assert!(lines[1].starts_with(jti) && lines[1].contains(" active "), "{out}");

        let (r, _) = cli(&store, &format!("revoke {jti}"), NOW_MS + 1);
        assert_eq!(r, Ok(()));
        assert_eq!(view.lookup(jti), Lookup::Revoked, "a revoke is seen without a restart");
        let (r, out) = cli(&store, &format!("revoke {jti}"), NOW_MS + 2);
        assert_eq!(r, Ok(()));
        assert!(out.starts_with("already revoked"), "{out}");
        let (r, _) = cli(&store, "revoke no-such-jti", NOW_MS);
        assert!(matches!(r, Err(CliError::Failed(_))), "{r:?}");

        let (r, out) = cli(&store, "list --json", NOW_MS + 3);
        assert_eq!(r, Ok(()));
        let v: serde_json::Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v[0]["status"], "revoked");
        assert_eq!(v[0]["revoked_at"], rfc3339_ms(NOW_MS + 1));
        assert_eq!(v[0]["kinds"], serde_json::json!(["http", "file"]));

        let (_, out) = cli(&store, "list", NOW_MS + 3_600_000);
        assert!(out.contains(" revoked "), "revoked wins over expired: {out}");

        // Corrupt, oversized or deleted: fail closed; the CLI refuses to overwrite a corrupt file.
        std::fs::write(&store, b"{not json").expect("write");
        assert_eq!(view.lookup(jti), Lookup::Unavailable);
        let (r, _) = cli(&store, "create --name x --kinds http --ttl 1h", NOW_MS);
        assert!(matches!(r, Err(CliError::Failed(_))), "{r:?}");
        assert_eq!(std::fs::read(&store).expect("read"), b"{not json");
        std::fs::remove_file(&store).expect("rm");
        assert_eq!(view.lookup(jti), Lookup::Unavailable);
        let file = File::create(&store).expect("create");
        file.set_len(MAX_REGISTRY_BYTES + 1).expect("grow");
        assert_eq!(view.lookup(jti), Lookup::Unavailable, "oversized registry");
    }

    #[test]
    fn cli_errors_and_exit_codes() {
        let dir = TempDir::new("errors");
        let store = dir.0.join("tokens.json");
        let table: &[(&str, u8)] =
            &[("", 2), ("frobnicate", 2), ("revoke", 2), ("revoke a b", 2), ("list --all", 2), ("revoke nope", 1)];
        for (line, code) in table {
            let (r, _) = cli(&store, line, NOW_MS);
            assert_eq!(r.map_err(|e| e.exit_code()), Err(*code), "relay token {line}");
        }
        let (r, out) = cli(&store, "create --help", NOW_MS);
        assert_eq!(r, Ok(()));
        assert!(out.contains("relay token create"));

        let mut out = String::new();
        let none = || Ok(TokenConfig { secret: None, store: store.clone(), database: None });
        let r = run(&args("list"), none, NOW_MS, &mut out);
        assert_eq!(r.map_err(|e| e.exit_code()), Err(2), "no TOKEN_SECRET");
        let long_name = format!("--name {} --kinds http --ttl 1h", "n".repeat(MAX_NAME_BYTES + 1));
        assert!(matches!(parse_create(&args(&long_name)), Err(CliError::Usage(_))));
        let many_kinds: Vec<String> = (0..400).map(|i| format!("kind{i}")).collect();
        let (r, _) = cli(&store, &format!("create --name a --kinds {} --ttl 1h", many_kinds.join(",")), NOW_MS);
        assert!(matches!(r, Err(CliError::Usage(_))), "a token over MAX_TOKEN_BYTES is refused: {r:?}");
        assert!(!store.exists(), "nothing was written");
    }

    #[test]
    fn lock_file_sits_beside_the_store() {
        assert_eq!(lock_path(Path::new("/var/lib/relay/t.json")), PathBuf::from("/var/lib/relay/t.json.lock"));
        assert_eq!(lock_path(Path::new("t.json")), PathBuf::from("t.json.lock"));
        assert_eq!(dir_of(Path::new("t.json")), Path::new("."));
    }
}
