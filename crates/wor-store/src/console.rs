//! The web console's sign-in state: members' password hashes, single-use invitations,
//! server-side sessions and recent failed sign-ins.
//!
//! Invitation and session tokens are 256 bits from the operating system's random source,
//! shown once and stored as SHA-256 digests only. Passwords arrive here already hashed (an
//! argon2id PHC string); this module never sees one.

use std::fmt;

use rand::TryRngCore;
use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::canonical::sha256_hex;
use wor_core::{ApiKeyId, ConsoleSessionId, MemberId, ProjectId, Role};

use crate::staged::StagedEvent;
use crate::{Store, StoreError, now_millis, parse_column};

/// The text every invitation token starts with.
pub const INVITATION_TOKEN_PREFIX: &str = "wri_";
/// The text every single-use sign-in link's token starts with.
pub const SIGN_IN_LINK_TOKEN_PREFIX: &str = "wrl_";
/// The text every console session token starts with.
pub const SESSION_TOKEN_PREFIX: &str = "wrs_";

/// A freshly made token. Its `Debug` hides the value; read it with [`Self::expose`].
pub struct ConsoleToken(String);

impl ConsoleToken {
    pub(crate) fn generate(prefix: &str) -> Result<Self, StoreError> {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| StoreError::Corrupt(format!("random source failed: {e}")))?;
        Ok(Self(format!("{prefix}{}", hex::encode(bytes))))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ConsoleToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ConsoleToken(***)")
    }
}

/// An invitation that can still be used.
#[derive(Debug, Clone)]
pub struct InvitationRecord {
    pub project_id: ProjectId,
    pub member_id: MemberId,
    pub member_name: String,
    pub expires_at: i64,
}

/// A member who may sign in, with the stored hash to check a password against.
#[derive(Debug, Clone)]
pub struct SignInAccount {
    pub project_id: ProjectId,
    pub member_id: MemberId,
    pub phc: String,
}

/// A live console session, with its member's current role.
#[derive(Debug, Clone)]
pub struct ConsoleSessionRecord {
    pub id: ConsoleSessionId,
    pub project_id: ProjectId,
    pub member_id: MemberId,
    pub member_name: String,
    pub role: Role,
    /// The synchronizer token every form of this session carries.
    pub csrf_token: String,
}

/// How many rows [`Store::purge_console_state`] deleted, of each kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgedConsoleState {
    pub sessions: u64,
    pub invitations: u64,
    pub sign_in_links: u64,
    pub sign_in_failures: u64,
}

/// Where a console session was opened from, as the member will recognise it.
#[derive(Debug, Clone, Default)]
pub struct SessionOrigin {
    /// The client's address.
    pub address: String,
    /// The browser's `User-Agent`, cut to [`MAX_USER_AGENT_CHARS`].
    pub user_agent: String,
}

/// Longest `User-Agent` kept with a session.
pub const MAX_USER_AGENT_CHARS: usize = 200;

/// A live console session as listed to its member or an admin: never its token.
#[derive(Debug, Clone)]
pub struct ConsoleSessionSummary {
    pub id: ConsoleSessionId,
    pub member_id: MemberId,
    pub member_name: String,
    pub address: String,
    pub user_agent: String,
    pub created_at: i64,
    pub last_seen_at: i64,
    pub expires_at: i64,
}

/// How stale a session's idle clock may grow before a use of it is written down: a minute, or
/// a tenth of the idle limit when that is shorter.
fn session_seen_resolution_ms(idle_ms: i64) -> i64 {
    (idle_ms / 10).clamp(0, 60_000)
}

impl Store {
    /// Deletes what can no longer be used at `now`: sessions past their absolute expiry or
    /// unused for `idle_ms`, invitations past their expiry (used or not), and failed sign-ins
    /// from before `failures_before` (outside every lockout window).
    pub async fn purge_console_state(
        &self,
        now: i64,
        idle_ms: i64,
        failures_before: i64,
    ) -> Result<PurgedConsoleState, StoreError> {
        let sessions = sqlx::query(
            "DELETE FROM console_sessions WHERE expires_at <= $1 OR last_seen_at <= $2",
        )
        .bind(now)
        .bind(now.saturating_sub(idle_ms))
        .execute(&*self.write_pool().await?)
        .await?
        .rows_affected();
        let invitations = sqlx::query("DELETE FROM member_invitations WHERE expires_at <= $1")
            .bind(now)
            .execute(&*self.write_pool().await?)
            .await?
            .rows_affected();
        let sign_in_links = sqlx::query("DELETE FROM member_sign_in_links WHERE expires_at <= $1")
            .bind(now)
            .execute(&*self.write_pool().await?)
            .await?
            .rows_affected();
        let sign_in_failures = sqlx::query("DELETE FROM sign_in_failures WHERE at < $1")
            .bind(failures_before)
            .execute(&*self.write_pool().await?)
            .await?
            .rows_affected();
        Ok(PurgedConsoleState {
            sessions,
            invitations,
            sign_in_links,
            sign_in_failures,
        })
    }

