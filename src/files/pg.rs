//! Files in cluster mode (SPEC §11: uploaded through one node, downloaded through any other):
//! the bytes live in PostgreSQL as `bytea` chunks (docs/cluster.md §3 says why), moved by a
//! thread of their own with its own connection, so a 100 MiB upload never delays a turn's
//! transaction. It answers the blob store's protocol (`files::Job` → `files::Done`), so the
//! reactor's upload and download state machines are the same in both modes.
//!
//! Upload: `FILE_BEGIN` at once, `FILE_CHUNK` per [`CHUNK_BYTES`] as bytes arrive (at most one
//! chunk of each upload is held here; the reactor's window bounds what is in the channel),
//! `FILE_COMPLETE` with the name, type, size and sha256 once the part ended; the 201 follows
//! its COMMIT. Download: `FILE_META`, then one chunk read at a time as the client drains the
//! previous one. An upload refused or cut off is deleted at once (`FILE_ABORT`); expired files
//! (and uploads abandoned while the database was down) by the database thread's housekeeping
//! (`FILE_EXPIRE`). This thread blocks on PostgreSQL; the loop never does.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Done, FileMeta, Job, OpenError, Store, TransferId};
use crate::log::Level;
use crate::pg::db::{Health, HealthProbe};
use crate::pg::sql;
use crate::pg::url::DbParams;
use crate::pg::wire::{Conn, Param, PgError, Stmt, Timeouts};
use crate::tasks::uuid_string;

/// Bytes per stored chunk.
pub const CHUNK_BYTES: usize = 256 * 1024;

const UNREACHABLE: &str = "database unreachable";

struct Upload {
    file_id: String,
    buf: Vec<u8>,
    next: i64,
    failed: Option<String>,
}

struct Download {
    file_id: String,
    chunk_bytes: u64,
    /// The chunk read last (a download asks for less than a chunk at a time).
    cached: Option<(i64, Vec<u8>)>,
}

struct DbFiles {
    params: DbParams,
    health: HealthProbe,
    blob_ttl_ms: u64,
    conn: Option<Conn>,
    uploads: HashMap<TransferId, Upload>,
    downloads: HashMap<TransferId, Download>,
}

/// Starts the files thread of a node.
pub fn start(
    params: DbParams,
    health: HealthProbe,
    blob_ttl_ms: u64,
    wake: Arc<dyn Fn() + Send + Sync>,
) -> std::io::Result<Store> {
    let mut files =
        DbFiles { params, health, blob_ttl_ms, conn: None, uploads: HashMap::new(), downloads: HashMap::new() };
    let mut store = Store::spawn("relay-db-files", move |job| files.run(job), wake)?;
    store.in_database = true;
    Ok(store)
}

impl DbFiles {
    /// Runs statements as one transaction on this thread's connection (opened when needed, and
    /// only while the database thread says the database is up: a down database answers at
    /// once instead of after a connect timeout).
    fn exec(&mut self, stmts: &[Stmt]) -> Result<Vec<crate::pg::wire::Rows>, String> {
        if self.health.health() != Health::Ok {
            self.conn = None;
            return Err(UNREACHABLE.into());
        }
        if self.conn.is_none() {
            let conn = Conn::connect(&self.params, Timeouts { io_ms: 30_000 }).map_err(|e| e.to_string())?;
            self.conn = Some(conn);
        }
        let Some(conn) = self.conn.as_mut() else { return Err(UNREACHABLE.into()) };
        conn.pipeline(stmts).map_err(|e: PgError| {
            if e.is_fatal() {
                self.conn = None;
            }
            e.to_string()
        })
    }

