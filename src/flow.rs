//! Flow control (SPEC §14), the pure parts: a kind's dispatch policy (how a `PUT /kinds/{kind}`
//! body is checked, how a policy is shown and stored), the token bucket of its rates, and the
//! reasons a pending task waits. The stores apply policies when they choose what to dispatch;
//! nothing here touches a clock or a socket.

use serde::Deserialize;

pub use crate::tasks::WaitingOn;
use crate::tasks::push_json_str;

/// Kinds with a policy at most (each policy is a few dozen bytes; the limit bounds the map and
/// the per-claim work over limited kinds).
pub const MAX_POLICIES: usize = 10_000;

/// Kinds labelled in `relay_kind_running` / `relay_kind_pending` at most (SPEC §14).
pub const MAX_LABELLED_KINDS: usize = 1_000;

/// `"100/s"`: `count` dispatch starts per `per_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: u32,
    pub per_ms: u64,
}

impl Rate {
    pub fn parse(text: &str) -> Result<Rate, String> {
        let bad = || format!("bad rate {text:?}: expected N/s, N/m or N/h with N a positive integer");
        let (n, unit) = text.split_once('/').ok_or_else(bad)?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let count: u32 = n.parse().map_err(|_| bad())?;
        let per_ms = match unit {
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return Err(bad()),
        };
        if count == 0 {
            return Err(bad());
        }
        Ok(Rate { count, per_ms })
    }

    fn write(&self, s: &mut String) {
        s.push('"');
        s.push_str(&self.count.to_string());
        s.push_str(match self.per_ms {
            1_000 => "/s",
            60_000 => "/m",
            _ => "/h",
        });
        s.push('"');
    }

    /// One second's worth, at least 1: the default burst.
    fn default_burst(&self) -> u32 {
        ((u64::from(self.count) * 1_000 / self.per_ms) as u32).max(1)
    }
}

/// A kind's dispatch policy: `None` is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Policy {
    pub max_running: Option<u32>,
    pub max_running_per_key: Option<u32>,
    pub rate: Option<Rate>,
    pub burst: Option<u32>,
    pub rate_per_key: Option<Rate>,
    pub paused: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyBody<'a> {
    #[serde(default)]
    max_running: Option<serde_json::Number>,
    #[serde(default)]
    max_running_per_key: Option<serde_json::Number>,
    #[serde(borrow, default)]
    rate: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    burst: Option<serde_json::Number>,
    #[serde(borrow, default)]
    rate_per_key: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    paused: Option<bool>,
}

/// A positive integer as written: no fraction, no exponent, no zero.
fn positive(name: &str, n: Option<serde_json::Number>) -> Result<Option<u32>, String> {
    let Some(n) = n else { return Ok(None) };
    let text = n.to_string();
    match n.as_u64() {
        Some(v) if v > 0 && !text.contains(['.', 'e', 'E']) => {
            u32::try_from(v).map(Some).map_err(|_| format!("{name} is too large (at most {})", u32::MAX))
        }
        _ => Err(format!("{name} must be a positive integer")),
    }
}

