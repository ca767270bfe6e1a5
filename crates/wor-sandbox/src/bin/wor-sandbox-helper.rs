//! A stand-alone sandbox helper, for tests and benchmarks of this crate; the `wor` binary
//! is its own helper in production.

fn main() {
    wor_sandbox::main_if_helper();
    std::process::exit(2);
}
