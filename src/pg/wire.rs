//! A small blocking PostgreSQL client for the database thread and the `relay token` CLI:
//! `postgres-protocol` encodes and decodes the messages (and does SCRAM), this file does the
//! socket, the session start, and the two ways of sending SQL:
//!
//! - [`Conn::simple`]: the simple query protocol, for scripts (migrations, `BEGIN`/`COMMIT`).
//! - [`Conn::pipeline`]: many parameterised statements sent at once, then one `Sync`: one round
//!   trip, and — outside an explicit `BEGIN` — one implicit transaction: all or nothing, one
//!   commit. This is how a loop turn's records become one transaction.
//!
//! Parameters travel as text (the SQL casts them: `$1::uuid`), except [`Param::Bytes`], sent
//! in binary (a `bytea` parameter, no hex doubling). Results come back as text, or all binary
//! when a statement asks for it (file chunks).
//!
//! The socket is non-blocking and driven by `poll(2)`: writes and reads interleave, so a large
//! pipeline cannot deadlock with a server that is writing results we have not read yet, and
//! every call has a deadline. Any I/O or protocol error leaves the connection unusable
//! ([`PgError::is_fatal`]); a database error (bad SQL, a constraint) does not.
//!
//! Never on the event loop's thread: this file blocks.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::IsNull;
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::{self, Message};
use postgres_protocol::message::frontend;
use serde_json::value::RawValue;

use super::url::{DbParams, Host};

/// Largest message accepted from the server. Rows carry task payloads and results (bounded by
/// MAX_MESSAGE_SIZE) and file chunks (bounded by the chunk size); anything this big is a
/// broken or hostile server.
pub const MAX_BACKEND_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// Notifications kept while nobody takes them; older ones are dropped (each only says
/// "look again", so losing some loses nothing but latency).
const MAX_QUEUED_NOTIFICATIONS: usize = 1024;

#[derive(Debug)]
pub enum PgError {
    /// The socket failed, timed out, or the server closed it: reconnect.
    Io(io::Error),
    /// The server said something this client does not understand: reconnect.
    Protocol(String),
    /// The server refused the statement (the connection is still good).
    Db { code: String, message: String },
}

impl PgError {
    /// True when the connection must be dropped and a new one opened.
    pub fn is_fatal(&self) -> bool {
        match self {
            PgError::Io(_) | PgError::Protocol(_) => true,
            // 57P01..57P03: admin shutdown, crash shutdown, cannot connect now.
            PgError::Db { code, .. } => code.starts_with("57P") || code.starts_with("08"),
        }
    }

    /// The SQLSTATE of a database error.
    pub fn code(&self) -> Option<&str> {
        match self {
            PgError::Db { code, .. } => Some(code),
            _ => None,
        }
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PgError::Io(e) => write!(f, "connection: {e}"),
            PgError::Protocol(m) => write!(f, "protocol: {m}"),
            PgError::Db { code, message } => write!(f, "{message} (SQLSTATE {code})"),
        }
    }
}

impl From<io::Error> for PgError {
    fn from(e: io::Error) -> PgError {
        PgError::Io(e)
    }
}

fn protocol(m: impl Into<String>) -> PgError {
    PgError::Protocol(m.into())
}

/// One parameter of a statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    Null,
    /// Text format: the server parses it as the type the SQL gives the parameter.
    Text(String),
    /// Binary format: for a `bytea` parameter, the bytes themselves.
    Bytes(Vec<u8>),
}

impl From<&str> for Param {
    fn from(s: &str) -> Param {
        Param::Text(s.to_string())
    }
}

impl From<String> for Param {
    fn from(s: String) -> Param {
        Param::Text(s)
    }
}

impl From<i64> for Param {
    fn from(n: i64) -> Param {
        Param::Text(n.to_string())
    }
}

impl From<bool> for Param {
    fn from(b: bool) -> Param {
        Param::Text(if b { "t" } else { "f" }.to_string())
    }
}

impl<T: Into<Param>> From<Option<T>> for Param {
    fn from(v: Option<T>) -> Param {
        v.map_or(Param::Null, Into::into)
    }
}

