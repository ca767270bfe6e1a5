//! Route handlers, one module per resource.

pub mod approvals;
pub mod audit;
pub mod health;
pub mod invitations;
pub mod keys;
pub mod members;
pub mod model_connections;
pub mod notifications;
pub mod oauth;
pub mod policy;
pub mod project;
pub mod routines;
pub mod runs;
pub mod tool_connections;
pub mod webhooks;
