//! Tool-call decisions: given a proposed tool call, its routine, the run's provenance state and
//! budgets, Cedar policies answer `allow`, `confirm` or `deny` (pipeline step 4, invariants S5
//! and S8).
//!
//! Every policy is a Cedar `permit` or `forbid` over one schema ([`SCHEMA`]); a `permit` may
//! carry `@decision("confirm")` or `@decision("deny")`. One Cedar evaluation finds every policy
//! that matches, and the strongest wins: deny, then confirm, then allow; nothing matching is a
//! deny. A decision is a value ([`Decision`]) naming the policies that determined it, never an
//! error. This crate does no I/O; policy text comes in as strings.

mod decision;
mod depth;
mod engine;
mod error;
mod request;
mod template;

pub use decision::Decision;
pub use depth::{MAX_EXPRESSION_DEPTH, MAX_POLICY_NESTING};
pub use engine::{PolicyEngine, PolicyEngineBuilder};
pub use error::{PolicyError, PolicyLocation, PolicySource};
pub use request::{
    BudgetUsed, CallDescriptionError, DecisionRequest, DecisionRequestBuilder,
    ProvenanceDescription, ToolAnnotations, ToolCallDescription,
};
pub use template::{TEMPLATE_NAMES, TRUSTED_ARGUMENTS_TEMPLATE, TemplateError, fill_template};

/// The Cedar schema every policy is validated against (Cedar's human-readable schema syntax).
pub const SCHEMA: &str = include_str!("../policies/schema.cedarschema");

/// The default project policy: read-only tools run; other tools run under mode `auto` until
/// untrusted content is in the context, and need approval after.
pub const DEFAULT_PROJECT_POLICY: &str = include_str!("../policies/default.cedar");
