//! The HTTP API: routes, the order of checks (404 → 405 → 401/403 → 400/413 → 503/429), body
//! validation, and the calls into the core. No sockets: the reactor hands over a parsed head and
//! a complete body and gets back what to do.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::auth::{Auth, Identity, RegistryLoading};
use crate::config::parse_duration_ms;
use crate::dispatch::{CancelResult, Core, Io, NewTask, ReadFor, SubmitError};
use crate::http::{Head, Method, Response, error_code};
use crate::tasks::{ConnRef, TaskId, parse_id, push_json_str, push_uuid};

mod cluster;

/// Longest accepted `Idempotency-Key`.
const MAX_IDEMPOTENCY_KEY_BYTES: usize = 256;
/// Longest `payload.kind` (SPEC §4): kinds are routing keys the core keeps.
pub const MAX_KIND_BYTES: usize = 128;
/// Longest per-task `timeout` (SPEC §4).
pub const MAX_TASK_TIMEOUT_MS: u64 = 24 * 3_600_000;
/// Furthest a `delay` or `run_at` may reach ahead of now (SPEC §4).
pub const MAX_SCHEDULE_AHEAD_MS: u64 = 366 * 24 * 3_600_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'a> {
    Ws,
    Tasks,
    TasksBatch,
    Task(&'a str),
    Clients,
    Healthz,
    Metrics,
    Files,
    File(&'a str),
    /// The dashboard's files (`/ui`, `/ui/app.js`, `/ui/app.css`).
    Ui(&'a str),
    NotFound,
}

impl<'a> Route<'a> {
    pub fn of(path: &'a str) -> Route<'a> {
        match path {
            "/ws" => Route::Ws,
            "/tasks" => Route::Tasks,
            "/tasks/batch" => Route::TasksBatch,
            "/clients" => Route::Clients,
            "/healthz" => Route::Healthz,
            "/metrics" => Route::Metrics,
            "/files" => Route::Files,
            "/ui" | "/ui/" => Route::Ui("index.html"),
            _ => {
                if let Some(id) = path.strip_prefix("/tasks/").filter(|id| !id.is_empty() && !id.contains('/')) {
                    Route::Task(id)
                } else if let Some(id) = path.strip_prefix("/files/").filter(|id| !id.is_empty() && !id.contains('/')) {
                    Route::File(id)
                } else if let Some(name) = path.strip_prefix("/ui/").filter(|n| crate::ui::exists(n)) {
                    Route::Ui(name)
                } else {
                    Route::NotFound
                }
            }
        }
    }

    /// The methods this route answers, as the `Allow` header lists them.
    pub fn allow(self) -> &'static str {
        match self {
            Route::Ws => "GET",
            Route::Clients | Route::Healthz | Route::Metrics | Route::File(_) | Route::Ui(_) => "GET, HEAD",
            Route::Tasks => "GET, HEAD, POST",
            Route::TasksBatch | Route::Files => "POST",
            Route::Task(_) => "GET, HEAD, DELETE",
            Route::NotFound => "",
        }
    }

    fn allows(self, method: Method) -> bool {
        match self {
            // HEAD is GET without the body (RFC 9110), except for the WebSocket upgrade.
            Route::Ws => method == Method::Get,
            Route::Clients | Route::Healthz | Route::Metrics | Route::File(_) | Route::Ui(_) => {
                matches!(method, Method::Get | Method::Head)
            }
            Route::Tasks => matches!(method, Method::Get | Method::Head | Method::Post),
            Route::TasksBatch | Route::Files => method == Method::Post,
            Route::Task(_) => matches!(method, Method::Get | Method::Head | Method::Delete),
            Route::NotFound => false,
        }
    }
}

/// Why [`Api::precheck`] did not let a request through.
#[derive(Debug)]
pub enum Refused {
    /// The final answer, sent without reading the body.
    Answer(Response),
    /// The token registry is being re-read off the loop: check the head again once it is in.
    RegistryLoading,
}

impl From<Response> for Refused {
    fn from(r: Response) -> Refused {
        Refused::Answer(r)
    }
}

impl From<RegistryLoading> for Refused {
    fn from(_: RegistryLoading) -> Refused {
        Refused::RegistryLoading
    }
}

/// What the reactor should do with a request.
#[derive(Debug)]
pub enum Handled {
    Respond(Response),
    /// The core will answer later through `Io::reply`.
    Held,
    /// Switch the connection to WebSocket with this `Sec-WebSocket-Accept` value.
    Upgrade {
        accept_key: String,
    },
}

pub struct Api {
    pub auth: Auth,
    pub max_message_bytes: usize,
    pub max_batch_bytes: usize,
    pub max_file_bytes: u64,
}

/// Room for the multipart framing around a file of MAX_FILE_SIZE (boundaries, part headers,
/// small extra fields).
pub const MULTIPART_OVERHEAD_BYTES: u64 = 64 * 1024;

pub fn error(status: u16, message: &str) -> Response {
    Response::error(status, error_code(status), message)
}

impl Api {
    /// The largest body a request on this route may carry.
    pub fn body_limit(&self, route: Route<'_>) -> u64 {
        match route {
            Route::TasksBatch => self.max_batch_bytes as u64,
            Route::Files => self.max_file_bytes.saturating_add(MULTIPART_OVERHEAD_BYTES),
            _ => self.max_message_bytes as u64,
        }
    }

    /// Checks that need only the head: path, method, credentials, declared size. `Some` is the
    /// final answer (sent without reading the body). `wall_ms` is the wall clock, for JWT `exp`.
    /// `Err` is the final answer (sent without reading the body); `Ok` carries who is asking
    /// (`None` on routes that need no token, and on `/ws`, whose token is not an identity).
    pub fn precheck(&self, head: &Head, wall_ms: u64) -> Result<Option<Identity>, Refused> {
        let route = Route::of(&head.path);
        if route == Route::NotFound {
            return Err(error(404, &format!("no such endpoint: {}", head.path)).into());
        }
        if !route.allows(head.method) {
            let msg = format!("{} accepts {}", head.path, route.allow());
            return Err(error(405, &msg).with_header("Allow", route.allow()).into());
        }
        let identity = match route {
            Route::Ws => {
                let token = head.query_param("token").map(percent_decode);
                if !self.auth.worker(token.as_deref()) {
                    return Err(error(401, "missing or invalid worker token (use /ws?token=...)").into());
                }
                None
            }
            Route::Healthz | Route::Metrics | Route::Ui(_) => None,
            Route::Files | Route::File(_) => {
                Some(self.auth.files(head.bearer_token(), wall_ms)?.ok_or_else(|| self.refused(head, wall_ms))?)
            }
            Route::Clients => match self.auth.task_api(head.bearer_token(), wall_ms)? {
                None => return Err(self.refused(head, wall_ms).into()),
                Some(Identity::Root) => Some(Identity::Root),
                Some(_) => return Err(error(403, "/clients needs the root API token").into()),
            },
            _ => Some(self.auth.task_api(head.bearer_token(), wall_ms)?.ok_or_else(|| self.refused(head, wall_ms))?),
        };
        if route == Route::TasksBatch && head.idempotency_key.is_some() {
            return Err(error(
                400,
                "Idempotency-Key is not supported on POST /tasks/batch (give each task its own submit)",
            )
            .into());
        }
        if let crate::http::Framing::Length(n) = head.framing {
            let limit = self.body_limit(route);
            if n > limit {
                return Err(error(413, &format!("body of {n} bytes is over the limit of {limit} bytes")).into());
            }
        }
        Ok(identity)
    }

    /// A bearer token was refused: 401, unless it may be a scoped JWT that cannot be checked
    /// now (cluster mode, registry cache stale: 503, so the caller retries rather than giving up).
    fn refused(&self, head: &Head, wall_ms: u64) -> Response {
        let jwt_like = head.bearer_token().is_some_and(|t| t.bytes().filter(|&b| b == b'.').count() == 2);
        if jwt_like && self.auth.registry_unavailable(wall_ms) {
            return Response::error(503, "database_unavailable", "scoped tokens cannot be checked now; try again");
        }
        unauthorized()
    }

    /// Handles a complete request whose head passed [`Api::precheck`], which found `identity`.
    #[allow(clippy::too_many_arguments)]
    pub fn handle(
        &self,
        core: &mut Core,
        io: &mut dyn Io,
        conn: ConnRef,
        head: &Head,
        identity: Option<&Identity>,
        body: &[u8],
        connections_open: usize,
    ) -> Handled {
        let route = Route::of(&head.path);
        let wait = match head.query_param("wait") {
            None | Some("false" | "0") => false,
            Some("true" | "1") => true,
            // A misspelt value must not quietly turn a blocking call into a non-blocking one.
            Some(other) if matches!(route, Route::Tasks | Route::Task(_)) => {
                let msg = format!("invalid wait {:?} (true, false, 1 or 0)", percent_decode(other));
                return Handled::Respond(error(400, &msg));
            }
            Some(_) => false,
        };
        if core.is_cluster()
            && let Some(handled) = self.cluster_route(core, conn, head, identity, body, route, wait)
        {
            return handled;
        }
        match route {
            Route::Ws => match upgrade(head) {
                Ok(accept_key) => Handled::Upgrade { accept_key },
                Err(response) => Handled::Respond(response),
            },
            // (503 while the journal cannot write: SPEC §7.)
            Route::Healthz => {
                Handled::Respond(Response::json(if core.journal_writable() { 200 } else { 503 }, core.health_json()))
            }
            Route::Metrics => {
                let text = core.metrics.render(&core.gauges(connections_open));
                let mut r = Response::json(200, text.into_bytes());
                r.content_type = "text/plain; version=0.0.4; charset=utf-8";
                Handled::Respond(r)
            }
            Route::Clients => Handled::Respond(Response::json(200, core.clients_json())),
            Route::Ui(name) => Handled::Respond(crate::ui::asset(name)),
            Route::Tasks => {
                let Some(identity) = identity else { return Handled::Respond(unauthorized()) };
                if head.method != Method::Post {
                    let q = match crate::listing::parse_query(&head.query) {
                        Ok(q) if q.at.is_none() => q,
                        Ok(_) => return Handled::Respond(error(400, "invalid cursor (a cluster's)")),
                        Err(msg) => return Handled::Respond(error(400, &msg)),
                    };
                    let plan = crate::listing::plan(core, &q, identity);
                    if plan.evicted.is_empty() {
                        let mut r = Response::json(200, crate::listing::render(&plan.pieces, plan.next));
                        r.lsn = plan.lsn;
                        return Handled::Respond(r);
                    }
                    core.read_page(io, conn, plan, q.kind, identity);
                    return Handled::Held;
                }
                self.submit(core, io, conn, head, body, identity, wait)
            }
            Route::Task(id_text) => {
                let Some(identity) = identity else { return Handled::Respond(unauthorized()) };
                let Some(id) = parse_id(id_text) else { return Handled::Respond(error(404, "no such task")) };
                if core.task(id).is_none() {
                    // Finished and out of memory (TASK_MEMORY): read back from the journal; the
                    // kind is checked against the token once it is read.
                    let purpose = if head.method == Method::Delete { ReadFor::Cancel } else { ReadFor::Get };
                    return if core.read_evicted(conn, id, purpose, identity) {
                        Handled::Held
                    } else {
                        Handled::Respond(error(404, "no such task"))
                    };
                }
                if !visible(core, id, identity) {
                    return Handled::Respond(error(404, "no such task"));
                }
                match head.method {
                    Method::Delete => Handled::Respond(cancel(core, io, id)),
                    _ if wait => match core.wait(conn, id, false) {
                        Some(r) => Handled::Respond(r),
                        None => Handled::Held,
                    },
                    _ => Handled::Respond(task_json_response(core, id, 200)),
                }
            }
            // (the reactor runs batches through `Api::batch_start`; this arm keeps the match whole)
            Route::TasksBatch => Handled::Respond(error(500, "batch submitted outside its path")),
            Route::Files | Route::File(_) => {
                Handled::Respond(error(501, "file transfer is not available in this version"))
            }
            Route::NotFound => Handled::Respond(error(404, "no such endpoint")),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        core: &mut Core,
        io: &mut dyn Io,
        conn: ConnRef,
        head: &Head,
        body: &[u8],
        identity: &Identity,
        wait: bool,
    ) -> Handled {
        if core.shutting_down {
            return Handled::Respond(Response::error(503, "shutting_down", "relay is shutting down"));
        }
        let key = match head.idempotency_key.as_deref() {
            Some("") => return Handled::Respond(error(400, "Idempotency-Key must not be empty")),
            Some(k) if k.len() > MAX_IDEMPOTENCY_KEY_BYTES => {
                return Handled::Respond(error(400, "Idempotency-Key is longer than 256 bytes"));
            }
            other => other,
        };
        // A repeated key answers for the first task before the body is even looked at: its
        // payload is not compared (SPEC §4).
        if let Some(id) = key.and_then(|k| core.idempotent_task(identity.owner_key(), k)) {
            return self.answer_submit(core, conn, id, wait, identity);
        }
        if let Some(r) = core.journal_unavailable() {
            return Handled::Respond(r);
        }
        let parsed = match parse_submit(body, core.wall_ms) {
            Ok(p) => p,
            Err(msg) => return Handled::Respond(error(400, &msg)),
        };
        if !identity.allows_kind(parsed.kind.as_deref()) {
            let msg = match parsed.kind.as_deref() {
                Some(kind) => format!("this token may not submit tasks of kind {kind:?}"),
                None => "this token may only submit tasks with a payload.kind it is scoped to".to_string(),
            };
            return Handled::Respond(error(403, &msg));
        }
        let new = NewTask {
            payload: parsed.payload,
            kind: parsed.kind.as_deref(),
            run_at_wall_ms: parsed.run_at_wall_ms,
            queue: parsed.queue.unwrap_or(false),
            timeout_ms: parsed.timeout_ms,
            max_retries: parsed.max_retries,
            idempotency: key.map(|k| (identity.owner_key(), k)),
        };
        let id = match core.submit(io, new) {
            Ok(id) => id,
            Err(SubmitError::NoWorker) => {
                let msg = match parsed.kind.as_deref() {
                    Some(kind) => format!("no connected worker can take tasks of kind {kind:?}"),
                    None => "no connected worker can take this task".to_string(),
                };
                return Handled::Respond(Response::error(503, "no_worker", &msg));
            }
            Err(SubmitError::QueueFull) => {
                let msg = "the queue is full (MAX_PENDING tasks or MAX_PENDING_BYTES of payload already wait)";
                return Handled::Respond(Response::error(429, "queue_full", msg));
            }
        };
        self.answer_submit(core, conn, id, wait, identity)
    }

    /// What a submit answers for task `id`: the task when it is final or the wait ends
    /// (`wait=true`), else 202 `{task_id, status}`.
    fn answer_submit(&self, core: &mut Core, conn: ConnRef, id: TaskId, wait: bool, identity: &Identity) -> Handled {
        if core.task(id).is_none() {
            // The key names a finished task that left memory.
            if wait && core.read_evicted(conn, id, ReadFor::PostWait, identity) {
                return Handled::Held;
            }
            let mut r = Response::json(202, accepted_json(core, id));
            r.lsn = core.task(id).map_or(0, |t| t.stored.lsn);
            return Handled::Respond(r);
        }
        if wait {
            return match core.wait(conn, id, true) {
                Some(r) => Handled::Respond(r),
                None => Handled::Held,
            };
        }
        let mut r = Response::json(202, accepted_json(core, id));
        r.lsn = core.task(id).map_or(0, |t| t.stored.lsn);
        Handled::Respond(r)
    }
}

/// A `POST /tasks/batch` under way: its items are submitted a slice per loop turn, so a batch
/// of a hundred thousand tasks never holds the loop for long.
pub struct Batch {
    body: Vec<u8>,
    /// Offset and length of each item's JSON in `body`.
    items: Vec<(usize, usize)>,
    next: usize,
    out: String,
    lsn: u64,
    identity: Identity,
    /// Cluster mode: the node's key for this batch (0 until its first slice).
    cluster_key: u64,
}

/// Batch items submitted per loop turn, over every batch under way (each slice takes what
/// is left of it; a batch that finds none waits for the next turn).
pub const BATCH_ITEMS_PER_TURN: usize = 4096;

/// Items one batch may hold (the default MAX_PENDING). Its answer is built in memory, about
/// 70 to 250 bytes per item whatever the item's size: without a count limit, a body of tiny
/// items (`[1,1,1,...]`) asks for an answer 40 times its size.
pub const MAX_BATCH_ITEMS: usize = 1_000_000;
const TOO_MANY_ITEMS: &str = "too many items";

#[derive(Deserialize)]
struct BatchBody<'a> {
    #[serde(borrow, default)]
    tasks: Option<BatchItems<'a>>,
}

/// The items of a batch, at most [`MAX_BATCH_ITEMS`] (reading stops at the first one over).
struct BatchItems<'a>(Vec<&'a RawValue>);

impl<'de: 'a, 'a> Deserialize<'de> for BatchItems<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Items<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Items<'a> {
            type Value = BatchItems<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of submit bodies")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<BatchItems<'a>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<&RawValue>()? {
                    if items.len() == MAX_BATCH_ITEMS {
                        return Err(serde::de::Error::custom(TOO_MANY_ITEMS));
                    }
                    items.push(item);
                }
                Ok(BatchItems(items))
            }
        }
        d.deserialize_seq(Items(std::marker::PhantomData))
    }
}

