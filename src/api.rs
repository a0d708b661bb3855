//! The HTTP API: routes, the order of checks (404 → 405 → 401/403 → 400/413 → 503/429), the
//! one submit and batch validation, and the calls into the core — the same for both stores.
//! No sockets: the reactor hands over a parsed head and a complete body and gets back what to
//! do.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::auth::{Auth, Identity, RegistryLoading};
use crate::config::parse_duration_ms;
use crate::dispatch::{Core, Io, NewTask};
use crate::http::{Head, Method, Response, error, percent_decode};
use crate::tasks::{ConnRef, Status, parse_id};

/// Longest accepted `Idempotency-Key`.
const MAX_IDEMPOTENCY_KEY_BYTES: usize = 256;
/// Longest `payload.kind` (SPEC §4): kinds are routing keys the core keeps.
pub const MAX_KIND_BYTES: usize = 128;
/// Longest per-task `timeout` (SPEC §4).
pub const MAX_TASK_TIMEOUT_MS: u64 = 24 * 3_600_000;
/// Furthest a `delay` or `run_at` may reach ahead of now (SPEC §4).
pub const MAX_SCHEDULE_AHEAD_MS: u64 = 366 * 24 * 3_600_000;
/// Most `max_retries` a task may ask for (SPEC §4).
pub const MAX_TASK_RETRIES: u32 = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'a> {
    Ws,
    Tasks,
    TasksBatch,
    /// `POST /tasks/retry` (SPEC §13).
    TasksRetry,
    Task(&'a str),
    /// `/kinds` and `/kinds/{kind}` (the kind percent-encoded): dispatch policies (SPEC §14).
    Kinds,
    Kind(&'a str),
    /// `POST /tasks/{id}/retry`.
    TaskRetry(&'a str),
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
            "/tasks/retry" => Route::TasksRetry,
            "/clients" => Route::Clients,
            "/kinds" => Route::Kinds,
            "/healthz" => Route::Healthz,
            "/metrics" => Route::Metrics,
            "/files" => Route::Files,
            "/ui" | "/ui/" => Route::Ui("index.html"),
            _ => {
                if let Some(id) = path.strip_prefix("/tasks/").filter(|id| !id.is_empty() && !id.contains('/')) {
                    Route::Task(id)
                } else if let Some(k) = path.strip_prefix("/kinds/").filter(|k| !k.is_empty() && !k.contains('/')) {
                    Route::Kind(k)
                } else if let Some(id) = path
                    .strip_prefix("/tasks/")
                    .and_then(|rest| rest.strip_suffix("/retry"))
                    .filter(|id| !id.is_empty() && !id.contains('/'))
                {
                    Route::TaskRetry(id)
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
            Route::Clients | Route::Kinds | Route::Healthz | Route::Metrics | Route::File(_) | Route::Ui(_) => {
                "GET, HEAD"
            }
            Route::Kind(_) => "GET, HEAD, PUT, DELETE",
            Route::Tasks => "GET, HEAD, POST",
            Route::TasksBatch | Route::Files | Route::TasksRetry | Route::TaskRetry(_) => "POST",
            Route::Task(_) => "GET, HEAD, DELETE",
            Route::NotFound => "",
        }
    }

    fn allows(self, method: Method) -> bool {
        match self {
            // HEAD is GET without the body (RFC 9110), except for the WebSocket upgrade.
            Route::Ws => method == Method::Get,
            Route::Clients | Route::Kinds | Route::Healthz | Route::Metrics | Route::File(_) | Route::Ui(_) => {
                matches!(method, Method::Get | Method::Head)
            }
            Route::Kind(_) => matches!(method, Method::Get | Method::Head | Method::Put | Method::Delete),
            Route::Tasks => matches!(method, Method::Get | Method::Head | Method::Post),
            Route::TasksBatch | Route::Files | Route::TasksRetry | Route::TaskRetry(_) => method == Method::Post,
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
            Route::Kinds | Route::Kind(_) => match self.auth.task_api(head.bearer_token(), wall_ms)? {
                None => return Err(self.refused(head, wall_ms).into()),
                Some(Identity::Root) => Some(Identity::Root),
                Some(_) => return Err(error(403, "kind policies need the root API token").into()),
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
            Some(other) if matches!(route, Route::Tasks | Route::Task(_) | Route::TaskRetry(_)) => {
                let msg = format!("invalid wait {:?} (true, false, 1 or 0)", percent_decode(other));
                return Handled::Respond(error(400, &msg));
            }
            Some(_) => false,
        };
        let identity = match route {
            Route::Ws => {
                return match upgrade(head) {
                    Ok(accept_key) => Handled::Upgrade { accept_key },
                    Err(response) => Handled::Respond(response),
                };
            }
            Route::Healthz => return Handled::Respond(core.health()),
            Route::Metrics => {
                let text = core.metrics.render(&core.gauges(connections_open));
                let mut r = Response::json(200, text.into_bytes());
                r.content_type = "text/plain; version=0.0.4; charset=utf-8";
                return Handled::Respond(r);
            }
            Route::Ui(name) => return Handled::Respond(crate::ui::asset(name, head.if_none_match.as_deref())),
            // (the reactor runs batches through `Api::batch_start`; this arm keeps the match whole)
            Route::TasksBatch => return Handled::Respond(error(500, "batch submitted outside its path")),
            Route::Files | Route::File(_) => {
                return Handled::Respond(error(501, "file transfer is not available in this version"));
            }
            Route::NotFound => return Handled::Respond(error(404, "no such endpoint")),
            Route::Clients
            | Route::Kinds
            | Route::Kind(_)
            | Route::Tasks
            | Route::Task(_)
            | Route::TasksRetry
            | Route::TaskRetry(_) => match identity {
                Some(identity) => identity,
                None => return Handled::Respond(unauthorized()),
            },
        };
        // (A store that cannot read answers 503 here; one that cannot write refuses what would
        // write — not an idempotent repeat, not the cancel of a final task — itself.)
        if let Some(r) = core.store.unavailable(false) {
            return Handled::Respond(r);
        }
        let answer = match route {
            Route::Clients => core.clients(io, conn),
            Route::Kinds => core.kind_op(io, conn, crate::flow::KindOp::List),
            Route::Kind(raw) => {
                let Some(kind) = crate::http::percent_decode_segment(raw) else {
                    return Handled::Respond(error(400, "invalid kind: it is not UTF-8"));
                };
                if kind.len() > MAX_KIND_BYTES {
                    return Handled::Respond(error(400, &format!("a kind is at most {MAX_KIND_BYTES} bytes")));
                }
                if let Err(msg) = check_text(&kind) {
                    return Handled::Respond(error(400, &format!("invalid kind: {msg}")));
                }
                let op = match head.method {
                    Method::Put => match crate::flow::Policy::parse(body) {
                        Ok(p) => crate::flow::KindOp::Set(kind.to_string(), Some(p)),
                        Err(msg) => return Handled::Respond(error(400, &msg)),
                    },
                    Method::Delete => crate::flow::KindOp::Set(kind.to_string(), None),
                    _ => crate::flow::KindOp::Get(kind.to_string()),
                };
                core.kind_op(io, conn, op)
            }
            Route::Tasks if head.method != Method::Post => match crate::listing::parse_query(&head.query) {
                Ok(q) => match q.kind.as_deref().map(check_text) {
                    Some(Err(msg)) => Some(error(400, &format!("invalid kind: {msg}"))),
                    _ => core.list(io, conn, &q, identity.scope()),
                },
                Err(msg) => Some(error(400, &msg)),
            },
            Route::Tasks => return self.submit(core, io, conn, head, body, identity, wait),
            Route::TaskRetry(id_text) => {
                let Some(id) = parse_id(id_text) else { return Handled::Respond(error(404, "no such task")) };
                core.rerun(io, conn, id, identity.scope(), wait)
            }
            Route::TasksRetry => match parse_rerun(body) {
                Ok(filter) => core.rerun_many(io, conn, &filter, identity.scope()),
                Err(msg) => Some(error(400, &msg)),
            },
            Route::Task(id_text) => {
                let Some(id) = parse_id(id_text) else { return Handled::Respond(error(404, "no such task")) };
                let payload = match head.query_param("include") {
                    None => false,
                    Some("payload") => true,
                    Some(other) => {
                        let msg = format!("invalid include {:?} (payload)", percent_decode(other));
                        return Handled::Respond(error(400, &msg));
                    }
                };
                match head.method {
                    Method::Delete => core.cancel(io, conn, id, identity.scope()),
                    _ => core.get(io, conn, id, identity.scope(), wait, payload),
                }
            }
            _ => Some(error(404, "no such endpoint")),
        };
        match answer {
            Some(r) => Handled::Respond(r),
            None => Handled::Held,
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
            Some(k) if check_text(k).is_err() => {
                return Handled::Respond(error(400, "Idempotency-Key must not contain U+0000"));
            }
            other => other,
        };
        let owner = identity.owner_key();
        // A keyed submit that will not be stored is answered for the task its key names, if
        // one does: a repeat is answered before its body counts (SPEC §4).
        let refuse = |core: &mut Core, io: &mut dyn Io, r: Response| match key {
            Some(k) => held_or(core.refuse_keyed(io, conn, owner, k, wait, r)),
            None => Handled::Respond(r),
        };
        let parsed = match check_submit(body, core.wall_ms, identity) {
            Ok(p) => p,
            Err((status, _, msg)) => return refuse(core, io, error(status, &msg)),
        };
        let new = NewTask {
            payload: parsed.payload,
            kind: parsed.kind.as_deref(),
            run_at_wall_ms: parsed.run_at_wall_ms,
            queue: parsed.queue.unwrap_or(false),
            timeout_ms: parsed.timeout_ms,
            max_retries: parsed.max_retries,
            retry: parsed.retry,
            priority: parsed.priority,
            submitter: owner,
            key: parsed.key.as_deref().unwrap_or(""),
            idempotency: key.map(|k| (owner, k)),
        };
        held_or(core.submit(io, conn, &new, wait))
    }
}

fn held_or(answer: Option<Response>) -> Handled {
    match answer {
        Some(r) => Handled::Respond(r),
        None => Handled::Held,
    }
}

/// The one submit check, for `POST /tasks` bodies and batch items alike: the body is valid
/// (SPEC §4), its values are ones every store can keep, and the identity may submit its kind.
/// The error is (status, batch item code, message).
fn check_submit<'a>(
    body: &'a [u8],
    wall_ms: u64,
    identity: &Identity,
) -> Result<Submit<'a>, (u16, &'static str, String)> {
    let parsed = parse_submit(body, wall_ms).map_err(|m| (400, "bad_request", m))?;
    if !identity.allows_kind(parsed.kind.as_deref()) {
        let msg = match parsed.kind.as_deref() {
            Some(kind) => format!("this token may not submit tasks of kind {kind:?}"),
            None => "this token may only submit tasks with a payload.kind it is scoped to".to_string(),
        };
        return Err((403, "forbidden", msg));
    }
    Ok(parsed)
}

/// Text every store can keep (PostgreSQL's `text` cannot hold U+0000): checked before it
/// reaches one, so a bad value fails its own request only (SPEC §11).
pub fn check_text(text: &str) -> Result<(), &'static str> {
    if text.contains('\0') { Err("it must not contain U+0000") } else { Ok(()) }
}

