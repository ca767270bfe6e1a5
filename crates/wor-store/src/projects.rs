//! Projects: the tenants. Creating one creates its owner member and owner key in the same
//! transaction, so a project never exists without someone who can manage it.

use sqlx::Row;
use wor_core::{MemberId, ProjectId, Role};

use crate::api_keys::{self, ApiKeyKind, NewApiKey, PlaintextApiKey};
use crate::{Store, StoreError, conflict_or, now_millis, parse_column};

#[derive(Debug, Clone, serde::Serialize)]
pub struct ProjectRecord {
    pub id: ProjectId,
    pub name: String,
    pub created_at: i64,
}

/// What creating a project yields: the project, its owner and the owner's key, shown once.
#[derive(Debug)]
pub struct CreatedProject {
    pub project: ProjectRecord,
    pub owner: crate::MemberRecord,
    pub owner_key: PlaintextApiKey,
}

impl Store {
    /// Creates a project with an owner member named `owner_name` and a personal key for them.
    pub async fn create_project(
        &self,
        name: &str,
        owner_name: &str,
    ) -> Result<CreatedProject, StoreError> {
        let now = now_millis();
        let project = ProjectRecord {
            id: ProjectId::new(),
            name: name.to_owned(),
            created_at: now,
        };
        let mut tx = self.begin_write().await?;
        sqlx::query("INSERT INTO projects (id, name, created_at) VALUES ($1, $2, $3)")
            .bind(project.id.to_string())
            .bind(name)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(|e| conflict_or(e, || format!("a project named `{name}` already exists")))?;
        let owner = crate::MemberRecord {
            id: MemberId::new(),
            project_id: project.id,
            name: owner_name.to_owned(),
            role: Role::Owner,
            created_at: now,
        };
        crate::members::insert(&mut tx, &owner).await?;
        let (_, owner_key) = api_keys::insert(
            &mut tx,
            project.id,
            NewApiKey {
                name: format!("{owner_name} (initial owner key)"),
                role: Role::Owner,
                kind: ApiKeyKind::Personal(owner.id),
                created_by: None,
            },
        )
        .await?;
        tx.commit().await?;
        Ok(CreatedProject {
            project,
            owner,
            owner_key,
        })
    }

    pub async fn get_project(&self, id: ProjectId) -> Result<ProjectRecord, StoreError> {
        let row = sqlx::query("SELECT id, name, created_at FROM projects WHERE id = $1")
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        project_from_row(&row)
    }

    pub async fn list_projects(&self) -> Result<Vec<ProjectRecord>, StoreError> {
        let rows = sqlx::query("SELECT id, name, created_at FROM projects ORDER BY id")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(project_from_row).collect()
    }

    pub async fn count_projects(&self) -> Result<i64, StoreError> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM projects")
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get("n")?)
    }
}

fn project_from_row(row: &sqlx::any::AnyRow) -> Result<ProjectRecord, StoreError> {
    let id: String = row.try_get("id")?;
    Ok(ProjectRecord {
        id: parse_column(&id, "projects.id")?,
        name: row.try_get("name")?,
        created_at: row.try_get("created_at")?,
    })
}