impl Api {
    /// Checks a batch body and finds its items (one pass over the JSON; nothing submitted yet).
    pub fn batch_start(&self, body: Vec<u8>, identity: Identity) -> Result<Box<Batch>, Response> {
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(error(400, "the body must be a JSON object {\"tasks\": [...]}"));
        }
        let items = {
            let parsed: BatchBody = serde_json::from_slice(&body).map_err(|e| {
                if e.to_string().starts_with(TOO_MANY_ITEMS) {
                    error(413, &format!("a batch holds at most {MAX_BATCH_ITEMS} tasks"))
                } else {
                    error(400, &format!("invalid JSON body: {e}"))
                }
            })?;
            let Some(BatchItems(tasks)) = parsed.tasks else {
                return Err(error(400, "tasks is required: an array of submit bodies"));
            };
            let base = body.as_ptr() as usize;
            tasks.iter().map(|raw| (raw.get().as_ptr() as usize - base, raw.get().len())).collect::<Vec<_>>()
        };
        let mut out = String::with_capacity(16 + items.len() * 72);
        out.push_str("{\"tasks\":[");
        Ok(Box::new(Batch { body, items, next: 0, out, lsn: 0, identity, cluster_key: 0 }))
    }

    /// Submits the next slice of a batch, at most `budget` items (which it takes from). `Some`
    /// is the answer once every item is done (or, in cluster mode, `Held` until the database
    /// has them).
    pub fn batch_step(
        &self,
        core: &mut Core,
        io: &mut dyn Io,
        conn: ConnRef,
        batch: &mut Batch,
        budget: &mut usize,
    ) -> Option<Handled> {
        if core.is_cluster() {
            return self.cluster_batch_step(core, conn, batch);
        }
        if batch.next == 0
            && let Some(r) = core.journal_unavailable()
        {
            // (A batch the journal fills under way answers its remaining items one by one.)
            return Some(Handled::Respond(r));
        }
        let end = (batch.next + *budget).min(batch.items.len());
        *budget -= end - batch.next;
        for i in batch.next..end {
            let (off, len) = batch.items[i];
            if i > 0 {
                batch.out.push(',');
            }
            let item = &batch.body[off..off + len];
            match submit_item(core, io, item, &batch.identity, self.max_message_bytes) {
                Ok(id) => {
                    batch.out.push_str("{\"task_id\":\"");
                    push_uuid(&mut batch.out, id);
                    batch.out.push_str("\",\"status\":\"");
                    let task = core.task(id);
                    batch.out.push_str(task.map_or("pending", |t| t.status.as_str()));
                    batch.out.push_str("\"}");
                    batch.lsn = batch.lsn.max(task.map_or(0, |t| t.stored.lsn));
                }
                Err((code, message)) => {
                    batch.out.push_str("{\"error\":\"");
                    batch.out.push_str(code);
                    batch.out.push_str("\",\"message\":");
                    push_json_str(&mut batch.out, &message);
                    batch.out.push('}');
                }
            }
        }
        batch.next = end;
        if end < batch.items.len() {
            return None;
        }
        batch.out.push_str("]}");
        let mut r = Response::json(202, std::mem::take(&mut batch.out).into_bytes());
        r.lsn = batch.lsn;
        Some(Handled::Respond(r))
    }
}

