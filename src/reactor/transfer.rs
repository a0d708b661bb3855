//! File transfers: uploads streamed through the multipart parser to the disk thread, and
//! downloads streamed from it; the disk thread's answers.

use super::*;

impl Server {
    // ----- file transfers ----------------------------------------------------------------------

    pub(super) fn end_transfer(&mut self, phase: &Phase) {
        end_transfer(&self.store, &mut self.transfers, phase);
    }

    /// `POST /files` passed its checks: stream the body to the disk thread.
    pub(super) fn start_upload(&mut self, r: ConnRef, head: Head) -> bool {
        if head.framing == Framing::Empty {
            self.answer_early(r, &head, crate::http::error(400, "POST /files needs a multipart body"));
            return true;
        }
        let parse = match UploadParse::new(head.content_type.as_deref(), self.cfg.max_file_bytes) {
            Ok(p) => p,
            Err(UploadError::Bad(msg)) => {
                self.answer_early(r, &head, crate::http::error(400, &msg));
                return true;
            }
            Err(UploadError::TooLarge) => {
                self.answer_early(r, &head, crate::http::error(413, "file over MAX_FILE_SIZE"));
                return true;
            }
        };
        let transfer = self.next_transfer;
        self.next_transfer += 1;
        let file_id = uuid::Uuid::new_v4().as_u128();
        self.transfers.insert(transfer, r);
        self.store.send(Job::Create { t: transfer, file_id });
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        let body_here = matches!(head.framing, Framing::Length(n) if http.buf.len() as u64 >= n);
        if head.expect_continue && !body_here && head.minor_version == 1 {
            conn.out.extend_from_slice(CONTINUE_100);
            mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        }
        let (body_left, chunked) = match head.framing {
            Framing::Length(n) => (n, None),
            _ => (0, Some((ChunkedDecoder::default(), Vec::new()))),
        };
        http.phase = Phase::Upload(Box::new(Upload {
            transfer,
            file_id,
            keep_alive: head.keep_alive,
            parse: Some(parse),
            chunked,
            body_left,
            disk_bytes: 0,
            finishing: false,
        }));
        crate::log!(Level::Debug, "upload started", file_id = uuid_string(file_id), client_ip = conn.client_ip);
        let at = self.now_ms + self.cfg.header_timeout_ms;
        self.set_deadline(r, at);
        true
    }