    /// Makes a single-use invitation for `member`, valid for `ttl_ms`.
    pub async fn create_invitation(
        &self,
        project: ProjectId,
        member: MemberId,
        created_by: Option<ApiKeyId>,
        ttl_ms: i64,
    ) -> Result<(ConsoleToken, i64), StoreError> {
        let (token, expires_at, _) = self
            .create_invitation_staged(project, member, created_by, ttl_ms, None)
            .await?;
        Ok((token, expires_at))
    }

    /// [`Self::create_invitation`], staging `recorded`, when given, from the invitation's expiry
    /// time in the same transaction (`crate::staged`).
    pub async fn create_invitation_staged(
        &self,
        project: ProjectId,
        member: MemberId,
        created_by: Option<ApiKeyId>,
        ttl_ms: i64,
        recorded: Option<&(dyn Fn(i64) -> AuditEvent + Sync)>,
    ) -> Result<(ConsoleToken, i64, Option<StagedEvent>), StoreError> {
        let token = ConsoleToken::generate(INVITATION_TOKEN_PREFIX)?;
        let now = now_millis();
        let expires_at = now.saturating_add(ttl_ms);
        let mut tx = self.begin_write().await?;
        // A member has one live invitation: a new link spends the ones sent before it, so an
        // older link that leaked cannot set the password after the newer one did.
        spend_invitations(&mut tx, project, member, now).await?;
        sqlx::query(
            "INSERT INTO member_invitations (sha256, project_id, member_id, created_by, \
             created_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(sha256_hex(token.expose().as_bytes()))
        .bind(project.to_string())
        .bind(member.to_string())
        .bind(created_by.map(|k| k.to_string()))
        .bind(now)
        .bind(expires_at)
        .execute(&mut **tx)
        .await?;
        let staged =
            crate::staged::stage_some(&mut tx, recorded.map(|recorded| recorded(expires_at)))
                .await?;
        tx.commit().await?;
        Ok((token, expires_at, staged))
    }

    /// The invitation `presented` names, if it is unused and unexpired.
    pub async fn invitation(
        &self,
        presented: &str,
    ) -> Result<Option<InvitationRecord>, StoreError> {
        self.live_member_token("member_invitations", presented)
            .await
    }

    /// Uses invitation `presented` to set its member's password hash. `None` when the
    /// invitation is unknown, used or expired: it works once, and only before it expires.
    /// Stages `recorded`, the `member.set_password` entry, in the same transaction
    /// (`crate::staged`).
    pub async fn accept_invitation(
        &self,
        presented: &str,
        phc: &str,
        recorded: &(dyn Fn(&InvitationRecord) -> AuditEvent + Sync),
    ) -> Result<Option<(InvitationRecord, StagedEvent)>, StoreError> {
        let Some(invitation) = self.invitation(presented).await? else {
            return Ok(None);
        };
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        // INVARIANT: the update is the single-use check; of two concurrent uses one matches.
        let used = sqlx::query(
            "UPDATE member_invitations SET used_at = $1 \
             WHERE sha256 = $2 AND used_at IS NULL AND expires_at > $1",
        )
        .bind(now)
        .bind(sha256_hex(presented.as_bytes()))
        .execute(&mut **tx)
        .await?;
        if used.rows_affected() != 1 {
            return Ok(None);
        }
        // The password set, no other invitation of the member's may set it again.
        spend_invitations(&mut tx, invitation.project_id, invitation.member_id, now).await?;
        sqlx::query("DELETE FROM member_passwords WHERE member_id = $1")
            .bind(invitation.member_id.to_string())
            .execute(&mut **tx)
            .await?;
        // A new password ends every session opened with the old one.
        sqlx::query("DELETE FROM console_sessions WHERE member_id = $1")
            .bind(invitation.member_id.to_string())
            .execute(&mut **tx)
            .await?;
        sqlx::query(
            "INSERT INTO member_passwords (member_id, project_id, phc, set_at) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(invitation.member_id.to_string())
        .bind(invitation.project_id.to_string())
        .bind(phc)
        .bind(now)
        .execute(&mut **tx)
        .await?;
        let staged = crate::staged::stage_one(&mut tx, recorded(&invitation)).await?;
        tx.commit().await?;
        Ok(Some((invitation, staged)))
    }

    /// Makes a single-use link that signs `member` in without a password, valid for `ttl_ms`,
    /// staging `recorded` (from its expiry time), its `member.sign_in_link` entry, in the same
    /// transaction (`crate::staged`).
    pub async fn create_sign_in_link(
        &self,
        project: ProjectId,
        member: MemberId,
        ttl_ms: i64,
        recorded: &(dyn Fn(i64) -> AuditEvent + Sync),
    ) -> Result<(ConsoleToken, i64, StagedEvent), StoreError> {
        let token = ConsoleToken::generate(SIGN_IN_LINK_TOKEN_PREFIX)?;
        let now = now_millis();
        let expires_at = now.saturating_add(ttl_ms);
        let mut tx = self.begin_write().await?;
        let inserted = sqlx::query(
            "INSERT INTO member_sign_in_links (sha256, project_id, member_id, created_at, \
             expires_at) SELECT $1, project_id, id, $4, $5 FROM members \
             WHERE project_id = $2 AND id = $3",
        )
        .bind(sha256_hex(token.expose().as_bytes()))
        .bind(project.to_string())
        .bind(member.to_string())
        .bind(now)
        .bind(expires_at)
        .execute(&mut **tx)
        .await?;
        // A member of another project, or none, gets no link.
        if inserted.rows_affected() != 1 {
            return Err(StoreError::NotFound);
        }
        let staged = crate::staged::stage_one(&mut tx, recorded(expires_at)).await?;
        tx.commit().await?;
        Ok((token, expires_at, staged))
    }

    /// The sign-in link `presented` names, if it is unused and unexpired.
    pub async fn sign_in_link(
        &self,
        presented: &str,
    ) -> Result<Option<InvitationRecord>, StoreError> {
        self.live_member_token("member_sign_in_links", presented)
            .await
    }

    /// The unused, unexpired row of `table` (one of the member token tables, named by this
    /// module only) whose digest is `presented`'s, with its member's name.
    async fn live_member_token(
        &self,
        table: &'static str,
        presented: &str,
    ) -> Result<Option<InvitationRecord>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT t.project_id, t.member_id, t.expires_at, m.name FROM {table} t \
             JOIN members m ON m.id = t.member_id AND m.project_id = t.project_id \
             WHERE t.sha256 = $1 AND t.used_at IS NULL AND t.expires_at > $2"
        )))
        .bind(sha256_hex(presented.as_bytes()))
        .bind(now_millis())
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let project_id: String = row.try_get("project_id")?;
        let member_id: String = row.try_get("member_id")?;
        Ok(Some(InvitationRecord {
            project_id: parse_column(&project_id, &format!("{table}.project_id"))?,
            member_id: parse_column(&member_id, &format!("{table}.member_id"))?,
            member_name: row.try_get("name")?,
            expires_at: row.try_get("expires_at")?,
        }))
    }

    /// Uses sign-in link `presented`: `None` when it is unknown, used or expired, so it works
    /// once, and only before it expires.
    pub async fn use_sign_in_link(
        &self,
        presented: &str,
    ) -> Result<Option<InvitationRecord>, StoreError> {
        let Some(link) = self.sign_in_link(presented).await? else {
            return Ok(None);
        };
        // INVARIANT: the update is the single-use check; of two concurrent uses one matches.
        let used = sqlx::query(
            "UPDATE member_sign_in_links SET used_at = $1 \
             WHERE sha256 = $2 AND used_at IS NULL AND expires_at > $1",
        )
        .bind(now_millis())
        .bind(sha256_hex(presented.as_bytes()))
        .execute(&*self.write_pool().await?)
        .await?;
        Ok((used.rows_affected() == 1).then_some(link))
    }

    /// The member named `member` in the project named `project`, if they have a password.
    pub async fn sign_in_account(
        &self,
        project: &str,
        member: &str,
    ) -> Result<Option<SignInAccount>, StoreError> {
        let row = sqlx::query(
            "SELECT m.project_id, m.id, pw.phc FROM projects p \
             JOIN members m ON m.project_id = p.id \
             JOIN member_passwords pw ON pw.member_id = m.id AND pw.project_id = m.project_id \
             WHERE p.name = $1 AND m.name = $2",
        )
        .bind(project)
        .bind(member)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let project_id: String = row.try_get("project_id")?;
        let member_id: String = row.try_get("id")?;
        Ok(Some(SignInAccount {
            project_id: parse_column(&project_id, "members.project_id")?,
            member_id: parse_column(&member_id, "members.id")?,
            phc: row.try_get("phc")?,
        }))
    }

    /// The id of the project named `name`, if there is one.
    pub async fn project_id_by_name(&self, name: &str) -> Result<Option<ProjectId>, StoreError> {
        let id: Option<String> = sqlx::query_scalar("SELECT id FROM projects WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        id.map(|id| parse_column(&id, "projects.id")).transpose()
    }

    /// Starts a session for `member` that ends `absolute_ms` from now at the latest. Returns
    /// the session token (for the cookie) and the session's CSRF token.
    pub async fn create_console_session(
        &self,
        project: ProjectId,
        member: MemberId,
        absolute_ms: i64,
        origin: &SessionOrigin,
    ) -> Result<ConsoleToken, StoreError> {
        let (token, _) = self
            .create_console_session_staged(project, member, absolute_ms, origin, None)
            .await?;
        Ok(token)
    }

    /// [`Self::create_console_session`], staging `recorded`, when given, its `console.sign_in`
    /// entry, in the same transaction (`crate::staged`).
    pub async fn create_console_session_staged(
        &self,
        project: ProjectId,
        member: MemberId,
        absolute_ms: i64,
        origin: &SessionOrigin,
        recorded: Option<AuditEvent>,
    ) -> Result<(ConsoleToken, Option<StagedEvent>), StoreError> {
        let token = ConsoleToken::generate(SESSION_TOKEN_PREFIX)?;
        let csrf = ConsoleToken::generate("")?;
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO console_sessions (sha256, id, project_id, member_id, csrf_token, \
             created_at, last_seen_at, expires_at, address, user_agent) \
             VALUES ($1, $2, $3, $4, $5, $6, $6, $7, $8, $9)",
        )
        .bind(sha256_hex(token.expose().as_bytes()))
        .bind(ConsoleSessionId::new().to_string())
        .bind(project.to_string())
        .bind(member.to_string())
        .bind(csrf.expose())
        .bind(now)
        .bind(now.saturating_add(absolute_ms))
        .bind(&origin.address)
        .bind(
            origin
                .user_agent
                .chars()
                .take(MAX_USER_AGENT_CHARS)
                .collect::<String>(),
        )
        .execute(&mut **tx)
        .await?;
        let staged = crate::staged::stage_some(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok((token, staged))
    }

    /// The live sessions of `project` (of `member` only, when given), most recently used first.
    pub async fn list_console_sessions(
        &self,
        project: ProjectId,
        member: Option<MemberId>,
        idle_ms: i64,
    ) -> Result<Vec<ConsoleSessionSummary>, StoreError> {
        let now = now_millis();
        let rows = sqlx::query(
            "SELECT s.id, s.member_id, m.name, s.address, s.user_agent, s.created_at, \
             s.last_seen_at, s.expires_at FROM console_sessions s \
             JOIN members m ON m.id = s.member_id AND m.project_id = s.project_id \
             WHERE s.project_id = $1 AND ($2 IS NULL OR s.member_id = $2) \
             AND s.expires_at > $3 AND s.last_seen_at > $4 \
             ORDER BY s.last_seen_at DESC, s.id LIMIT 500",
        )
        .bind(project.to_string())
        .bind(member.map(|m| m.to_string()))
        .bind(now)
        .bind(now.saturating_sub(idle_ms))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|row| {
                let id: String = row.try_get("id")?;
                let member_id: String = row.try_get("member_id")?;
                Ok(ConsoleSessionSummary {
                    id: parse_column(&id, "console_sessions.id")?,
                    member_id: parse_column(&member_id, "console_sessions.member_id")?,
                    member_name: row.try_get("name")?,
                    address: row.try_get("address")?,
                    user_agent: row.try_get("user_agent")?,
                    created_at: row.try_get("created_at")?,
                    last_seen_at: row.try_get("last_seen_at")?,
                    expires_at: row.try_get("expires_at")?,
                })
            })
            .collect()
    }

    /// Ends session `id` of `project`, if it belongs to `member` (any member's, when `None`).
    /// Returns the member whose session it was, with `recorded` (from that member), its
    /// `console.session_revoke` entry, staged in the same transaction (`crate::staged`); `None`
    /// when there is no such session there, and nothing is staged.
    pub async fn revoke_console_session(
        &self,
        project: ProjectId,
        id: ConsoleSessionId,
        member: Option<MemberId>,
        recorded: &(dyn Fn(MemberId) -> AuditEvent + Sync),
    ) -> Result<Option<(MemberId, StagedEvent)>, StoreError> {
        let mut tx = self.begin_write().await?;
        let owner: Option<String> = sqlx::query_scalar(
            "DELETE FROM console_sessions WHERE project_id = $1 AND id = $2 \
             AND ($3 IS NULL OR member_id = $3) RETURNING member_id",
        )
        .bind(project.to_string())
        .bind(id.to_string())
        .bind(member.map(|m| m.to_string()))
        .fetch_optional(&mut **tx)
        .await?;
        let Some(owner) = owner else {
            return Ok(None);
        };
        let owner: MemberId = parse_column(&owner, "console_sessions.member_id")?;
        let staged = crate::staged::stage_one(&mut tx, recorded(owner)).await?;
        tx.commit().await?;
        Ok(Some((owner, staged)))
    }

    /// The live session `presented` names: not past its absolute expiry, and used within the
    /// last `idle_ms`. Using it refreshes its idle clock once the clock is a minute old (or a
    /// tenth of `idle_ms`, when that is shorter): a session in steady use is written on one
    /// request a minute, not on every one, and ends after between nine tenths of `idle_ms` and
    /// all of it unused. The refresh is not a condition of the answer: when the database is too
    /// busy to take it (this process's turn to write, or SQLite's lock, not had in time), the
    /// live session is answered all the same and a later use refreshes it.
    pub async fn console_session(
        &self,
        presented: &str,
        idle_ms: i64,
    ) -> Result<Option<ConsoleSessionRecord>, StoreError> {
        let now = now_millis();
        let Some((digest, row)) = self.live_session(presented, idle_ms, now).await? else {
            return Ok(None);
        };
        let last_seen_at: i64 = row.try_get("last_seen_at")?;
        if now.saturating_sub(last_seen_at) >= session_seen_resolution_ms(idle_ms) {
            // Never moved back by a request that read the session before another's refresh.
            self.write_if_not_busy("console_session.last_seen_at", async {
                sqlx::query(
                    "UPDATE console_sessions SET last_seen_at = $1 \
                     WHERE sha256 = $2 AND last_seen_at < $1",
                )
                .bind(now)
                .bind(&digest)
                .execute(&*self.write_pool().await?)
                .await?;
                Ok(())
            })
            .await?;
        }
        let id: String = row.try_get("id")?;
        let project_id: String = row.try_get("project_id")?;
        let member_id: String = row.try_get("member_id")?;
        let role: String = row.try_get("role")?;
        Ok(Some(ConsoleSessionRecord {
            id: parse_column(&id, "console_sessions.id")?,
            project_id: parse_column(&project_id, "console_sessions.project_id")?,
            member_id: parse_column(&member_id, "console_sessions.member_id")?,
            member_name: row.try_get("name")?,
            role: parse_column(&role, "members.role")?,
            csrf_token: row.try_get("csrf_token")?,
        }))
    }

    /// Whether the session `presented` names is live, as [`Store::console_session`] finds it,
    /// without using it: what a long-lived answer (a page's live updates) asks again as it
    /// goes, so that it ends with its session but does not keep it from idling out.
    pub async fn console_session_opens(
        &self,
        presented: &str,
        idle_ms: i64,
    ) -> Result<bool, StoreError> {
        Ok(self
            .live_session(presented, idle_ms, now_millis())
            .await?
            .is_some())
    }

    /// The live session `presented` names at `now`, by its digest, with its member.
    async fn live_session(
        &self,
        presented: &str,
        idle_ms: i64,
        now: i64,
    ) -> Result<Option<(String, sqlx::any::AnyRow)>, StoreError> {
        if !presented.starts_with(SESSION_TOKEN_PREFIX) {
            return Ok(None);
        }
        let digest = sha256_hex(presented.as_bytes());
        let row = sqlx::query(
            "SELECT s.id, s.project_id, s.member_id, s.csrf_token, s.last_seen_at, m.name, \
             m.role FROM console_sessions s \
             JOIN members m ON m.id = s.member_id AND m.project_id = s.project_id \
             WHERE s.sha256 = $1 AND s.expires_at > $2 AND s.last_seen_at > $3",
        )
        .bind(&digest)
        .bind(now)
        .bind(now.saturating_sub(idle_ms))
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|row| (digest, row)))
    }

    /// Ends the session `presented` names (signing out), staging `recorded`, its
    /// `console.sign_out` entry, in the same transaction (`crate::staged`). Ending an unknown
    /// one does nothing and stages nothing.
    pub async fn end_console_session(
        &self,
        presented: &str,
        recorded: AuditEvent,
    ) -> Result<Option<StagedEvent>, StoreError> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query("DELETE FROM console_sessions WHERE sha256 = $1")
            .bind(sha256_hex(presented.as_bytes()))
            .execute(&mut **tx)
            .await?;
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        let staged = crate::staged::stage_one(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok(Some(staged))
    }

    /// Counts a sign-in attempt against each of `scopes` (an account with its limit, an
    /// address with its limit) before its password is checked. In one write transaction (on
    /// PostgreSQL under a lock per scope, taken in sorted order) it refuses with `None` when a
    /// scope already has its limit of failures since `since`; else it records a failure for each
    /// scope and returns when, for [`Self::release_sign_in_attempt`] to take back if the password
    /// is right. So attempts sent at once cannot all pass the count before any is recorded.
    pub async fn reserve_sign_in_attempt(
        &self,
        scopes: &[(&str, i64)],
        since: i64,
    ) -> Result<Option<i64>, StoreError> {
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        if self.backend() == crate::Backend::Postgres {
            let mut names: Vec<&str> = scopes.iter().map(|(scope, _)| *scope).collect();
            names.sort_unstable();
            for scope in names {
                sqlx::query(
                    "SELECT 1 AS locked FROM (SELECT pg_advisory_xact_lock(hashtext($1))) AS l",
                )
                .bind(scope)
                .fetch_one(&mut **tx)
                .await?;
            }
        }
        for (scope, limit) in scopes {
            let failures: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM sign_in_failures WHERE scope = $1 AND at > $2",
            )
            .bind(*scope)
            .bind(since)
            .fetch_one(&mut **tx)
            .await?;
            if failures >= *limit {
                return Ok(None);
            }
        }
        for (scope, _) in scopes {
            sqlx::query("INSERT INTO sign_in_failures (scope, at) VALUES ($1, $2)")
                .bind(*scope)
                .bind(now)
                .execute(&mut **tx)
                .await?;
        }
        tx.commit().await?;
        Ok(Some(now))
    }

    /// Takes back the failures [`Self::reserve_sign_in_attempt`] recorded at `at` for `scopes`:
    /// the password was right.
    pub async fn release_sign_in_attempt(
        &self,
        scopes: &[&str],
        at: i64,
    ) -> Result<(), StoreError> {
        for scope in scopes {
            sqlx::query("DELETE FROM sign_in_failures WHERE scope = $1 AND at = $2")
                .bind(*scope)
                .bind(at)
                .execute(&*self.write_pool().await?)
                .await?;
        }
        Ok(())
    }

    /// How many sign-ins failed for `scope` since `since` (milliseconds since the epoch).
    pub async fn sign_in_failures(&self, scope: &str, since: i64) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar(
                "SELECT COUNT(*) FROM sign_in_failures WHERE scope = $1 AND at > $2",
            )
            .bind(scope)
            .bind(since)
            .fetch_one(&self.pool)
            .await?,
        )
    }

    /// Forgets the failures of `scope` (after a successful sign-in) and any older than
    /// `before` everywhere.
    pub async fn clear_sign_in_failures(&self, scope: &str, before: i64) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sign_in_failures WHERE scope = $1 OR at < $2")
            .bind(scope)
            .bind(before)
            .execute(&*self.write_pool().await?)
            .await?;
        Ok(())
    }
}

/// Marks every invitation of `member` not used yet as used at `now`, in `tx`.
async fn spend_invitations(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    project: ProjectId,
    member: MemberId,
    now: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE member_invitations SET used_at = $1 \
         WHERE project_id = $2 AND member_id = $3 AND used_at IS NULL",
    )
    .bind(now)
    .bind(project.to_string())
    .bind(member.to_string())
    .execute(&mut **tx)
    .await?;
    Ok(())
}
