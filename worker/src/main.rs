//! `relay-worker`: the library with its built-in kinds (`http`, `file`), configured by the
//! environment. Exit codes: 0 after a graceful shutdown, 1 on a runtime failure, 2 for a bad
//! configuration or usage.

fn main() -> std::process::ExitCode {
    relay_worker::main_with(|_| {})
}