/// One statement of a pipeline. `sql` is `'static`: statements are constants, prepared once per
/// connection and reused by name.
#[derive(Debug, Clone)]
pub struct Stmt {
    pub sql: &'static str,
    pub params: Vec<Param>,
    /// Results in binary format (every column) instead of text.
    pub binary_results: bool,
    /// Columns whose text is JSON: checked, and made [`RawValue`]s, on the connection's thread
    /// (a large result is checked there, not on the loop that reads the row: [`Row::json`]).
    pub json_columns: &'static [usize],
    /// What the connection's thread makes of the statement's rows once they are read (a large
    /// result shaped there, not on the loop: cluster mode's `GET /kinds`).
    pub rows_made: Option<fn(&mut Rows)>,
}

impl Stmt {
    pub fn new(sql: &'static str, params: Vec<Param>) -> Stmt {
        Stmt { sql, params, binary_results: false, json_columns: &[], rows_made: None }
    }

    /// The same statement, its rows given to `f` on the connection's thread once read
    /// ([`Stmt::rows_made`]).
    pub fn with_rows_made(mut self, f: fn(&mut Rows)) -> Stmt {
        self.rows_made = Some(f);
        self
    }

    /// The same statement, with `columns` checked as JSON where its rows are read
    /// ([`Stmt::json_columns`]).
    pub fn with_json(mut self, columns: &'static [usize]) -> Stmt {
        self.json_columns = columns;
        self
    }
}

/// One result row: column values as raw bytes (text or binary, as the statement asked).
#[derive(Debug)]
pub struct Row {
    data: Bytes,
    ranges: Vec<Option<Range<usize>>>,
    /// The statement's JSON columns that hold valid JSON, checked already (column, value): the
    /// first read takes the value (a large result is not copied again on the loop).
    json: Vec<(usize, RefCell<Option<Box<RawValue>>>)>,
}

impl Clone for Row {
    fn clone(&self) -> Row {
        let json = self.json.iter().map(|(i, v)| (*i, RefCell::new(v.borrow().clone()))).collect();
        Row { data: self.data.clone(), ranges: self.ranges.clone(), json }
    }
}

/// The same columns (what the JSON cache holds follows from them).
impl PartialEq for Row {
    fn eq(&self, other: &Row) -> bool {
        self.len() == other.len() && (0..self.len()).all(|i| self.bytes(i) == other.bytes(i))
    }
}

impl Eq for Row {}

impl Row {
    /// About the memory the row holds: itself, its column ranges and its message's bytes.
    pub fn held_bytes(&self) -> usize {
        std::mem::size_of::<Row>()
            + self.ranges.capacity() * std::mem::size_of::<Option<Range<usize>>>()
            + self.data.len()
            + self.json.capacity() * std::mem::size_of::<(usize, RefCell<Option<Box<RawValue>>>)>()
    }

