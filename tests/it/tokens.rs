//! Scoped tokens (SPEC §3, §6): the real `relay token` CLI and the real server, sharing one
//! TOKEN_SECRET and TOKEN_STORE. Tasks are submitted with `queue: true`, so no worker is needed.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::support::pg::TestDb;
use crate::support::*;

const SECRET: &str = "integration-test-secret-0123456789abcdef";

/// A registry in a fresh temp directory (removed when dropped), or in cluster mode a fresh
/// database's `relay_tokens` (`relay token` with `DATABASE_URL`, SPEC §11).
pub(crate) struct Store {
    dir: PathBuf,
    path: PathBuf,
    db: Option<Arc<TestDb>>,
    url: String,
}

pub(crate) struct Issued {
    pub jti: String,
    pub token: String,
}

impl Store {
    pub(crate) fn new(tag: &str, mode: Mode) -> Store {
        let dir = std::env::temp_dir().join(format!("relay-it-tokens-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tokens.json");
        let db = mode.is_cluster().then(|| {
            let pg = crate::support::pg::shared().expect("the cluster half has PostgreSQL");
            Arc::new(TestDb::create(pg))
        });
        let url = db.as_ref().map(|db| db.url()).unwrap_or_default();
        Store { dir, path, db, url }
    }

    fn path(&self) -> &str {
        self.path.to_str().expect("utf-8 temp path")
    }

    /// Where the registry is: the file, or the database.
    fn backend(&self) -> (&str, &str) {
        if self.db.is_some() { ("DATABASE_URL", self.url.as_str()) } else { ("TOKEN_STORE", self.path()) }
    }

    fn env(&self) -> [(&str, &str); 2] {
        [("TOKEN_SECRET", SECRET), self.backend()]
    }

    /// The server, with its blobs in the same temp directory.
    pub(crate) fn start_relay(&self) -> Relay {
        self.start_relay_with(&[("TOKEN_SECRET", SECRET)])
    }

    /// The server on this registry with `env` (no TOKEN_SECRET unless `env` has it).
    fn start_relay_with(&self, env: &[(&str, &str)]) -> Relay {
        let blobs = self.dir.join("blobs");
        let blobs = blobs.to_str().expect("utf-8 temp path");
        let mut env = env.to_vec();
        env.push(("BLOB_DIR", blobs));
        match &self.db {
            Some(db) => Mode::start_on(db.clone(), &env),
            None => {
                env.push(("TOKEN_STORE", self.path()));
                Relay::start_with(&env)
            }
        }
    }

    /// What the registry holds, as text: the file, or the table's rows.
    fn registry_text(&self) -> String {
        match &self.db {
            Some(db) => db.query("SELECT t::text FROM relay_tokens t").join("\n"),
            None => std::fs::read_to_string(&self.path).expect("registry"),
        }
    }

    /// Runs `relay token ...`: (exit code, stdout, stderr).
    fn cli(&self, args: &[&str]) -> (Option<i32>, String, String) {
        let mut full = vec!["token"];
        full.extend_from_slice(args);
        run_relay_env(&full, &self.env())
    }

    pub(crate) fn create(&self, name: &str, kinds: &str, ttl: &str) -> Issued {
        let (code, out, err) = self.cli(&["create", "--name", name, "--kinds", kinds, "--ttl", ttl]);
        assert_eq!(code, Some(0), "create failed: {err}");
        let field = |key: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(key).and_then(|rest| rest.strip_prefix(": ")))
                .unwrap_or_else(|| panic!("no {key} in {out:?}"))
                .to_string()
        };
        assert_eq!(field("name"), name);
        assert_eq!(field("kinds"), kinds);
        Issued { jti: field("jti"), token: field("token") }
    }

    fn list(&self) -> Vec<Value> {
        let (code, out, err) = self.cli(&["list", "--json"]);
        assert_eq!(code, Some(0), "list failed: {err}");
        serde_json::from_str::<Value>(&out).expect("list --json").as_array().cloned().expect("an array")
    }

    fn status_of(&self, jti: &str) -> String {
        let list = self.list();
        let entry = list.iter().find(|t| t["jti"] == jti).unwrap_or_else(|| panic!("{jti} not listed"));
        entry["status"].as_str().unwrap_or_default().to_string()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn call(relay: &Relay, method: &str, path: &str, token: &str, body: Option<&str>) -> Resp {
    let auth = format!("Bearer {token}");
    request(relay.addr, method, path, &[("Authorization", auth.as_str())], body.map(str::as_bytes))
}

fn submit_kind(relay: &Relay, token: &str, kind: &str) -> Resp {
    let body = format!(r#"{{"payload":{{"kind":"{kind}"}},"queue":true}}"#);
    call(relay, "POST", "/tasks", token, Some(&body))
}

/// A one-part multipart upload to `/files`.
fn upload(relay: &Relay, token: &str) -> Resp {
    let auth = format!("Bearer {token}");
    let body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\nhello\r\n--b--\r\n";
    let headers = [("Authorization", auth.as_str()), ("Content-Type", "multipart/form-data; boundary=b")];
    request(relay.addr, "POST", "/files", &headers, Some(body))
}

fn id_of(r: &Resp) -> String {
    r.json()["task_id"].as_str().unwrap_or_else(|| panic!("no task_id: {}", r.text())).to_string()
}

#[test]
fn create_use_revoke_is_401_on_the_next_request_without_a_restart() {
    for_each_mode(|mode| {
        let store = Store::new("revoke", mode);
        let relay = store.start_relay();
        let t = store.create("billing-service", "http,file", "720h");

        let r = submit_kind(&relay, &t.token, "http");
        assert_eq!(r.status, 202, "{}", r.text());
        let id = id_of(&r);
        assert_eq!(call(&relay, "GET", &format!("/tasks/{id}"), &t.token, None).status, 200);
        let r = upload(&relay, &t.token);
        assert_eq!(r.status, 201, "a scoped token opens /files: {}", r.text());
        let file_id = r.json()["file_id"].as_str().expect("file_id").to_string();
        assert_eq!(call(&relay, "GET", &format!("/files/{file_id}"), &t.token, None).status, 200);
        assert_eq!(store.status_of(&t.jti), "active");

        let (code, out, err) = store.cli(&["revoke", &t.jti]);
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains(&t.jti), "{out}");

        // One node: the very next request. Cluster: within 1 s on every node (SPEC §11; the
        // CLI's NOTIFY makes it milliseconds, the nodes' 500 ms refresh bounds it).
        if mode.is_cluster() {
            let revoked = poll_until(Duration::from_secs(1), || {
                call(&relay, "GET", &format!("/tasks/{id}"), &t.token, None).status == 401
            });
            assert!(revoked, "a revoke is refused within 1 s in cluster mode");
        }
        let r = call(&relay, "GET", &format!("/tasks/{id}"), &t.token, None);
        assert_eq!(r.status, 401, "the very next request after a revoke: {}", r.text());
        assert_eq!(r.header("WWW-Authenticate"), Some("Bearer"));
        assert_eq!(submit_kind(&relay, &t.token, "http").status, 401);
        assert_eq!(upload(&relay, &t.token).status, 401);
        assert_eq!(call(&relay, "GET", &format!("/files/{file_id}"), &t.token, None).status, 401);
        assert_eq!(store.status_of(&t.jti), "revoked");
        assert_eq!(relay.get_task(&id)["status"], "pending", "the root token is unaffected");

        assert!(relay.wait_log("scoped token refused", Duration::from_secs(2)), "the refusal is logged");
        let log = relay.log_text();
        assert!(!log.contains(&t.token), "a token appeared in the log");
        assert!(!log.contains(t.token.rsplit('.').next().unwrap_or("?")), "a signature appeared in the log");
        assert!(!log.contains(SECRET), "the secret appeared in the log");
    });
}

#[test]
fn an_expired_token_is_401() {
    for_each_mode(|mode| {
        let store = Store::new("expiry", mode);
        let relay = store.start_relay();
        let t = store.create("short-lived", "http", "2s");
        // exp is rounded up to a whole second, so the token is good for at least 2 s.
        assert_eq!(submit_kind(&relay, &t.token, "http").status, 202);
        let expired = poll_until(Duration::from_secs(6), || submit_kind(&relay, &t.token, "http").status == 401);
        assert!(expired, "the token was still accepted 6 s after a 2 s TTL");
        assert_eq!(store.status_of(&t.jti), "expired");
        assert_eq!(relay.submit(r#"{"payload":{"kind":"http"},"queue":true}"#).status, 202);
    });
}

// Single-node only: it deletes and corrupts the registry file (TOKEN_STORE); in cluster mode the registry is a table of the database
#[test]
fn a_missing_or_corrupt_registry_refuses_every_jwt_while_the_root_token_works() {
    let store = Store::new("failclosed", Mode::Single);
    let relay = store.start_relay();
    let first = store.create("a", "http", "1h");
    assert_eq!(submit_kind(&relay, &first.token, "http").status, 202);

    std::fs::remove_file(&store.path).expect("delete the registry");
    assert_eq!(submit_kind(&relay, &first.token, "http").status, 401, "registry deleted: fail closed");
    assert_eq!(relay.submit(r#"{"payload":{"kind":"http"},"queue":true}"#).status, 202, "root still works");

    // A new registry (created by the CLI) is picked up; the old jti is not in it.
    let second = store.create("b", "http", "1h");
    assert_eq!(submit_kind(&relay, &second.token, "http").status, 202);
    assert_eq!(submit_kind(&relay, &first.token, "http").status, 401);

    std::fs::write(&store.path, b"{\"version\":1,\"tokens\":[").expect("corrupt the registry");
    assert_eq!(submit_kind(&relay, &second.token, "http").status, 401, "corrupt registry: fail closed");
    assert_eq!(relay.submit(r#"{"payload":{"kind":"http"},"queue":true}"#).status, 202);
    let (code, _, err) = store.cli(&["create", "--name", "c", "--kinds", "http", "--ttl", "1h"]);
    assert_eq!(code, Some(1), "the CLI does not overwrite a corrupt registry: {err}");
}

#[test]
fn scoped_kinds_403_on_submit_and_404_on_read_or_cancel_of_other_kinds() {
    for_each_mode(|mode| {
        let store = Store::new("kinds", mode);
        let relay = store.start_relay();
        let t = store.create("http-only", "http", "1h");

        let root_file = id_of(&relay.submit(r#"{"payload":{"kind":"file"},"queue":true}"#));
        let root_none = id_of(&relay.submit(r#"{"payload":{"x":1},"queue":true}"#));
        let root_http = id_of(&relay.submit(r#"{"payload":{"kind":"http"},"queue":true}"#));

        let forbidden = [
            r#"{"payload":{"kind":"file"},"queue":true}"#,
            r#"{"payload":{"x":1},"queue":true}"#,
            r#"{"payload":"just text","queue":true}"#,
        ];
        for body in forbidden {
            let r = call(&relay, "POST", "/tasks", &t.token, Some(body));
            assert_eq!(r.status, 403, "{body}: {}", r.text());
            assert_eq!(r.error(), "forbidden");
        }
        for id in [&root_file, &root_none, "00000000-0000-4000-8000-000000000000"] {
            assert_eq!(call(&relay, "GET", &format!("/tasks/{id}"), &t.token, None).status, 404, "GET {id}");
            assert_eq!(call(&relay, "DELETE", &format!("/tasks/{id}"), &t.token, None).status, 404, "DELETE {id}");
        }
        assert_eq!(relay.get_task(&root_file)["status"], "pending", "a 404 DELETE canceled nothing");

        let r = call(&relay, "GET", &format!("/tasks/{root_http}"), &t.token, None);
        assert_eq!(r.status, 200, "a task of its kind is visible whoever submitted it");
        let r = call(&relay, "DELETE", &format!("/tasks/{root_http}"), &t.token, None);
        assert_eq!((r.status, r.json()["status"].clone()), (200, "canceled".into()));

        // Idempotency keys belong to the token identity: root and the jti do not share them.
        let keyed = |token: &str| {
            let auth = format!("Bearer {token}");
            let headers = [("Authorization", auth.as_str()), ("Idempotency-Key", "order-17")];
            let body = br#"{"payload":{"kind":"http"},"queue":true}"#;
            id_of(&request(relay.addr, "POST", "/tasks", &headers, Some(body)))
        };
        let by_root = keyed(API);
        let by_jwt = keyed(&t.token);
        assert_ne!(by_root, by_jwt);
        assert_eq!(keyed(&t.token), by_jwt);

        let r = call(&relay, "GET", "/clients", &t.token, None);
        assert_eq!(r.status, 403, "{}", r.text());
        assert_eq!(call(&relay, "GET", "/clients", API, None).status, 200);
    });
}

#[test]
fn each_token_opens_only_its_endpoints() {
    for_each_mode(|mode| {
        let store = Store::new("roles", mode);
        let relay = store.start_relay();
        let t = store.create("svc", "http", "1h");
        let ws_get = |token: &str| {
            let path = format!("/ws?token={token}");
            let headers = [
                ("Upgrade", "websocket"),
                ("Connection", "Upgrade"),
                ("Sec-WebSocket-Version", "13"),
                ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ];
            request(relay.addr, "GET", &path, &headers, None).status
        };
        assert_eq!(ws_get(&t.token), 401, "a JWT never opens /ws");
        assert_eq!(ws_get(API), 401, "the API token never opens /ws");
        assert_eq!(ws_get(WRK), 101, "the worker token does");
        assert_eq!(submit_kind(&relay, WRK, "http").status, 401, "the worker token never opens the task API");
        assert_eq!(upload(&relay, WRK).status, 201, "the worker token opens /files");
        assert_eq!(upload(&relay, API).status, 201, "so does the API token");

        // Forgeries: another secret, a tampered payload, alg none.
        let claims = relay::jwt::Claims {
            jti: t.jti.clone(),
            name: "svc".into(),
            kinds: vec!["http".into(), "file".into()],
            iat: 0,
            exp: 4_000_000_000,
        };
        let foreign = relay::jwt::sign(b"some-other-secret-of-at-least-32-bytes", &claims);
        let mut parts: Vec<String> = t.token.split('.').map(String::from).collect();
        parts[1] = foreign.split('.').nth(1).unwrap_or_default().to_string();
        let tampered = parts.join(".");
        let alg_none = format!("eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.{}.", parts[1]);
        for bad in [&foreign, &tampered, &alg_none, "not-a-jwt", &format!("{}x", t.token)] {
            assert_eq!(submit_kind(&relay, bad, "http").status, 401, "{bad}");
            assert_eq!(upload(&relay, bad).status, 401, "{bad}");
        }
        assert_eq!(submit_kind(&relay, &t.token, "http").status, 202, "the genuine token still works");
    });
}

#[test]
fn without_token_secret_the_server_refuses_every_jwt() {
    for_each_mode(|mode| {
        let store = Store::new("disabled", mode);
        let t = store.create("svc", "http", "1h");
        let relay = store.start_relay_with(&[]);
        assert_eq!(submit_kind(&relay, &t.token, "http").status, 401);
        assert_eq!(relay.submit(r#"{"payload":{"kind":"http"},"queue":true}"#).status, 202);
    });
}

#[test]
fn concurrent_creates_all_land_in_the_registry() {
    for_each_mode(|mode| {
        let store = Store::new("race", mode);
        const ROUNDS: usize = 5;
        const AT_ONCE: usize = 3;
        let mut jtis = Vec::new();
        for round in 0..ROUNDS {
            let children: Vec<_> = (0..AT_ONCE)
                .map(|i| {
                    Command::new(relay_bin())
                        .env_clear()
                        .envs(store.env())
                        .args(["token", "create", "--name", &format!("r{round}-{i}"), "--kinds", "http", "--ttl", "1h"])
                        .args(["--json"])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .expect("spawn relay token create")
                })
                .collect();
            for child in children {
                let out = child.wait_with_output().expect("wait");
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
                let v: Value = serde_json::from_slice(&out.stdout).expect("create --json");
                assert_eq!(v["kinds"], serde_json::json!(["http"]));
                jtis.push(v["jti"].as_str().expect("jti").to_string());
            }
        }
        let listed = store.list();
        assert_eq!(listed.len(), ROUNDS * AT_ONCE, "{listed:?}");
        for jti in &jtis {
            assert!(listed.iter().any(|t| &t["jti"] == jti), "{jti} was lost");
        }
        let leftovers: Vec<_> = std::fs::read_dir(&store.dir)
            .expect("read dir")
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");
    });
}

#[test]
fn cli_output_and_exit_codes() {
    for_each_mode(|mode| {
        let store = Store::new("cli", mode);
        let (code, out, _) = store.cli(&["--help"]);
        assert_eq!(code, Some(0));
        assert!(out.contains("relay token create") && out.contains("TOKEN_SECRET"), "{out}");

        let t = store.create("billing-service", "http,file", "720h");
        let (code, out, _) = store.cli(&["list"]);
        assert_eq!(code, Some(0));
        let lines: Vec<&str> = out.lines().collect();
        let header: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(header, ["JTI", "NAME", "KINDS", "STATUS", "EXPIRES"]);
        let row: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(&row[..4], [t.jti.as_str(), "billing-service", "http,file", "active"]);
        assert!(row[4].ends_with('Z'), "RFC 3339: {}", row[4]);

        let (code, out, _) = store.cli(&["create", "--name", "j", "--kinds", "a,b", "--ttl", "1h", "--json"]);
        assert_eq!(code, Some(0));
        let v: Value = serde_json::from_str(&out).expect("create --json");
        for key in ["jti", "name", "kinds", "expires", "token"] {
            assert!(v.get(key).is_some(), "create --json lacks {key}: {v}");
        }
        let listed = store.list();
        let first = &listed[0];
        assert_eq!(first["kinds"], serde_json::json!(["http", "file"]));
        assert!(first.get("created_at").is_some() && first.get("expires_at").is_some());
        assert!(first.get("revoked_at").is_none(), "revoked_at only when revoked: {first}");
        assert!(!store.registry_text().contains(&t.token), "the registry holds no token material");

        let usage: &[&[&str]] = &[&[], &["bogus"], &["create", "--name", "x"], &["revoke"], &["list", "extra"]];
        for args in usage {
            assert_eq!(store.cli(args).0, Some(2), "relay token {args:?}");
        }
        assert_eq!(store.cli(&["revoke", "no-such-jti"]).0, Some(1), "unknown jti");

        let list = ["token", "list"];
        assert_eq!(run_relay_env(&list, &[store.backend()]).0, Some(2), "no TOKEN_SECRET");
        let empty = [("TOKEN_SECRET", ""), store.backend()];
        assert_eq!(run_relay_env(&list, &empty).0, Some(2), "empty TOKEN_SECRET");
        let (code, _, err) = run_relay_env(&list, &[("TOKEN_SECRET", "too-short"), store.backend()]);
        assert_eq!(code, Some(2));
        assert!(err.contains("TOKEN_SECRET") && !err.contains("too-short"), "names the variable, not the value: {err}");
    });
}

#[test]
fn scoped_tokens_list_only_their_kinds() {
    for_each_mode(|mode| {
        let store = Store::new("list", mode);
        let relay = store.start_relay();
        let t = store.create("http-only", "http", "1h");
        let http = id_of(&relay.submit(r#"{"payload":{"kind":"http"},"queue":true}"#));
        let _file = id_of(&relay.submit(r#"{"payload":{"kind":"file"},"queue":true}"#));
        let _none = id_of(&relay.submit(r#"{"payload":{"x":1},"queue":true}"#));
        let ids = |r: &Resp| -> Vec<String> {
            assert_eq!(r.status, 200, "{}", r.text());
            r.json()["tasks"]
                .as_array()
                .expect("tasks")
                .iter()
                .map(|t| t["task_id"].as_str().expect("id").to_string())
                .collect()
        };
        assert_eq!(ids(&call(&relay, "GET", "/tasks", &t.token, None)), [http]);
        assert_eq!(ids(&call(&relay, "GET", "/tasks?kind=file", &t.token, None)), Vec::<String>::new());
        assert_eq!(ids(&call(&relay, "GET", "/tasks", API, None)).len(), 3, "root lists every kind");
    });
}

#[test]
fn scoped_tokens_cannot_read_or_change_kind_policies() {
    for_each_mode(|mode| {
        let store = Store::new("kind-policies", mode);
        let relay = store.start_relay();
        let t = store.create("http-only", "http", "1h");
        assert_eq!(relay.api("PUT", "/kinds/http", Some(r#"{"max_running":3}"#)).status, 200);
        for (method, path, body) in [
            ("PUT", "/kinds/http", Some(r#"{"paused":true}"#)),
            ("DELETE", "/kinds/http", None),
            ("GET", "/kinds/http", None),
            ("GET", "/kinds", None),
        ] {
            let r = call(&relay, method, path, &t.token, body);
            assert_eq!((r.status, r.error()), (403, "forbidden".to_string()), "{method} {path}: {}", r.text());
        }
        let kept = relay.api("GET", "/kinds/http", None).json();
        assert_eq!(kept["policy"], serde_json::json!({"max_running": 3}), "unchanged: {kept}");
    });
}

/// SPEC §13: a scoped token re-runs only tasks of its kinds (others look like 404), one by one
/// or in bulk.
#[test]
fn scoped_tokens_rerun_only_their_kinds() {
    for_each_mode(|mode| {
        let store = Store::new("rerun", mode);
        let relay = store.start_relay();
        let t = store.create("http-only", "http", "1h");
        // Canceled tasks of two kinds (nothing runs: no worker).
        let http = id_of(&relay.submit(r#"{"payload":{"kind":"http"},"queue":true}"#));
        let file = id_of(&relay.submit(r#"{"payload":{"kind":"file"},"queue":true}"#));
        for id in [&http, &file] {
            assert_eq!(relay.api("DELETE", &format!("/tasks/{id}"), None).status, 200);
        }
        let r = call(&relay, "POST", &format!("/tasks/{file}/retry"), &t.token, None);
        assert_eq!(r.status, 404, "{}", r.text());
        let bulk = r#"{"status":"canceled","finished_after":"2000-01-01T00:00:00Z"}"#;
        let r = call(&relay, "POST", "/tasks/retry", &t.token, Some(bulk));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["task_ids"], serde_json::json!([http]), "{}", r.text());
        assert_eq!(relay.get_task(&file)["status"], "canceled");
        assert_eq!(relay.get_task(&http)["status"], "pending");
        let r = call(&relay, "POST", &format!("/tasks/{http}/retry"), &t.token, None);
        assert_eq!(r.status, 409, "pending already: {}", r.text());
    });
}
