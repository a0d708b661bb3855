//! Who is asking: the root API token, the worker token, or a scoped JWT; and which of them
//! opens what (SPEC §3): the task API takes the API token or a JWT, `/ws` only the worker
//! token, `/files` any of the three.
//!
//! Static tokens are compared in time that depends on the presented token's length alone
//! ([`same_secret`]), so neither the content nor the length of the expected token leaks through
//! timing (a SHA-256 of every bearer did the same for ~3,400 instructions a request). A JWT is checked by `jwt`
//! (signature, alg, exp against the wall time passed in) and then looked up by `jti` in the
//! registry view, whose only I/O is a `stat` per lookup and a bounded re-read when the file
//! changed. Nothing here logs a token; refusals are logged with their reason (and `jti` once
//! the signature proved it genuine).

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::rc::Rc;

use crate::jwt;
use crate::log::Level;
use crate::tokens::{Lookup, RegistryView};

/// The identity a request authenticated as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The root `API_TOKEN`: every kind, every endpoint of the task API.
    Root,
    /// The `WORKER_TOKEN` (only `/ws` and `/files`).
    Worker,
    /// A scoped JWT: only the listed kinds; identified by its `jti`.
    Scoped { jti: String, kinds: Vec<String> },
}

impl Identity {
    /// May this identity submit, read or cancel a task of `kind`?
    pub fn allows_kind(&self, kind: Option<&str>) -> bool {
        match self {
            Identity::Root => true,
            Identity::Worker => false,
            Identity::Scoped { kinds, .. } => kind.is_some_and(|k| kinds.iter().any(|allowed| allowed == k)),
        }
    }

    /// The kinds this identity may see (`None`: every kind, the root token).
    pub fn scope(&self) -> Option<&[String]> {
        match self {
            Identity::Root => None,
            Identity::Worker => Some(&[]),
            Identity::Scoped { kinds, .. } => Some(kinds),
        }
    }

    /// The key under which idempotency keys are remembered (root, or the JWT's jti).
    pub fn owner_key(&self) -> &str {
        match self {
            Identity::Root => "",
            Identity::Worker => "\u{0}worker",
            Identity::Scoped { jti, .. } => jti,
        }
    }
}

/// The token registry changed and its new version is being read off the loop: the request
/// must ask again once it is loaded ([`Auth::poll_registry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistryLoading;

/// Who is asking (`None`: nobody the endpoint accepts), or "ask again shortly".
pub type Checked = Result<Option<Identity>, RegistryLoading>;

pub struct Auth {
    api_token: Box<[u8]>,
    worker_token: Box<[u8]>,
    /// With `AUTH_TOKEN` alone both roles share one token (SPEC §2).
    shared: bool,
    /// `None` when `TOKEN_SECRET` is unset: every JWT is refused.
    scoped: Option<Scoped>,
}

struct Scoped {
    secret: Vec<u8>,
    registry: Registry,
}

enum Registry {
    /// `TOKEN_STORE`. The reactor is single-threaded; the view caches the registry between
    /// requests.
    File(RefCell<RegistryView>),
    /// Cluster mode: the node's cache of the database's `relay_tokens`, which the node's turn
    /// transactions refresh (refused as `Unavailable` once older than 1 s: fail closed), and
    /// the cache generation the waiting requests were last woken for.
    Db(Rc<RefCell<crate::tokens::pg::TokenCache>>, Cell<u64>),
}

/// Whether `given` is `secret`, in time that depends on `given`'s length only: every byte of
/// `given` is compared with the secret's byte at the same place, the secret repeated as often as
/// needed (an index that wraps without a branch), and the lengths are compared in the same sum.
fn same_secret(given: &str, secret: &[u8]) -> bool {
    let (given, n) = (given.as_bytes(), secret.len());
    if n == 0 {
        // (Never configured so: the startup refuses an empty token.)
        return given.is_empty();
    }
    let mut diff = u64::from(given.len() != n);
    let mut j = 0usize;
    for &b in given {
        diff |= u64::from(b ^ secret[j]);
        let next = j + 1;
        j = next & usize::from(next != n).wrapping_neg();
    }
    std::hint::black_box(diff) == 0
}

impl Auth {
    pub fn new(api_token: &str, worker_token: &str) -> Auth {
        Auth {
            api_token: api_token.as_bytes().into(),
            worker_token: worker_token.as_bytes().into(),
            shared: api_token == worker_token,
            scoped: None,
        }
    }

    /// Enables scoped JWTs signed with `secret` (`TOKEN_SECRET`) and listed in the registry at
    /// `store` (`TOKEN_STORE`). With `secret` `None` they stay disabled.
    pub fn with_scoped_tokens(mut self, secret: Option<&str>, store: &Path) -> Auth {
        self.scoped = secret.map(|secret| {
            let mut registry = RegistryView::new(store);
            registry.refresh(); // logs the registry's state at startup
            Scoped { secret: secret.as_bytes().to_vec(), registry: Registry::File(RefCell::new(registry)) }
        });
        self
    }