/// One batch item: a submit body (at most `max_bytes`, as a `POST /tasks` body), queued unless
/// it says `"queue": false`.
fn submit_item(
    core: &mut Core,
    io: &mut dyn Io,
    item: &[u8],
    identity: &Identity,
    max_bytes: usize,
) -> Result<TaskId, (&'static str, String)> {
    if item.len() > max_bytes {
        let msg = format!("item of {} bytes is over MAX_MESSAGE_SIZE ({max_bytes} bytes)", item.len());
        return Err(("bad_request", msg));
    }
    if !core.journal_writable() {
        return Err(("journal_unavailable", "the journal cannot write (no space on the disk of DATA_DIR)".to_string()));
    }
    let parsed = parse_submit(item, core.wall_ms).map_err(|m| ("bad_request", m))?;
    if !identity.allows_kind(parsed.kind.as_deref()) {
        let msg = match parsed.kind.as_deref() {
            Some(kind) => format!("this token may not submit tasks of kind {kind:?}"),
            None => "this token may only submit tasks with a payload.kind it is scoped to".to_string(),
        };
        return Err(("forbidden", msg));
    }
    let new = NewTask {
        payload: parsed.payload,
        kind: parsed.kind.as_deref(),
        run_at_wall_ms: parsed.run_at_wall_ms,
        queue: parsed.queue.unwrap_or(true),
        timeout_ms: parsed.timeout_ms,
        max_retries: parsed.max_retries,
        idempotency: None,
    };
    core.submit(io, new).map_err(|e| match e {
        SubmitError::NoWorker => ("no_worker", "no connected worker can take this task".to_string()),
        SubmitError::QueueFull => ("queue_full", "MAX_PENDING tasks are already waiting".to_string()),
    })
}

