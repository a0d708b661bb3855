//! HTTP connections: reading, the request state machine (head, body, held answers), and
//! answers written before the connection closes.

use super::*;

impl Server {
    pub(super) fn read_http(&mut self, r: ConnRef, stop_on_short: bool) {
        loop {
            let Some(conn) = self.conns.get_mut(r) else { return };
            let State::Http(http) = &mut conn.state else { return };
            // The most input the connection may buffer in its phase.
            let cap = match &http.phase {
                Phase::Held { .. }
                | Phase::Download(_)
                | Phase::Stream(_)
                | Phase::Batch { .. }
                | Phase::AuthWait(_) => MAX_HELD_INPUT_BYTES,
                Phase::Body { head, .. } if Route::of(&head.path) == Route::TasksBatch => {
                    // A batch body may be MAX_BATCH_BYTES, but the bodies buffered at once share
                    // a budget: each holds what has arrived and one read more, never what its
                    // head declared (a stalled body must not keep honest ones waiting).
                    let declared = match head.framing {
                        Framing::Length(n) => usize::try_from(n).unwrap_or(usize::MAX),
                        _ => self.cfg.max_batch_bytes,
                    }
                    .saturating_add(BATCH_FRAMING_SLACK_BYTES);
                    let want = http.buf.len().saturating_add(self.scratch.len()).min(declared);
                    if http.batch_reserved < want {
                        if self.batches.grow(r, declared, want) {
                            http.batch_reserved = want;
                        } else if self.batches.wait(r) {
                            // The wait is relay's, not the client's: no 408 meanwhile.
                            conn.deadline_ms = u64::MAX;
                            crate::log!(
                                Level::Debug,
                                "batch body waits for room in the batch budget",
                                client_ip = conn.client_ip
                            );
                        }
                    }
                    http.batch_reserved
                }
                Phase::Upload(up) if up.disk_bytes >= UPLOAD_WINDOW_BYTES => 0,
                Phase::Upload(_) if self.disk.is_full() => {
                    self.disk.wait(r);
                    0
                }
                Phase::Upload(_) => UPLOAD_INPUT_BYTES,
                // Between requests: room for a head and some pipelined requests; more waits in
                // the kernel until these are answered.
                Phase::Idle | Phase::Head => MAX_HEAD_BYTES + MAX_HELD_INPUT_BYTES,
                Phase::Body { .. } => self.http_input_cap,
            };
            let backlog = conn.out.len() - conn.out_pos + conn.spill_bytes;
            let blocked = conn.close_after_flush || backlog > MAX_HTTP_BACKLOG_BYTES || http.buf.len() >= cap;
            if blocked {
                conn.read_more = true;
                return;
            }
            let room = (cap - http.buf.len()).min(self.scratch.len());
            match conn.stream.read(&mut self.scratch[..room]) {
                Ok(0) => {
                    // The peer closed its side (SPEC §10): everything it sent before is still
                    // answered — the requests buffered, an upload, a held answer — then the
                    // connection closes. Nothing more will be read.
                    http.eof = true;
                    conn.read_more = false;
                    self.process_http(r);
                    return;
                }
                Ok(n) => {
                    http.buf.extend_from_slice(&self.scratch[..n]);
                    self.process_http(r);
                    if stop_on_short && n < room {
                        if let Some(conn) = self.conns.get_mut(r) {
                            conn.read_more = false;
                        }
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    conn.read_more = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close_now(r, "read error");
                    return;
                }
            }
        }
    }

    /// Handles every complete request in the connection's buffer, in order.
    pub(super) fn process_http(&mut self, r: ConnRef) {
        for _ in 0..MAX_ITEMS_PER_TURN {
            if !self.step_http(r) {
                self.after_half_close(r);
                return;
            }
        }
        // A turn's worth done; the rest next turn.
        self.again.push(r);
    }

    /// After the peer half-closed: once every request it sent is answered (or can never be
    /// complete), finish the connection.
    fn after_half_close(&mut self, r: ConnRef) {
        let disk_full = self.disk.is_full();
        let journal_full = self.journal_full();
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &conn.state else { return };
        if !http.eof || conn.close_after_flush || conn.pending_out() > MAX_HTTP_BACKLOG_BYTES {
            return;
        }
        match &http.phase {
            // The answer is under way; when it is done the buffer is looked at again.
            Phase::Held { .. } | Phase::Download(_) | Phase::Stream(_) | Phase::Batch { .. } | Phase::AuthWait(_) => {}
            // A whole submit held back until the journal catches up (`journal_blocked`).
            Phase::Body { head, .. }
                if journal_full && matches!(Route::of(&head.path), Route::Tasks | Route::TasksBatch) => {}
            Phase::Upload(up) if up.finishing || up.disk_bytes >= UPLOAD_WINDOW_BYTES || disk_full => {}
            Phase::Upload(_) => {
                self.respond_and_close(r, crate::http::error(400, "the connection was closed before the upload ended"));
            }
            // What is left in the buffer (if anything) can never become a whole request.
            Phase::Idle | Phase::Head | Phase::Body { .. } => {
                if conn.pending_out() == 0 {
                    self.close_now(r, "peer closed");
                } else {
                    conn.close_after_flush = true;
                    mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
                }
            }
        }
    }

    /// One step of the HTTP state machine. `true` if it made progress and may continue.
    pub(super) fn step_http(&mut self, r: ConnRef) -> bool {
        let now = self.now_ms;
        let journal_full = self.journal_full();
        self.count_out(r);
        let pressure = self.output_pressure();
        let Some(conn) = self.conns.get_mut(r) else { return false };
        // Answers wait while this client has not read the earlier ones: beyond its backlog, or,
        // when OUTPUT_MEMORY is used up, while it has any (SPEC §10: bounded as a whole).
        let backlog = conn.pending_out();
        if conn.close_after_flush || backlog > MAX_HTTP_BACKLOG_BYTES || (pressure && backlog > 0) {
            return false;
        }
        let State::Http(http) = &mut conn.state else { return false };
        match &mut http.phase {
            Phase::Held { .. } | Phase::Download(_) | Phase::Stream(_) => false,
            Phase::Upload(_) => self.step_upload(r),
            Phase::Batch { .. } => self.step_batch(r),
            Phase::Idle | Phase::Head => {
                if http.buf.is_empty() {
                    return false;
                }
                if matches!(http.phase, Phase::Idle) {
                    http.phase = Phase::Head;
                    let at = now + self.cfg.header_timeout_ms;
                    self.set_deadline(r, at);
                    return true;
                }
                let Some(end) = http::find_head_end(&http.buf, http.scanned) else {
                    if !http::could_be_request(&http.buf) {
                        self.respond_and_close(r, crate::http::error(400, "not an HTTP/1.x request"));
                    } else if http.buf.len() > MAX_HEAD_BYTES {
                        self.respond_and_close(r, crate::http::error(431, "request head over 16 KiB"));
                    } else {
                        http.scanned = http.buf.len();
                    }
                    return false;
                };
                http.scanned = 0;
                let head = match http::parse_head(&http.buf, end) {
                    Ok(h) => h,
                    Err(e) => {
                        let status = e.status();
                        let msg = e.to_string();
                        self.respond_and_close(r, crate::http::error(status, &msg));
                        return false;
                    }
                };
                http.buf.drain(..end);
                http.requests += 1;
                conn.client_ip = self.cfg.trusted_proxies.client_ip(
                    conn.peer_ip,
                    head.forwarded_for.as_deref(),
                    head.real_ip.as_deref(),
                );
                self.start_request(r, head)
            }
            // Woken by `resume_auth_waiters`, not by input.
            Phase::AuthWait(_) => false,
            Phase::Body { head, chunked, .. } => {
                if journal_full
                    && head.method == Method::Post
                    && matches!(Route::of(&head.path), Route::Tasks | Route::TasksBatch)
                {
                    // Backpressure: the disk is behind; this submit waits (`on_journal` resumes it).
                    // The wait is relay's, not the client's: no 408 meanwhile.
                    self.journal_blocked.push(r);
                    self.set_deadline(r, u64::MAX);
                    return false;
                }
                let body = match head.framing {
                    Framing::Empty => Vec::new(),
                    Framing::Length(n) => {
                        let n = n as usize;
                        if http.buf.len() < n {
                            return false;
                        }
                        let rest = http.buf.split_off(n);
                        std::mem::replace(&mut http.buf, rest)
                    }
                    Framing::Chunked => {
                        let limit = self.api.body_limit(Route::of(&head.path)) as usize;
                        let Some(state) = chunked.as_mut() else { return false };
                        let (decoder, decoded) = &mut **state;
                        match decoder.decode(&http.buf, decoded, limit) {
                            Ok(used) => {
                                http.buf.drain(..used);
                            }
                            Err(http::ChunkError::TooLarge) => {
                                let msg = format!("body is over the limit of {limit} bytes");
                                self.respond_and_close(r, crate::http::error(413, &msg));
                                return false;
                            }
                            Err(http::ChunkError::Malformed(why)) => {
                                self.respond_and_close(
                                    r,
                                    crate::http::error(400, &format!("malformed chunked body: {why}")),
                                );
                                return false;
                            }
                        }
                        if !decoder.is_done() {
                            return false;
                        }
                        std::mem::take(decoded)
                    }
                };
                let Phase::Body { head, identity, .. } = std::mem::replace(&mut http.phase, Phase::Idle) else {
                    return false;
                };
                if Route::of(&head.path) == Route::TasksBatch
                    && let Some(identity) = identity
                {
                    // The body is parsed into the batch: the buffered bytes are free again.
                    self.release_batch(r);
                    let Some(State::Http(http)) = self.conns.get_mut(r).map(|c| &mut c.state) else { return false };
                    match self.api.batch_start(body, identity) {
                        Ok(batch) => {
                            http.phase = Phase::Batch { batch, keep_alive: head.keep_alive };
                            self.set_deadline(r, u64::MAX);
                        }
                        Err(response) => {
                            // Its body is read already: nothing of it is left to skip.
                            let mut head = head;
                            head.framing = Framing::Empty;
                            self.answer_early(r, &head, response);
                        }
                    }
                    return true;
                }
                self.complete_request(r, &head, identity.as_ref(), &body);
                true
            }
        }
    }

    /// Gives back the batch budget a connection holds; wakes those waiting for it.
    pub(super) fn release_batch(&mut self, r: ConnRef) {
        if let Some(State::Http(http)) = self.conns.get_mut(r).map(|c| &mut c.state) {
            http.batch_reserved = 0;
        }
        let woken = self.batches.release(r);
        if !woken.is_empty() {
            // Woken bodies may still be on their way: their clock starts again.
            let at = self.now_ms + self.cfg.header_timeout_ms;
            for w in woken {
                self.set_deadline(w, at);
                self.again.push(w);
            }
        }
    }

    /// Submits the next slice of a batch; its answer once every item is in.
    fn step_batch(&mut self, r: ConnRef) -> bool {
        if self.batch_budget == 0 {
            // This turn's batch items are used up: the next slice next turn.
            self.again.push(r);
            return false;
        }
        if self.journal_full() {
            // Backpressure holds for batches under way too: the disk is behind, the next slice
            // waits (`on_journal` resumes it).
            self.journal_blocked.push(r);
            return false;
        }
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        let Phase::Batch { mut batch, keep_alive } = std::mem::replace(&mut http.phase, Phase::Idle) else {
            return false;
        };
        let mut budget = self.batch_budget;
        let answer = {
            let (mut wire, core, api) = self.wire_and_api();
            api.batch_step(core, &mut wire, r, &mut batch, &mut budget)
        };
        self.batch_budget = budget;
        let durable = self.core.store.durable_lsn();
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        let response = match answer {
            None => {
                http.phase = Phase::Batch { batch, keep_alive };
                // The next slice next turn, after others had theirs.
                self.again.push(r);
                return false;
            }
            Some(Handled::Respond(response)) => response,
            Some(_) => {
                // Cluster mode: answered when the database has every item.
                http.phase = Phase::Held {
                    keep_alive,
                    head_only: false,
                    http11: true,
                    method: Method::Post,
                    path: "/tasks/batch".into(),
                };
                return false;
            }
        };
        self.core.metrics.http_request(response.status);
        let close = !keep_alive || self.shutdown_started;
        put_response(conn, r, response, close, false, false, durable, &mut self.gated, &self.date.1);
        conn.close_after_flush |= close;
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
        true
    }

    /// A parsed head: check it (auth may have to wait for the token registry), then start
    /// the body, an upload or a download. `true` if the connection may go on.
    pub(super) fn start_request(&mut self, r: ConnRef, head: Head) -> bool {
        let identity = match self.api.precheck(&head, self.core.wall_ms) {
            Ok(identity) => identity,
            Err(Refused::Answer(response)) => {
                self.answer_early(r, &head, response);
                return true;
            }
            Err(Refused::RegistryLoading) => {
                // The token registry changed and is being read off the loop: this request is
                // checked against the new version (SPEC §6: a revoke holds from the next
                // request). `resume_auth_waiters` brings it back.
                if let Some(phase) = self.http_phase(r) {
                    *phase = Phase::AuthWait(Box::new(head));
                    self.auth_waiters.push(r);
                }
                return false;
            }
        };
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        match Route::of(&head.path) {
            Route::Files => return self.start_upload(r, head),
            Route::File(id) => {
                let id = crate::tasks::parse_id(id);
                return self.start_download(r, head, id);
            }
            _ => {}
        }
        let body_ready = match head.framing {
            Framing::Empty => true,
            Framing::Length(n) => http.buf.len() as u64 >= n,
            Framing::Chunked => false,
        };
        if head.expect_continue && !body_ready && head.minor_version == 1 {
            conn.out.extend_from_slice(CONTINUE_100);
            mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        }
        let chunked = (head.framing == Framing::Chunked).then(|| Box::new((ChunkedDecoder::default(), Vec::new())));
        if let Framing::Length(n) = head.framing {
            let wanted = (n as usize).min(self.http_input_cap);
            http.buf.reserve(wanted.saturating_sub(http.buf.len()));
        }
        http.phase = Phase::Body { head: Box::new(head), identity, chunked };
        true
    }

    /// The token registry's new version is in: requests that waited on it are checked again.
    pub(super) fn resume_auth_waiters(&mut self) {
        for r in std::mem::take(&mut self.auth_waiters) {
            let Some(phase) = self.http_phase(r) else { continue };
            if !matches!(phase, Phase::AuthWait(_)) {
                continue;
            }
            let Phase::AuthWait(head) = std::mem::replace(phase, Phase::Head) else { continue };
            if self.start_request(r, *head) {
                self.again.push(r);
            }
        }
    }

    /// The head alone decided the answer. The connection stays usable only if the body (if
    /// any) is already here to be skipped.
    pub(super) fn answer_early(&mut self, r: ConnRef, head: &Head, response: Response) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let body_skipped = match head.framing {
            Framing::Empty => true,
            Framing::Length(n) if http.buf.len() as u64 >= n => {
                http.buf.drain(..n as usize);
                true
            }
            _ => false,
        };
        let close = !body_skipped || !head.keep_alive || self.shutdown_started;
        self.core.metrics.http_request(response.status);
        crate::log!(
            Level::Debug,
            "request",
            method = format!("{:?}", head.method),
            path = head.path,
            status = response.status,
            client_ip = conn.client_ip
        );
        if close {
            http.buf.clear();
            conn.close_after_flush = true;
        }
        http.phase = Phase::Idle;
        write_response(conn, response, close, head.method == Method::Head, &self.date.1);
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
    }

