//! Environment values: durations, RFC 3339 times, TRUSTED_PROXIES lists and X-Forwarded-For
//! headers, and Retry-After headers (seconds or an HTTP-date) never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = relay::config::parse_duration_ms(text);
    let _ = relay::timefmt::parse_rfc3339_ms(text);
    // (A Retry-After header, as the http kind reads it from an upstream.)
    let _ = relay::timefmt::parse_retry_after_ms(text, u64::from(data.len() as u32) << 20);
    if let Ok(proxies) = relay::proxy::TrustedProxies::parse("10.0.0.0/8, ::1") {
        let _ = proxies.client_ip(std::net::IpAddr::from([10, 0, 0, 1]), Some(text), Some(text));
    }
    let _ = relay::proxy::TrustedProxies::parse(text);
    let _ = relay::http::percent_decode(text);
});
