//! The built-in `echo` kind: the result is the task's `spec`, unchanged (`null` when the payload
//! has none). It touches no network and no disk, so a first task works offline, and a deployment
//! can be checked end to end (submit → relay → worker → result) without a target to call.

use serde_json::Value;
use serde_json::value::RawValue;

use crate::Error;

/// The handler: the spec back as the result. The spec is JSON that relay and the worker have
/// both parsed already, so reading it again does not fail in practice; if it did, the task
/// would fail with the reason (`bad spec: ...`).
pub fn run(_task_id: &str, spec: &RawValue) -> Result<Value, Error> {
    Ok(serde_json::from_str(spec.get())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(spec: &str, expected: Value) {
        let raw = RawValue::from_string(spec.to_string()).expect("valid JSON");
        assert_eq!(run("t", &raw), Ok(expected), "{spec}");
    }

    #[test]
    fn the_result_is_the_spec() {
        check("null", Value::Null);
        check(r#"{"text":"hello","n":[1,2.5,true,null]}"#, serde_json::json!({"text":"hello","n":[1,2.5,true,null]}));
        check(r#""just a string""#, serde_json::json!("just a string"));
        check("12345678901234567890", serde_json::json!(12_345_678_901_234_567_890u64));
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        check(&deep, serde_json::from_str(&deep).expect("100 levels"));
    }
}
