//! The egress guard: the one outbound HTTP client of Work on Repeat.
//!
//! Every byte that leaves the server goes through this crate, which refuses any destination
//! that resolves to a loopback, private or other special-use address. No other crate opens
//! sockets or builds an HTTP client (`clippy.toml` enforces it).
//!
//! Code map: [`address`] names special-use ranges; [`url`] parses and vets URLs; [`policy`]
//! holds the server-wide [`EgressPolicy`] and per-connection [`HostAllowlist`]s; [`resolver`]
//! resolves names behind the policy and pins answers; [`client`] is the [`EgressClient`];
//! [`check`](mod@check) answers `wor egress check` without connecting; [`connect_proxy`] is the
//! sandbox's only way out.
//!
//! Architecture invariant: the reqwest client is built in exactly one function
//! (`client::build_http`), and it resolves names only through the [`GuardedResolver`].

pub mod address;
pub mod check;
pub mod client;
pub mod connect_proxy;
pub mod metrics;
pub mod policy;
pub mod resolver;
#[cfg(feature = "testing")]
pub mod testing;
pub mod url;

pub use address::{SpecialRange, classify};
pub use check::{EgressDecision, check};
pub use client::{
    EgressClient, EgressError, EgressLimits, EgressRequest, EgressResponse, KeylessModelRefusal,
    WEBHOOK_TIMEOUT,
};
pub use policy::{
    AllowlistError, EgressConfig, EgressDenial, EgressPolicy, HostAllowlist, HostPattern,
    PolicyError,
};
pub use reqwest::header::{self, HeaderMap};
pub use reqwest::{Method, StatusCode};
pub use resolver::{
    GuardedLookupError, GuardedResolver, Lookup, LookupFuture, NameResolver, PinLimits,
    ResolveError, StaticEntryError, StaticResolver, SystemResolver,
};
pub use url::{EgressHost, EgressUrl, UrlRefusal};
