//! The built-in `http` kind (SPEC §8): one HTTP request described by the spec
//! `{method (default GET), url, headers, body}`, answered with
//! `{status_code, headers, body | body_base64}`.
//!
//! Any answer, 2xx or not, is `done` (the caller sees the status) — except a status the spec
//! lists in `retry_on` (e.g. `[429, 503]`), which ends the attempt `failed` with the answer's
//! `Retry-After` (seconds or an HTTP-date) as `retry_after_ms`, so relay retries no sooner (SPEC
//! §13); a network error (DNS, connect, TLS, timeout, a cut-off body) is `failed`, so relay
//! retries from another worker.
//! `ALLOW_HOSTS` is checked before the first byte is sent and on every redirect; redirects are
//! followed up to 5 and a 6th, or one to a host not allowed, fails the task without contacting
//! that host. `HTTP_TIMEOUT` bounds the whole exchange, body included. The response body is
//! read up to `MAX_MESSAGE_SIZE` bytes (a larger one could not travel back to relay anyway).
//! No proxy from the environment is used: the point of a worker is its own egress.

use std::io::Read;
use std::time::Duration;

use base64::Engine as _;
use reqwest::blocking::Client;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use reqwest::redirect::Policy;
use reqwest::{Method, Url};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::config::AllowHosts;
use crate::kinds::describe_error;
use crate::{Config, Error};

pub const MAX_REDIRECTS: usize = 5;

pub struct HttpKind {
    client: Client,
    allow_hosts: Option<AllowHosts>,
    timeout: Duration,
    max_body_bytes: usize,
}

#[derive(Deserialize)]
struct Spec {
    method: Option<String>,
    url: Option<String>,
    headers: Option<Map<String, Value>>,
    body: Option<Value>,
    /// Statuses that end the attempt `failed`, paced by the answer's `Retry-After` (SPEC §13).
    retry_on: Option<Vec<u16>>,
}

impl HttpKind {
    pub fn new(cfg: &Config, mut tls: rustls::ClientConfig) -> Result<HttpKind, Error> {
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let allow = cfg.allow_hosts.clone();
        let policy = Policy::custom(move |attempt| {
            // `previous` holds every URL requested so far, the first one included.
            if attempt.previous().len() > MAX_REDIRECTS {
                let error = format!("too many redirects (more than {MAX_REDIRECTS})");
                return attempt.error(error);
            }
            if let Some(allow) = &allow
                && !allow.allows(attempt.url())
            {
                let error = format!("redirect to {} refused: not in ALLOW_HOSTS", host_port(attempt.url()));
                return attempt.error(error);
            }
            attempt.follow()
        });
        let timeout = Duration::from_millis(cfg.http_timeout_ms);
        let client = Client::builder()
            .tls_backend_preconfigured(tls)
            .no_proxy()
            .redirect(policy)
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(crate::runner::VERSION)
            .pool_max_idle_per_host(4)
            .build()
            .map_err(|e| Error::new(format!("cannot build the HTTP client: {}", describe_error(&e))))?;
        Ok(HttpKind { client, allow_hosts: cfg.allow_hosts.clone(), timeout, max_body_bytes: cfg.max_message_bytes })
    }

    pub fn run(&self, _task_id: &str, spec: &RawValue) -> Result<Value, Error> {
        let spec: Spec = serde_json::from_str(spec.get())
            .map_err(|e| Error::new(format!("bad http spec (expected {{method, url, headers, body}}): {e}")))?;
        let url = spec.url.ok_or("spec.url is required")?;
        let url = Url::parse(&url).map_err(|e| Error::new(format!("spec.url {url:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Error::new(format!("spec.url: scheme {:?} not supported (http or https)", url.scheme())));
        }
        if let Some(allow) = &self.allow_hosts
            && !allow.allows(&url)
        {
            return Err(Error::new(format!("host {} not in ALLOW_HOSTS", host_port(&url))));
        }
        let method = match spec.method.as_deref().map(str::trim) {
            None | Some("") => Method::GET,
            Some(m) => Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| Error::new(format!("spec.method {m:?} is not an HTTP method")))?,
        };
        let headers = request_headers(spec.headers.as_ref())?;
        let has_content_type = headers.contains_key(CONTENT_TYPE);
        let mut request = self.client.request(method, url).headers(headers).timeout(self.timeout);
        match spec.body {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => request = request.body(text),
            Some(value) => {
                if !has_content_type {
                    request = request.header(CONTENT_TYPE, "application/json");
                }
                request = request.body(value.to_string());
            }
        }
        let response = request.send().map_err(|e| Error::new(describe_error(&e)))?;
        let status = response.status().as_u16();
        if spec.retry_on.as_ref().is_some_and(|codes| codes.contains(&status)) {
            // The upstream says "not now": a failed attempt relay retries, no sooner than its
            // Retry-After (seconds or an HTTP-date), if it gave one.
            let after = response.headers().get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok());
            let wait =
                after.and_then(|v| relay_common::timefmt::parse_retry_after_ms(v, relay_common::timefmt::wall_ms()));
            let message = match after {
                Some(v) => format!("HTTP {status} (spec.retry_on), Retry-After: {v}"),
                None => format!("HTTP {status} (spec.retry_on)"),
            };
            return Err(match wait {
                Some(ms) => Error::retry_after(message, ms),
                None => Error::new(message),
            });
        }
        let headers = response_headers(response.headers());
        let is_json = response.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(is_json_type);
        let mut body = Vec::new();
        let limit = self.max_body_bytes as u64;
        response
            .take(limit + 1)
            .read_to_end(&mut body)
            .map_err(|e| Error::new(format!("reading the response body: {}", describe_error(&e))))?;
        if body.len() as u64 > limit {
            return Err(Error::new(format!("response body larger than {limit} bytes (MAX_MESSAGE_SIZE)")));
        }
        let mut result = json!({"status_code": status, "headers": headers});
        let (key, value) = body_value(body, is_json);
        result[key] = value;
        Ok(result)
    }
}

