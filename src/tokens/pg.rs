//! The scoped-token registry in the database (`relay_tokens`), for `relay token ...` when
//! `DATABASE_URL` is set. The CLI may block, so it uses the wire client directly (never the
//! server's threads). It runs the migrations first, so the CLI works before any node started.
//! The output formats are the file registry's (`crate::tokens`); only the storage differs.
//!
//! Also here, for the nodes: [`TokenCache`], the registry as a node sees it (pure).

use std::collections::HashMap;

use crate::pg::schema;
use crate::pg::sql;
use crate::pg::url::DbParams;
use crate::pg::wire::{Conn, Param, PgError, Stmt, Timeouts};
use crate::timefmt::{parse_rfc3339_ms, rfc3339_ms};
use crate::tokens::{Lookup, Record};

/// What a revoke found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Revoked {
    /// Revoked now, at this time (RFC 3339).
    Now(String),
    /// Already revoked, at this time.
    Before(String),
    Unknown,
}

fn open(db: &DbParams) -> Result<Conn, String> {
    let mut conn = Conn::connect(db, Timeouts { io_ms: 10_000 }).map_err(|e| format!("database {db}: {e}"))?;
    schema::migrate(&mut conn).map_err(|e| format!("database {db}: {e}"))?;
    Ok(conn)
}

fn failed(db: &DbParams, e: PgError) -> String {
    format!("database {db}: {e}")
}

/// Records a new token.
pub fn insert(db: &DbParams, r: &Record) -> Result<(), String> {
    let created = parse_rfc3339_ms(&r.created_at).map_err(|e| format!("created_at: {e}"))?;
    let expires = parse_rfc3339_ms(&r.expires_at).map_err(|e| format!("expires_at: {e}"))?;
    let kinds = sql::array(r.kinds.iter().map(|k| Some(k.as_str())));
    let mut conn = open(db)?;
    let stmt = Stmt::new(
        sql::TOKEN_INSERT,
        vec![
            r.jti.as_str().into(),
            r.name.as_str().into(),
            Param::Text(kinds),
            (created as i64).into(),
            (expires as i64).into(),
        ],
    );
    // Tell every node at once (it also picks the token up on its next refresh).
    let notify = Stmt::new(sql::NOTIFY, vec![sql::CHANNEL_TOKENS.into()]);
    conn.pipeline(&[stmt, notify]).map_err(|e| failed(db, e))?;
    conn.close();
    Ok(())
}

/// Every token, oldest first.
pub fn load(db: &DbParams) -> Result<Vec<Record>, String> {
    let mut conn = open(db)?;
    let out = conn.pipeline(&[Stmt::new(sql::TOKEN_LIST, vec![])]).map_err(|e| failed(db, e))?;
    conn.close();
    let mut records = Vec::new();
    for row in out.first().map(|r| r.rows.as_slice()).unwrap_or_default() {
        let bad = || format!("database {db}: a malformed relay_tokens row");
        let kinds: Vec<String> = serde_json::from_str(row.text(2).ok_or_else(bad)?).map_err(|_| bad())?;
        let ms = |i: usize| row.i64(i).and_then(|v| u64::try_from(v).ok());
        records.push(Record {
            jti: row.text(0).ok_or_else(bad)?.to_string(),
            name: row.text(1).ok_or_else(bad)?.to_string(),
            kinds,
            created_at: rfc3339_ms(ms(3).ok_or_else(bad)?),
            expires_at: rfc3339_ms(ms(4).ok_or_else(bad)?),
            revoked_at: ms(5).map(rfc3339_ms),
        });
    }
    Ok(records)
}

/// Revokes `jti` at `now_ms` (a second revoke keeps the first time). Every node is notified.
pub fn revoke(db: &DbParams, jti: &str, now_ms: u64) -> Result<Revoked, String> {
    let mut conn = open(db)?;
    let out = conn
        .pipeline(&[Stmt::new(sql::TOKEN_REVOKE, vec![jti.into(), (now_ms as i64).into()])])
        .map_err(|e| failed(db, e))?;
    conn.close();
    let Some(row) = out.first().and_then(|r| r.rows.first()) else { return Ok(Revoked::Unknown) };
    let at = row.i64(0).and_then(|v| u64::try_from(v).ok()).map(rfc3339_ms).unwrap_or_default();
    Ok(if row.bool(1) == Some(true) { Revoked::Now(at) } else { Revoked::Before(at) })
}