fn unauthorized() -> Response {
    error(401, "missing or invalid bearer token").with_header("WWW-Authenticate", "Bearer")
}

/// A task a scoped token may not see looks like a task that does not exist.
fn visible(core: &Core, id: TaskId, identity: &Identity) -> bool {
    core.task(id).is_some_and(|t| identity.allows_kind(t.kind.as_deref()))
}

fn cancel(core: &mut Core, io: &mut dyn Io, id: TaskId) -> Response {
    if core.task(id).is_some_and(|t| !t.status.is_final())
        && let Some(r) = core.journal_unavailable()
    {
        return r;
    }
    let status = match core.cancel(io, id) {
        CancelResult::Canceled => 200,
        CancelResult::AlreadyFinal => 409,
        CancelResult::NotFound => return error(404, "no such task"),
    };
    task_json_response(core, id, status)
}

/// The task JSON of `id` (held back until the journal has what it shows).
fn task_json_response(core: &Core, id: TaskId, status: u16) -> Response {
    let mut body = String::new();
    core.write_task_json(id, &mut body);
    let mut r = Response::json(status, body.into_bytes());
    r.lsn = core.task(id).map_or(0, |t| t.stored.lsn);
    r
}

fn accepted_json(core: &Core, id: TaskId) -> Vec<u8> {
    let mut s = String::with_capacity(80);
    s.push_str("{\"task_id\":\"");
    push_uuid(&mut s, id);
    s.push_str("\",\"status\":\"");
    let status = core.task(id).map(|t| t.status).or_else(|| core.evicted(id).map(|e| e.status));
    s.push_str(status.map_or("pending", |st| st.as_str()));
    s.push_str("\"}");
    s.into_bytes()
}

