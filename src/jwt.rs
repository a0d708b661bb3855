//! HS256 JSON Web Tokens: sign and verify. Pure: no I/O, no clock (the caller passes wall time),
//! no knowledge of the registry (`tokens`) or of who may do what (`auth`).
//!
//! Verification order, each step bounded: length cap → exactly three segments → signature
//! decoded and checked in constant time (`verify_slice`) over the raw `header.payload` bytes →
//! header `alg` exactly `HS256` → claims parsed → `exp` strictly in the future (no leeway).
//! Nothing an attacker sends is JSON-parsed before the MAC has verified, and no input panics.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Longest token accepted. Ours are a few hundred bytes; this bounds the work per request.
pub const MAX_TOKEN_BYTES: usize = 4096;

/// The only header we produce, and the only `alg` we accept.
const HEADER_JSON: &str = r#"{"alg":"HS256","typ":"JWT"}"#;

/// The claims relay puts in a scoped token. Field order is the serialization order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub jti: String,
    pub name: String,
    pub kinds: Vec<String>,
    /// Issued at, seconds since the Unix epoch.
    pub iat: u64,
    /// Expires at, seconds since the Unix epoch; the token is invalid from this second on.
    pub exp: u64,
}

/// Why a token was refused. Every variant means 401 to a client; the variant is for logs/tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JwtError {
    /// Longer than [`MAX_TOKEN_BYTES`].
    TooLong,
    /// Not three dot-separated segments, or a segment that is not unpadded base64url.
    Malformed,
    /// The MAC does not match (wrong secret, tampered header/payload/signature, other alg).
    BadSignature,
    /// The header is not JSON, or its `alg` is not exactly `HS256`.
    BadAlgorithm,
    /// The claims are not JSON of the expected shape.
    BadClaims,
    /// `exp` is not in the future.
    Expired,
}

impl JwtError {
    pub fn as_str(self) -> &'static str {
        match self {
            JwtError::TooLong => "too_long",
            JwtError::Malformed => "malformed",
            JwtError::BadSignature => "bad_signature",
            JwtError::BadAlgorithm => "bad_algorithm",
            JwtError::BadClaims => "bad_claims",
            JwtError::Expired => "expired",
        }
    }
}

impl fmt::Display for JwtError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn mac(secret: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length (long ones are hashed), so this cannot fail.
    match HmacSha256::new_from_slice(secret) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of any length"),
    }
}

/// Signs `claims` with `secret`: `base64url(header).base64url(claims).base64url(mac)`.
pub fn sign(secret: &[u8], claims: &Claims) -> String {
    let mut token = URL_SAFE_NO_PAD.encode(HEADER_JSON);
    token.push('.');
    // Serializing a struct of strings and integers cannot fail.
    let payload = serde_json::to_vec(claims).unwrap_or_default();
    URL_SAFE_NO_PAD.encode_string(payload, &mut token);
    let sig = signature(secret, &token);
    token.push('.');
    token.push_str(&sig);
    token
}

/// The base64url HS256 MAC of `signing_input` (`header.payload`). Public so that tests and the
/// fuzz target can build authentic tokens around arbitrary headers and claims.
pub fn signature(secret: &[u8], signing_input: &str) -> String {
    let mut m = mac(secret);
    m.update(signing_input.as_bytes());
    URL_SAFE_NO_PAD.encode(m.finalize().into_bytes())
}

#[derive(Deserialize)]
struct Header {
    alg: String,
}

