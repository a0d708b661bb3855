//! The link: one WebSocket to relay over a blocking `TcpStream`, plain (`ws://`) or wrapped
//! in rustls (`wss://`) by us — tungstenite's own TLS features stay off, since workspace
//! feature unification would compile them into the server too.
//!
//! Every socket operation has a deadline: connect per address, the TLS + WebSocket handshake
//! (read timeout = `connect_timeout_ms`), every write (`write_timeout_ms`). After the handshake
//! the read timeout drops to `poll_interval_ms`, so the runner's loop wakes up to send results
//! even when relay is quiet; tungstenite and rustls both keep partial frames/records across
//! such timeouts. This module connects and hands the socket over; the runner owns the states.
//! A 401 to the upgrade is told apart from every other failure (`ConnectError::TokenRefused`):
//! it is the one answer a retry cannot change.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use reqwest::Url;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, StreamOwned};
use tungstenite::handshake::HandshakeError;
use tungstenite::protocol::WebSocketConfig;
use tungstenite::{WebSocket, client::client_with_config};

use crate::Config;

pub type Ws = WebSocket<LinkStream>;

pub enum LinkStream {
    Plain(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl LinkStream {
    pub fn tcp(&self) -> &TcpStream {
        match self {
            LinkStream::Plain(s) => s,
            LinkStream::Tls(s) => &s.sock,
        }
    }
}

impl Read for LinkStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            LinkStream::Plain(s) => s.read(buf),
            LinkStream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for LinkStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            LinkStream::Plain(s) => s.write(buf),
            LinkStream::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            LinkStream::Plain(s) => s.flush(),
            LinkStream::Tls(s) => s.flush(),
        }
    }
}

/// Every tungstenite limit set explicitly: relay's messages are at most `max_message_bytes`
/// of payload plus a small envelope.
pub fn ws_config(max_message_bytes: usize) -> WebSocketConfig {
    let max = max_message_bytes + 64 * 1024;
    WebSocketConfig::default()
        .read_buffer_size(64 * 1024)
        .write_buffer_size(0)
        .max_write_buffer_size(2 * max)
        .max_message_size(Some(max))
        .max_frame_size(Some(max))
        .accept_unmasked_frames(false)
}

/// Why a connection could not be made.
#[derive(Debug, PartialEq, Eq)]
pub enum ConnectError {
    /// relay answered the upgrade with 401: the worker token is not relay's `WORKER_TOKEN`.
    /// Trying again cannot help, so the runner stops.
    TokenRefused,
    /// Anything else (no route, refused, timed out, TLS, another status): worth a retry. The
    /// text never contains the token.
    Failed(String),
}

impl From<String> for ConnectError {
    fn from(text: String) -> ConnectError {
        ConnectError::Failed(text)
    }
}

impl From<&str> for ConnectError {
    fn from(text: &str) -> ConnectError {
        ConnectError::Failed(text.to_string())
    }
}

/// Connects, upgrades and returns the WebSocket, ready for the runner's loop.
pub fn connect(cfg: &Config, tls: Option<&Arc<ClientConfig>>) -> Result<Ws, ConnectError> {
    let url = cfg.ws_url_with_token();
    let tcp = connect_tcp(&url, Duration::from_millis(cfg.connect_timeout_ms))?;
    let io_err = |what: &str, e: io::Error| ConnectError::Failed(format!("{what}: {e}"));
    tcp.set_nodelay(true).map_err(|e| io_err("set_nodelay", e))?;
    tcp.set_read_timeout(Some(Duration::from_millis(cfg.connect_timeout_ms))).map_err(|e| io_err("timeout", e))?;
    tcp.set_write_timeout(Some(Duration::from_millis(cfg.write_timeout_ms))).map_err(|e| io_err("timeout", e))?;
    let stream = if url.scheme() == "wss" {
        let tls = tls.ok_or("wss:// without a TLS configuration")?;
        let host = url.host_str().unwrap_or_default().trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(host.to_string()).map_err(|e| format!("TLS server name {host:?}: {e}"))?;
        let conn = ClientConnection::new(tls.clone(), name).map_err(|e| format!("TLS: {e}"))?;
        LinkStream::Tls(Box::new(StreamOwned::new(conn, tcp)))
    } else {
        LinkStream::Plain(tcp)
    };
    let (ws, _response) =
        client_with_config(url.as_str(), stream, Some(ws_config(cfg.max_message_bytes))).map_err(|e| match e {
            HandshakeError::Interrupted(_) => "handshake timed out".into(),
            HandshakeError::Failure(tungstenite::Error::Http(resp)) if resp.status().as_u16() == 401 => {
                ConnectError::TokenRefused
            }
            HandshakeError::Failure(tungstenite::Error::Http(resp)) => {
                format!("relay refused the upgrade: HTTP {}", resp.status()).into()
            }
            HandshakeError::Failure(tungstenite::Error::Io(e)) => e.to_string().into(),
            HandshakeError::Failure(e) => format!("handshake failed: {e}").into(),
        })?;
    ws.get_ref()
        .tcp()
        .set_read_timeout(Some(Duration::from_millis(cfg.poll_interval_ms.max(1))))
        .map_err(|e| io_err("timeout", e))?;
    Ok(ws)
}

fn connect_tcp(url: &Url, timeout: Duration) -> Result<TcpStream, String> {
    let port = url.port_or_known_default().ok_or("the URL has no port")?;
    let host = url.host_str().ok_or("the URL has no host")?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => (bare, port).to_socket_addrs().map_err(|e| format!("cannot resolve {bare}: {e}"))?.collect(),
    };
    let mut last = String::from("no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("connect {addr}: {e}"),
        }
    }
    Err(last)
}