impl Policy {
    /// Parses a `PUT /kinds/{kind}` body (SPEC §14). The error is the 400 message.
    pub fn parse(body: &[u8]) -> Result<Policy, String> {
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err("the body must be a JSON object (the policy)".into());
        }
        let raw: PolicyBody = serde_json::from_slice(body).map_err(|e| format!("invalid policy: {e}"))?;
        let rate = |name: &str, r: Option<std::borrow::Cow<str>>| {
            r.map(|r| Rate::parse(&r).map_err(|e| format!("{name}: {e}"))).transpose()
        };
        Ok(Policy {
            max_running: positive("max_running", raw.max_running)?,
            max_running_per_key: positive("max_running_per_key", raw.max_running_per_key)?,
            rate: rate("rate", raw.rate)?,
            burst: positive("burst", raw.burst)?,
            rate_per_key: rate("rate_per_key", raw.rate_per_key)?,
            paused: raw.paused.unwrap_or(false),
        })
    }

    /// The policy as `GET /kinds/{kind}` shows it (and as it is stored): the limits set, and
    /// `paused` when paused.
    pub fn write_json(&self, s: &mut String) {
        s.push('{');
        let mut first = true;
        let mut field = |s: &mut String, name: &str| {
            if !first {
                s.push(',');
            }
            first = false;
            s.push('"');
            s.push_str(name);
            s.push_str("\":");
        };
        if let Some(n) = self.max_running {
            field(s, "max_running");
            s.push_str(&n.to_string());
        }
        if let Some(n) = self.max_running_per_key {
            field(s, "max_running_per_key");
            s.push_str(&n.to_string());
        }
        if let Some(r) = &self.rate {
            field(s, "rate");
            r.write(s);
        }
        if let Some(n) = self.burst {
            field(s, "burst");
            s.push_str(&n.to_string());
        }
        if let Some(r) = &self.rate_per_key {
            field(s, "rate_per_key");
            r.write(s);
        }
        if self.paused {
            field(s, "paused");
            s.push_str("true");
        }
        s.push('}');
    }

    pub fn to_json(&self) -> String {
        let mut s = String::new();
        self.write_json(&mut s);
        s
    }

    /// `max_running`: the kind's attempts running at once, over all its keys.
    pub fn kind_cap(&self) -> Option<u32> {
        self.max_running
    }

    /// `max_running_per_key`: the attempts of one lane (kind, submitter, key) running at once.
    pub fn key_cap(&self) -> Option<u32> {
        self.max_running_per_key
    }

    /// The kind's own `rate` bucket, full.
    pub fn kind_bucket(&self) -> Option<Bucket> {
        self.rate.map(|r| Bucket::new(r, self.burst))
    }

    /// A lane's `rate_per_key` bucket, full (`burst` applies to both rates).
    pub fn key_bucket(&self) -> Option<Bucket> {
        self.rate_per_key.map(|r| Bucket::new(r, self.burst))
    }

    /// Does it hold the kind as a whole back (paused, `max_running`, `rate`)?
    pub fn kind_limits(&self) -> bool {
        self.paused || self.max_running.is_some() || self.rate.is_some()
    }

    /// Does it hold single lanes back (`max_running_per_key`, `rate_per_key`)?
    pub fn key_limits(&self) -> bool {
        self.max_running_per_key.is_some() || self.rate_per_key.is_some()
    }

    /// The tighter of the two running caps, if either is set (a kind with it may have room
    /// again whenever one of its attempts ends).
    pub fn running_cap(&self) -> Option<u32> {
        match (self.max_running, self.max_running_per_key) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Is the kind claimed apart, under its lock (limited, not paused: a paused kind is not
    /// claimed at all)?
    pub fn claimed_apart(&self) -> bool {
        !self.paused && self.limits()
    }

    /// Does it hold anything back?
    pub fn limits(&self) -> bool {
        self.paused || self.running_cap().is_some() || self.rate.is_some() || self.rate_per_key.is_some()
    }
}

/// A token bucket: `burst` tokens at most, refilled at the rate; it starts full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Tokens per millisecond.
    per_ms: f64,
    capacity: f64,
    tokens: f64,
    /// When `tokens` was counted (wall clock; `None`: never, it is full).
    at_ms: Option<u64>,
}

impl Bucket {
    pub fn new(rate: Rate, burst: Option<u32>) -> Bucket {
        let capacity = f64::from(burst.unwrap_or_else(|| rate.default_burst()).max(1));
        Bucket { per_ms: f64::from(rate.count) / rate.per_ms as f64, capacity, tokens: capacity, at_ms: None }
    }

    fn refill(&mut self, now_ms: u64) {
        if let Some(at) = self.at_ms {
            let dt = now_ms.saturating_sub(at) as f64;
            self.tokens = (self.tokens + dt * self.per_ms).min(self.capacity);
        }
        self.at_ms = Some(now_ms);
    }

    /// Whole tokens available now.
    pub fn available(&mut self, now_ms: u64) -> u32 {
        self.refill(now_ms);
        // (A hair of float error must not hold back a token that is due.)
        (self.tokens + 1e-9).floor().max(0.0) as u32
    }