/// A `POST /tasks/batch` under way: its items are submitted a slice per loop turn, so a batch
/// of a hundred thousand tasks never holds the loop for long.
pub struct Batch {
    body: Vec<u8>,
    /// Offset and length of each item's JSON in `body`.
    items: Vec<(usize, usize)>,
    next: usize,
    identity: Identity,
    /// The core's key for this batch (0 until its first slice).
    key: u64,
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
        Ok(Box::new(Batch { body, items, next: 0, identity, key: 0 }))
    }

    /// Submits the next slice of a batch, at most `budget` items (which it takes from). `Some`
    /// is the answer once every item is done (or `Held` until the store has them all).
    pub fn batch_step(
        &self,
        core: &mut Core,
        io: &mut dyn Io,
        conn: ConnRef,
        batch: &mut Batch,
        budget: &mut usize,
    ) -> Option<Handled> {
        if batch.key == 0 {
            if let Some(r) = core.store.unavailable(true) {
                return Some(Handled::Respond(r));
            }
            batch.key = core.batch_begin(conn);
        }
        let end = (batch.next + *budget).min(batch.items.len());
        *budget -= end - batch.next;
        for i in batch.next..end {
            let (off, len) = batch.items[i];
            let item = &batch.body[off..off + len];
            match check_item(item, core.wall_ms, &batch.identity, self.max_message_bytes) {
                Ok(parsed) => {
                    let new = NewTask {
                        payload: parsed.payload,
                        kind: parsed.kind.as_deref(),
                        run_at_wall_ms: parsed.run_at_wall_ms,
                        queue: parsed.queue.unwrap_or(true),
                        timeout_ms: parsed.timeout_ms,
                        max_retries: parsed.max_retries,
                        retry: parsed.retry,
                        priority: parsed.priority,
                        submitter: batch.identity.owner_key(),
                        key: parsed.key.as_deref().unwrap_or(""),
                        idempotency: None,
                    };
                    core.batch_item(io, batch.key, Ok(new));
                }
                Err(e) => core.batch_item(io, batch.key, Err(e)),
            }
        }
        batch.next = end;
        if end < batch.items.len() {
            return None;
        }
        Some(held_or(core.batch_end(io, batch.key)))
    }
}

