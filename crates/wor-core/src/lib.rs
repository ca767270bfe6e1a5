//! Domain types of Work on Repeat: typed ids, member roles, routine definitions, budgets, run
//! statuses and provenance labels, the provider-neutral model conversation, canonical JSON and
//! hashing, and the audit chain with its verification.
//!
//! This crate is the centre every other crate points toward. It does no I/O and depends on no
//! runtime, database, HTTP or sandbox crate, so nothing here can fail for I/O reasons.

pub mod approval;
pub mod audit;
pub mod budget;
pub mod call;
pub mod canonical;
pub mod ids;
pub mod json_depth;
pub mod model;
pub mod name;
pub mod provenance;
pub mod quote;
pub mod replay;
pub mod role;
pub mod routine;
pub mod run;
pub mod run_loop;
pub mod schedule;
pub mod step;
pub mod text;

pub use ids::{
    ApiKeyId, ApprovalId, ConnectionId, ConsoleSessionId, IdError, MemberId, NotificationRouteId,
    ProjectId, RoutineId, RunId,
};
pub use role::{Role, RoleChangeRefusal, RoleParseError};
