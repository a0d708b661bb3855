//! Worker WebSockets: the upgrade, reading frames through tungstenite, and closing.

use super::*;

impl Server {
    pub(super) fn upgrade(&mut self, r: ConnRef, accept_key: &str, client_ip: IpAddr) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let leftover = std::mem::take(&mut http.buf);
        conn.out.extend_from_slice(b"HTTP/1.1 101 Switching Protocols\r\nDate: ");
        conn.out.extend_from_slice(&self.date.1);
        conn.out.extend_from_slice(
            format!("\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept_key}\r\n\r\n")
                .as_bytes(),
        );
        self.core.metrics.http_request(101);
        let now = self.now_ms;
        conn.state = State::Ws(Box::new(Ws {
            ctx: ws_context(leftover, self.cfg.max_message_bytes),
            last_seen_ms: now,
            next_ping_ms: now + self.cfg.ping_interval_ms,
            starved: false,
            peer_closed: false,
        }));
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        conn.deadline_ms = u64::MAX;
        let at = now + self.cfg.ping_interval_ms.min(self.cfg.pong_wait_ms);
        self.set_deadline(r, at);
        {
            let (mut wire, core) = self.wire();
            core.worker_connected(&mut wire, r, client_ip);
        }
        // Frames that arrived with the upgrade request are already buffered: read them now.
        self.read_ws(r, false);
    }

    /// Reads a worker's socket into the scratch buffer and lets tungstenite parse frames from
    /// there: one syscall per batch of frames rather than one per refill of tungstenite's small
    /// buffer. With `stop_on_short`, a read that did not fill the buffer counts as draining the
    /// socket (edge-triggered epoll reports data that arrives later as a new event).
    pub(super) fn read_ws(&mut self, r: ConnRef, stop_on_short: bool) {
        let now = self.now_ms;
        let mut texts = Vec::new();
        let mut close: Option<(CloseCode, &'static str)> = None;
        let mut gone = false;
        let peer_closed: bool;
        let mut mark: usize;
        let mut more = false;
        let mut blocked = false;
        let session = self.core.is_session_worker(r);
        {
            let Some(conn) = self.conns.get_mut(r) else { return };
            mark = conn.out.len();
            let State::Ws(ws) = &mut conn.state else { return };
            // (A session worker's output from here on waits until its messages are handled and
            // gated below: nothing they cause may leave before what they journal is durable.)
            if session {
                conn.hold_from = Some(mark);
            }
            // First what tungstenite already holds (frames that came with the upgrade), then
            // the socket.
            let mut n = 0;
            let mut reads = 0;
            loop {
                // A worker that does not read what relay writes (its pongs included) is not
                // read either until its output drains: `flush` brings it back. Its frames then
                // wait in the kernel, and PONG_WAIT ends it if it never reads again.
                if conn.out.len() - conn.out_pos > self.max_ws_out_bytes {
                    blocked = true;
                    break;
                }
                let mut io = WsIo { input: &self.scratch[..n], pos: 0, out: &mut conn.out };
                loop {
                    match ws.ctx.read(&mut io) {
                        Ok(Message::Text(text)) => texts.push(text),
                        Ok(Message::Binary(_)) => {
                            close = Some((CloseCode::Unsupported, "binary frames are not accepted"));
                            break;
                        }
                        Ok(Message::Close(_)) => ws.peer_closed = true, // (reply queued)
                        Ok(_) => {}                                     // ping (answered by tungstenite), pong
                        Err(tungstenite::Error::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(tungstenite::Error::Capacity(_)) => {
                            close = Some((CloseCode::Size, "message over MAX_MESSAGE_SIZE"));
                            break;
                        }
                        Err(tungstenite::Error::Utf8(_)) => {
                            close = Some((CloseCode::Invalid, "text frame is not valid UTF-8"));
                            break;
                        }
                        Err(tungstenite::Error::Protocol(_)) => {
                            close = Some((CloseCode::Protocol, "WebSocket protocol error"));
                            break;
                        }
                        Err(_) => {
                            gone = true;
                            break;
                        }
                    }
                }
                if close.is_some() || gone || (stop_on_short && reads > 0 && n < self.scratch.len()) {
                    break;
                }
                if reads == MAX_READS_PER_TURN {
                    more = true;
                    break;
                }
                match conn.stream.read(&mut self.scratch) {
                    Ok(0) => {
                        gone = true;
                        break;
                    }
                    Ok(got) => {
                        n = got;
                        reads += 1;
                        ws.last_seen_ms = now;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => n = 0,
                    Err(_) => {
                        gone = true;
                        break;
                    }
                }
            }
            conn.read_more = more || blocked;
            peer_closed = ws.peer_closed;
            if conn.pending_out() > 0 {
                mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
            }
        }
        let before = self.journal_lsn();
        for text in texts {
            let (mut wire, core) = self.wire();
            core.worker_message(&mut wire, r, text.as_str());
        }
        // What a session worker's messages had written (a result's end) is durable (on disk,
        // or committed) before relay says anything more to it — the pongs of this read
        // included: a worker forgets a result once a pong says relay read it, so a crash must
        // not lose it after that (SPEC §12).
        let after = self.journal_lsn();
        if let Some(held) = self.conns.get_mut(r).and_then(|c| c.hold_from.take()) {
            mark = held; // (where `mark` is now, if written bytes were dropped meanwhile)
        }
        if after > before && self.core.is_session_worker(r) {
            let durable = self.core.store.durable_lsn();
            if let Some(conn) = self.conns.get_mut(r)
                && conn.gate_from(mark, after, durable)
            {
                self.gated.conns.push(r);
            }
            if after > durable {
                self.gated.want = self.gated.want.max(after);
            }
        }
        if let Some((code, reason)) = close {
            self.close_ws(r, code, reason);
        } else if gone {
            // Closed (after a close handshake, whose reply is already queued) or reset.
            if peer_closed {
                let (mut wire, core) = self.wire();
                core.worker_closed(&mut wire, r, "connection closed");
            } else {
                self.worker_gone(r, "connection lost");
            }
            self.finish_after_flush(r);
        } else if more {
            self.again.push(r);
        }
    }

    /// The store's newest record that [`crate::store::Store::durable_lsn`] counts: the
    /// journal's (0 without one), or in cluster mode the newest session row or attempt end.
    fn journal_lsn(&self) -> u64 {
        match &self.core.store {
            crate::store::Store::Pg(p) => p.newest_record(),
            store => store.mem().and_then(|m| m.journal()).map_or(0, |j| j.lsn()),
        }
    }

    pub(super) fn worker_gone(&mut self, r: ConnRef, why: &str) {
        let (mut wire, core) = self.wire();
        core.worker_disconnected(&mut wire, r, why);
    }

    /// Queues `{"type":"reconnect"}` for a session worker (relay is restarting).
    pub(super) fn send_reconnect(&mut self, r: ConnRef) {
        let (mut wire, _core) = self.wire();
        wire.send_text(r, &["{\"type\":\"reconnect\"}"]);
    }

    /// Sends a close frame, ends the worker, and closes once the frame is written.
    pub(super) fn close_ws(&mut self, r: ConnRef, code: CloseCode, reason: &'static str) {
        if let Some(conn) = self.conns.get_mut(r)
            && let State::Ws(ws) = &mut conn.state
        {
            let mut io = WsIo::writer(&mut conn.out);
            let _ = ws.ctx.close(&mut io, Some(CloseFrame { code, reason: reason.into() }));
            crate::log!(
                Level::Info,
                "closing worker connection",
                client_ip = conn.client_ip,
                code = u16::from(code),
                reason = reason
            );
        }
        {
            let (mut wire, core) = self.wire();
            core.worker_closed(&mut wire, r, reason);
        }
        self.finish_after_flush(r);
    }

    /// No more input will be processed: write what is queued, then shut down and linger.
    pub(super) fn finish_after_flush(&mut self, r: ConnRef) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        conn.state = State::Closing;
        conn.close_after_flush = true;
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        let at = self.now_ms + LINGER_MS;
        conn.deadline_ms = u64::MAX;
        self.set_deadline(r, at);
    }
}