    /// Feeds buffered body bytes to the upload's parser and its file bytes to the disk.
    pub(super) fn step_upload(&mut self, r: ConnRef) -> bool {
        enum Step {
            Wait,
            Progress,
            Finish(Result<files::Uploaded, UploadError>),
            Fail(UploadError),
        }
        let budget_full = self.disk.is_full();
        let body_limit = self.api.body_limit(crate::api::Route::Files) as usize;
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        let crate::conn::Http { buf, phase, .. } = http;
        let Phase::Upload(up) = phase else { return false };
        if up.finishing || up.disk_bytes >= UPLOAD_WINDOW_BYTES {
            return false;
        }
        if budget_full {
            self.disk.wait(r);
            return false;
        }
        let Some(parse) = up.parse.as_mut() else { return false };
        let mut to_disk = Vec::new();
        let mut used_any = false;
        let step = match &mut up.chunked {
            Some((decoder, decoded)) => {
                // `decoded` only holds what the parser has not taken yet: this bounds one chunk,
                // and the parser bounds the file.
                let fed = match decoder.decode(buf, decoded, body_limit) {
                    Ok(used) => {
                        buf.drain(..used);
                        used_any |= used > 0;
                        parse.feed(decoded, &mut to_disk)
                    }
                    Err(http::ChunkError::TooLarge) => Err(UploadError::TooLarge),
                    Err(_) => Err(UploadError::Bad("malformed chunked body".into())),
                };
                match fed {
                    Err(e) => Step::Fail(e),
                    Ok(used) => {
                        decoded.drain(..used);
                        used_any |= used > 0;
                        if parse.is_done() {
                            decoded.clear(); // the epilogue
                        }
                        if decoder.is_done() {
                            Step::Finish(Ok(files::Uploaded::default()))
                        } else if used_any {
                            Step::Progress
                        } else {
                            Step::Wait
                        }
                    }
                }
            }
            None => {
                let avail = (buf.len() as u64).min(up.body_left) as usize;
                match parse.feed(&buf[..avail], &mut to_disk) {
                    Err(e) => Step::Fail(e),
                    Ok(mut used) => {
                        if parse.is_done() {
                            used = avail; // the epilogue
                        }
                        buf.drain(..used);
                        up.body_left -= used as u64;
                        if up.body_left == 0 {
                            Step::Finish(Ok(files::Uploaded::default()))
                        } else if used > 0 {
                            Step::Progress
                        } else if avail as u64 == up.body_left {
                            // The whole body is here and the parser wants more: no more can
                            // come, so the multipart is malformed (answered now, not at 408).
                            Step::Finish(Ok(files::Uploaded::default()))
                        } else {
                            Step::Wait
                        }
                    }
                }
            }
        };
        let transfer = up.transfer;
        if !to_disk.is_empty() && !matches!(step, Step::Fail(_)) {
            up.disk_bytes += to_disk.len();
            self.disk.take(to_disk.len());
            self.store.send(Job::Write { t: transfer, data: to_disk });
        }
        let step = match step {
            // The body is complete: the parser must have seen its end and a file part.
            Step::Finish(_) => {
                Step::Finish(up.parse.take().map_or(Err(UploadError::Bad("no upload".into())), UploadParse::finish))
            }
            other => other,
        };
        match step {
            Step::Wait => false,
            Step::Progress => {
                let at = self.now_ms + self.cfg.header_timeout_ms;
                self.set_deadline(r, at);
                true
            }
            Step::Finish(Ok(file)) => {
                up.finishing = true;
                let file_id = up.file_id;
                let now = crate::timefmt::wall_ms();
                let meta = FileMeta {
                    file_id: uuid_string(file_id),
                    filename: file.filename,
                    content_type: file.content_type,
                    size: file.size,
                    sha256: file.sha256,
                    created_ms: now,
                    expires_ms: now + self.cfg.blob_ttl_ms,
                };
                self.store.send(Job::Finish { t: transfer, meta });
                self.set_deadline(r, u64::MAX);
                false
            }
            Step::Finish(Err(e)) | Step::Fail(e) => {
                let response = match e {
                    UploadError::TooLarge => {
                        crate::http::error(413, &format!("file over MAX_FILE_SIZE ({} bytes)", self.cfg.max_file_bytes))
                    }
                    UploadError::Bad(msg) => crate::http::error(400, &msg),
                };
                self.respond_and_close(r, response);
                false
            }
        }
    }

    /// `GET`/`HEAD /files/{id}`: ask the disk thread to open the file.
    pub(super) fn start_download(&mut self, r: ConnRef, head: Head, file_id: Option<u128>) -> bool {
        let Some(file_id) = file_id else {
            self.answer_early(r, &head, crate::http::error(404, "no such file"));
            return true;
        };
        if head.framing != Framing::Empty {
            self.answer_early(r, &head, crate::http::error(400, "a file download takes no request body"));
            return true;
        }
        let transfer = self.next_transfer;
        self.next_transfer += 1;
        self.transfers.insert(transfer, r);
        self.store.send(Job::Open { t: transfer, file_id, now_wall_ms: crate::timefmt::wall_ms() });
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        http.phase = Phase::Download(Box::new(Download {
            transfer,
            keep_alive: head.keep_alive,
            head_only: head.method == Method::Head,
            range: head.range.clone(),
            if_range: head.if_range.clone(),
            if_none_match: head.if_none_match.clone(),
            started: false,
            next: 0,
            end: 0,
            reading: false,
        }));
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
        false
    }

    /// Asks for the next chunk of a download once its output has drained enough.
    pub(super) fn pump_download(&mut self, r: ConnRef) {
        // Under OUTPUT_MEMORY pressure the next chunk waits until the last one is written.
        let low_water = if self.output_pressure() { 0 } else { DOWNLOAD_LOW_WATER_BYTES };
        let Some(conn) = self.conns.get_mut(r) else { return };
        let pending = conn.pending_out();
        let State::Http(http) = &mut conn.state else { return };
        let Phase::Download(d) = &mut http.phase else { return };
        if !d.started || d.reading || d.next >= d.end || pending > low_water {
            return;
        }
        let len = (d.end - d.next).min(DOWNLOAD_CHUNK_BYTES as u64) as usize;
        d.reading = true;
        self.store.send(Job::Read { t: d.transfer, offset: d.next, len });
    }