// ---------------------------------------------------------------------------------------------
// The server's side: each node's cache of the registry (SPEC §11: a revoke is refused on every
// node within 1 s). Pure: the database thread runs `TOKEN_CHANGES` and hands the rows here.

/// Longest a cache may go without a successful refresh and still be trusted (SPEC §11: 1 s).
pub const MAX_CACHE_AGE_MS: u64 = 1_000;

/// Most tokens held; beyond it the cache refuses to grow and reports itself unavailable (fail
/// closed) rather than forget a revocation.
pub const MAX_CACHED_TOKENS: usize = 1_000_000;

/// jti → revoked, as of the last refresh.
#[derive(Debug, Default)]
pub struct TokenCache {
    revoked: HashMap<String, bool>,
    /// The highest `changed` applied: the next refresh asks for rows above it.
    high_water: i64,
    /// Time of the last successful refresh (the caller's clock: the node passes the wall
    /// clock); `None` before the first.
    refreshed_ms: Option<u64>,
    overflowed: bool,
    /// Grows with every refresh (requests waiting for one are woken when it changes).
    generation: u64,
}

impl TokenCache {
    /// The `$1` of the next `TOKEN_CHANGES`.
    pub fn high_water(&self) -> i64 {
        self.high_water
    }

    /// Applies one refresh's rows `(jti, revoked, changed)` (in `changed` order), made at
    /// wall-clock `now_ms` (the clock the API checks tokens against). A refresh that returned the statement's limit should be followed by
    /// another at once.
    pub fn apply<'a>(&mut self, rows: impl IntoIterator<Item = (&'a str, bool, i64)>, now_ms: u64) {
        for (jti, revoked, changed) in rows {
            if !self.revoked.contains_key(jti) && self.revoked.len() >= MAX_CACHED_TOKENS {
                self.overflowed = true;
                continue;
            }
            self.revoked.insert(jti.to_string(), revoked);
            self.high_water = self.high_water.max(changed);
        }
        self.refreshed_ms = Some(now_ms);
        self.generation += 1;
    }

    /// When the last refresh was made, if any.
    pub fn refreshed_at(&self) -> Option<u64> {
        self.refreshed_ms
    }

    /// How many refreshes were applied.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// What the registry says about `jti`, if the cache is fresh enough to say it.
    pub fn lookup(&self, jti: &str, now_ms: u64) -> Lookup {
        let fresh = self.refreshed_ms.is_some_and(|t| now_ms.saturating_sub(t) <= MAX_CACHE_AGE_MS);
        if !fresh || self.overflowed {
            return Lookup::Unavailable;
        }
        match self.revoked.get(jti) {
            Some(false) => Lookup::Active,
            Some(true) => Lookup::Revoked,
            None => Lookup::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_follows_changes_and_fails_closed_when_stale() {
        let mut c = TokenCache::default();
        assert_eq!(c.lookup("a", 0), Lookup::Unavailable, "never refreshed");
        c.apply([("a", false, 1), ("b", false, 2)], 1_000);
        assert_eq!(c.high_water(), 2);
        let table: &[(&str, u64, Lookup)] = &[
            ("a", 1_000, Lookup::Active),
            ("b", 2_000, Lookup::Active),
            ("c", 1_500, Lookup::Unknown),
            ("a", 2_001, Lookup::Unavailable),
        ];
        for (jti, now, expected) in table {
            assert_eq!(c.lookup(jti, *now), *expected, "{jti} at {now}");
        }
        c.apply([("a", true, 3)], 2_500);
        assert_eq!((c.lookup("a", 2_500), c.lookup("b", 2_500), c.high_water()), (Lookup::Revoked, Lookup::Active, 3));
        c.apply([], 3_000);
        assert_eq!(c.lookup("a", 3_900), Lookup::Revoked, "an empty refresh still counts as fresh");
        assert_eq!(c.high_water(), 3);
    }
}
