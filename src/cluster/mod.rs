//! Cluster mode (SPEC §11, docs/cluster.md): several relay nodes sharing one PostgreSQL
//! database. This folder owns everything that speaks to PostgreSQL; nothing here touches the
//! event loop's sockets, and the loop never waits on anything here.
//!
//! - `url`: `DATABASE_URL` → connection parameters (pure).
//! - `wire`: a blocking PostgreSQL client with pipelining (helper threads and the CLI only).

pub mod url;
pub mod wire;
