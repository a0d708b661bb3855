//! PostgreSQL (SPEC §11, docs/cluster.md): everything that speaks to the database, below the
//! task store that uses it (`store::pg`), the token registry's database form (`tokens::pg`) and
//! the files' (`files::pg`). Nothing here touches the event loop's sockets, and the loop
//! never waits on anything here.
//!
//! - `url`: `DATABASE_URL` → connection parameters (pure; the password never appears).
//! - `wire`: a blocking PostgreSQL client with pipelining (helper threads and the CLI only).
//! - `schema`: the tables, and migrations run at start under an advisory lock.
//! - `sql`: every statement relay runs, with builders for their parameters.
//! - `db`: the database threads and the loop's non-blocking handle on them.

pub mod db;
pub mod schema;
pub mod sql;

pub mod url;
pub mod wire;
