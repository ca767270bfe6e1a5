//! The egress guard's refusals as a metric, through the `metrics` facade (nothing is recorded
//! unless the server installs a recorder). The label is the class of the refusal, never the
//! host, address or URL refused.

use metrics::counter;

use crate::policy::EgressDenial;

pub const EGRESS_DENIALS: &str = "wor_egress_denials_total";

/// Describes the guard's metric to the installed recorder (`# HELP` line).
pub fn describe() {
    metrics::describe_counter!(
        EGRESS_DENIALS,
        "Outbound requests and sandbox CONNECTs the egress guard refused, by reason class \
         (url, host_not_allowed, address, unresolvable)"
    );
}

/// The reason class of a refusal: a fixed word.
pub fn reason_class(denial: &EgressDenial) -> &'static str {
    match denial {
        EgressDenial::Url(_) => "url",
        EgressDenial::HostNotAllowed { .. } => "host_not_allowed",
        EgressDenial::Address { .. } => "address",
        EgressDenial::Unresolvable { .. } => "unresolvable",
    }
}

pub(crate) fn denied(denial: &EgressDenial) {
    counter!(EGRESS_DENIALS, "reason" => reason_class(denial)).increment(1);
}