/// Verifies `token` against `secret` at wall time `now_ms` (milliseconds since the epoch).
pub fn verify(secret: &[u8], token: &str, now_ms: u64) -> Result<Claims, JwtError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(JwtError::TooLong);
    }
    let mut parts = token.split('.');
    let (Some(header_b64), Some(payload_b64), Some(sig_b64), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(JwtError::Malformed);
    };
    // An HS256 MAC is 32 bytes: 43 base64url characters. Any other length cannot verify.
    if sig_b64.len() != 43 {
        return Err(JwtError::BadSignature);
    }
    let mut sig = [0u8; 32];
    match URL_SAFE_NO_PAD.decode_slice(sig_b64, &mut sig) {
        Ok(32) => {}
        _ => return Err(JwtError::Malformed),
    }
    let signing_input_len = header_b64.len() + 1 + payload_b64.len();
    let mut m = mac(secret);
    m.update(&token.as_bytes()[..signing_input_len]);
    m.verify_slice(&sig).map_err(|_| JwtError::BadSignature)?;

    // Authentic from here on: only now do we decode and parse.
    let header = URL_SAFE_NO_PAD.decode(header_b64).map_err(|_| JwtError::Malformed)?;
    let header: Header = serde_json::from_slice(&header).map_err(|_| JwtError::BadAlgorithm)?;
    if header.alg != "HS256" {
        return Err(JwtError::BadAlgorithm);
    }
    let payload = URL_SAFE_NO_PAD.decode(payload_b64).map_err(|_| JwtError::Malformed)?;
    let claims: Claims = serde_json::from_slice(&payload).map_err(|_| JwtError::BadClaims)?;
    if claims.jti.is_empty() {
        return Err(JwtError::BadClaims);
    }
    if now_ms / 1000 >= claims.exp {
        return Err(JwtError::Expired);
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const NOW_MS: u64 = 1_700_000_100_000;

    /// Computed independently with Python's standard library:
    /// ```text
    /// python3 -c 'import hmac,hashlib,base64
    /// b=lambda x: base64.urlsafe_b64encode(x).rstrip(b"=").decode()
    /// h=b(b"{\"alg\":\"HS256\",\"typ\":\"JWT\"}")
    /// p=b(b"{\"jti\":\"0b7f2c1e-6a55-4d8e-9c1a-2f3e4d5c6b7a\",\"name\":\"billing\",\"kinds\":[\"http\",\"file\"],\"iat\":1700000000,\"exp\":1700003600}")
    /// s=b(hmac.new(b"0123456789abcdef0123456789abcdef",(h+"."+p).encode(),hashlib.sha256).digest())
    /// print(h+"."+p+"."+s)'
    /// ```
    const PYTHON_TOKEN: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.\
        eyJqdGkiOiIwYjdmMmMxZS02YTU1LTRkOGUtOWMxYS0yZjNlNGQ1YzZiN2EiLCJuYW1lIjoiYmlsbGluZyIsImtpbmRzIjpbImh0dHAiLCJmaWxlIl0sImlhdCI6MTcwMDAwMDAwMCwiZXhwIjoxNzAwMDAzNjAwfQ.\
        FlTpPearP04d4fUmfpjaoj1QObkjzakvwkovPVXtXeY";

    /// The example token on jwt.io (secret `your-256-bit-secret`): an outside HS256 vector whose
    /// MAC must verify; its claims (no jti, no exp) are not ours, so it ends as `BadClaims`.
    const JWT_IO_TOKEN: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.\
        eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.\
        SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c";

    const EXP_STRING: &str = r#"{"jti":"j","name":"n","kinds":[],"iat":1,"exp":"9999999999"}"#;
    const EMPTY_JTI: &str = r#"{"jti":"","name":"n","kinds":[],"iat":1,"exp":9999999999}"#;

    fn claims() -> Claims {
        Claims {
            jti: "0b7f2c1e-6a55-4d8e-9c1a-2f3e4d5c6b7a".into(),
            name: "billing".into(),
            kinds: vec!["http".into(), "file".into()],
            iat: 1_700_000_000,
            exp: 1_700_003_600,
        }
    }

    fn b64(s: &str) -> String {
        URL_SAFE_NO_PAD.encode(s)
    }

    /// A token with any header and payload text, MAC'd with `secret` over exactly those bytes.
    fn forge(secret: &[u8], header: &str, payload: &str) -> String {
        let input = format!("{}.{}", b64(header), b64(payload));
        format!("{input}.{}", signature(secret, &input))
    }

    /// Replaces segment `i` of a token.
    fn with_segment(token: &str, i: usize, segment: &str) -> String {
        let mut parts: Vec<&str> = token.split('.').collect();
        parts[i] = segment;
        parts.join(".")
    }

    /// (name, secret, token, wall time in ms, expected).
    type Case<'a> = (&'a str, &'a [u8], String, u64, Result<Claims, JwtError>);

    fn check(case: &str, secret: &[u8], token: &str, now_ms: u64, expected: Result<Claims, JwtError>) {
        assert_eq!(verify(secret, token, now_ms), expected, "case {case:?}");
    }

    #[test]
    fn sign_matches_python() {
        assert_eq!(sign(SECRET, &claims()), PYTHON_TOKEN);
    }

    #[test]
    fn verify_table() {
        let good = sign(SECRET, &claims());
        let payload_b64 = good.split('.').nth(1).unwrap_or_default().to_string();
        let sig_b64 = good.split('.').nth(2).unwrap_or_default().to_string();
        let claims_json = serde_json::to_string(&claims()).unwrap_or_default();

        let mut tampered_payload = claims();
        tampered_payload.kinds.push("admin".into());
        let tampered_payload =
            with_segment(&good, 1, &URL_SAFE_NO_PAD.encode(serde_json::to_vec(&tampered_payload).unwrap_or_default()));
        let mut flipped = sig_b64.clone().into_bytes();
        flipped[0] = if flipped[0] == b'A' { b'B' } else { b'A' };
        let tampered_sig = with_segment(&good, 2, &String::from_utf8(flipped).unwrap_or_default());

        let hs512_real = {
            // A genuine HS512 token: the MAC is over the same input but 64 bytes of SHA-512.
            let input = format!("{}.{}", b64(r#"{"alg":"HS512","typ":"JWT"}"#), payload_b64);
            let mut m = Hmac::<sha2::Sha512>::new_from_slice(SECRET).unwrap_or_else(|_| unreachable!());
            m.update(input.as_bytes());
            format!("{input}.{}", URL_SAFE_NO_PAD.encode(m.finalize().into_bytes()))
        };
        let alg_none_unsigned = format!("{}.{payload_b64}.", b64(r#"{"alg":"none","typ":"JWT"}"#));
        let sig_42 = &sig_b64[..42];
        let expired = Claims { exp: NOW_MS / 1000, ..claims() };
        let just_valid = Claims { exp: NOW_MS / 1000 + 1, ..claims() };

        let payload_mac_ok = {
            let input = format!("{}.pay*load", b64(HEADER_JSON));
            format!("{input}.{}", signature(SECRET, &input))
        };
        let two_segments = good.rsplit_once('.').map(|(a, _)| a.to_string()).unwrap_or_default();
        let wrong_secret: &[u8] = b"0123456789abcdef0123456789abcdeF";
        let claims_with = |json: &str| forge(SECRET, HEADER_JSON, json);

        use JwtError::*;
        let table: Vec<Case<'_>> = vec![
            ("python vector", SECRET, PYTHON_TOKEN.into(), NOW_MS, Ok(claims())),
            ("round trip", SECRET, good.clone(), NOW_MS, Ok(claims())),
            ("jwt.io vector", b"your-256-bit-secret", JWT_IO_TOKEN.into(), NOW_MS, Err(BadClaims)),
            ("wrong secret", wrong_secret, good.clone(), NOW_MS, Err(BadSignature)),
            ("tampered payload", SECRET, tampered_payload, NOW_MS, Err(BadSignature)),
            ("tampered signature", SECRET, tampered_sig, NOW_MS, Err(BadSignature)),
            ("tampered header", SECRET, with_segment(&good, 0, &b64(r#"{"alg":"HS256"}"#)), NOW_MS, Err(BadSignature)),
            ("alg none, no signature", SECRET, alg_none_unsigned, NOW_MS, Err(BadSignature)),
            (
                "alg none, valid MAC",
                SECRET,
                forge(SECRET, r#"{"alg":"none"}"#, &claims_json),
                NOW_MS,
                Err(BadAlgorithm),
            ),
            ("alg HS512, real HS512 MAC", SECRET, hs512_real, NOW_MS, Err(BadSignature)),
            (
                "alg HS512, HS256 MAC",
                SECRET,
                forge(SECRET, r#"{"alg":"HS512"}"#, &claims_json),
                NOW_MS,
                Err(BadAlgorithm),
            ),
            ("alg lower case", SECRET, forge(SECRET, r#"{"alg":"hs256"}"#, &claims_json), NOW_MS, Err(BadAlgorithm)),
            ("alg missing", SECRET, forge(SECRET, r#"{"typ":"JWT"}"#, &claims_json), NOW_MS, Err(BadAlgorithm)),
            ("header not JSON", SECRET, forge(SECRET, "HS256", &claims_json), NOW_MS, Err(BadAlgorithm)),
            ("claims not JSON", SECRET, claims_with("{"), NOW_MS, Err(BadClaims)),
            ("exp a string", SECRET, claims_with(EXP_STRING), NOW_MS, Err(BadClaims)),
            ("empty jti", SECRET, claims_with(EMPTY_JTI), NOW_MS, Err(BadClaims)),
            ("expired: exp == now", SECRET, sign(SECRET, &expired), NOW_MS, Err(Expired)),
            ("last valid millisecond", SECRET, sign(SECRET, &just_valid), NOW_MS + 999, Ok(just_valid.clone())),
            ("expired: no leeway", SECRET, sign(SECRET, &just_valid), NOW_MS + 1000, Err(Expired)),
            ("malformed base64 signature", SECRET, with_segment(&good, 2, &"!".repeat(43)), NOW_MS, Err(Malformed)),
            (
                "standard-alphabet signature",
                SECRET,
                with_segment(&good, 2, &format!("{sig_42}+")),
                NOW_MS,
                Err(Malformed),
            ),
            (
                "non-canonical last symbol",
                SECRET,
                with_segment(&good, 2, &format!("{sig_42}Z")),
                NOW_MS,
                Err(Malformed),
            ),
            ("padded signature", SECRET, with_segment(&good, 2, &format!("{sig_b64}=")), NOW_MS, Err(BadSignature)),
            ("short signature", SECRET, with_segment(&good, 2, "AAAA"), NOW_MS, Err(BadSignature)),
            ("long signature", SECRET, with_segment(&good, 2, &sig_b64.repeat(2)), NOW_MS, Err(BadSignature)),
            ("malformed base64 payload, valid MAC", SECRET, payload_mac_ok, NOW_MS, Err(Malformed)),
            ("oversize", SECRET, format!("{good}{}", "A".repeat(MAX_TOKEN_BYTES)), NOW_MS, Err(TooLong)),
            ("two segments", SECRET, two_segments, NOW_MS, Err(Malformed)),
            ("four segments", SECRET, format!("{good}.x"), NOW_MS, Err(Malformed)),
            ("one segment", SECRET, "abc".into(), NOW_MS, Err(Malformed)),
            ("empty", SECRET, String::new(), NOW_MS, Err(Malformed)),
            ("dots only", SECRET, "..".into(), NOW_MS, Err(BadSignature)),
            ("non-ASCII", SECRET, format!("é.é.{}é", "A".repeat(41)), NOW_MS, Err(Malformed)),
        ];
        for (name, secret, token, now_ms, expected) in table {
            check(name, secret, &token, now_ms, expected);
        }
    }
}
