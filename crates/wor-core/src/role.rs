//! Member roles and what each may do.

use std::fmt;
use std::str::FromStr;

/// A member's (or a service key's) role in one project, from most to least powerful.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything, including members and other owners.
    Owner,
    /// Configures routines, connections, keys and members below owner.
    Admin,
    /// Decides approvals; reads everything.
    Approver,
    /// Reads.
    Viewer,
}

/// The text was not one of the four role names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a role: expected owner, admin, approver or viewer")]
pub struct RoleParseError(pub String);

impl Role {
    pub const ALL: [Role; 4] = [Role::Owner, Role::Admin, Role::Approver, Role::Viewer];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Owner => "owner",
            Role::Admin => "admin",
            Role::Approver => "approver",
            Role::Viewer => "viewer",
        }
    }

    fn rank(self) -> u8 {
        match self {
            Role::Owner => 3,
            Role::Admin => 2,
            Role::Approver => 1,
            Role::Viewer => 0,
        }
    }

    /// May change configuration: routines, connections, policies, keys, members.
    pub fn can_configure(self) -> bool {
        self.rank() >= Role::Admin.rank()
    }

    /// May decide approvals. Whether a *particular* caller may decide a particular approval
    /// also depends on separation of duties, which the approval itself checks.
    pub fn can_approve(self) -> bool {
        matches!(self, Role::Owner | Role::Admin | Role::Approver)
    }

    /// May start and cancel runs: every role but `viewer`.
    pub fn can_operate_runs(self) -> bool {
        self != Role::Viewer
    }

    /// Whether this role is at least as powerful as `other`.
    pub fn includes(self, other: Role) -> bool {
        self.rank() >= other.rank()
    }

    /// May grant `other` to a new member or service key: never more than one holds.
    pub fn can_grant(self, other: Role) -> bool {
        self.can_configure() && self.includes(other)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = RoleParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| RoleParseError(s.chars().take(40).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_follow_the_ladder() {
        assert!(Role::Owner.can_configure() && Role::Admin.can_configure());
        assert!(!Role::Approver.can_configure() && !Role::Viewer.can_configure());
        assert!(Role::Approver.can_approve() && !Role::Viewer.can_approve());
        assert!(Role::Admin.can_grant(Role::Admin) && !Role::Admin.can_grant(Role::Owner));
        assert!(!Role::Approver.can_grant(Role::Viewer));
    }

    #[test]
    fn parses_exact_names_only() {
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
        }
        assert!("Owner".parse::<Role>().is_err());
        assert!("root".parse::<Role>().is_err());
    }
}