/// Checks the WebSocket handshake headers (the token was checked by `precheck`) and returns
/// the `Sec-WebSocket-Accept` value. Public for the `ws_upgrade` fuzz target.
pub fn upgrade(head: &Head) -> Result<String, Response> {
    if head.minor_version == 0 {
        // RFC 6455 §4.1: the opening handshake is an HTTP/1.1 request.
        return Err(error(400, "a WebSocket upgrade needs HTTP/1.1"));
    }
    if !head.upgrade_websocket || !head.connection_upgrade {
        return Err(error(426, "/ws needs a WebSocket upgrade (Connection: Upgrade, Upgrade: websocket)")
            .with_header("Upgrade", "websocket"));
    }
    if head.ws_version.as_deref() != Some("13") {
        return Err(
            error(426, "unsupported Sec-WebSocket-Version (13 is required)").with_header("Sec-WebSocket-Version", "13")
        );
    }
    match head.ws_key.as_deref() {
        Some(key) if valid_ws_key(key) => Ok(tungstenite::handshake::derive_accept_key(key.as_bytes())),
        _ => Err(error(400, "missing or invalid Sec-WebSocket-Key")),
    }
}

/// The key is base64 of 16 bytes: 22 characters and `==`.
pub fn valid_ws_key(key: &str) -> bool {
    key.len() == 24
        && key.ends_with("==")
        && key[..22].bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
}