/// One batch item: a submit body (at most `max_bytes`, as a `POST /tasks` body), checked as a
/// submit is; queued unless it says `"queue": false`.
fn check_item<'a>(
    item: &'a [u8],
    wall_ms: u64,
    identity: &Identity,
    max_bytes: usize,
) -> Result<Submit<'a>, (&'static str, String)> {
    if item.len() > max_bytes {
        let msg = format!("item of {} bytes is over MAX_MESSAGE_SIZE ({max_bytes} bytes)", item.len());
        return Err(("bad_request", msg));
    }
    check_submit(item, wall_ms, identity).map_err(|(_, code, msg)| (code, msg))
}

fn unauthorized() -> Response {
    error(401, "missing or invalid bearer token").with_header("WWW-Authenticate", "Bearer")
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
    pub retry: crate::tasks::RetryPolicy,
    /// Seconds of head start (SPEC §14; 0 when absent).
    pub priority: i32,
    /// The fairness key (SPEC §14; `None`: absent or `null`).
    pub key: Option<Cow<'a, str>>,
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
    max_retries: Option<u64>,
    #[serde(borrow, default, deserialize_with = "present")]
    priority: Option<&'a RawValue>,
    /// The fairness key (SPEC §14): a string of at most 128 bytes; raw, so that another type
    /// is a 400 of its own.
    #[serde(borrow, default, deserialize_with = "present")]
    key: Option<&'a RawValue>,
    /// (Raw: serde would take an array for the struct, positionally.)
    #[serde(borrow, default)]
    retry: Option<&'a RawValue>,
}

