//! A TLS-terminating proxy for the wss:// test: a rustls acceptor on 127.0.0.1 with a
//! self-signed certificate for `localhost` made at test time, forwarding plain bytes to relay.
//! The certificate's PEM is written to a file the worker gets as CA_FILE.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{ServerConfig, ServerConnection, StreamOwned};

pub struct TlsProxy {
    pub addr: SocketAddr,
    pub ca_file: PathBuf,
    _dir: TempDir,
}

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("relay-worker-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl TlsProxy {
    pub fn start(upstream: SocketAddr) -> TlsProxy {
        let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("certificate");
        let dir = TempDir::new("tls");
        let ca_file = dir.0.join("ca.pem");
        std::fs::write(&ca_file, certified.cert.pem()).expect("write CA_FILE");
        let cert = CertificateDer::from(certified.cert.der().to_vec());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .expect("server config");
        let config = Arc::new(config);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let config = config.clone();
                std::thread::spawn(move || {
                    let _ = pump(client, upstream, config);
                });
            }
        });
        TlsProxy { addr, ca_file, _dir: dir }
    }
}

/// Moves bytes both ways until either side closes. One thread, short read timeouts on both
/// sockets (a rustls stream cannot be split across threads).
fn pump(client: TcpStream, upstream: SocketAddr, config: Arc<ServerConfig>) -> std::io::Result<()> {
    let conn = ServerConnection::new(config).map_err(std::io::Error::other)?;
    let mut tls = StreamOwned::new(conn, client);
    let mut plain = TcpStream::connect(upstream)?;
    tls.sock.set_read_timeout(Some(Duration::from_millis(5)))?;
    plain.set_read_timeout(Some(Duration::from_millis(5)))?;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let mut idle = true;
        match tls.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => {
                plain.write_all(&buf[..n])?;
                idle = false;
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
        match plain.read(&mut buf) {
            Ok(0) => {
                tls.conn.send_close_notify();
                let _ = tls.flush();
                return Ok(());
            }
            Ok(n) => {
                tls.write_all(&buf[..n])?;
                tls.flush()?;
                idle = false;
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
        if idle {
            std::thread::yield_now();
        }
    }
}
