//! Who is calling: the API key in `Authorization: Bearer …`, resolved to its project and role;
//! or a run's own credential (`wrt_…`, S14), which [`run_credential_gate`] lets through to
//! [`RUN_CREDENTIAL_ROUTES`] only.
//!
//! INVARIANT: the project a request acts on comes from here and from nowhere else — never from
//! a path, query or body.
//! INVARIANT: a run credential never reaches a handler that takes a [`Caller`]: configuration,
//! approvals, keys, members, other runs — all refuse it with 403 before any handler runs (a
//! token shaped like one that is not live with 401); the internal API refuses every bearer
//! itself.

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use wor_core::audit::Actor;
use wor_core::{ApiKeyId, MemberId, ProjectId, Role};
use wor_store::{AuthenticatedKey, RUN_TOKEN_PREFIX, RunGrant};

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
        require_configure(self.role)
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

/// Where every route of the internal API lives (`internal.rs`); none takes a bearer credential.
const INTERNAL_PATH_PREFIX: &str = "/internal/";

/// The routes a run credential may call: reading its own run. Everything else refuses it.
pub const RUN_CREDENTIAL_ROUTES: &[(Method, &str)] = &[(Method::GET, "/v1/run")];

/// The bearer token of a request, if it has one. The scheme name is case-insensitive
/// (RFC 9110 section 11.1): `Bearer`, `bearer` and `BEARER` are one scheme.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// Refuses a run credential on every route but [`RUN_CREDENTIAL_ROUTES`], before routing, so a
/// route added later is closed to it by default: a live one with 403, and a token that only
/// looks like one (unknown, expired, or of a run that is not running) with the 401 of any
/// credential that is not one. The internal API's routes refuse every bearer themselves (401
/// `bearer_refused`), so this gate leaves them to it and looks nothing up for them.
pub async fn run_credential_gate(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let run_credential =
        bearer(request.headers()).filter(|token| token.starts_with(RUN_TOKEN_PREFIX));
    if let Some(token) = run_credential
        && !request.uri().path().starts_with(INTERNAL_PATH_PREFIX)
        && !RUN_CREDENTIAL_ROUTES
            .iter()
            .any(|(method, path)| request.method() == method && request.uri().path() == *path)
    {
        match state.store.authenticate_run_token(token).await {
            Ok(Some(_)) => {}
            Ok(None) => return ApiError::Unauthenticated.into_response(),
            Err(err) => return ApiError::from(err).into_response(),
        }
        tracing::warn!(category = "auth", action = "run_credential.refused",
            method = %request.method(), "a run credential was refused");
        return ApiError::Forbidden(
            "a run's credential can only read its own run (GET /v1/run); it cannot call this route"
                .to_owned(),
        )
        .into_response();
    }
    next.run(request).await
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let token = bearer(&parts.headers).ok_or(ApiError::Unauthenticated)?;
        if token.starts_with(RUN_TOKEN_PREFIX) {
            // The gate refuses these before routing; this holds even without it.
            return Err(ApiError::Forbidden(
                "a run's credential cannot call this route".to_owned(),
            ));
        }
        let key = state
            .store
            .authenticate_api_key(token)
            .await?
            .ok_or(ApiError::Unauthenticated)?;
        Ok(key.into())
    }
}

/// A caller whose role may change the project's configuration, checked before anything else
/// of the request is read: a caller without that role is refused with the 403 of
/// [`require_configure`] whatever its body holds, and a body is never read for it. Used by the
/// routes that create something, whose path names nothing to look up first (a route that names
/// another project's resource answers 404 before it answers 403, and takes a [`Caller`]). Where
/// such a route calls a function the console calls too, that function checks the role again.
#[derive(Debug, Clone)]
pub struct Configurer(pub Caller);

impl FromRequestParts<AppState> for Configurer {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let caller = Caller::from_request_parts(parts, state).await?;
        caller.require_configure()?;
        Ok(Configurer(caller))
    }
}

/// A run acting with its own credential: one running run of one project, until its deadline.
#[derive(Debug, Clone)]
pub struct RunCaller(pub RunGrant);

impl FromRequestParts<AppState> for RunCaller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let token = bearer(&parts.headers).ok_or(ApiError::Unauthenticated)?;
        let grant = state
            .store
            .authenticate_run_token(token)
            .await?
            .ok_or(ApiError::Unauthenticated)?;
        Ok(RunCaller(grant))
    }
}

/// `Ok` when `role` may change the project's configuration (`admin` or `owner`), else the 403
/// every configuration route answers.
pub(crate) fn require_configure(role: Role) -> Result<(), ApiError> {
    if role.can_configure() {
        Ok(())
    } else {
        Err(ApiError::Forbidden(format!(
            "role `{role}` cannot change configuration; `admin` or `owner` is required"
        )))
    }
}