    pub(super) fn complete_request(&mut self, r: ConnRef, head: &Head, identity: Option<&Identity>, body: &[u8]) {
        let open = self.conns.len();
        let handled = {
            let (mut wire, core, api) = self.wire_and_api();
            api.handle(core, &mut wire, r, head, identity, body, open)
        };
        let durable = self.core.store.durable_lsn();
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let client_ip = conn.client_ip;
        match handled {
            Handled::Respond(response) => {
                self.core.metrics.http_request(response.status);
                crate::log!(
                    Level::Debug,
                    "request",
                    method = format!("{:?}", head.method),
                    path = head.path,
                    status = response.status,
                    client_ip = client_ip
                );
                let close = !head.keep_alive || response.close || self.shutdown_started;
                put_response(
                    conn,
                    r,
                    response,
                    close,
                    head.method == Method::Head,
                    head.minor_version >= 1,
                    durable,
                    &mut self.gated,
                    &self.date.1,
                );
                conn.close_after_flush |= close;
                mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
                let at = self.now_ms + self.cfg.idle_timeout_ms;
                self.set_deadline(r, at);
            }
            Handled::Held => {
                http.phase = Phase::Held {
                    keep_alive: head.keep_alive,
                    head_only: head.method == Method::Head,
                    http11: head.minor_version >= 1,
                    method: head.method,
                    path: head.path.as_str().into(),
                };
                self.set_deadline(r, u64::MAX);
            }
            Handled::Upgrade { accept_key } => self.upgrade(r, &accept_key, client_ip),
        }
    }

