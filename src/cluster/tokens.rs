//! The scoped-token registry in the database (`relay_tokens`), for `relay token ...` when
//! `DATABASE_URL` is set. The CLI may block, so it uses the wire client directly (never the
//! server's threads). It runs the migrations first, so the CLI works before any node started.
//! The output formats are the file registry's (`crate::tokens`); only the storage differs.

use super::schema;
use super::sql;
use super::url::DbParams;
use super::wire::{Conn, Param, PgError, Stmt, Timeouts};
use crate::timefmt::{parse_rfc3339_ms, rfc3339_ms};
use crate::tokens::Record;

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