/// A validated submit body.
#[derive(Debug)]
pub struct Submit<'a> {
    pub payload: &'a RawValue,
    pub kind: Option<Cow<'a, str>>,
    pub run_at_wall_ms: Option<u64>,
    /// As given (`None`: absent; a submit defaults to false, a batch item to true).
    pub queue: Option<bool>,
    pub timeout_ms: Option<u64>,
    pub max_retries: Option<u32>,
}

/// `Some(raw)` when the field is present, even as `null` (an `Option<&RawValue>` would turn a
/// null into `None`, and `"kind": null` must be a 400, not "no kind").
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

#[derive(Deserialize)]
struct SubmitBody<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    payload: Option<&'a RawValue>,
    #[serde(borrow, default)]
    delay: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    run_at: Option<Cow<'a, str>>,
    #[serde(default)]
    queue: Option<bool>,
    #[serde(borrow, default)]
    timeout: Option<Cow<'a, str>>,
    #[serde(default)]
    max_retries: Option<u32>,
}

#[derive(Deserialize)]
struct KindProbe<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    kind: Option<&'a RawValue>,
}

/// Parses and validates a submit body (SPEC §4). The error is the 400 message.
pub fn parse_submit(body: &[u8], wall_ms: u64) -> Result<Submit<'_>, String> {
    if body.is_empty() {
        return Err("empty body: expected a JSON object with a payload".into());
    }
    // serde would also accept an array as a struct; the body must be an object.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => "the body must be a JSON object with a payload".into(),
            Err(e) => format!("invalid JSON body: {e}"),
        });
    }
    let raw: SubmitBody = serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
    let payload = match raw.payload {
        Some(p) if p.get() != "null" => p,
        _ => return Err("payload is required and must not be null".into()),
    };
    let kind = if payload.get().starts_with('{') {
        let probe: KindProbe = serde_json::from_str(payload.get()).map_err(|e| format!("invalid payload: {e}"))?;
        match probe.kind {
            None => None,
            Some(k) if k.get().starts_with('"') => {
                let kind =
                    serde_json::from_str::<Cow<str>>(k.get()).map_err(|e| format!("invalid payload.kind: {e}"))?;
                if kind.len() > MAX_KIND_BYTES {
                    return Err(format!("payload.kind is longer than {MAX_KIND_BYTES} bytes"));
                }
                Some(kind)
            }
            Some(_) => return Err("payload.kind must be a string".into()),
        }
    } else {
        None
    };
    if kind.as_deref().is_some_and(|k| k.len() > MAX_KIND_BYTES) {
        return Err(format!("payload.kind is longer than {MAX_KIND_BYTES} bytes"));
    }
    let run_at_wall_ms = match (raw.delay, raw.run_at) {
        (Some(_), Some(_)) => return Err("give either delay or run_at, not both".into()),
        (Some(delay), None) => {
            let ms = parse_duration_ms(&delay).map_err(|e| format!("invalid delay {delay:?}: {e}"))?;
            if ms > MAX_SCHEDULE_AHEAD_MS {
                return Err(format!("delay {delay:?} is more than 366 days"));
            }
            Some(wall_ms + ms)
        }
        (None, Some(at)) => {
            let ms = crate::timefmt::parse_rfc3339_ms(&at).map_err(|e| format!("invalid run_at {at:?}: {e}"))?;
            if ms.saturating_sub(wall_ms) > MAX_SCHEDULE_AHEAD_MS {
                return Err(format!("run_at {at:?} is more than 366 days ahead"));
            }
            Some(ms)
        }
        (None, None) => None,
    };
    let timeout_ms = match raw.timeout {
        Some(t) => {
            let ms = parse_duration_ms(&t).map_err(|e| format!("invalid timeout {t:?}: {e}"))?;
            if ms > MAX_TASK_TIMEOUT_MS {
                return Err(format!("timeout {t:?} is more than 24h"));
            }
            Some(ms)
        }
        None => None,
    };
    Ok(Submit { payload, kind, run_at_wall_ms, queue: raw.queue, timeout_ms, max_retries: raw.max_retries })
}

