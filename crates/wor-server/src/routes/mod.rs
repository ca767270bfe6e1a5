//! Route handlers, one module per resource.

pub mod audit;
pub mod health;
pub mod keys;
pub mod members;
pub mod project;
