//! A fake worker over a real WebSocket (tungstenite client on a std socket). It can answer,
//! fail, stay silent, answer late, answer twice, disconnect, and stop answering pings.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tungstenite::protocol::CloseFrame;
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::{Message, WebSocket};

use super::Relay;

#[derive(Debug, Clone)]
pub struct TaskMsg {
    pub id: String,
    pub payload: Value,
    /// The attempt number a task frame to a session carries (SPEC §12).
    pub attempt: Option<u64>,
}

/// What the worker does by itself when a task arrives.
#[derive(Debug, Clone)]
pub enum Auto {
    /// Nothing: the test answers (or not) by hand.
    Manual,
    /// `done` with `{"echo": payload}`.
    Echo,
    /// `failed` with this error.
    Fail(String),
    /// `done` after a delay.
    Late(Duration),
    /// `done` twice.
    Twice,
}

enum Cmd {
    Text(String),
    Close(u16),
    /// Stop reading (so pings go unanswered) and stop writing.
    Freeze,
    /// Drop the TCP connection without a close frame.
    Drop,
    Binary,
    /// A WebSocket ping (relay's pong arrives in `others` as `{"type":"pong"}`).
    Ping,
}

pub struct FakeWorker {
    cmd: Sender<Cmd>,
    tasks: Receiver<TaskMsg>,
    cancels: Receiver<String>,
    /// Frames of other types (`welcome`, `reconnect`), as they came.
    others: Receiver<Value>,
    closed: Arc<AtomicBool>,
    close_code: Arc<Mutex<Option<u16>>>,
    /// Pings read from relay (each was answered by tungstenite).
    pings: Arc<AtomicUsize>,
    join: Option<JoinHandle<()>>,
}

impl FakeWorker {
    pub fn connect(relay: &Relay, hello: Option<Value>, auto: Auto) -> FakeWorker {
        FakeWorker::connect_url(&relay.ws_url(), hello, auto).expect("worker connects")
    }

    pub fn connect_url(url: &str, hello: Option<Value>, auto: Auto) -> Result<FakeWorker, String> {
        let rest = url.strip_prefix("ws://").ok_or("ws:// url")?;
        let host = rest.split('/').next().ok_or("host")?;
        let stream = TcpStream::connect(host).map_err(|e| e.to_string())?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        // The handshake reads too: bounded, so a relay that never answers fails the test.
        stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
        // Room for the largest task a test sends (tungstenite's default frame limit is 16 MiB).
        let config = tungstenite::protocol::WebSocketConfig::default()
            .max_frame_size(Some(128 << 20))
            .max_message_size(Some(128 << 20));
        let (mut ws, _resp) =
            tungstenite::client::client_with_config(url, stream, Some(config)).map_err(|e| e.to_string())?;
        ws.get_mut().set_read_timeout(Some(Duration::from_millis(10))).map_err(|e| e.to_string())?;
        if let Some(h) = hello {
            ws.send(Message::text(h.to_string())).map_err(|e| e.to_string())?;
        }
        let (cmd_tx, cmd_rx) = channel();
        let (task_tx, task_rx) = channel();
        let (cancel_tx, cancel_rx) = channel();
        let (other_tx, other_rx) = channel();
        let closed = Arc::new(AtomicBool::new(false));
        let close_code = Arc::new(Mutex::new(None));
        let pings = Arc::new(AtomicUsize::new(0));
        let shared =
            Shared { closed: closed.clone(), close_code: close_code.clone(), pings: pings.clone(), others: other_tx };
        let self_tx = cmd_tx.clone();
        let join = std::thread::spawn(move || run(ws, auto, cmd_rx, self_tx, task_tx, cancel_tx, shared));
        Ok(FakeWorker {
            cmd: cmd_tx,
            tasks: task_rx,
            cancels: cancel_rx,
            others: other_rx,
            closed,
            close_code,
            pings,
            join: Some(join),
        })
    }

    pub fn next_task(&self, within: Duration) -> Option<TaskMsg> {
        self.tasks.recv_timeout(within).ok()
    }

    pub fn expect_task(&self) -> TaskMsg {
        self.next_task(Duration::from_secs(5)).expect("a task within 5s")
    }

    /// True if no task arrives within `within`. A negative window only proves anything if
    /// the window cannot close before the event would have come: prefer a marker (a later task
    /// that must arrive first) or a state read from relay. Kept for the branches that use it.
    #[allow(dead_code)]
    pub fn no_task(&self, within: Duration) -> bool {
        self.next_task(within).is_none()
    }

    /// The next frame relay sent that is neither a task nor a cancel (a `welcome`, ...).
    pub fn next_other(&self, within: Duration) -> Option<Value> {
        self.others.recv_timeout(within).ok()
    }

    /// The `welcome` relay answers a hello with a `worker_id` with (SPEC §12).
    pub fn expect_welcome(&self) -> Value {
        let w = self.next_other(Duration::from_secs(5)).expect("a frame within 5s");
        assert_eq!(w["type"], "welcome", "{w}");
        w
    }

    /// `done` for attempt `attempt` of the task (the result echoes it).
    pub fn done_attempt(&self, id: &str, attempt: u64, data: Value) {
        self.send(
            json!({"type": "result", "task_id": id, "attempt": attempt, "status": "done", "data": data}).to_string(),
        );
    }