    /// Takes `n` tokens (there are that many: [`Bucket::available`]).
    pub fn take(&mut self, now_ms: u64, n: u32) {
        self.refill(now_ms);
        self.tokens = (self.tokens - f64::from(n)).max(0.0);
    }

    /// Its rate (tokens per ms) and capacity: what a store that keeps buckets elsewhere (the
    /// cluster store, in the database) needs to refill them there.
    pub fn rate_and_capacity(&self) -> (f64, f64) {
        (self.per_ms, self.capacity)
    }

    /// When it is full again if nothing takes from it (wall clock; `now_ms` if it is).
    pub fn full_ms(&mut self, now_ms: u64) -> u64 {
        self.refill(now_ms);
        let missing = self.capacity - self.tokens;
        if missing <= 1e-9 {
            return now_ms;
        }
        now_ms + (missing / self.per_ms).ceil().max(1.0) as u64
    }

    /// When the next whole token is there (wall clock).
    pub fn next_token_ms(&mut self, now_ms: u64) -> u64 {
        self.refill(now_ms);
        if self.tokens + 1e-9 >= 1.0 {
            return now_ms;
        }
        now_ms + ((1.0 - self.tokens) / self.per_ms - 1e-6).ceil().max(1.0) as u64
    }

    /// What a restart must keep (SPEC §14: a restart is not idle time that refills it): its
    /// tokens and when they were counted; `None` while it was never taken from (full).
    pub fn state(&self) -> Option<(f64, u64)> {
        self.at_ms.map(|at| (self.tokens, at))
    }

    /// Takes back a [`Bucket::state`] (a value that is not a count of tokens reads as none).
    pub fn restore(&mut self, tokens: f64, at_ms: u64) {
        self.tokens = if tokens.is_finite() { tokens.clamp(0.0, self.capacity) } else { 0.0 };
        self.at_ms = Some(at_ms);
    }

    /// Is it full now (nothing to keep across a restart)?
    pub fn is_full(&mut self, now_ms: u64) -> bool {
        self.refill(now_ms);
        self.capacity - self.tokens <= 1e-9
    }

    /// The same limits (a policy change that keeps the rate keeps the bucket's state).
    pub fn same_shape(&self, other: &Bucket) -> bool {
        self.per_ms == other.per_ms && self.capacity == other.capacity
    }
}

/// `{"kind":...,"policy":{...},"running":N,"pending":N}`.
pub fn write_kind_json(s: &mut String, kind: &str, policy: Option<&Policy>, running: u64, pending: u64) {
    s.push_str("{\"kind\":");
    push_json_str(s, kind);
    s.push_str(",\"policy\":");
    match policy {
        Some(p) => p.write_json(s),
        None => s.push_str("{}"),
    }
    s.push_str(",\"running\":");
    s.push_str(&running.to_string());
    s.push_str(",\"pending\":");
    s.push_str(&pending.to_string());
    s.push('}');
}

/// `GET /kinds/{kind}` and the answers of `PUT`/`DELETE`.
pub fn kind_response(kind: &str, policy: Option<&Policy>, running: u64, pending: u64) -> crate::http::Response {
    let mut s = String::with_capacity(160);
    write_kind_json(&mut s, kind, policy, running, pending);
    crate::http::Response::json(200, s.into_bytes())
}

pub fn unknown_kind() -> crate::http::Response {
    crate::http::Response::error(404, "not_found", "no such kind: it has no policy and no pending or running task")
}

/// What a request about kind policies asks a store.
#[derive(Debug, Clone)]
pub enum KindOp {
    /// `GET /kinds/{kind}`.
    Get(String),
    /// `PUT` (`Some`) or `DELETE` (`None`).
    Set(String, Option<Policy>),
    /// `GET /kinds`.
    List,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(body: &str) -> Result<String, String> {
        Policy::parse(body.as_bytes()).map(|p| p.to_json())
    }