/// Decodes `%XX` and `+` in a query value; invalid escapes are kept as they are.
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_submit(body: &str, expected: Result<(Option<&str>, Option<u64>, bool), &str>) {
        let got = parse_submit(body.as_bytes(), 1_000)
            .map(|s| (s.kind.map(|k| k.into_owned()), s.run_at_wall_ms, s.queue.unwrap_or(false)));
        match (&got, &expected) {
            (Ok(g), Ok(e)) => assert_eq!((g.0.as_deref(), g.1, g.2), *e, "{body}"),
            (Err(g), Err(e)) => assert!(g.contains(e), "{body}: error {g:?} should mention {e:?}"),
            _ => panic!("{body}: got {got:?}, expected {expected:?}"),
        }
    }

    #[test]
    fn submit_bodies() {
        check_submit(r#"{"payload":{"x":1}}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":{"kind":"http","spec":{}}}"#, Ok((Some("http"), None, false)));
        check_submit(r#"{"payload":{"kind":"h\u0074tp"}}"#, Ok((Some("http"), None, false)));
        check_submit(r#"{"payload":[1,2]}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":"text"}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":0,"queue":true}"#, Ok((None, None, true)));
        check_submit(r#"{"payload":1,"delay":"2s"}"#, Ok((None, Some(3_000), false)));
        check_submit(r#"{"payload":1,"run_at":"1970-01-01T00:00:05Z"}"#, Ok((None, Some(5_000), false)));
        check_submit(r#"{"payload":1,"unknown":true}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":null}"#, Err("payload is required"));
        check_submit(r#"{}"#, Err("payload is required"));
        check_submit("", Err("empty body"));
        check_submit("not json", Err("invalid JSON"));
        check_submit(r#"{"payload":{"kind":5}}"#, Err("payload.kind must be a string"));
        check_submit(r#"{"payload":{"kind":null}}"#, Err("payload.kind must be a string"));
        let longest = format!(r#"{{"payload":{{"kind":"{}"}}}}"#, "k".repeat(MAX_KIND_BYTES));
        check_submit(&longest, Ok((Some(&"k".repeat(MAX_KIND_BYTES)), None, false)));
        let over = format!(r#"{{"payload":{{"kind":"{}é"}}}}"#, "k".repeat(MAX_KIND_BYTES - 1));
        check_submit(&over, Err("longer than 128 bytes"));
        check_submit(r#"{"payload":1,"delay":"1s","run_at":"2030-01-01T00:00:00Z"}"#, Err("not both"));
        check_submit(r#"{"payload":1,"delay":"soon"}"#, Err("invalid delay"));
        check_submit(r#"{"payload":1,"run_at":"tomorrow"}"#, Err("invalid run_at"));
        check_submit(r#"{"payload":1,"timeout":"-1s"}"#, Err("invalid timeout"));
        check_submit(r#"{"payload":1,"max_retries":-1}"#, Err("invalid JSON"));
        check_submit(r#"{"payload":1,"queue":"yes"}"#, Err("invalid JSON"));
        check_submit(r#"[1]"#, Err("must be a JSON object"));
        check_submit(r#"  {"payload":1}"#, Ok((None, None, false)));
    }

    #[test]
    fn unbounded_kind_timeout_and_schedule_are_accepted() {
        // Issue 10 #10: a 1 MiB kind was pinned as a routing key, a run_at in year 9999 held a
        // pending slot forever and a 100-year timeout never ended. Limits are inclusive.
        let k128 = "k".repeat(128);
        check_submit(&format!(r#"{{"payload":{{"kind":"{k128}"}}}}"#), Ok((Some(&k128), None, false)));
        check_submit(&format!(r#"{{"payload":{{"kind":"{k128}x"}}}}"#), Err("longer than 128 bytes"));
        check_submit(&format!(r#"{{"payload":{{"kind":"{}"}}}}"#, "k".repeat(1 << 20)), Err("longer than 128 bytes"));
        check_submit(r#"{"payload":1,"timeout":"24h"}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":1,"timeout":"24h1ms"}"#, Err("more than 24h"));
        check_submit(r#"{"payload":1,"timeout":"876000h"}"#, Err("more than 24h"));
        check_submit(r#"{"payload":1,"delay":"8784h"}"#, Ok((None, Some(1_000 + MAX_SCHEDULE_AHEAD_MS), false)));
        check_submit(r#"{"payload":1,"delay":"8784h1s"}"#, Err("more than 366 days"));
        check_submit(r#"{"payload":1,"run_at":"9999-12-31T00:00:00Z"}"#, Err("more than 366 days ahead"));
        let wall = 1_700_000_000_000;
        let at = |ms: u64| {
            let mut s = String::new();
            crate::timefmt::write_rfc3339_ms(&mut s, ms);
            format!(r#"{{"payload":1,"run_at":"{s}"}}"#)
        };
        assert!(parse_submit(at(wall + MAX_SCHEDULE_AHEAD_MS).as_bytes(), wall).is_ok());
        assert!(parse_submit(at(wall + MAX_SCHEDULE_AHEAD_MS + 1).as_bytes(), wall).is_err());
        assert!(parse_submit(at(wall - 1_000).as_bytes(), wall).is_ok(), "a past run_at is due at once");
    }

    #[test]
    fn routes() {
        let table: &[(&str, Route)] = &[
            ("/ws", Route::Ws),
            ("/tasks", Route::Tasks),
            ("/tasks/batch", Route::TasksBatch),
            ("/tasks/abc", Route::Task("abc")),
            ("/tasks/", Route::NotFound),
            ("/tasks/a/b", Route::NotFound),
            ("/files/x", Route::File("x")),
            ("/nope", Route::NotFound),
            ("/", Route::NotFound),
        ];
        for (path, expected) in table {
            assert_eq!(Route::of(path), *expected, "{path}");
        }
    }

    #[test]
    fn percent_decoding() {
        for (input, expected) in
            [("a%20b", "a b"), ("a+b", "a b"), ("%zz", "%zz"), ("100%", "100%"), ("%4", "%4"), ("x%41", "xA")]
        {
            assert_eq!(percent_decode(input), expected, "{input}");
        }
    }
}
