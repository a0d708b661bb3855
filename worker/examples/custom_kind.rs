//! A worker with a kind of its own, next to the built-in `http`, `file` and `echo` kinds.
//!
//! Run relay, then:
//!
//! ```sh
//! RELAY_URL=ws://localhost:8080/ws TOKEN=wtok cargo run -p relay-worker --example custom_kind
//! curl -sS -H "Authorization: Bearer atok" \
//!   -d '{"payload":{"kind":"word_count","spec":{"text":"to be or not to be"}}}' \
//!   "localhost:8080/tasks?wait=true"
//! # ... "result":{"distinct":4,"top":"be","words":6} ...
//! ```

use std::collections::BTreeMap;

use relay_worker::{Error, Worker};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

#[derive(Deserialize)]
struct Spec {
    text: String,
}

/// The whole contract of a kind: the task id and the payload's `spec` in, the result's `data`
/// (or an error, which fails the task so relay tries another worker) out.
fn word_count(_task_id: &str, spec: &RawValue) -> Result<Value, Error> {
    let spec: Spec = serde_json::from_str(spec.get())?;
    if spec.text.len() > 1 << 20 {
        return Err(Error::new("text longer than 1 MiB"));
    }
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    for word in spec.text.split_whitespace() {
        *counts.entry(word).or_default() += 1;
    }
    let top = counts.iter().max_by_key(|(w, n)| (**n, std::cmp::Reverse(**w))).map(|(w, _)| *w);
    Ok(json!({"words": counts.values().sum::<u64>(), "distinct": counts.len(), "top": top}))
}

fn main() -> std::process::ExitCode {
    relay_worker::main_with(|worker: &mut Worker| {
        worker.register("word_count", word_count);
    })
}
