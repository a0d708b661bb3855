//! JWT verification: never a panic, whatever the bytes. Random input cannot carry a valid MAC,
//! so each input is tried three times: as a whole token; as a `header.payload` that gets an
//! authentic signature; and as `header JSON \n claims JSON`, encoded and signed, which drives
//! the header and claims parsers behind the MAC check directly.
#![no_main]
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use libfuzzer_sys::fuzz_target;
use relay::jwt::{self, JwtError};

const SECRET: &[u8] = b"fuzz-secret-0123456789abcdef-0123456789";
const NOW_MS: u64 = 1_700_000_000_000;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(claims) = jwt::verify(SECRET, text, NOW_MS) {
        // Only our signature verifies; anything that did must be in date.
        assert!(claims.exp > NOW_MS / 1000);
    }
    let (header, claims) = text.split_once('\n').unwrap_or((r#"{"alg":"HS256"}"#, text));
    let input = format!("{}.{}", URL_SAFE_NO_PAD.encode(header), URL_SAFE_NO_PAD.encode(claims));
    signed(&input);
    signed(text);
});

/// `input` with an authentic signature appended.
fn signed(input: &str) {
    let token = format!("{input}.{}", jwt::signature(SECRET, input));
    match jwt::verify(SECRET, &token, NOW_MS) {
        Ok(claims) => {
            assert!(!claims.jti.is_empty() && claims.exp > NOW_MS / 1000);
            // What verified re-signs into a token that verifies to the same claims.
            assert_eq!(jwt::verify(SECRET, &jwt::sign(SECRET, &claims), NOW_MS), Ok(claims));
        }
        // The MAC is authentic: whatever else is wrong, the signature never is.
        Err(JwtError::BadSignature) => panic!("an authentic MAC was refused: {token:?}"),
        Err(_) => {}
    }
    // Another key never verifies what SECRET signed.
    assert!(jwt::verify(b"another-secret-0123456789abcdef-0123", &token, NOW_MS).is_err());
}
