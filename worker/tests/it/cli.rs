//! The binary's command line and configuration errors.

use std::path::Path;

use crate::support::{run, worker_bin};

fn worker(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    run(Path::new(worker_bin()), args, env)
}

#[test]
fn missing_token_exits_2_with_a_clear_message() {
    let (code, _, stderr) = worker(&[], &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("TOKEN: is required"), "{stderr}");
}

#[test]
fn invalid_values_exit_2_naming_the_variable() {
    let table = [
        ("CONCURRENCY", "zero"),
        ("CONCURRENCY", "0"),
        ("HTTP_TIMEOUT", "30"),
        ("HTTP_TIMEOUT", "0s"),
        ("RELAY_URL", "http://localhost:8080/ws"),
        ("MESH_URL", "nonsense"),
        ("ALLOW_HOSTS", "example.com:notaport"),
        ("CA_FILE", "/nonexistent/ca.pem"),
        ("SHUTDOWN_TIMEOUT", "-5s"),
    ];
    for (var, value) in table {
        let (code, _, stderr) = worker(&[], &[("TOKEN", "w"), (var, value)]);
        assert_eq!(code, Some(2), "{var}={value}: {stderr}");
        assert!(stderr.contains(&format!("{var}=")), "{var}={value}: {stderr}");
    }
}

#[test]
fn help_lists_every_variable() {
    let (code, stdout, _) = worker(&["--help"], &[]);
    assert_eq!(code, Some(0));
    for var in [
        "RELAY_URL",
        "MESH_URL",
        "TOKEN",
        "CONCURRENCY",
        "HTTP_TIMEOUT",
        "ALLOW_HOSTS",
        "CA_FILE",
        "SHUTDOWN_TIMEOUT",
        "MAX_MESSAGE_SIZE",
    ] {
        assert!(stdout.contains(var), "--help misses {var}:\n{stdout}");
    }
    let (code, _, stderr) = worker(&["--frobnicate"], &[]);
    assert_eq!(code, Some(2), "{stderr}");
}