    /// Cluster mode: scoped JWTs are looked up in `cache`, the node's view of the database's
    /// registry (its refreshes are stamped with the wall clock).
    pub fn with_db_tokens(mut self, secret: Option<&str>, cache: Rc<RefCell<crate::tokens::pg::TokenCache>>) -> Auth {
        self.scoped = secret
            .map(|secret| Scoped { secret: secret.as_bytes().to_vec(), registry: Registry::Db(cache, Cell::new(0)) });
        self
    }

    /// The registry cannot be trusted now (cluster mode: the cache is more than 1 s old, the
    /// database unreachable): a scoped JWT is then refused with 503, not 401.
    pub fn registry_unavailable(&self, wall_ms: u64) -> bool {
        self.scoped.as_ref().is_some_and(|s| match &s.registry {
            Registry::Db(cache, _) => cache.borrow().lookup("", wall_ms) == Lookup::Unavailable,
            Registry::File(_) => false,
        })
    }

    /// From now on a changed registry is read on a helper thread; `wake` tells the loop to
    /// call [`Auth::poll_registry`].
    pub fn start_registry_loader(&self, wake: std::sync::Arc<dyn Fn() + Send + Sync>) -> std::io::Result<()> {
        match self.scoped.as_ref().map(|s| &s.registry) {
            Some(Registry::File(view)) => view.borrow_mut().start_loader(wake),
            // (Cluster mode: the node's own transactions refresh the cache.)
            Some(Registry::Db(..)) | None => Ok(()),
        }
    }

    /// Installs a registry version the helper thread read. `true` if requests waiting on it
    /// may ask again.
    pub fn poll_registry(&self) -> bool {
        self.scoped.as_ref().is_some_and(|s| match &s.registry {
            Registry::File(view) => view.borrow_mut().poll_loaded(),
            // Cluster mode: any refresh since the last look may answer a waiting request.
            Registry::Db(cache, seen) => {
                let generation = cache.borrow().generation();
                seen.replace(generation) != generation
            }
        })
    }

    /// The task API: the root token or a scoped JWT, checked at wall time `wall_ms`.
    pub fn task_api(&self, bearer: Option<&str>, wall_ms: u64) -> Checked {
        let Some(bearer) = bearer else { return Ok(None) };
        if same_secret(bearer, &self.api_token) {
            return Ok(Some(Identity::Root));
        }
        self.scoped(bearer, wall_ms)
    }

    /// A scoped JWT: signature, alg and `exp` (`jwt`), then the registry (known, not revoked).
    fn scoped(&self, bearer: &str, wall_ms: u64) -> Checked {
        let Some(scoped) = self.scoped.as_ref() else { return Ok(None) };
        let claims = match jwt::verify(&scoped.secret, bearer, wall_ms) {
            Ok(claims) => claims,
            Err(e) => {
                crate::log!(Level::Debug, "bearer token refused", reason = e);
                return Ok(None);
            }
        };
        let lookup = match &scoped.registry {
            Registry::File(view) => view.borrow_mut().check(&claims.jti),
            Registry::Db(cache, _) => {
                let cache = cache.borrow();
                match cache.lookup(&claims.jti, wall_ms) {
                    // A token issued after (or within a second before) the cache's last refresh
                    // may be missing from it yet: the request waits for the next refresh (at
                    // most 500 ms away); one unknown after that is refused.
                    Lookup::Unknown
                        if cache
                            .refreshed_at()
                            .is_some_and(|at| at <= claims.iat.saturating_mul(1000).saturating_add(1000)) =>
                    {
                        Lookup::Pending
                    }
                    other => other,
                }
            }
        };
        match lookup {
            Lookup::Active => Ok(Some(Identity::Scoped { jti: claims.jti, kinds: claims.kinds })),
            Lookup::Pending => Err(RegistryLoading),
            refused => {
                crate::log!(Level::Debug, "scoped token refused", reason = refused.as_str(), jti = claims.jti);
                Ok(None)
            }
        }
    }

    /// `/ws?token=`: the worker token only (unless both roles share one token).
    pub fn worker(&self, token: Option<&str>) -> bool {
        let Some(token) = token else { return false };
        same_secret(token, &self.worker_token) || (self.shared && same_secret(token, &self.api_token))
    }

