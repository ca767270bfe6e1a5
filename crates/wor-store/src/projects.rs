//! Projects: the tenants. Creating one creates its owner member and owner key in the same
//! transaction, so a project never exists without someone who can manage it.

use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::{MemberId, ProjectId, Role};

use crate::api_keys::{self, ApiKeyKind, ApiKeyRecord, NewApiKey, PlaintextApiKey};
use crate::staged::StagedEvent;
use crate::{Store, StoreError, conflict_or, now_millis, parse_column};

/// The audit entries of a project made, from the project, its owner and the owner's key.
pub type ProjectEntries<'a> =
    dyn Fn(&ProjectRecord, &crate::MemberRecord, &ApiKeyRecord) -> Vec<AuditEvent> + Sync + 'a;

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

/// What an operator's owner recovery yields: the owner (new or existing) and a new owner key,
/// shown once.
#[derive(Debug)]
pub struct RecoveredOwner {
    pub owner: crate::MemberRecord,
    /// Whether the owner is a member created by the recovery.
    pub owner_created: bool,
    pub key: ApiKeyRecord,
    pub plaintext: PlaintextApiKey,
}

impl Store {
    /// Creates a project with an owner member named `owner_name` and a personal key for them.
    pub async fn create_project(
        &self,
        name: &str,
        owner_name: &str,
    ) -> Result<CreatedProject, StoreError> {
        let (created, _) = self.create_project_staged(name, owner_name, None).await?;
        Ok(created)
    }

    /// [`Self::create_project`], staging the entries `recorded`, when given, makes in the same
    /// transaction (`crate::staged`).
    pub async fn create_project_staged(
        &self,
        name: &str,
        owner_name: &str,
        recorded: Option<&ProjectEntries<'_>>,
    ) -> Result<(CreatedProject, Vec<StagedEvent>), StoreError> {
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
            .execute(&mut **tx)
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
        let (key, owner_key) = api_keys::insert(
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
        let staged = match recorded {
            Some(recorded) => {
                crate::staged::stage(&mut tx, recorded(&project, &owner, &key)).await?
            }
            None => Vec::new(),
        };
        tx.commit().await?;
        let created = CreatedProject {
            project,
            owner,
            owner_key,
        };
        Ok((created, staged))
    }

    /// Lets someone manage `project` again (an operator's recovery, when every owner key is
    /// lost): a new personal `owner` key for the owner member named `owner_name`, or, when the
    /// project has no member of that name, a new `owner` member with that key. A member of that
    /// name with a lower role is refused: recovery makes no one an owner who was not.
    ///
    /// Stages the entries `recorded` makes from what the recovery made in the same
    /// transaction (`crate::staged`).
    pub async fn recover_owner(
        &self,
        project: ProjectId,
        owner_name: &str,
        recorded: &(dyn Fn(&RecoveredOwner) -> Vec<AuditEvent> + Sync),
    ) -> Result<(RecoveredOwner, Vec<StagedEvent>), StoreError> {
        let mut tx = self.begin_write().await?;
        api_keys::lock_project(&mut tx, project).await?;
        let existing = sqlx::query(
            "SELECT id, role, created_at FROM members WHERE project_id = $1 AND name = $2",
        )
        .bind(project.to_string())
        .bind(owner_name)
        .fetch_optional(&mut **tx)
        .await?;
        let (owner, owner_created) = match existing {
            Some(row) => {
                let id: String = row.try_get("id")?;
                let role: String = row.try_get("role")?;
                let role: Role = parse_column(&role, "members.role")?;
                if role != Role::Owner {
                    return Err(StoreError::Conflict(format!(
                        "member `{owner_name}` has role `{role}`, not `owner`; name an owner or \
                         a new member"
                    )));
                }
                let member = crate::MemberRecord {
                    id: parse_column(&id, "members.id")?,
                    project_id: project,
                    name: owner_name.to_owned(),
                    role,
                    created_at: row.try_get("created_at")?,
                };
                (member, false)
            }
            None => {
                let member = crate::MemberRecord {
                    id: MemberId::new(),
                    project_id: project,
                    name: owner_name.to_owned(),
                    role: Role::Owner,
                    created_at: now_millis(),
                };
                crate::members::insert(&mut tx, &member).await?;
                (member, true)
            }
        };
        let (key, plaintext) = api_keys::insert(
            &mut tx,
            project,
            NewApiKey {
                name: format!("{owner_name} (recovered owner key)"),
                role: Role::Owner,
                kind: ApiKeyKind::Personal(owner.id),
                created_by: None,
            },
        )
        .await?;
        let recovered = RecoveredOwner {
            owner,
            owner_created,
            key,
            plaintext,
        };
        let staged = crate::staged::stage(&mut tx, recorded(&recovered)).await?;
        tx.commit().await?;
        Ok((recovered, staged))
    }

    /// The project named `name`.
    pub async fn find_project(&self, name: &str) -> Result<ProjectRecord, StoreError> {
        let row = sqlx::query("SELECT id, name, created_at FROM projects WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        project_from_row(&row)
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