/// `"retry": {...}` of a submit (SPEC §13). Unknown fields are refused: a misspelt policy must
/// not pass for the default.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RetryBody<'a> {
    #[serde(borrow, default)]
    backoff: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    backoff_max: Option<Cow<'a, str>>,
    #[serde(default)]
    any_worker: Option<bool>,
}

/// The longest `retry.backoff`/`retry.backoff_max` a task may ask for.
const MAX_TASK_BACKOFF_MS: u64 = 24 * 3_600_000;

/// A task's `retry` object, checked (SPEC §13): durations as elsewhere, `0s` allowed for
/// `backoff` (no wait), each at most 24h.
fn parse_retry(raw: Option<&RawValue>) -> Result<crate::tasks::RetryPolicy, String> {
    let Some(raw) = raw.filter(|r| r.get() != "null") else { return Ok(Default::default()) };
    if !raw.get().starts_with('{') {
        return Err("retry must be an object such as {\"backoff\":\"2s\"}".into());
    }
    let raw: RetryBody = serde_json::from_str(raw.get()).map_err(|e| format!("invalid retry: {e}"))?;
    let duration = |name: &str, text: Option<&str>, zero_ok: bool| -> Result<Option<u64>, String> {
        let Some(t) = text else { return Ok(None) };
        let ms = match parse_duration_ms(t) {
            Ok(ms) => ms,
            Err(e) if zero_ok && e == "must be positive" => 0,
            Err(e) => return Err(format!("invalid retry.{name} {t:?}: {e}")),
        };
        if ms > MAX_TASK_BACKOFF_MS {
            return Err(format!("retry.{name} {t:?} is more than 24h"));
        }
        Ok(Some(ms))
    };
    Ok(crate::tasks::RetryPolicy {
        backoff_ms: duration("backoff", raw.backoff.as_deref(), true)?,
        backoff_max_ms: duration("backoff_max", raw.backoff_max.as_deref(), false)?,
        any_worker: raw.any_worker,
    })
}

