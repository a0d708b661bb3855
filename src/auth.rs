//! Who is asking: the root API token, the worker token, or (later) a scoped JWT. No I/O.
//!
//! Static tokens are compared in constant time over their SHA-256 digests, so neither the
//! content nor the length of the expected token leaks through timing.

use sha2::{Digest, Sha256};

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

    /// The key under which idempotency keys are remembered (root, or the JWT's jti).
    pub fn owner_key(&self) -> &str {
        match self {
            Identity::Root => "",
            Identity::Worker => "\u{0}worker",
            Identity::Scoped { jti, .. } => jti,
        }
    }
}

pub struct Auth {
    api_digest: [u8; 32],
    worker_digest: [u8; 32],
    /// With `AUTH_TOKEN` alone both roles share one token (SPEC §2).
    shared: bool,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

impl Auth {
    pub fn new(api_token: &str, worker_token: &str) -> Auth {
        Auth { api_digest: digest(api_token), worker_digest: digest(worker_token), shared: api_token == worker_token }
    }

    /// The task API: the root token (scoped JWTs join later).
    pub fn task_api(&self, bearer: Option<&str>) -> Option<Identity> {
        let d = digest(bearer?);
        ct_eq(&d, &self.api_digest).then_some(Identity::Root)
    }

    /// `/ws?token=`: the worker token only (unless both roles share one token).
    pub fn worker(&self, token: Option<&str>) -> bool {
        let Some(token) = token else { return false };
        let d = digest(token);
        ct_eq(&d, &self.worker_digest) || (self.shared && ct_eq(&d, &self.api_digest))
    }

    /// `/files`: the API token, a scoped JWT, or the worker token.
    pub fn files(&self, bearer: Option<&str>) -> Option<Identity> {
        let d = digest(bearer?);
        if ct_eq(&d, &self.api_digest) {
            Some(Identity::Root)
        } else if ct_eq(&d, &self.worker_digest) {
            Some(Identity::Worker)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_separate() {
        let auth = Auth::new("api", "wrk");
        assert_eq!(auth.task_api(Some("api")), Some(Identity::Root));
        assert_eq!(auth.task_api(Some("wrk")), None);
        assert_eq!(auth.task_api(Some("ap")), None);
        assert_eq!(auth.task_api(None), None);
        assert!(auth.worker(Some("wrk")));
        assert!(!auth.worker(Some("api")));
        assert_eq!(auth.files(Some("wrk")), Some(Identity::Worker));
        assert_eq!(auth.files(Some("api")), Some(Identity::Root));
        let shared = Auth::new("one", "one");
        assert!(shared.worker(Some("one")));
        assert_eq!(shared.task_api(Some("one")), Some(Identity::Root));
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
