//! The token registry file (TOKEN_STORE): any bytes parse to a registry or an error, never a
//! panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = relay::tokens::parse_registry(data);
});
