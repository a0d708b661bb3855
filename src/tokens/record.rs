//! The token registry's shared types (the leaf under the file and database registries and the
//! CLI): a token's record, its status, what a lookup finds, and the file format's version.

use serde::{Deserialize, Serialize};

use crate::timefmt::parse_rfc3339_ms;

/// Largest registry file read, by the server or the CLI. Bigger counts as unreadable. At about
/// 250 bytes a token this is some 60 000 tokens.
pub const MAX_REGISTRY_BYTES: u64 = 16 * 1024 * 1024;

/// Longest token name, and longest kind name, accepted by `create`.
pub const MAX_NAME_BYTES: usize = 200;

/// The latest `expires` `create` accepts (9999-12-31T23:59:59Z), so times stay RFC 3339.
pub const MAX_EXP_S: u64 = 253_402_300_799;

pub const REGISTRY_VERSION: u32 = 1;

// ---------------------------------------------------------------------------------------------
// The file format.

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    pub version: u32,
    pub tokens: Vec<Record>,
}

impl Default for Registry {
    fn default() -> Registry {
        Registry { version: REGISTRY_VERSION, tokens: Vec::new() }
    }
}

/// One issued token. Times are RFC 3339 UTC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub jti: String,
    pub name: String,
    pub kinds: Vec<String>,
    pub created_at: String,
    pub expires_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Active,
    Revoked,
    Expired,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Active => "active",
            Status::Revoked => "revoked",
            Status::Expired => "expired",
        }
    }
}

impl Record {
    /// Revoked wins over expired; an `expires_at` that does not parse counts as expired.
    pub fn status(&self, now_ms: u64) -> Status {
        if self.revoked_at.is_some() {
            Status::Revoked
        } else if parse_rfc3339_ms(&self.expires_at).map_or(true, |exp| exp <= now_ms) {
            Status::Expired
        } else {
            Status::Active
        }
    }
}

/// Parses registry bytes. The version must be one this build understands.
pub fn parse_registry(bytes: &[u8]) -> Result<Registry, String> {
    let registry: Registry = serde_json::from_slice(bytes).map_err(|e| format!("not a token registry: {e}"))?;
    if registry.version != REGISTRY_VERSION {
        return Err(format!("registry version {} is not supported (expected {REGISTRY_VERSION})", registry.version));
    }
    Ok(registry)
}

// ---------------------------------------------------------------------------------------------
// The server's view.

/// What the registry says about a `jti`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Active,
    Revoked,
    Unknown,
    /// The registry is missing or unreadable: refuse (fail closed).
    Unavailable,
    /// The file changed and its new version is being read off the loop: ask again once
    /// `RegistryView::poll_loaded` installed it.
    Pending,
}

impl Lookup {
    pub fn as_str(self) -> &'static str {
        match self {
            Lookup::Active => "active",
            Lookup::Revoked => "revoked",
            Lookup::Unknown => "unknown_jti",
            Lookup::Unavailable => "registry_unavailable",
            Lookup::Pending => "registry_loading",
        }
    }
}