    fn run(&mut self, job: Job) -> Option<Done> {
        match job {
            // Nothing to find on a disk: the database keeps the files and their times.
            Job::Scan { .. } => Some(Done::Scanned(Vec::new())),
            Job::Sweep { .. } | Job::Delete { .. } => None,
            Job::Create { t, file_id } => {
                let file_id = uuid_string(file_id);
                let now = crate::timefmt::wall_ms() as i64;
                let begin = Stmt::new(
                    sql::FILE_BEGIN,
                    vec![
                        file_id.as_str().into(),
                        "".into(),
                        "application/octet-stream".into(),
                        (CHUNK_BYTES as i64).into(),
                        now.into(),
                        now.saturating_add(self.blob_ttl_ms as i64).into(),
                    ],
                );
                let result = self.exec(&[begin]).map(|_| {
                    self.uploads.insert(t, Upload { file_id, buf: Vec::new(), next: 0, failed: None });
                });
                Some(Done::Created { t, result })
            }
            Job::Write { t, data } => {
                let len = data.len();
                let mut chunks = Vec::new();
                if let Some(up) = self.uploads.get_mut(&t)
                    && up.failed.is_none()
                {
                    up.buf.extend_from_slice(&data);
                    while up.buf.len() >= CHUNK_BYTES {
                        let rest = up.buf.split_off(CHUNK_BYTES);
                        let chunk = std::mem::replace(&mut up.buf, rest);
                        chunks.push(chunk_stmt(&up.file_id, up.next, chunk));
                        up.next += 1;
                    }
                }
                if !chunks.is_empty()
                    && let Err(e) = self.exec(&chunks)
                    && let Some(up) = self.uploads.get_mut(&t)
                {
                    up.failed = Some(e);
                }
                Some(Done::Written { t, len })
            }
            Job::Finish { t, meta } => Some(Done::Finished { t, result: self.finish(t, meta) }),
            Job::Abort { t } => {
                // A refused upload (413, 400) or one whose client left keeps nothing, as on one
                // node: its rows go now. Should that fail (the database is down), FILE_EXPIRE
                // removes them an hour after the upload began.
                if let Some(up) = self.uploads.remove(&t) {
                    let stmt = Stmt::new(sql::FILE_ABORT, vec![up.file_id.as_str().into()]);
                    if let Err(e) = self.exec(&[stmt]) {
                        crate::log!(
                            Level::Warn,
                            "an abandoned upload's rows stay until FILE_EXPIRE",
                            file_id = up.file_id,
                            error = e
                        );
                    }
                }
                None
            }
            Job::Open { t, file_id, now_wall_ms } => {
                let id = uuid_string(file_id);
                let stmt = Stmt::new(sql::FILE_META, vec![id.as_str().into(), (now_wall_ms as i64).into()]);
                let result = match self.exec(&[stmt]) {
                    Err(e) => Err(OpenError::Io(e)),
                    Ok(rows) => match rows.first().and_then(|r| r.rows.first()) {
                        None => Err(OpenError::NotFound),
                        Some(row) => {
                            let ms = |i: usize| row.i64(i).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
                            let meta = FileMeta {
                                file_id: id.clone(),
                                filename: row.text(0).unwrap_or("file").to_string(),
                                content_type: row.text(1).unwrap_or("application/octet-stream").to_string(),
                                size: ms(2),
                                sha256: row.text(3).unwrap_or("").to_string(),
                                created_ms: ms(5),
                                expires_ms: ms(6),
                            };
                            let chunk_bytes = ms(4).max(1);
                            self.downloads.insert(t, Download { file_id: id, chunk_bytes, cached: None });
                            Ok(meta)
                        }
                    },
                };
                Some(Done::Opened { t, result })
            }
            Job::Read { t, offset, len } => Some(Done::Read { t, result: self.read(t, offset, len) }),
            Job::Close { t } => {
                self.downloads.remove(&t);
                None
            }
        }
    }

    fn finish(&mut self, t: TransferId, meta: FileMeta) -> Result<FileMeta, String> {
        let Some(mut up) = self.uploads.remove(&t) else { return Err("no such upload".into()) };
        if let Some(e) = up.failed.take() {
            return Err(e);
        }
        let mut stmts = Vec::new();
        if !up.buf.is_empty() {
            stmts.push(chunk_stmt(&up.file_id, up.next, std::mem::take(&mut up.buf)));
        }
        stmts.push(Stmt::new(
            sql::FILE_COMPLETE,
            vec![
                up.file_id.as_str().into(),
                (meta.size as i64).into(),
                meta.sha256.as_str().into(),
                meta.filename.as_str().into(),
                meta.content_type.as_str().into(),
                (meta.expires_ms as i64).into(),
            ],
        ));
        let rows = self.exec(&stmts)?;
        if rows.last().map_or(0, |r| r.affected) != 1 {
            crate::log!(Level::Error, "an upload's metadata row is missing", file_id = up.file_id);
            return Err("the upload's record is gone".into());
        }
        Ok(meta)
    }

    fn read(&mut self, t: TransferId, offset: u64, len: usize) -> Result<Vec<u8>, String> {
        let Some(d) = self.downloads.get(&t) else { return Err("no such download".into()) };
        let n = (offset / d.chunk_bytes) as i64;
        let within = (offset % d.chunk_bytes) as usize;
        if d.cached.as_ref().is_none_or(|(c, _)| *c != n) {
            let mut stmt = Stmt::new(sql::FILE_READ_CHUNK, vec![d.file_id.as_str().into(), n.into()]);
            stmt.binary_results = true;
            let rows = self.exec(&[stmt])?;
            let data = rows.first().and_then(|r| r.rows.first()).and_then(|r| r.bytes(0)).map(<[u8]>::to_vec);
            let Some(data) = data else { return Err(format!("chunk {n} is missing")) };
            if let Some(d) = self.downloads.get_mut(&t) {
                d.cached = Some((n, data));
            }
        }
        let Some((_, data)) = self.downloads.get(&t).and_then(|d| d.cached.as_ref()) else {
            return Err("no such download".into());
        };
        let end = within.saturating_add(len).min(data.len());
        Ok(data.get(within..end).map(<[u8]>::to_vec).unwrap_or_default())
    }
}

fn chunk_stmt(file_id: &str, n: i64, data: Vec<u8>) -> Stmt {
    Stmt::new(sql::FILE_CHUNK, vec![file_id.into(), n.into(), Param::Bytes(data)])
}