    pub fn next_cancel(&self, within: Duration) -> Option<String> {
        self.cancels.recv_timeout(within).ok()
    }

    pub fn done(&self, id: &str, data: Value) {
        self.send(json!({"type": "result", "task_id": id, "status": "done", "data": data}).to_string());
    }

    pub fn fail(&self, id: &str, error: &str) {
        self.send(json!({"type": "result", "task_id": id, "status": "failed", "error": error}).to_string());
    }

    pub fn send(&self, text: String) {
        let _ = self.cmd.send(Cmd::Text(text));
    }

    pub fn send_binary(&self) {
        let _ = self.cmd.send(Cmd::Binary);
    }

    pub fn close(&self) {
        let _ = self.cmd.send(Cmd::Close(1000));
    }

    /// Sends a WebSocket ping after what was sent before; relay's pong comes to `next_other`.
    pub fn ping(&self) {
        let _ = self.cmd.send(Cmd::Ping);
    }

    pub fn freeze(&self) {
        let _ = self.cmd.send(Cmd::Freeze);
    }

    pub fn drop_connection(&self) {
        let _ = self.cmd.send(Cmd::Drop);
    }

    /// How many pings relay has sent this worker so far.
    pub fn pings(&self) -> usize {
        self.pings.load(Ordering::SeqCst)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Waits until the server closed the socket; returns its close code, if it sent one.
    pub fn wait_closed(&self, within: Duration) -> Option<Option<u16>> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.is_closed() {
                return Some(*self.close_code.lock().expect("code"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        let _ = self.cmd.send(Cmd::Drop);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// What the worker thread reports back to the handle.
struct Shared {
    closed: Arc<AtomicBool>,
    close_code: Arc<Mutex<Option<u16>>>,
    pings: Arc<AtomicUsize>,
    others: Sender<Value>,
}

fn run(
    mut ws: WebSocket<TcpStream>,
    auto: Auto,
    cmds: Receiver<Cmd>,
    self_tx: Sender<Cmd>,
    tasks: Sender<TaskMsg>,
    cancels: Sender<String>,
    shared: Shared,
) {
    let Shared { closed, close_code, pings, others } = shared;
    let mut frozen = false;
    loop {
        while let Ok(cmd) = cmds.try_recv() {
            let result = match cmd {
                Cmd::Text(t) if !frozen => ws.send(Message::text(t)),
                Cmd::Text(_) => Ok(()),
                Cmd::Binary => ws.send(Message::binary(vec![1u8, 2, 3])),
                Cmd::Ping if !frozen => ws.send(Message::Ping(vec![7u8].into())),
                Cmd::Ping => Ok(()),
                Cmd::Close(code) => ws.close(Some(CloseFrame { code: CloseCode::from(code), reason: "bye".into() })),
                Cmd::Freeze => {
                    frozen = true;
                    Ok(())
                }
                Cmd::Drop => {
                    let _ = ws.get_mut().shutdown(std::net::Shutdown::Both);
                    closed.store(true, Ordering::SeqCst);
                    return;
                }
            };
            if result.is_err() && !ws.can_write() {
                // Closing; keep reading for the server's reply.
            }
        }
        if frozen {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        match ws.read() {
            Ok(Message::Text(text)) => {
                let v: Value = match serde_json::from_str(text.as_str()) {
                    Ok(v) => v,
                    Err(_) => continue,
                };
                let id = v["task_id"].as_str().unwrap_or_default().to_string();
                match v["type"].as_str() {
                    Some("task") => {
                        let msg =
                            TaskMsg { id: id.clone(), payload: v["payload"].clone(), attempt: v["attempt"].as_u64() };
                        let _ = tasks.send(msg.clone());
                        auto_answer(&auto, &msg, &self_tx);
                    }
                    Some("cancel") => {
                        let _ = cancels.send(id);
                    }
                    _ => {
                        let _ = others.send(v);
                    }
                }
            }
            Ok(Message::Ping(_)) => {
                pings.fetch_add(1, Ordering::SeqCst);
            }
            Ok(Message::Pong(_)) => {
                let _ = others.send(json!({"type": "pong"}));
            }
            Ok(Message::Close(frame)) => {
                *close_code.lock().expect("code") = frame.map(|f| u16::from(f.code));
            }
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => {
                closed.store(true, Ordering::SeqCst);
                return;
            }
        }
    }
}

fn auto_answer(auto: &Auto, msg: &TaskMsg, tx: &Sender<Cmd>) {
    let done =
        json!({"type": "result", "task_id": msg.id, "status": "done", "data": {"echo": msg.payload}}).to_string();
    match auto {
        Auto::Manual => {}
        Auto::Echo => {
            let _ = tx.send(Cmd::Text(done));
        }
        Auto::Twice => {
            let _ = tx.send(Cmd::Text(done.clone()));
            let _ = tx.send(Cmd::Text(done));
        }
        Auto::Fail(e) => {
            let text = json!({"type": "result", "task_id": msg.id, "status": "failed", "error": e}).to_string();
            let _ = tx.send(Cmd::Text(text));
        }
        Auto::Late(d) => {
            let (tx, d) = (tx.clone(), *d);
            std::thread::spawn(move || {
                std::thread::sleep(d);
                let _ = tx.send(Cmd::Text(done));
            });
        }
    }
}
