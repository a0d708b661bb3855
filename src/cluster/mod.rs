//! Cluster mode (SPEC §11, docs/cluster.md): several relay nodes sharing one PostgreSQL
//! database. This folder owns everything that speaks to PostgreSQL; nothing here touches the
//! event loop's sockets, and the loop never waits on anything here.
//!
//! - `url`: `DATABASE_URL` → connection parameters (pure).
//! - `wire`: a blocking PostgreSQL client with pipelining (helper threads and the CLI only).
//! - `schema`: the tables, and migrations run at start under an advisory lock.
//! - `sql`: every statement the cluster runs, with builders for their parameters.
//! - `db`: the database threads and the loop's non-blocking handle on them.
//! - `tokens`: the scoped-token registry in the database (`relay token` with DATABASE_URL).
//! - `node`: a node's state in the core (what the next turn transaction carries, caches).
//! - `files`: uploads and downloads through the database (a thread of their own).
//! - `render`: task JSON, listing pages and `/clients` entries from database rows (pure).

pub mod db;
pub mod files;
pub mod node;
pub mod render;
pub mod schema;
pub mod sql;
pub mod tokens;
pub mod url;
pub mod wire;
