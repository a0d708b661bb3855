//! A loopback TCP proxy that can cut every connection through it at once, without a WebSocket
//! close frame — a network blip as a worker behind NAT or a restarting proxy sees it (SPEC §12).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::WRK;

#[allow(dead_code)] // (retarget, accepted: for the restart tests)
pub struct Proxy {
    pub addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    live: Arc<Mutex<Vec<TcpStream>>>,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

#[allow(dead_code)]
impl Proxy {
    /// A proxy on an ephemeral loopback port that forwards to `target`.
    pub fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy binds");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let target = Arc::new(Mutex::new(target));
        let live: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, l, a, s) = (target.clone(), live.clone(), accepted.clone(), stop.clone());
        let join = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((down, _)) => {
                        let to = *t.lock().expect("target");
                        let Ok(up) = TcpStream::connect_timeout(&to, Duration::from_secs(2)) else {
                            let _ = down.shutdown(Shutdown::Both);
                            continue;
                        };
                        let _ = down.set_nonblocking(false);
                        let _ = (down.set_nodelay(true), up.set_nodelay(true));
                        a.fetch_add(1, Ordering::SeqCst);
                        {
                            let mut live = l.lock().expect("live");
                            for s in [&down, &up] {
                                if let Ok(c) = s.try_clone() {
                                    live.push(c);
                                }
                            }
                        }
                        pipe(&down, &up);
                        pipe(&up, &down);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Proxy { addr, target, live, accepted, stop, join: Some(join) }
    }

    /// The worker URL through the proxy.
    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws?token={WRK}", self.addr)
    }

    /// Forwards new connections to `target` from now on (a relay restarted on another port).
    pub fn retarget(&self, target: SocketAddr) {
        *self.target.lock().expect("target") = target;
    }

    /// Cuts every connection through the proxy now: both sides see the TCP connection end, no
    /// WebSocket close frame is sent.
    pub fn cut(&self) {
        for s in self.live.lock().expect("live").drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Connections the proxy forwarded so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.cut();
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// Copies `from` → `to` on a thread until either side ends; then ends both.
fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else { return };
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
}