    /// A transfer is over: its connection may take the next request.
    pub(super) fn finish_transfer(&mut self, r: ConnRef, keep_alive: bool) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        if let State::Http(http) = &mut conn.state {
            http.phase = Phase::Idle;
        }
        if !keep_alive || self.shutdown_started {
            conn.close_after_flush = true;
        }
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        self.again.push(r);
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
    }

    /// Answers from the disk thread.
    pub(super) fn on_disk_done(&mut self) {
        while let Some(done) = self.store.try_done() {
            match done {
                Done::Scanned(files) => {
                    let wall = crate::timefmt::wall_ms();
                    for (file_id, expires_ms) in files {
                        let at = self.now_ms + expires_ms.saturating_sub(wall);
                        self.core.wheel.arm(at, Timer::BlobExpire(file_id));
                    }
                }
                Done::Created { t, result: Err(e) } => {
                    crate::log!(
                        Level::Error,
                        "cannot create an upload file",
                        dir = self.cfg.blob_dir.display(),
                        error = e
                    );
                    if let Some(r) = self.transfers.get(&t).copied() {
                        let response = self.store_failed("cannot store the file");
                        self.respond_and_close(r, response);
                    }
                }
                Done::Created { result: Ok(()), .. } => {}
                Done::Written { t, len } => {
                    // Every upload the full budget stopped may go on, not only this one.
                    let woken = self.disk.release(len);
                    self.again.extend(woken);
                    if let Some(r) = self.transfers.get(&t).copied()
                        && let Some(Phase::Upload(up)) = self.http_phase(r)
                    {
                        up.disk_bytes = up.disk_bytes.saturating_sub(len);
                        self.again.push(r);
                    }
                }
                Done::Finished { t, result } => self.upload_finished(t, result),
                Done::Opened { t, result } => self.download_opened(t, result),
                Done::Read { t, result } => self.download_read(t, result),
            }
        }
    }

    pub(super) fn http_phase(&mut self, r: ConnRef) -> Option<&mut Phase> {
        match &mut self.conns.get_mut(r)?.state {
            State::Http(http) => Some(&mut http.phase),
            _ => None,
        }
    }

    pub(super) fn upload_finished(&mut self, t: TransferId, result: Result<FileMeta, String>) {
        let r = self.transfers.remove(&t);
        let meta = match result {
            Ok(meta) => meta,
            Err(e) => {
                crate::log!(Level::Error, "cannot store an upload", error = e);
                if let Some(r) = r {
                    let response = self.store_failed("cannot store the file");
                    self.respond_and_close(r, response);
                }
                return;
            }
        };
        let Some(file_id) = crate::tasks::parse_id(&meta.file_id) else { return };
        let ttl_at = self.now_ms + meta.expires_ms.saturating_sub(meta.created_ms);
        self.core.wheel.arm(ttl_at, Timer::BlobExpire(file_id));
        crate::log!(Level::Info, "file stored", file_id = meta.file_id, size = meta.size);
        let Some(r) = r else { return };
        let Some(Phase::Upload(up)) = self.http_phase(r) else { return };
        let keep_alive = up.keep_alive;
        let mut body = String::with_capacity(256);
        body.push_str("{\"file_id\":\"");
        body.push_str(&meta.file_id);
        body.push_str("\",\"filename\":");
        crate::tasks::push_json_str(&mut body, &meta.filename);
        body.push_str(",\"content_type\":");
        crate::tasks::push_json_str(&mut body, &meta.content_type);
        body.push_str(&format!(",\"size\":{},\"sha256\":\"{}\",\"expires_at\":\"", meta.size, meta.sha256));
        crate::timefmt::write_rfc3339_ms(&mut body, meta.expires_ms);
        body.push_str("\"}");
        let response = Response::json(201, body.into_bytes());
        self.core.metrics.http_request(201);
        if let Some(conn) = self.conns.get_mut(r) {
            write_response(conn, response, !keep_alive || self.shutdown_started, false, &self.date.1);
        }
        self.finish_transfer(r, keep_alive);
    }

    /// The file store could not do its job (see [`crate::files::Store::failed`]).
    fn store_failed(&self, message: &str) -> Response {
        self.store.failed(message)
    }

    pub(super) fn download_opened(&mut self, t: TransferId, result: Result<FileMeta, OpenError>) {
        let Some(r) = self.transfers.get(&t).copied() else {
            self.store.send(Job::Close { t });
            return;
        };
        let shutting_down = self.shutdown_started;
        let unreadable = self.store_failed("cannot read the file");
        let date = self.date.1;
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let Phase::Download(d) = &mut http.phase else { return };
        let (keep_alive, head_only) = (d.keep_alive, d.head_only);
        let close = !keep_alive || shutting_down;
        let meta = match result {
            Ok(meta) => meta,
            Err(e) => {
                self.transfers.remove(&t);
                let response = match e {
                    OpenError::NotFound => crate::http::error(404, "no such file"),
                    OpenError::Io(msg) => {
                        crate::log!(Level::Error, "cannot open a stored file", error = msg);
                        unreadable
                    }
                };
                self.core.metrics.http_request(response.status);
                write_response(conn, response, close, head_only, &date);
                self.finish_transfer(r, keep_alive);
                return;
            }
        };
        let etag = format!("\"{}\"", meta.sha256);
        if d.if_none_match.as_deref().is_some_and(|h| http::none_match(h, &etag)) {
            // The client has these bytes (RFC 9110 §13.1.2): no body, the validator again.
            self.transfers.remove(&t);
            self.store.send(Job::Close { t });
            let response = Response::json(304, Vec::new()).with_header("ETag", etag);
            self.core.metrics.http_request(304);
            write_response(conn, response, close, head_only, &date);
            self.finish_transfer(r, keep_alive);
            return;
        }
        // A Range under an If-Range that names another version is ignored: the whole file.
        let range = match &d.if_range {
            Some(validator) if !http::if_range_holds(validator, &etag) => None,
            _ => d.range.as_deref(),
        };
        let (status, start, end) = match files::parse_range(range, meta.size) {
            RangeAnswer::Full => (200, 0, meta.size),
            RangeAnswer::Partial { start, end } => (206, start, end),
            RangeAnswer::Unsatisfiable => {
                self.transfers.remove(&t);
                self.store.send(Job::Close { t });
                let response = crate::http::error(416, "range not satisfiable")
                    .with_header("Content-Range", format!("bytes */{}", meta.size));
                self.core.metrics.http_request(416);
                write_response(conn, response, close, head_only, &date);
                self.finish_transfer(r, keep_alive);
                return;
            }
        };
        use std::io::Write as _;
        let out = &mut conn.out;
        let _ = write!(
            out,
            "HTTP/1.1 {status} {}\r\nDate: {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nContent-Disposition: {}\r\n\
             Accept-Ranges: bytes\r\nETag: {etag}\r\nX-Content-Type-Options: nosniff\r\n",
            http::reason(status),
            std::str::from_utf8(&date).unwrap_or(""),
            meta.content_type,
            end - start,
            files::content_disposition(&meta.filename),
        );
        if status == 206 {
            let _ = write!(out, "Content-Range: bytes {start}-{}/{}\r\n", end - 1, meta.size);
        }
        if close {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        self.core.metrics.http_request(status);
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        if head_only || start == end {
            self.transfers.remove(&t);
            self.store.send(Job::Close { t });
            self.finish_transfer(r, keep_alive);
            return;
        }
        d.started = true;
        d.next = start;
        d.end = end;
        self.pump_download(r);
    }

    pub(super) fn download_read(&mut self, t: TransferId, result: Result<Vec<u8>, String>) {
        let Some(r) = self.transfers.get(&t).copied() else {
            self.store.send(Job::Close { t });
            return;
        };
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let Phase::Download(d) = &mut http.phase else { return };
        d.reading = false;
        let data = match result {
            Ok(data) if !data.is_empty() => data,
            other => {
                // The head is sent: all we can do is end the connection early.
                let why = other.err().unwrap_or_else(|| "the file is shorter than its metadata says".into());
                crate::log!(Level::Error, "file read failed mid-download", error = why);
                self.close_now(r, "file read failed");
                return;
            }
        };
        d.next += data.len() as u64;
        let (done, keep_alive) = (d.next >= d.end, d.keep_alive);
        conn.out.extend_from_slice(&data);
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
        if done {
            self.transfers.remove(&t);
            self.store.send(Job::Close { t });
            self.finish_transfer(r, keep_alive);
        }
    }
}
