//! Bytes from a worker's socket, in arbitrary pieces, through tungstenite reading from relay's
//! buffer (as `Server::read_ws` does) and every text message into a real core: never a panic,
//! and no message larger than the limit gets through.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::conn::{WsIo, ws_context};
use tungstenite::Message;

#[path = "common.rs"]
mod common;
use common::{NullIo, WORKER, core_with_worker};

const LIMIT: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else { return };
    let (first, second) = rest.split_at(usize::from(split) % (rest.len() + 1));
    // Part arrives with the upgrade request, the rest later, in pieces.
    let mut ctx = ws_context(first.to_vec(), LIMIT);
    let mut core = core_with_worker();
    let mut out = Vec::new();
    for piece in std::iter::once(&[][..]).chain(second.chunks(97)) {
        let mut io = WsIo { input: piece, pos: 0, out: &mut out };
        loop {
            match ctx.read(&mut io) {
                Ok(Message::Text(text)) => {
                    assert!(text.len() <= LIMIT);
                    core.worker_message(&mut NullIo, WORKER, text.as_str());
                }
                Ok(Message::Binary(b)) => assert!(b.len() <= LIMIT),
                Ok(_) => {}
                Err(tungstenite::Error::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // Any other error ends the connection in relay (`Server::read_ws` closes it and
                // never reads again); tungstenite's state after an error is not meant to be read
                // from (after a Capacity error it keeps the oversized header, and a further read
                // trips its own debug assertion).
                Err(_) => return,
            }
        }
        assert!(out.len() <= 64 * 1024, "replies (pongs, close) stay small");
    }
});