/// `POST /tasks/retry`'s body (SPEC §13), read field by field: each has one JSON type (a
/// `null` is refused, not taken for "absent"), and an unknown field is a 400.
#[derive(Default)]
struct RerunBody {
    status: Option<String>,
    kind: Option<String>,
    error_contains: Option<String>,
    finished_after: Option<String>,
    limit: Option<u64>,
    dry_run: Option<bool>,
}

/// Checks a `POST /tasks/retry` body: status `failed` (default) or `canceled`, at least one
/// filter besides it, `limit` 1–10,000 (default 1,000). The error is the 400 message.
pub fn parse_rerun(body: &[u8]) -> Result<crate::store::RerunFilter, String> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err("the body must be a JSON object of filters, such as {\"kind\":\"http\"}".into());
    }
    let fields: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
    let mut raw = RerunBody::default();
    for (name, v) in fields {
        let text = || v.as_str().map(str::to_string).ok_or_else(|| format!("{name} must be a string"));
        match name.as_str() {
            "status" => raw.status = Some(text()?),
            "kind" => raw.kind = Some(text()?),
            "error_contains" => raw.error_contains = Some(text()?),
            "finished_after" => raw.finished_after = Some(text()?),
            "limit" => raw.limit = Some(v.as_u64().ok_or("limit must be an integer from 1 to 10000")?),
            "dry_run" => raw.dry_run = Some(v.as_bool().ok_or("dry_run must be true or false")?),
            _ => {
                return Err(format!(
                    "unknown field {name:?} (status, kind, error_contains, finished_after, limit, dry_run)"
                ));
            }
        }
    }
    let status = match raw.status.as_deref() {
        None | Some("failed") => Status::Failed,
        Some("canceled") => Status::Canceled,
        Some(other) => return Err(format!("status {other:?}: only failed or canceled tasks are run again")),
    };
    for (name, v) in [("kind", &raw.kind), ("error_contains", &raw.error_contains)] {
        if let Some(Err(why)) = v.as_deref().map(check_text) {
            return Err(format!("invalid {name}: {why}"));
        }
        if v.as_ref().is_some_and(|t| t.len() > 1024) {
            return Err(format!("{name} is longer than 1024 bytes"));
        }
    }
    let finished_after_ms = match raw.finished_after.as_deref() {
        None => None,
        Some(t) => Some(crate::timefmt::parse_rfc3339_ms(t).map_err(|e| format!("invalid finished_after {t:?}: {e}"))?),
    };
    if raw.kind.is_none() && raw.error_contains.is_none() && finished_after_ms.is_none() {
        return Err("give at least one filter besides status: kind, error_contains or finished_after".into());
    }
    let max = crate::store::MAX_RERUN_LIMIT;
    let limit = match raw.limit {
        None => 1_000,
        Some(n) if (1..=u64::from(max)).contains(&n) => n as u32,
        Some(n) => return Err(format!("limit {n} is outside 1..{max}")),
    };
    Ok(crate::store::RerunFilter {
        status,
        kind: raw.kind,
        error_contains: raw.error_contains,
        finished_after_ms,
        limit,
        dry_run: raw.dry_run.unwrap_or(false),
    })
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
    if let Some(Err(why)) = kind.as_deref().map(check_text) {
        return Err(format!("invalid payload.kind: {why}"));
    }
    let max_retries = match raw.max_retries {
        Some(n) if n > u64::from(MAX_TASK_RETRIES) => {
            return Err(format!("max_retries {n} is more than {MAX_TASK_RETRIES}"));
        }
        n => n.map(|n| n as u32),
    };
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
    // (`null` is absent, as for every optional field of a submit.)
    let priority = match raw.priority {
        Some(p) if p.get() != "null" => parse_priority(p.get())?,
        _ => 0,
    };
    let key = match raw.key.filter(|k| k.get() != "null") {
        Some(k) => Some(parse_key(k.get())?),
        None => None,
    };
    let retry = parse_retry(raw.retry)?;
    Ok(Submit { payload, kind, run_at_wall_ms, queue: raw.queue, timeout_ms, max_retries, priority, retry, key })
}

