//! The routes that differ in cluster mode (SPEC §11): tasks, `/clients` and `/healthz` are the
//! database's, so their answers are held until the turn's transaction replies (or answered
//! 503 at once while the database is unreachable). The checks and their order are those of
//! single-node mode (`api.rs`); only where the answer comes from changes.

use super::*;

/// The kinds an identity may see (`None`: all of them).
fn scope(identity: &Identity) -> Option<Vec<String>> {
    match identity {
        Identity::Root => None,
        Identity::Worker => Some(Vec::new()),
        Identity::Scoped { kinds, .. } => Some(kinds.clone()),
    }
}

impl Api {
    /// `Some` for the routes cluster mode answers differently.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cluster_route(
        &self,
        core: &mut Core,
        conn: ConnRef,
        head: &Head,
        identity: Option<&Identity>,
        body: &[u8],
        route: Route<'_>,
        wait: bool,
    ) -> Option<Handled> {
        let handled = match route {
            Route::Healthz => Handled::Respond(core.cluster_health()),
            Route::Clients => match core.cluster_unavailable() {
                Some(r) => Handled::Respond(r),
                None => {
                    core.cluster_clients(conn);
                    Handled::Held
                }
            },
            Route::Tasks if head.method != Method::Post => {
                let identity = identity?;
                let q = match crate::listing::parse_query(&head.query) {
                    Ok(q) if q.below == u64::MAX => q,
                    Ok(_) => return Some(Handled::Respond(error(400, "invalid cursor (not one of this cluster's)"))),
                    Err(msg) => return Some(Handled::Respond(error(400, &msg))),
                };
                if let Some(r) = core.cluster_unavailable() {
                    return Some(Handled::Respond(r));
                }
                core.cluster_list(conn, &q, scope(identity));
                Handled::Held
            }
            Route::Tasks => self.cluster_submit(core, conn, head, body, identity?, wait),
            Route::Task(id_text) => {
                let identity = identity?;
                let Some(id) = parse_id(id_text) else { return Some(Handled::Respond(error(404, "no such task"))) };
                if let Some(r) = core.cluster_unavailable() {
                    return Some(Handled::Respond(r));
                }
                if head.method == Method::Delete {
                    core.cluster_cancel(conn, id, scope(identity));
                } else {
                    core.cluster_get(conn, id, scope(identity), wait);
                }
                Handled::Held
            }
            _ => return None,
        };
        Some(handled)
    }

    /// `POST /tasks` in cluster mode: the same checks, then the task joins the turn's insert.
    /// A keyed submit that will not be inserted (bad body, no worker, queue full) first asks the
    /// database whether its key names a task: a repeat is answered for that task (SPEC §4).
    fn cluster_submit(
        &self,
        core: &mut Core,
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
        if let Some(r) = core.cluster_unavailable() {
            return Handled::Respond(r);
        }
        let owner = identity.owner_key();
        let refuse = |core: &mut Core, r: Response| match key {
            Some(k) => {
                core.cluster_key_lookup(conn, owner, k, wait, r);
                Handled::Held
            }
            None => Handled::Respond(r),
        };
        let parsed = match parse_submit(body, core.wall_ms) {
            Ok(p) => p,
            Err(msg) => return refuse(core, error(400, &msg)),
        };
        if parsed.kind.as_deref().is_some_and(|k| !crate::cluster::node::storable(k)) {
            return refuse(core, error(400, "payload.kind must not contain U+0000 (cluster mode)"));
        }
        if !identity.allows_kind(parsed.kind.as_deref()) {
            let msg = match parsed.kind.as_deref() {
                Some(kind) => format!("this token may not submit tasks of kind {kind:?}"),
                None => "this token may only submit tasks with a payload.kind it is scoped to".to_string(),
            };
            return refuse(core, error(403, &msg));
        }
        let new = NewTask {
            payload: parsed.payload,
            kind: parsed.kind.as_deref(),
            run_at_wall_ms: parsed.run_at_wall_ms,
            queue: parsed.queue.unwrap_or(false),
            timeout_ms: parsed.timeout_ms,
            max_retries: parsed.max_retries,
            idempotency: key.map(|k| (owner, k)),
        };
        match core.cluster_submit(conn, &new, wait) {
            Ok(_) => Handled::Held,
            Err(SubmitError::NoWorker) => {
                let msg = match parsed.kind.as_deref() {
                    Some(kind) => format!("no connected worker can take tasks of kind {kind:?}"),
                    None => "no connected worker can take this task".to_string(),
                };
                refuse(core, Response::error(503, "no_worker", &msg))
            }
            Err(SubmitError::QueueFull) => {
                let msg = "the queue is full (MAX_PENDING tasks or MAX_PENDING_BYTES of payload already wait)";
                refuse(core, Response::error(429, "queue_full", msg))
            }
        }
    }

    /// A slice of a batch in cluster mode: items are checked and join the turn's insert; the
    /// answer waits until every insert is answered.
    pub(super) fn cluster_batch_step(&self, core: &mut Core, conn: ConnRef, batch: &mut Batch) -> Option<Handled> {
        if batch.cluster_key == 0 {
            if let Some(r) = core.cluster_unavailable() {
                return Some(Handled::Respond(r));
            }
            batch.cluster_key = core.cluster_batch_begin(conn);
        }
        let end = (batch.next + BATCH_ITEMS_PER_TURN).min(batch.items.len());
        for i in batch.next..end {
            let (off, len) = batch.items[i];
            let item = &batch.body[off..off + len];
            let checked = check_item(item, core.wall_ms, &batch.identity);
            match checked {
                Ok(parsed) => {
                    let new = NewTask {
                        payload: parsed.payload,
                        kind: parsed.kind.as_deref(),
                        run_at_wall_ms: parsed.run_at_wall_ms,
                        queue: parsed.queue.unwrap_or(true),
                        timeout_ms: parsed.timeout_ms,
                        max_retries: parsed.max_retries,
                        idempotency: None,
                    };
                    core.cluster_batch_item(batch.cluster_key, Ok(new));
                }
                Err(e) => core.cluster_batch_item(batch.cluster_key, Err(e)),
            }
        }
        batch.next = end;
        if end < batch.items.len() {
            return None;
        }
        Some(match core.cluster_batch_end(batch.cluster_key) {
            Some(r) => Handled::Respond(r),
            None => Handled::Held,
        })
    }
}

/// A batch item's checks (those of [`submit_item`], plus what PostgreSQL text cannot hold).
fn check_item<'a>(item: &'a [u8], wall_ms: u64, identity: &Identity) -> Result<Submit<'a>, (&'static str, String)> {
    let parsed = parse_submit(item, wall_ms).map_err(|m| ("bad_request", m))?;
    if parsed.kind.as_deref().is_some_and(|k| !crate::cluster::node::storable(k)) {
        return Err(("bad_request", "payload.kind must not contain U+0000 (cluster mode)".to_string()));
    }
    if !identity.allows_kind(parsed.kind.as_deref()) {
        let msg = match parsed.kind.as_deref() {
            Some(kind) => format!("this token may not submit tasks of kind {kind:?}"),
            None => "this token may only submit tasks with a payload.kind it is scoped to".to_string(),
        };
        return Err(("forbidden", msg));
    }
    Ok(parsed)
}