    /// `/files`: the API token, a scoped JWT, or the worker token.
    pub fn files(&self, bearer: Option<&str>, wall_ms: u64) -> Checked {
        let Some(bearer) = bearer else { return Ok(None) };
        if same_secret(bearer, &self.api_token) {
            Ok(Some(Identity::Root))
        } else if same_secret(bearer, &self.worker_token) {
            Ok(Some(Identity::Worker))
        } else {
            self.scoped(bearer, wall_ms)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_secret_needs_every_byte_and_the_length() {
        let secret = b"s3cret-token";
        assert!(same_secret("s3cret-token", secret));
        for other in
            ["", "s", "s3cret-toke", "s3cret-tokenX", "s3cret-tokens3cret-token", "S3cret-token", "s3cret-tokeN"]
        {
            assert!(!same_secret(other, secret), "{other:?}");
        }
        assert!(same_secret("a", b"a") && !same_secret("aa", b"a") && !same_secret("", b"a"));
    }

    const NOW_MS: u64 = 1_800_000_000_000;

    #[test]
    fn roles_are_separate() {
        let auth = Auth::new("api", "wrk");
        assert_eq!(auth.task_api(Some("api"), NOW_MS), Ok(Some(Identity::Root)));
        assert_eq!(auth.task_api(Some("wrk"), NOW_MS), Ok(None));
        assert_eq!(auth.task_api(Some("ap"), NOW_MS), Ok(None));
        assert_eq!(auth.task_api(None, NOW_MS), Ok(None));
        assert!(auth.worker(Some("wrk")));
        assert!(!auth.worker(Some("api")));
        assert_eq!(auth.files(Some("wrk"), NOW_MS), Ok(Some(Identity::Worker)));
        assert_eq!(auth.files(Some("api"), NOW_MS), Ok(Some(Identity::Root)));
        let shared = Auth::new("one", "one");
        assert!(shared.worker(Some("one")));
        assert_eq!(shared.task_api(Some("one"), NOW_MS), Ok(Some(Identity::Root)));
    }

    /// What each endpoint makes of one bearer: (task API, /files, /ws).
    fn check(auth: &Auth, bearer: &str, expected: (Option<Identity>, Option<Identity>, bool)) {
        let got = (
            auth.task_api(Some(bearer), NOW_MS).expect("no loader: never pending"),
            auth.files(Some(bearer), NOW_MS).expect("no loader: never pending"),
            auth.worker(Some(bearer)),
        );
        assert_eq!(got, expected, "bearer {:?}", &bearer[..bearer.len().min(20)]);
    }

    #[test]
    fn scoped_tokens() {
        let dir = std::env::temp_dir().join(format!("relay-auth-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let store = dir.join("tokens.json");
        let secret = "0123456789abcdef0123456789abcdef";
        let claims = |jti: &str, exp: u64| jwt::Claims {
            jti: jti.into(),
            name: "n".into(),
            kinds: vec!["http".into()],
            iat: 0,
            exp,
        };
        let exp = NOW_MS / 1000 + 60;
        let active = jwt::sign(secret.as_bytes(), &claims("a", exp));
        let revoked = jwt::sign(secret.as_bytes(), &claims("r", exp));
        let unknown = jwt::sign(secret.as_bytes(), &claims("u", exp));
        let expired = jwt::sign(secret.as_bytes(), &claims("a", NOW_MS / 1000));
        let foreign = jwt::sign(b"another secret, also 32 bytes long", &claims("a", exp));
        let registry = r#"{"version":1,"tokens":[
            {"jti":"a","name":"n","kinds":["http"],"created_at":"2020-01-01T00:00:00Z","expires_at":"2099-01-01T00:00:00Z"},
            {"jti":"r","name":"n","kinds":["http"],"created_at":"2020-01-01T00:00:00Z","expires_at":"2099-01-01T00:00:00Z",
             "revoked_at":"2020-01-02T00:00:00Z"}]}"#;
        std::fs::write(&store, registry).expect("write registry");

        let auth = Auth::new("api", "wrk").with_scoped_tokens(Some(secret), &store);
        let scoped = Some(Identity::Scoped { jti: "a".into(), kinds: vec!["http".into()] });
        check(&auth, &active, (scoped.clone(), scoped, false));
        for refused in [&revoked, &unknown, &expired, &foreign, "a.b.c"] {
            check(&auth, refused, (None, None, false));
        }
        check(&auth, "api", (Some(Identity::Root), Some(Identity::Root), false));
        check(&auth, "wrk", (None, Some(Identity::Worker), true));

        // Without TOKEN_SECRET every JWT is refused, whatever the registry says.
        let disabled = Auth::new("api", "wrk").with_scoped_tokens(None, &store);
        check(&disabled, &active, (None, None, false));

        // The registry disappears: fail closed; the root token still works.
        std::fs::remove_file(&store).expect("rm registry");
        check(&auth, &active, (None, None, false));
        check(&auth, "api", (Some(Identity::Root), Some(Identity::Root), false));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kind_scopes() {
        let scoped = Identity::Scoped { jti: "j".into(), kinds: vec!["http".into()] };
        assert!(scoped.allows_kind(Some("http")));
        assert!(!scoped.allows_kind(Some("file")));
        assert!(!scoped.allows_kind(None));
        assert!(Identity::Root.allows_kind(None));
    }
}