    /// Writes the next piece of a streamed answer (`crate::stream`) once its output has
    /// drained to LOW_WATER_BYTES (under OUTPUT_MEMORY pressure: all of it), and ends the answer
    /// after the last. One piece a call: the next waits for a flush (the next turn at the
    /// earliest), so a long answer shares the loop with everyone else.
    pub(super) fn pump_stream(&mut self, r: ConnRef) {
        let low_water = if self.output_pressure() { 0 } else { crate::stream::LOW_WATER_BYTES };
        let Some(conn) = self.conns.get_mut(r) else { return };
        let pending = conn.pending_out();
        let State::Http(http) = &mut conn.state else { return };
        let Phase::Stream(st) = &mut http.phase else { return };
        if pending > low_water {
            return;
        }
        let mut piece = String::with_capacity(crate::stream::PIECE_BYTES + 1024);
        self.core.store.stream_piece(&mut st.body, &mut piece);
        let (done, keep_alive) = (st.body.done, st.keep_alive);
        if st.body.chunked {
            crate::stream::push_chunk(&mut conn.out, piece.as_bytes());
            if done {
                conn.out.extend_from_slice(crate::stream::LAST_CHUNK);
            }
        } else {
            conn.out.extend_from_slice(piece.as_bytes());
        }
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        self.count_out(r);
        if done {
            self.finish_transfer(r, keep_alive);
        } else {
            let at = self.now_ms + self.cfg.idle_timeout_ms;
            self.set_deadline(r, at);
        }
    }

    pub(super) fn respond_and_close(&mut self, r: ConnRef, response: Response) {
        self.release_batch(r);
        let Some(conn) = self.conns.get_mut(r) else { return };
        self.core.metrics.http_request(response.status);
        write_response(conn, response, true, false, &self.date.1);
        if let State::Http(http) = &mut conn.state {
            http.buf = Vec::new();
            let phase = std::mem::replace(&mut http.phase, Phase::Idle);
            end_transfer(&self.store, &mut self.transfers, &phase);
        }
        conn.close_after_flush = true;
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        // A client that never reads this answer is closed once its output is stuck for
        // IDLE_TIMEOUT (phase Idle), like any other.
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
    }

    pub(super) fn drain_closing(&mut self, r: ConnRef) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        loop {
            match conn.stream.read(&mut self.scratch) {
                Ok(0) => {
                    if conn.pending_out() == 0 {
                        self.close_now(r, "closed");
                    }
                    return;
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close_now(r, "read error while closing");
                    return;
                }
            }
        }
    }
}
