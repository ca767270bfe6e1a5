//! Members of a project and their roles.

use sqlx::{Any, Row, Transaction};
use wor_core::audit::AuditEvent;
use wor_core::{MemberId, ProjectId, Role};

use crate::api_keys::{live_owner_keys, lock_project};
use crate::staged::StagedEvent;
use crate::{Store, StoreError, conflict_or, now_millis, parse_column};

#[derive(Debug, Clone, serde::Serialize)]
pub struct MemberRecord {
    pub id: MemberId,
    pub project_id: ProjectId,
    pub name: String,
    pub role: Role,
    pub created_at: i64,
}

/// Who asks for a role change: the role they act with, and the member they are (`None` for a
/// service key).
#[derive(Debug, Clone, Copy)]
pub struct RoleChanger {
    pub role: Role,
    pub member: Option<MemberId>,
}

/// A member after a role change, and the role they had before it.
#[derive(Debug, Clone)]
pub struct RoleChange {
    pub member: MemberRecord,
    pub previous: Role,
}

impl RoleChange {
    /// Whether the role is different now: asking for the role a member has changes nothing.
    pub fn changed(&self) -> bool {
        self.member.role != self.previous
    }
}

const COLUMNS: &str = "id, project_id, name, role, created_at";

pub(crate) async fn insert(
    tx: &mut Transaction<'_, Any>,
    member: &MemberRecord,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO members (id, project_id, name, role, created_at) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(member.id.to_string())
    .bind(member.project_id.to_string())
    .bind(&member.name)
    .bind(member.role.as_str())
    .bind(member.created_at)
    .execute(&mut **tx)
    .await
    .map_err(|e| {
        conflict_or(e, || {
            format!("a member named `{}` already exists", member.name)
        })
    })?;
    Ok(())
}

impl Store {
    pub async fn create_member(
        &self,
        project: ProjectId,
        name: &str,
        role: Role,
    ) -> Result<MemberRecord, StoreError> {
        let (member, _) = self.create_member_staged(project, name, role, None).await?;
        Ok(member)
    }

    /// [`Self::create_member`], staging `recorded`, when given, from the new member in the same
    /// transaction (`crate::staged`).
    pub async fn create_member_staged(
        &self,
        project: ProjectId,
        name: &str,
        role: Role,
        recorded: Option<&(dyn Fn(&MemberRecord) -> AuditEvent + Sync)>,
    ) -> Result<(MemberRecord, Option<StagedEvent>), StoreError> {
        let member = MemberRecord {
            id: MemberId::new(),
            project_id: project,
            name: name.to_owned(),
            role,
            created_at: now_millis(),
        };
        let mut tx = self.begin_write().await?;
        insert(&mut tx, &member).await?;
        let staged =
            crate::staged::stage_some(&mut tx, recorded.map(|recorded| recorded(&member))).await?;
        tx.commit().await?;
        Ok((member, staged))
    }

    pub async fn get_member(
        &self,
        project: ProjectId,
        id: MemberId,
    ) -> Result<MemberRecord, StoreError> {
        fetch_member(&self.pool, project, id).await
    }

    /// Gives member `id` of `project` role `role`, for `by`.
    ///
    /// INVARIANT: checked in the transaction that changes it, under the project's lock, with
    /// the member's role and the changer's own role as they are then: the changer may
    /// configure and their role includes both the member's role and the new one
    /// ([`Role::may_change_role`], refused as [`StoreError::RoleChange`]); and the project
    /// keeps an `owner` member with a live personal `owner` key, so demoting the last one is
    /// refused with [`StoreError::LastOwner`] (two demotions at once cannot both pass).
    pub async fn change_member_role(
        &self,
        project: ProjectId,
        id: MemberId,
        role: Role,
        by: RoleChanger,
    ) -> Result<RoleChange, StoreError> {
        Ok(self
            .change_member_role_staged(project, id, role, by, None)
            .await?
            .0)
    }

    /// [`Store::change_member_role`] staging the change's `member.role_change` entry, made by
    /// `recorded`, when given, from the change, in the same transaction (`crate::staged`) when the
    /// role changed; asking for the role a member has stages nothing. The caller appends the entry
    /// with [`crate::AuditLog::append_staged`].
    pub async fn change_member_role_staged(
        &self,
        project: ProjectId,
        id: MemberId,
        role: Role,
        by: RoleChanger,
        recorded: Option<&(dyn Fn(&RoleChange) -> AuditEvent + Sync)>,
    ) -> Result<(RoleChange, Option<StagedEvent>), StoreError> {
        let mut tx = self.begin_write().await?;
        lock_project(&mut tx, project).await?;
        let member = fetch_member(&mut **tx, project, id).await?;
        // The changer's own membership as it is now: a demotion that committed after they
        // were authenticated holds here.
        let acting = match by.member {
            Some(changer) => by
                .role
                .at_most(fetch_member(&mut **tx, project, changer).await?.role),
            None => by.role,
        };
        acting
            .may_change_role(member.role, role)
            .map_err(StoreError::RoleChange)?;
        let previous = member.role;
        if previous == role {
            tx.rollback().await?;
            return Ok((RoleChange { member, previous }, None));
        }
        sqlx::query("UPDATE members SET role = $1 WHERE project_id = $2 AND id = $3")
            .bind(role.as_str())
            .bind(project.to_string())
            .bind(id.to_string())
            .execute(&mut **tx)
            .await?;
        if previous == Role::Owner && live_owner_keys(&mut tx, project).await? == 0 {
            tx.rollback().await?;
            return Err(StoreError::LastOwner { member_id: id });
        }
        let change = RoleChange {
            member: MemberRecord { role, ..member },
            previous,
        };
        let staged =
            crate::staged::stage_some(&mut tx, recorded.map(|recorded| recorded(&change))).await?;
        tx.commit().await?;
        Ok((change, staged))
    }

    pub async fn list_members(&self, project: ProjectId) -> Result<Vec<MemberRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM members WHERE project_id = $1 ORDER BY id"
        )))
        .bind(project.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(member_from_row).collect()
    }
}

/// Member `id` of `project`, read through `db`: the pool, or a transaction that must see it
/// as it is then.
async fn fetch_member<'c>(
    db: impl sqlx::Executor<'c, Database = Any>,
    project: ProjectId,
    id: MemberId,
) -> Result<MemberRecord, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM members WHERE project_id = $1 AND id = $2"
    )))
    .bind(project.to_string())
    .bind(id.to_string())
    .fetch_optional(db)
    .await?
    .ok_or(StoreError::NotFound)?;
    member_from_row(&row)
}

fn member_from_row(row: &sqlx::any::AnyRow) -> Result<MemberRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let project_id: String = row.try_get("project_id")?;
    let role: String = row.try_get("role")?;
    Ok(MemberRecord {
        id: parse_column(&id, "members.id")?,
        project_id: parse_column(&project_id, "members.project_id")?,
        name: row.try_get("name")?,
        role: parse_column(&role, "members.role")?,
        created_at: row.try_get("created_at")?,
    })
}
