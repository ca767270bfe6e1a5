//! What the API returns: plain serialisable views of stored records. Views never carry a
//! secret; a key's value appears only in [`CreatedApiKey`], once.

use utoipa::ToSchema;
use wor_store::{ApiKeyRecord, MemberRecord, ProjectRecord};

/// Milliseconds of `duration`, saturating.
pub(crate) fn millis(duration: std::time::Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// RFC 3339 text of a stored millisecond timestamp.
pub fn rfc3339(millis: i64) -> String {
    chrono::DateTime::from_timestamp_millis(millis)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| millis.to_string())
}

#[derive(Debug, serde::Serialize, ToSchema)]
pub struct ProjectView {
    #[schema(example = "prj_0193b0c4d5e67f8091a2b3c4d5e6f708")]
    pub id: String,
    pub name: String,
    pub created_at: String,
}

impl From<ProjectRecord> for ProjectView {
    fn from(p: ProjectRecord) -> Self {
        ProjectView {
            id: p.id.to_string(),
            name: p.name,
            created_at: rfc3339(p.created_at),
        }
    }
}

#[derive(Debug, serde::Serialize, ToSchema)]
pub struct MemberView {
    pub id: String,
    pub name: String,
    /// One of `owner`, `admin`, `approver`, `viewer`.
    pub role: String,
    pub created_at: String,
}

impl From<MemberRecord> for MemberView {
    fn from(m: MemberRecord) -> Self {
        MemberView {
            id: m.id.to_string(),
            name: m.name,
            role: m.role.to_string(),
            created_at: rfc3339(m.created_at),
        }
    }
}

/// A key's metadata: its prefix identifies it; the key itself is never returned again.
#[derive(Debug, serde::Serialize, ToSchema)]
pub struct ApiKeyView {
    pub id: String,
    pub name: String,
    /// The role the key was made with.
    pub role: String,
    /// The role it acts with now: `role`, lowered to its member's current role for a personal
    /// key whose member was demoted.
    pub acts_as: String,
    /// A service key acts with its role and no person; it can never approve.
    pub service: bool,
    pub member_id: Option<String>,
    /// The first characters of the key, to recognise it.
    pub prefix: String,
    pub created_at: String,
    pub created_by: Option<String>,
    pub last_used_at: Option<String>,
    pub revoked_at: Option<String>,
}

impl From<ApiKeyRecord> for ApiKeyView {
    fn from(k: ApiKeyRecord) -> Self {
        ApiKeyView {
            id: k.id.to_string(),
            name: k.name,
            role: k.role.to_string(),
            acts_as: k.acts_as.to_string(),
            service: k.service,
            member_id: k.member_id.map(|m| m.to_string()),
            prefix: k.prefix,
            created_at: rfc3339(k.created_at),
            created_by: k.created_by.map(|c| c.to_string()),
            last_used_at: k.last_used_at.map(rfc3339),
            revoked_at: k.revoked_at.map(rfc3339),
        }
    }
}

/// A key just created: the only response that ever contains its value.
#[derive(Debug, serde::Serialize, ToSchema)]
pub struct CreatedApiKey {
    #[serde(flatten)]
    pub key: ApiKeyView,
    /// The key itself. Store it now: it is not shown again.
    pub api_key: String,
}

#[derive(Debug, serde::Serialize, ToSchema)]
pub struct WhoAmI {
    pub project: ProjectView,
    pub key_id: String,
    pub member_id: Option<String>,
    pub role: String,
    pub service: bool,
}
