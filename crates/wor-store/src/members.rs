//! Members of a project and their roles.

use sqlx::{Any, Row, Transaction};
use wor_core::{MemberId, ProjectId, Role};

use crate::{Store, StoreError, conflict_or, now_millis, parse_column};

#[derive(Debug, Clone, serde::Serialize)]
pub struct MemberRecord {
    pub id: MemberId,
    pub project_id: ProjectId,
    pub name: String,
    pub role: Role,
    pub created_at: i64,
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
        let member = MemberRecord {
            id: MemberId::new(),
            project_id: project,
            name: name.to_owned(),
            role,
            created_at: now_millis(),
        };
        let mut tx = self.begin_write().await?;
        insert(&mut tx, &member).await?;
        tx.commit().await?;
        Ok(member)
    }

    pub async fn get_member(
        &self,
        project: ProjectId,
        id: MemberId,
    ) -> Result<MemberRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM members WHERE project_id = $1 AND id = $2"
        )))
        .bind(project.to_string())
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound)?;
        member_from_row(&row)
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
