//! A small HTTP/1.1 target on 127.0.0.1 for the http kind: one thread per connection, one
//! request per connection (`Connection: close`), answers chosen by a closure. It records every
//! request it received, so a test can prove a host was *not* contacted.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Req {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Req {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

pub enum Reply {
    Respond {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
    /// Close the connection without answering (a network error for the client).
    Hangup,
    /// Wait, then reply.
    After(Duration, Box<Reply>),
}

impl Reply {
    pub fn new(status: u16, headers: &[(&str, &str)], body: impl Into<Vec<u8>>) -> Reply {
        let headers = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Reply::Respond { status, headers, body: body.into() }
    }

    pub fn json(status: u16, body: &serde_json::Value) -> Reply {
        Reply::new(status, &[("Content-Type", "application/json")], body.to_string())
    }

    pub fn redirect(location: &str) -> Reply {
        Reply::new(302, &[("Location", location)], "")
    }
}

type Handler = dyn Fn(&Req, usize) -> Reply + Send + Sync;

pub struct Target {
    pub addr: SocketAddr,
    pub hits: Arc<Mutex<Vec<Req>>>,
}

impl Target {
    /// Starts a target; `handler(request, index)` gets each request and its 0-based index.
    pub fn start(handler: impl Fn(&Req, usize) -> Reply + Send + Sync + 'static) -> Target {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind target");
        let addr = listener.local_addr().expect("addr");
        let hits: Arc<Mutex<Vec<Req>>> = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let hits2 = hits.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (hits, handler) = (hits2.clone(), handler.clone());
                std::thread::spawn(move || serve(stream, &hits, &*handler));
            }
        });
        Target { addr, hits }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn hit_count(&self) -> usize {
        self.hits.lock().expect("hits").len()
    }

    pub fn paths(&self) -> Vec<String> {
        self.hits.lock().expect("hits").iter().map(|r| r.path.clone()).collect()
    }
}

fn serve(mut stream: TcpStream, hits: &Mutex<Vec<Req>>, handler: &Handler) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let Some(req) = read_request(&mut stream) else { return };
    let index = {
        let mut h = hits.lock().expect("hits");
        h.push(req.clone());
        h.len() - 1
    };
    let mut reply = handler(&req, index);
    loop {
        match reply {
            Reply::After(d, next) => {
                std::thread::sleep(d);
                reply = *next;
            }
            Reply::Hangup => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
                return;
            }
            Reply::Respond { status, headers, body } => {
                let mut head =
                    format!("HTTP/1.1 {status} X\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
                for (k, v) in headers {
                    head.push_str(&format!("{k}: {v}\r\n"));
                }
                head.push_str("\r\n");
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body);
                return;
            }
        }
    }
}

fn read_request(stream: &mut TcpStream) -> Option<Req> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split_whitespace();
    let (method, path) = (first.next()?.to_string(), first.next()?.to_string());
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_string(), v.trim().to_string())).collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some(Req { method, path, headers, body })
}