    /// A row of text columns (`None`: NULL), as the server would send it (for tests of what is
    /// made from rows).
    pub fn from_texts(columns: &[Option<&str>]) -> Row {
        let mut data = Vec::new();
        let mut ranges = Vec::with_capacity(columns.len());
        for c in columns {
            ranges.push(c.map(|text| {
                let start = data.len();
                data.extend_from_slice(text.as_bytes());
                start..data.len()
            }));
        }
        Row { data: Bytes::from(data), ranges, json: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Column `i` as bytes; `None` for NULL or a missing column.
    pub fn bytes(&self, i: usize) -> Option<&[u8]> {
        let r = self.ranges.get(i)?.as_ref()?;
        self.data.get(r.clone())
    }

    /// Column `i` as text (text-format results).
    pub fn text(&self, i: usize) -> Option<&str> {
        self.bytes(i).and_then(|b| std::str::from_utf8(b).ok())
    }

    /// Column `i` as JSON: the value checked on the connection's thread when the statement
    /// named the column ([`Stmt::with_json`]) — taken by the first read; else (or read again)
    /// checked now. `None` for NULL or text that is not JSON.
    pub fn json(&self, i: usize) -> Option<Box<RawValue>> {
        match self.json.iter().find(|(c, _)| *c == i).and_then(|(_, v)| v.borrow_mut().take()) {
            Some(v) => Some(v),
            None => RawValue::from_string(self.text(i)?.to_owned()).ok(),
        }
    }

    /// Checks the text of `columns` as JSON once (on the thread that read the row).
    fn check_json(&mut self, columns: &[usize]) {
        for &i in columns {
            if let Some(v) = self.text(i).and_then(|t| RawValue::from_string(t.to_owned()).ok()) {
                self.json.push((i, RefCell::new(Some(v))));
            }
        }
    }

    /// Column `i` as an integer (text-format results).
    pub fn i64(&self, i: usize) -> Option<i64> {
        self.text(i)?.parse().ok()
    }

    /// Column `i` as a boolean (text-format results: `t`/`f`).
    pub fn bool(&self, i: usize) -> Option<bool> {
        match self.text(i)? {
            "t" => Some(true),
            "f" => Some(false),
            _ => None,
        }
    }
}

/// What one statement produced.
#[derive(Debug, Clone, Default)]
pub struct Rows {
    pub rows: Vec<Row>,
    /// The count in the command tag (`UPDATE 3` → 3): rows inserted, updated, deleted or selected.
    pub affected: u64,
}

/// An asynchronous `NOTIFY` received on this connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub channel: String,
    pub payload: String,
    /// The backend (session) whose transaction sent it.
    pub pid: i32,
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn fd(&self) -> i32 {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Per-call time limits.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Longest one `simple` or `pipeline` call may take, writing and reading.
    pub io_ms: u64,
}

/// Lets one `simple` or `pipeline` call run past `io_ms` while its bytes still move or `busy`
/// says the server is still at work on it (its backend `active` on the query, seen on another
/// connection: a long transaction, not a connection gone quiet), up to `max_ms` in all.
pub struct Patience {
    pub max_ms: u64,
    pub busy: Box<dyn Fn() -> bool + Send>,
}

/// How long each look at [`Patience::busy`] extends a call.
const PATIENCE_STEP_MS: u64 = 500;

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts { io_ms: 30_000 }
    }
}

/// One open session.
pub struct Conn {
    stream: Stream,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// SQL text → name of the prepared statement on this connection.
    prepared: HashMap<&'static str, String>,
    next_name: u64,
    /// Statements prepared by a pipeline that failed: closed at the start of the next one, so
    /// a statement that keeps failing does not pile up prepared copies on the server.
    to_close: Vec<String>,
    notifications: VecDeque<Notification>,
    backend_pid: i32,
    pub timeouts: Timeouts,
    patience: Option<Patience>,
    /// Bytes written and read so far: a call whose bytes still move is not one gone quiet.
    moved: u64,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Conn(backend pid {})", self.backend_pid)
    }
}

impl Conn {
    /// Connects, logs in (trust, cleartext, MD5 or SCRAM-SHA-256) and waits until the session
    /// is ready. Blocks for at most `params.connect_timeout_ms` plus one `io_ms`.
    pub fn connect(params: &DbParams, timeouts: Timeouts) -> Result<Conn, PgError> {
        let limit = Duration::from_millis(params.connect_timeout_ms);
        let stream = match &params.host {
            Host::Unix(_) => {
                let path = params.socket_path().ok_or_else(|| protocol("no socket path"))?;
                Stream::Unix(UnixStream::connect(&path)?)
            }
            Host::Tcp(name) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{name} resolves to no address"));
                let mut found = None;
                for addr in (name.as_str(), params.port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, limit) {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                Stream::Tcp(found.ok_or(last)?)
            }
        };
        match &stream {
            Stream::Tcp(s) => s.set_nonblocking(true)?,
            Stream::Unix(s) => s.set_nonblocking(true)?,
        }
        let mut conn = Conn {
            stream,
            rbuf: BytesMut::with_capacity(16 * 1024),
            wbuf: BytesMut::with_capacity(16 * 1024),
            prepared: HashMap::new(),
            next_name: 0,
            to_close: Vec::new(),
            notifications: VecDeque::new(),
            backend_pid: 0,
            timeouts,
            patience: None,
            moved: 0,
        };
        let deadline = Instant::now() + limit.max(Duration::from_millis(timeouts.io_ms));
        conn.startup(params, deadline)?;
        Ok(conn)
    }

