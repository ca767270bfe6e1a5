//! Who is calling: the API key in `Authorization: Bearer …`, resolved to its project and role.
//!
//! INVARIANT: the project a request acts on comes from here and from nowhere else — never from
//! a path, query or body.

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use wor_core::audit::Actor;
use wor_core::{ApiKeyId, MemberId, ProjectId, Role};
use wor_store::AuthenticatedKey;

use crate::AppState;
use crate::error::ApiError;

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    pub project_id: ProjectId,
    pub key_id: ApiKeyId,
    /// The member a personal key acts as; `None` for a service key.
    pub member_id: Option<MemberId>,
    pub role: Role,
}

impl From<AuthenticatedKey> for Caller {
    fn from(key: AuthenticatedKey) -> Self {
        Caller {
            project_id: key.project_id,
            key_id: key.key_id,
            member_id: key.member_id,
            role: key.role,
        }
    }
}

impl Caller {
    /// Configuration routes: routines, connections, policies, keys, members.
    pub fn require_configure(&self) -> Result<(), ApiError> {
        if self.role.can_configure() {
            Ok(())
        } else {
            Err(ApiError::Forbidden(format!(
                "role `{}` cannot change configuration; `admin` or `owner` is required",
                self.role
            )))
        }
    }

    /// Who the audit log records as having acted: the member behind a personal key, or the
    /// service key itself.
    pub fn actor(&self) -> Actor {
        match self.member_id {
            Some(member_id) => Actor::Member {
                member_id,
                key_id: self.key_id,
            },
            None => Actor::ApiKey {
                key_id: self.key_id,
            },
        }
    }

    /// The member this caller acts as, or a 403 for a service key.
    pub fn require_member(&self, action: &str) -> Result<MemberId, ApiError> {
        self.member_id.ok_or_else(|| {
            ApiError::Forbidden(format!("a service key cannot {action}; use a member's key"))
        })
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let header = parts
            .headers
            .get(AUTHORIZATION)
            .ok_or(ApiError::Unauthenticated)?;
        let token = header
            .to_str()
            .ok()
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(ApiError::Unauthenticated)?;
        let key = state
            .store
            .authenticate_api_key(token)
            .await?
            .ok_or(ApiError::Unauthenticated)?;
        Ok(key.into())
    }
}
