//! The egress guard: the one outbound HTTP client of Work on Repeat.
//!
//! Every byte that leaves the server goes through this crate, which refuses any destination
//! that resolves to a loopback, private or other special-use address. No other crate opens
//! sockets or builds an HTTP client (`clippy.toml` enforces it).

pub mod address;
pub mod policy;
pub mod resolver;
pub mod url;

pub use address::{SpecialRange, classify};