    fn startup(&mut self, params: &DbParams, deadline: Instant) -> Result<(), PgError> {
        let options: [(&str, &str); 6] = [
            ("user", &params.user),
            ("database", &params.dbname),
            ("application_name", &params.application_name),
            ("client_encoding", "UTF8"),
            ("DateStyle", "ISO"),
            ("TimeZone", "UTC"),
        ];
        frontend::startup_message(options.iter().copied(), &mut self.wbuf)?;
        self.flush(deadline)?;
        let mut scram: Option<ScramSha256> = None;
        loop {
            match self.read_message(deadline)? {
                Message::AuthenticationOk => {}
                Message::AuthenticationCleartextPassword => {
                    let pw = params.password.as_deref().ok_or_else(|| protocol("the server asks for a password"))?;
                    frontend::password_message(pw.as_bytes(), &mut self.wbuf)?;
                    self.flush(deadline)?;
                }
                Message::AuthenticationMd5Password(body) => {
                    let pw = params.password.as_deref().ok_or_else(|| protocol("the server asks for a password"))?;
                    let hash =
                        postgres_protocol::authentication::md5_hash(params.user.as_bytes(), pw.as_bytes(), body.salt());
                    frontend::password_message(hash.as_bytes(), &mut self.wbuf)?;
                    self.flush(deadline)?;
                }
                Message::AuthenticationSasl(body) => {
                    let pw = params.password.as_deref().ok_or_else(|| protocol("the server asks for a password"))?;
                    let mut mechanisms = body.mechanisms();
                    let mut has_scram = false;
                    while let Some(m) = mechanisms.next()? {
                        has_scram |= m == sasl::SCRAM_SHA_256;
                    }
                    if !has_scram {
                        return Err(protocol("the server offers no SASL mechanism this client speaks"));
                    }
                    let s = ScramSha256::new(pw.as_bytes(), ChannelBinding::unsupported());
                    frontend::sasl_initial_response(sasl::SCRAM_SHA_256, s.message(), &mut self.wbuf)?;
                    scram = Some(s);
                    self.flush(deadline)?;
                }
                Message::AuthenticationSaslContinue(body) => {
                    let s = scram.as_mut().ok_or_else(|| protocol("SASL continue without a start"))?;
                    s.update(body.data())?;
                    frontend::sasl_response(s.message(), &mut self.wbuf)?;
                    self.flush(deadline)?;
                }
                Message::AuthenticationSaslFinal(body) => {
                    let s = scram.as_mut().ok_or_else(|| protocol("SASL final without a start"))?;
                    s.finish(body.data())?;
                }
                Message::BackendKeyData(body) => self.backend_pid = body.process_id(),
                Message::ParameterStatus(_) | Message::NoticeResponse(_) => {}
                Message::ErrorResponse(body) => return Err(db_error(&body)),
                Message::ReadyForQuery(_) => return Ok(()),
                _ => return Err(protocol("unexpected message during startup")),
            }
        }
    }

    /// From now on calls may run past `io_ms` as `patience` allows.
    pub fn set_patience(&mut self, patience: Patience) {
        self.patience = Some(patience);
    }

