//! The WebSocket upgrade check (api::upgrade on a parsed head, api::valid_ws_key): never a
//! panic; it accepts exactly the heads with `Upgrade: websocket`, `Connection: upgrade`,
//! version 13 and a key that is the base64 of 16 bytes, and then answers RFC 6455's accept
//! value for that key; a refusal is 426 or 400. The key check agrees with a base64 decoder.
#![no_main]
use base64::Engine as _;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use libfuzzer_sys::fuzz_target;
use relay::api::{upgrade, valid_ws_key};
use relay::http::{find_head_end, parse_head};

/// Standard base64 that does not insist the unused bits of the last character are zero.
const LENIENT: GeneralPurpose =
    GeneralPurpose::new(&base64::alphabet::STANDARD, GeneralPurposeConfig::new().with_decode_allow_trailing_bits(true));

fn is_16_bytes_of_base64(key: &str) -> bool {
    key.len() == 24 && LENIENT.decode(key).is_ok_and(|b| b.len() == 16)
}

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        assert_eq!(valid_ws_key(text), is_16_bytes_of_base64(text), "{text:?}");
    }
    if let Some(nonce) = data.get(..16) {
        let key = STANDARD.encode(nonce);
        assert!(valid_ws_key(&key), "{key:?}");
    }

    // The input as header lines of a GET /ws request.
    let mut raw = b"GET /ws?token=t HTTP/1.1\r\nHost: relay\r\n".to_vec();
    raw.extend_from_slice(data);
    raw.extend_from_slice(b"\r\n\r\n");
    let Some(end) = find_head_end(&raw, 0) else { return };
    let Ok(head) = parse_head(&raw, end) else { return };
    match upgrade(&head) {
        Ok(accept) => {
            assert!(head.upgrade_websocket && head.connection_upgrade);
            assert_eq!(head.ws_version.as_deref(), Some("13"));
            let key = head.ws_key.as_deref().expect("accepted without a key");
            assert!(is_16_bytes_of_base64(key), "{key:?}");
            assert_eq!(accept, tungstenite::handshake::derive_accept_key(key.as_bytes()));
            assert_eq!(STANDARD.decode(&accept).map(|d| d.len()).ok(), Some(20), "SHA-1 in base64: {accept:?}");
        }
        Err(refused) => {
            assert!(matches!(refused.status, 400 | 426), "{}", refused.status);
            let complete = head.upgrade_websocket
                && head.connection_upgrade
                && head.ws_version.as_deref() == Some("13")
                && head.ws_key.as_deref().is_some_and(is_16_bytes_of_base64);
            assert!(!complete, "a complete upgrade was refused: {head:?}");
        }
    }
});
