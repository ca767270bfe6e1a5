//! Test support for other crates' tests: the egress client they talk to loopback with.

use std::sync::Arc;

use crate::{EgressClient, EgressLimits, EgressPolicy, StaticResolver};

/// The development policy with loopback explicitly allowed (the way an operator lists a
/// private CIDR), names resolved by a static table, default limits.
#[allow(clippy::expect_used, reason = "test support fails loudly")]
pub fn loopback_egress() -> EgressClient {
    let policy = EgressPolicy::development()
        .with_allowed_cidrs(["127.0.0.1/32".parse().expect("a CIDR")])
        .expect("loopback is a valid allowed CIDR");
    EgressClient::with_resolver(
        policy,
        Arc::new(StaticResolver::new()),
        EgressLimits::default(),
    )
    .expect("the loopback client builds")
}