    /// The server process serving this session (what `pg_terminate_backend` takes).
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// Runs a script with the simple query protocol; returns the rows of every statement that
    /// returned some, in order. The first error aborts the rest of the script.
    pub fn simple(&mut self, sql: &str) -> Result<Vec<Rows>, PgError> {
        let deadline = self.deadline();
        frontend::query(sql, &mut self.wbuf)?;
        let mut out = Vec::new();
        let mut current = Rows::default();
        let mut error = None;
        self.flush_and_read(deadline, |msg| {
            match msg {
                Message::RowDescription(_) => current = Rows::default(),
                Message::DataRow(body) => current.rows.push(row(body)?),
                Message::CommandComplete(body) => {
                    current.affected = affected(&body);
                    out.push(std::mem::take(&mut current));
                }
                Message::EmptyQueryResponse => {}
                Message::ErrorResponse(body) => {
                    error.get_or_insert(db_error(&body));
                }
                _ => return Err(protocol("unexpected message in a simple query")),
            }
            Ok(())
        })?;
        match error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Sends every statement, then one `Sync`, in one write; reads every answer. Outside an
    /// explicit transaction the statements form one implicit transaction: the first error
    /// rolls all of them back and is returned (the server skips the rest).
    pub fn pipeline(&mut self, stmts: &[Stmt]) -> Result<Vec<Rows>, PgError> {
        let deadline = self.deadline();
        // Closing a statement that does not exist is not an error.
        for name in std::mem::take(&mut self.to_close) {
            frontend::close(b'S', &name, &mut self.wbuf)?;
        }
        let mut fresh: Vec<&'static str> = Vec::new();
        for stmt in stmts {
            let name = match self.prepared.get(stmt.sql) {
                Some(name) => name.clone(),
                None => {
                    // A new name each time: if this pipeline fails after the Parse, a later
                    // Parse must not collide with a statement that does exist.
                    self.next_name += 1;
                    let name = format!("r{}", self.next_name);
                    frontend::parse(&name, stmt.sql, std::iter::empty(), &mut self.wbuf)?;
                    self.prepared.insert(stmt.sql, name.clone());
                    fresh.push(stmt.sql);
                    name
                }
            };
            let formats = stmt.params.iter().map(|p| i16::from(matches!(p, Param::Bytes(_))));
            let result_format = [i16::from(stmt.binary_results)];
            frontend::bind("", &name, formats, stmt.params.iter(), encode, result_format, &mut self.wbuf).map_err(
                |e| match e {
                    frontend::BindError::Conversion(e) => protocol(format!("parameter: {e}")),
                    frontend::BindError::Serialization(e) => PgError::Io(e),
                },
            )?;
            frontend::execute("", 0, &mut self.wbuf)?;
        }
        frontend::sync(&mut self.wbuf);
        let mut out: Vec<Rows> = Vec::with_capacity(stmts.len());
        let mut current = Rows::default();
        let mut error = None;
        let result = self.flush_and_read(deadline, |msg| {
            match msg {
                Message::ParseComplete | Message::BindComplete | Message::NoData | Message::CloseComplete => {}
                Message::DataRow(body) => current.rows.push(row(body)?),
                Message::CommandComplete(body) => {
                    current.affected = affected(&body);
                    out.push(std::mem::take(&mut current));
                }
                Message::EmptyQueryResponse => out.push(std::mem::take(&mut current)),
                Message::ErrorResponse(body) => {
                    error.get_or_insert(db_error(&body));
                }
                Message::PortalSuspended => return Err(protocol("portal suspended")),
                _ => return Err(protocol("unexpected message in a pipeline")),
            }
            Ok(())
        });
        if result.is_err() || error.is_some() {
            // Whether those Parses succeeded is unknown: prepare them again next time.
            for sql in fresh {
                if let Some(name) = self.prepared.remove(sql) {
                    self.to_close.push(name);
                }
            }
        }
        result?;
        match error {
            Some(e) => Err(e),
            None if out.len() == stmts.len() => {
                for (stmt, rows) in stmts.iter().zip(out.iter_mut()) {
                    if !stmt.json_columns.is_empty() {
                        rows.rows.iter_mut().for_each(|row| row.check_json(stmt.json_columns));
                    }
                    if let Some(f) = stmt.rows_made {
                        f(rows);
                    }
                }
                Ok(out)
            }
            None => Err(protocol(format!("{} results for {} statements", out.len(), stmts.len()))),
        }
    }

    /// Waits up to `within` for a notification (reading the socket while idle). Notifications
    /// that arrived during other calls are returned first.
    pub fn wait_notification(&mut self, within: Duration) -> Result<Option<Notification>, PgError> {
        if let Some(n) = self.notifications.pop_front() {
            return Ok(Some(n));
        }
        let deadline = Instant::now() + within;
        loop {
            if let Some(msg) = self.try_parse()? {
                match msg {
                    Message::NotificationResponse(_) | Message::ParameterStatus(_) | Message::NoticeResponse(_) => {}
                    Message::ErrorResponse(body) => return Err(db_error(&body)),
                    _ => return Err(protocol("unexpected message while idle")),
                }
                if let Some(n) = self.notifications.pop_front() {
                    return Ok(Some(n));
                }
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            if !self.wait_io(false, deadline)? {
                return Ok(None);
            }
            self.fill()?;
        }
    }

    /// Takes the notifications that arrived during earlier calls.
    pub fn take_notifications(&mut self) -> Vec<Notification> {
        self.notifications.drain(..).collect()
    }

    /// Says goodbye (best effort) and closes.
    pub fn close(mut self) {
        frontend::terminate(&mut self.wbuf);
        let _ = self.flush(Instant::now() + Duration::from_millis(100));
    }

    fn deadline(&self) -> Instant {
        Instant::now() + Duration::from_millis(self.timeouts.io_ms)
    }

    /// Writes what is queued while reading what arrives, then reads until `ReadyForQuery`,
    /// handing each message of the exchange to `each` (notifications, parameter changes and
    /// notices are handled here).
    fn flush_and_read(
        &mut self,
        mut deadline: Instant,
        mut each: impl FnMut(Message) -> Result<(), PgError>,
    ) -> Result<(), PgError> {
        let began = Instant::now();
        let mut moved = self.moved;
        loop {
            while let Some(msg) = self.try_parse()? {
                match msg {
                    Message::ReadyForQuery(_) => {
                        if self.wbuf.is_empty() {
                            return Ok(());
                        }
                        return Err(protocol("ready before the request was sent"));
                    }
                    Message::NotificationResponse(_) | Message::ParameterStatus(_) | Message::NoticeResponse(_) => {}
                    other => each(other)?,
                }
            }
            let want_write = !self.wbuf.is_empty();
            if !self.wait_io(want_write, deadline)? {
                // (Bytes that moved since the last look — a 48 MiB row on its way — count as
                // work too: the server process then waits on this client, not on its query.)
                let progressed = std::mem::replace(&mut moved, self.moved) != self.moved;
                let patient = self.patience.as_ref().is_some_and(|p| {
                    began.elapsed() < Duration::from_millis(p.max_ms.saturating_sub(PATIENCE_STEP_MS))
                        && (progressed || (p.busy)())
                });
                if patient {
                    deadline = Instant::now() + Duration::from_millis(PATIENCE_STEP_MS);
                    continue;
                }
                return Err(PgError::Io(io::Error::new(io::ErrorKind::TimedOut, "no answer from PostgreSQL in time")));
            }
            if want_write {
                self.write_some()?;
            }
            self.fill()?;
        }
    }

    fn flush(&mut self, deadline: Instant) -> Result<(), PgError> {
        while !self.wbuf.is_empty() {
            if !self.wait_io(true, deadline)? {
                return Err(PgError::Io(io::Error::new(io::ErrorKind::TimedOut, "PostgreSQL does not read")));
            }
            self.write_some()?;
        }
        Ok(())
    }

    fn read_message(&mut self, deadline: Instant) -> Result<Message, PgError> {
        loop {
            if let Some(msg) = self.try_parse()? {
                return Ok(msg);
            }
            if !self.wait_io(false, deadline)? {
                return Err(PgError::Io(io::Error::new(io::ErrorKind::TimedOut, "no answer from PostgreSQL in time")));
            }
            self.fill()?;
        }
    }

    /// One message from the buffer, if a whole one is there. Notifications are queued here.
    fn try_parse(&mut self) -> Result<Option<Message>, PgError> {
        if let Some(header) = backend::Header::parse(&self.rbuf)?
            && header.len() as usize + 1 > MAX_BACKEND_MESSAGE_BYTES
        {
            return Err(protocol(format!("a {} byte message from the server", header.len())));
        }
        let msg = Message::parse(&mut self.rbuf)?;
        if let Some(Message::NotificationResponse(body)) = &msg {
            if self.notifications.len() >= MAX_QUEUED_NOTIFICATIONS {
                self.notifications.pop_front();
            }
            self.notifications.push_back(Notification {
                channel: body.channel()?.to_string(),
                payload: body.message()?.to_string(),
                pid: body.process_id(),
            });
        }
        Ok(msg)
    }

    /// `poll(2)` until readable (or writable when `write`), or the deadline. `false` on timeout.
    fn wait_io(&self, write: bool, deadline: Instant) -> Result<bool, PgError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let events = libc::POLLIN | if write { libc::POLLOUT } else { 0 };
            let mut pfd = libc::pollfd { fd: self.stream.fd(), events, revents: 0 };
            let ms = i32::try_from(left.as_millis().min(60_000)).unwrap_or(60_000);
            // SAFETY: one pollfd on a descriptor this connection owns.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(PgError::Io(e));
            }
            if rc > 0 {
                return Ok(true);
            }
            if left.is_zero() {
                return Ok(false);
            }
        }
    }

    fn write_some(&mut self) -> Result<(), PgError> {
        loop {
            match self.stream.write(&self.wbuf) {
                Ok(0) => return Err(PgError::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    self.moved = self.moved.wrapping_add(n as u64);
                    let _ = self.wbuf.split_to(n);
                    if self.wbuf.is_empty() {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(PgError::Io(e)),
            }
        }
    }

    /// Reads what the socket has. EOF is an error: the server never closes first in a session.
    fn fill(&mut self) -> Result<(), PgError> {
        let mut chunk = [0u8; 64 * 1024];
        // At most 1 MiB a call: the caller parses (and frees) between calls.
        for _ in 0..16 {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(PgError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "PostgreSQL closed the connection",
                    )));
                }
                Ok(n) => {
                    self.moved = self.moved.wrapping_add(n as u64);
                    self.rbuf.put_slice(&chunk[..n]);
                    if n < chunk.len() {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(PgError::Io(e)),
            }
        }
        Ok(())
    }
}

