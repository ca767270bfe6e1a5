//! `wor egress check`: what the guard would decide for a URL, without connecting.

use std::fmt;
use std::net::IpAddr;

use crate::client::{EgressError, vet};
use crate::policy::{EgressDenial, HostAllowlist};
use crate::resolver::GuardedResolver;

/// The guard's answer for one URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressDecision {
    /// The request would be sent, to one of these addresses.
    Allow(Vec<IpAddr>),
    /// The request would be refused, for this reason.
    Deny(EgressDenial),
}

impl fmt::Display for EgressDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EgressDecision::Allow(_) => f.write_str("allow"),
            EgressDecision::Deny(reason) => write!(f, "deny: {reason}"),
        }
    }
}

/// Runs the URL, allowlist and address checks [`crate::EgressClient::send`] runs, resolving
/// through `resolver`; makes no connection. A name that does not resolve is a denial here.
pub async fn check(
    url: &str,
    allowlist: Option<&HostAllowlist>,
    resolver: &GuardedResolver,
) -> EgressDecision {
    match vet(url, allowlist, resolver).await {
        Ok((_, addrs)) => EgressDecision::Allow(addrs),
        Err(EgressError::Denied(denial)) => EgressDecision::Deny(*denial),
        Err(EgressError::Resolve { host, source }) => {
            EgressDecision::Deny(EgressDenial::Unresolvable {
                host,
                reason: source.to_string(),
            })
        }
        // `vet` makes no request, so nothing else can come back; refuse all the same.
        Err(other) => EgressDecision::Deny(EgressDenial::Unresolvable {
            host: String::new(),
            reason: other.to_string(),
        }),
    }
}
