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

/// Why a caller may not change a member's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RoleChangeRefusal {
    #[error("role `{caller}` cannot change configuration; `admin` or `owner` is required")]
    CannotConfigure { caller: Role },
    #[error("role `{caller}` cannot change the role of a member who is `{member}`")]
    Outranked { caller: Role, member: Role },
    #[error("role `{caller}` cannot grant role `{role}`")]
    CannotGrant { caller: Role, role: Role },
}

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

    /// The less powerful of the two: what a personal key made with role `self` may do while
    /// its member holds `ceiling`.
    pub fn at_most(self, ceiling: Role) -> Role {
        if ceiling.includes(self) {
            self
        } else {
            ceiling
        }
    }

    /// Whether a caller with this role may change a member's role from `from` to `to`: a
    /// caller who may configure, whose role includes both the member's current role and the
    /// new one. Nobody grants above themselves, nor changes someone who outranks them.
    pub fn may_change_role(self, from: Role, to: Role) -> Result<(), RoleChangeRefusal> {
        if !self.can_configure() {
            return Err(RoleChangeRefusal::CannotConfigure { caller: self });
        }
        if !self.includes(from) {
            return Err(RoleChangeRefusal::Outranked {
                caller: self,
                member: from,
            });
        }
        if !self.can_grant(to) {
            return Err(RoleChangeRefusal::CannotGrant {
                caller: self,
                role: to,
            });
        }
        Ok(())
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
            .ok_or_else(|| RoleParseError(crate::quote::excerpt(s, 40)))
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
    fn a_role_change_stays_within_the_callers_own_role() {
        use RoleChangeRefusal::*;
        let (o, a, p, v) = (Role::Owner, Role::Admin, Role::Approver, Role::Viewer);
        assert_eq!(o.may_change_role(o, v), Ok(()));
        assert_eq!(o.may_change_role(v, o), Ok(()));
        assert_eq!(a.may_change_role(v, a), Ok(()));
        assert_eq!(a.may_change_role(a, p), Ok(()));
        assert_eq!(
            a.may_change_role(v, o),
            Err(CannotGrant { caller: a, role: o })
        );
        assert_eq!(
            a.may_change_role(o, v),
            Err(Outranked {
                caller: a,
                member: o
            })
        );
        assert_eq!(p.may_change_role(v, v), Err(CannotConfigure { caller: p }));
        for key in Role::ALL {
            for member in Role::ALL {
                let acting = key.at_most(member);
                assert!(key.includes(acting) && member.includes(acting));
                assert!(acting == key || acting == member);
            }
        }
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