fn encode(p: &Param, buf: &mut BytesMut) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
    match p {
        Param::Null => Ok(IsNull::Yes),
        Param::Text(s) => {
            buf.put_slice(s.as_bytes());
            Ok(IsNull::No)
        }
        Param::Bytes(b) => {
            buf.put_slice(b);
            Ok(IsNull::No)
        }
    }
}

fn row(body: backend::DataRowBody) -> Result<Row, PgError> {
    let ranges: Vec<Option<Range<usize>>> = body.ranges().collect()?;
    Ok(Row { data: body.buffer_bytes().clone(), ranges, json: Vec::new() })
}

/// The last number of a command tag (`INSERT 0 5` → 5, `UPDATE 3` → 3, `BEGIN` → 0).
fn affected(body: &backend::CommandCompleteBody) -> u64 {
    body.tag().ok().and_then(|t| t.rsplit(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(0)
}

fn db_error(body: &backend::ErrorResponseBody) -> PgError {
    let (mut code, mut message, mut detail) = (String::new(), String::new(), String::new());
    let mut fields = body.fields();
    while let Ok(Some(f)) = fields.next() {
        match f.type_() {
            b'C' => code = String::from_utf8_lossy(f.value_bytes()).into_owned(),
            b'M' => message = String::from_utf8_lossy(f.value_bytes()).into_owned(),
            b'D' => detail = String::from_utf8_lossy(f.value_bytes()).into_owned(),
            _ => {}
        }
    }
    if !detail.is_empty() {
        message = format!("{message}: {detail}");
    }
    PgError::Db { code, message }
}

#[cfg(test)]
mod tests {
    use super::Row;

    #[test]
    fn json_columns_are_checked_once_and_text_that_is_not_json_is_none() {
        let mut row = Row::from_texts(&[Some("{\"a\":[1,2]}"), Some("not json"), None, Some("7")]);
        row.check_json(&[0, 1, 2]);
        assert_eq!(row.json.len(), 1, "only the valid column is kept checked");
        assert_eq!(row.json(0).map(|v| v.get().to_string()).as_deref(), Some("{\"a\":[1,2]}"));
        // Read again: checked from the text.
        assert_eq!(row.json(0).map(|v| v.get().to_string()).as_deref(), Some("{\"a\":[1,2]}"));
        assert!(row.json(1).is_none());
        assert!(row.json(2).is_none());
        // A column the statement did not name is checked when read.
        assert_eq!(row.json(3).map(|v| v.get().to_string()).as_deref(), Some("7"));
    }
}