fn host_port(url: &Url) -> String {
    match url.port() {
        Some(port) => format!("{}:{port}", url.host_str().unwrap_or_default()),
        None => url.host_str().unwrap_or_default().to_string(),
    }
}

/// `headers`: name → string, or → array of strings for a repeated header.
fn request_headers(spec: Option<&Map<String, Value>>) -> Result<HeaderMap, Error> {
    let mut out = HeaderMap::new();
    let Some(spec) = spec else { return Ok(out) };
    for (name, value) in spec {
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| Error::new(format!("spec.headers: {name:?} is not a header name")))?;
        let values: Vec<&str> = match value {
            Value::String(s) => vec![s.as_str()],
            Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if values.is_empty() {
            return Err(Error::new(format!("spec.headers.{name}: expected a string or an array of strings")));
        }
        for v in values {
            let v = HeaderValue::from_str(v)
                .map_err(|_| Error::new(format!("spec.headers.{name}: not a valid header value")))?;
            out.append(header.clone(), v);
        }
    }
    Ok(out)
}

/// Lower-case names (as `HeaderName` already is); repeats joined by `", "` in arrival order.
fn response_headers(headers: &HeaderMap) -> Map<String, Value> {
    let mut out: Map<String, Value> = Map::new();
    for name in headers.keys() {
        let joined: Vec<String> =
            headers.get_all(name).iter().map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()).collect();
        out.insert(name.as_str().to_string(), Value::String(joined.join(", ")));
    }
    out
}

/// `application/json`, or any `+json` type (`application/problem+json`), parameters ignored.
fn is_json_type(content_type: &str) -> bool {
    let media = content_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    media == "application/json" || (media.starts_with("application/") && media.ends_with("+json"))
}

/// The body as the result carries it: parsed JSON when the response says JSON and is, else
/// text when it is UTF-8, else base64 under `body_base64`.
fn body_value(body: Vec<u8>, is_json: bool) -> (&'static str, Value) {
    if is_json && let Ok(value) = serde_json::from_slice::<Value>(&body) {
        return ("body", value);
    }
    match String::from_utf8(body) {
        Ok(text) => ("body", Value::String(text)),
        Err(e) => ("body_base64", Value::String(base64::engine::general_purpose::STANDARD.encode(e.as_bytes()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_body(body: &[u8], is_json: bool, expected: (&str, Value)) {
        assert_eq!(body_value(body.to_vec(), is_json), expected, "{body:?} json={is_json}");
    }

    #[test]
    fn bodies() {
        check_body(br#"{"a":[1,2]}"#, true, ("body", json!({"a": [1, 2]})));
        check_body(br#"{"a":[1,2]}"#, false, ("body", json!(r#"{"a":[1,2]}"#)));
        check_body(b"not json", true, ("body", json!("not json")));
        check_body(b"", true, ("body", json!("")));
        check_body("héllo".as_bytes(), false, ("body", json!("héllo")));
        check_body(&[0xff, 0x00, 0x80], false, ("body_base64", json!("/wCA")));
    }

    #[test]
    fn json_types() {
        for (ct, expected) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/problem+json", true),
            ("text/json", false),
            ("text/plain", false),
            ("application/jsonp", false),
        ] {
            assert_eq!(is_json_type(ct), expected, "{ct}");
        }
    }

    #[test]
    fn header_maps() {
        let spec: Map<String, Value> = serde_json::from_str(r#"{"X-One":"1","accept":["a/b","c/d"]}"#).expect("json");
        let h = request_headers(Some(&spec)).expect("headers");
        assert_eq!(h.get_all("x-one").iter().count(), 1);
        assert_eq!(h.get_all("accept").iter().count(), 2);
        for bad in [r#"{"X":1}"#, r#"{"bad name":"v"}"#, r#"{"X":"a\nb"}"#, r#"{"X":[]}"#] {
            let spec: Map<String, Value> = serde_json::from_str(bad).expect("json");
            assert!(request_headers(Some(&spec)).is_err(), "{bad}");
        }
        let mut resp = HeaderMap::new();
        resp.append("Set-Cookie", HeaderValue::from_static("a=1"));
        resp.append("set-cookie", HeaderValue::from_static("b=2"));
        resp.append("Content-Type", HeaderValue::from_static("text/plain"));
        assert_eq!(
            Value::Object(response_headers(&resp)),
            json!({"set-cookie": "a=1, b=2", "content-type": "text/plain"})
        );
    }
}