/// Longest fairness `key` of a submit, in bytes (SPEC §14).
pub const MAX_KEY_BYTES: usize = 128;

/// `"key"`: a JSON string of at most 128 bytes (as decoded); another type → 400.
fn parse_key(text: &str) -> Result<Cow<'_, str>, String> {
    if !text.starts_with('"') {
        return Err("key must be a string".into());
    }
    let key: Cow<str> = serde_json::from_str(text).map_err(|e| format!("invalid key: {e}"))?;
    if key.len() > MAX_KEY_BYTES {
        return Err(format!("key is longer than {MAX_KEY_BYTES} bytes"));
    }
    check_text(&key).map_err(|e| format!("key: {e}"))?;
    Ok(key)
}

/// Most seconds of head start a priority gives (SPEC §14).
pub const MAX_PRIORITY_S: i32 = 86_400;

/// `"priority"`: a JSON integer as written (no fraction, no exponent) within ±86,400.
fn parse_priority(text: &str) -> Result<i32, String> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("priority must be a JSON integer of seconds (-86400..86400)".into());
    }
    match text.parse::<i32>() {
        Ok(n) if (-MAX_PRIORITY_S..=MAX_PRIORITY_S).contains(&n) => Ok(n),
        _ => Err("priority is outside -86400..86400 seconds".into()),
    }
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
        for good in ["0", "-0", "86400", "-86400", "7"] {
            check_submit(&format!(r#"{{"payload":1,"priority":{good}}}"#), Ok((None, None, false)));
        }
        check_submit(r#"{"payload":1,"priority":null}"#, Ok((None, None, false)));
        let long = "k".repeat(MAX_KEY_BYTES);
        for good in ["\"\"", "\"c1\"", "null", &format!("\"{long}\"")] {
            check_submit(&format!(r#"{{"payload":1,"key":{good}}}"#), Ok((None, None, false)));
        }
        for bad in
            ["5", "true", "{}", "[\"a\"]", "\"a\\u0000b\"", &format!("\"{long}k\""), &format!("\"{}\"", "é".repeat(65))]
        {
            check_submit(&format!(r#"{{"payload":1,"key":{bad}}}"#), Err("key"));
        }
        for bad in ["86401", "-86401", "1.0", "1e3", "\"5\"", "true", "1000000000000", "{}"] {
            check_submit(&format!(r#"{{"payload":1,"priority":{bad}}}"#), Err("priority"));
        }
        assert_eq!(parse_submit(br#"{"payload":1,"priority":-30}"#, 0).map(|s| s.priority), Ok(-30));
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
        check_submit(r#"{"payload":1,"max_retries":100}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":1,"max_retries":101}"#, Err("more than 100"));
        check_submit(r#"{"payload":1,"max_retries":3000000000}"#, Err("more than 100"));
        check_submit(
            r#"{"payload":1,"retry":{"backoff":"2s","backoff_max":"1m","any_worker":true}}"#,
            Ok((None, None, false)),
        );
        check_submit(r#"{"payload":1,"retry":{"backoff":"0s"}}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":1,"retry":{}}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":1,"retry":{"backoff":"soon"}}"#, Err("invalid retry.backoff"));
        check_submit(r#"{"payload":1,"retry":{"backoff_max":"0s"}}"#, Err("invalid retry.backoff_max"));
        check_submit(r#"{"payload":1,"retry":{"backoff":"25h"}}"#, Err("more than 24h"));
        check_submit(r#"{"payload":1,"retry":{"any_worker":"yes"}}"#, Err("invalid retry"));
        check_submit(r#"{"payload":1,"retry":{"backof":"1s"}}"#, Err("invalid retry"));
        check_submit(r#"{"payload":1,"retry":true}"#, Err("retry must be an object"));
        check_submit(r#"{"payload":1,"retry":[null,null]}"#, Err("retry must be an object"));
        check_submit(r#"{"payload":1,"retry":null}"#, Ok((None, None, false)));
        check_submit(r#"{"payload":{"kind":"a\u0000b"}}"#, Err("U+0000"));
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
            ("/tasks/retry", Route::TasksRetry),
            ("/tasks/abc/retry", Route::TaskRetry("abc")),
            ("/tasks//retry", Route::NotFound),
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
}
