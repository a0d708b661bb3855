//! `relay`: parse arguments, load the configuration, run. Maps errors to exit codes:
//! 0 success, 1 runtime failure, 2 bad configuration or usage.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use relay::config::{Config, help_text};
use relay::log::Level;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => serve(),
        Some("serve") if args.len() == 1 => serve(),
        Some("serve") => {
            eprintln!("relay: serve takes no arguments (it is configured by the environment; see relay --help)");
            ExitCode::from(2)
        }
        Some("token") => relay::tokens::main(&args[1..]),
        Some("-h" | "--help" | "help") => {
            print!("{}", help_text());
            ExitCode::SUCCESS
        }
        Some("-V" | "--version" | "version") => {
            println!("relay {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("relay: unknown argument {other:?} (see relay --help)");
            ExitCode::from(2)
        }
    }
}

fn serve() -> ExitCode {
    // Before any thread exists, so only the signal helper ever receives SIGTERM/SIGINT.
    relay::signals::block_shutdown_signals();
    let cfg = match Config::from_env() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("relay: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = relay::files::prepare_blob_dir(&cfg.blob_dir) {
        eprintln!("relay: invalid configuration: BLOB_DIR: {e}");
        return ExitCode::from(2);
    }
    relay::log::set_level(cfg.log_level);
    relay::log::start_writer();
    raise_fd_limit(cfg.max_connections);

    let flag = Arc::new(AtomicBool::new(false));
    if cfg.data_dir.is_none() && cfg.database.is_none() {
        relay::log!(Level::Warn, "DATA_DIR is empty: tasks are kept in memory only and a restart loses them",);
    }
    let (server, waker) = match relay::reactor::Server::bind(cfg.clone(), flag.clone()) {
        Ok(pair) => pair,
        Err(relay::reactor::StartError::DataDir(msg)) => {
            relay::log::flush();
            eprintln!("relay: invalid configuration: {msg}");
            return ExitCode::from(2);
        }
        Err(relay::reactor::StartError::Listen(e)) => {
            relay::log!(Level::Error, "cannot listen", addr = format!("{}:{}", cfg.bind, cfg.port), error = e);
            relay::log::flush();
            return ExitCode::from(1);
        }
        Err(e) => {
            relay::log!(Level::Error, "cannot start", error = e);
            relay::log::flush();
            return ExitCode::from(1);
        }
    };
    if let Err(e) = relay::signals::spawn_waiter(flag, move || {
        let _ = waker.wake();
    }) {
        relay::log!(Level::Error, "cannot start the signal thread", error = e);
        relay::log::flush();
        return ExitCode::from(1);
    }
    relay::log_always!(
        Level::Info,
        "listening",
        addr = server.local_addr,
        version = env!("CARGO_PKG_VERSION"),
        max_connections = cfg.max_connections
    );
    let result = server.run();
    let code = match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            relay::log!(Level::Error, "event loop failed", error = e);
            ExitCode::from(1)
        }
    };
    relay::log::flush();
    code
}

/// Raises the soft open-file limit to the hard limit, so MAX_CONNECTIONS can be reached.
fn raise_fd_limit(max_connections: usize) {
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
        let needed = max_connections as u64 + 64;
        if (lim.rlim_cur as u64) < needed {
            relay::log!(
                Level::Warn,
                "open-file limit is below MAX_CONNECTIONS",
                limit = lim.rlim_cur,
                max_connections = max_connections
            );
        }
    }
}