    #[test]
    fn policy_bodies() {
        assert_eq!(parsed("{}"), Ok("{}".into()));
        assert_eq!(
            parsed(r#"{"max_running":2,"max_running_per_key":1,"rate":"10/s","burst":5,"rate_per_key":"600/m","paused":true}"#),
            Ok(r#"{"max_running":2,"max_running_per_key":1,"rate":"10/s","burst":5,"rate_per_key":"600/m","paused":true}"#.into())
        );
        assert_eq!(parsed(r#"{"paused":false,"rate":"3600/h"}"#), Ok(r#"{"rate":"3600/h"}"#.into()));
        assert_eq!(parsed(r#"{"max_running":null}"#), Ok("{}".into()));
        for bad in [
            r#"{"max_running":0}"#,
            r#"{"max_running":1.5}"#,
            r#"{"max_running":1.0}"#,
            r#"{"max_running":1e2}"#,
            r#"{"max_running":-1}"#,
            r#"{"max_running":"2"}"#,
            r#"{"max_running":99999999999}"#,
            r#"{"burst":0}"#,
            r#"{"rate":"0/s"}"#,
            r#"{"rate":"10/d"}"#,
            r#"{"rate":"10"}"#,
            r#"{"rate":"1.5/s"}"#,
            r#"{"rate":"-1/s"}"#,
            r#"{"rate":10}"#,
            r#"{"rate_per_key":"x/s"}"#,
            r#"{"paused":"yes"}"#,
            r#"{"limit":1}"#,
            "[]",
            "",
            "nope",
        ] {
            assert!(parsed(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn a_bucket_starts_full_holds_its_burst_and_refills_at_its_rate() {
        let mut b = Bucket::new(Rate { count: 10, per_ms: 1_000 }, None);
        assert_eq!(b.available(0), 10, "one second's worth");
        b.take(0, 10);
        assert_eq!(b.available(0), 0);
        assert_eq!(b.next_token_ms(0), 100);
        assert_eq!(b.available(99), 0);
        assert_eq!(b.available(100), 1);
        assert_eq!(b.available(100_000), 10, "idle: full again, never more");
        let mut slow = Bucket::new(Rate { count: 1, per_ms: 3_600_000 }, None);
        assert_eq!(slow.available(0), 1, "at least one token");
        slow.take(0, 1);
        assert_eq!(slow.next_token_ms(0), 3_600_000);
        let mut burst = Bucket::new(Rate { count: 1, per_ms: 1_000 }, Some(3));
        assert_eq!(burst.available(5), 3);
    }

    #[test]
    fn a_bucket_taken_back_from_its_state_goes_on_where_it_was() {
        let rate = Rate { count: 10, per_ms: 1_000 };
        let mut b = Bucket::new(rate, Some(4));
        assert_eq!(b.state(), None, "never taken from: full, nothing to keep");
        assert!(b.is_full(0));
        b.take(1_000, 4);
        let (tokens, at) = b.state().expect("taken from");
        let mut back = Bucket::new(rate, Some(4));
        back.restore(tokens, at);
        assert_eq!(back.available(1_000), 0, "empty, as it was left");
        assert_eq!(back.available(1_200), 2, "and it refills from then");
        assert!(!back.is_full(1_200) && back.is_full(1_400));
        for junk in [f64::NAN, f64::INFINITY, -3.0] {
            let mut b = Bucket::new(rate, Some(4));
            b.restore(junk, 0);
            assert_eq!(b.available(0), 0, "{junk}");
        }
        let mut over = Bucket::new(rate, Some(4));
        over.restore(1e9, 0);
        assert_eq!(over.available(0), 4, "never more than its burst");
    }

    #[test]
    fn the_tightest_running_cap_applies() {
        let p = Policy { max_running: Some(5), max_running_per_key: Some(2), ..Policy::default() };
        assert_eq!(p.running_cap(), Some(2));
        assert_eq!((p.kind_cap(), p.key_cap()), (Some(5), Some(2)), "each for itself in a store with lanes");
        assert!(p.kind_limits() && p.key_limits());
        assert_eq!(Policy::default().running_cap(), None);
        assert!(!Policy::default().limits());
    }
}
