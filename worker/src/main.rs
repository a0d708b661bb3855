fn main() {
    eprintln!("relay-worker: not built yet");
    std::process::exit(2);
}
