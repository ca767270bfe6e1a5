//! The audit chain: events, entries, signed checkpoints, their canonical encodings and
//! hashes, and verification of a stored or exported chain. Pure: no I/O, no clock.
//!
//! Each project has its own chain. Entry `n` (numbered from 1) holds the hash of entry `n - 1`
//! (entry 1 holds [`GENESIS_HASH`]), and its own hash is SHA-256 over the canonical JSON of
//! every field but the hash itself (see `docs/audit.md`). A checkpoint is an ed25519
//! signature over the canonical JSON of `(project, seq, hash of entry seq, time, key id)`.

use std::collections::{BTreeMap, btree_map};
use std::fmt;

use ed25519_dalek::Signature;
pub use ed25519_dalek::VerifyingKey;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::canonical::{
    Member, canonical_object, canonical_object_hash, sha256_hex, to_canonical_json,
};
use crate::{ApiKeyId, MemberId, ProjectId, RoutineId, RunId};

/// The `prev_hash` of a chain's first entry.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";
/// The `format` field hashed into every entry: changing the encoding changes this.
pub const ENTRY_FORMAT: &str = "wor-audit-entry/1";
/// The `format` field of every signed checkpoint message.
pub const CHECKPOINT_FORMAT: &str = "wor-audit-checkpoint/1";

/// Who caused an event.
// INVARIANT: `Actor::tag_and_ids` writes the members these serde attributes give each variant
// (the audit body and the stored text are written from it); the body test compares the two
// for every variant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Actor {
    /// The operator, through a command that works on the database directly.
    Operator,
    /// A member, through their personal API key.
    Member {
        member_id: MemberId,
        key_id: ApiKeyId,
    },
    /// A service API key (no person).
    ApiKey { key_id: ApiKeyId },
    /// A member signed in to the web console (no API key involved).
    ConsoleMember { member_id: MemberId },
    /// Someone at the console's sign-in page who has not signed in.
    ConsoleVisitor,
    /// A routine's schedule.
    Schedule { routine_id: RoutineId },
    /// An inbound webhook of a routine.
    Webhook { routine_id: RoutineId },
    /// A run (for its own transitions and its model and tool calls).
    Run { run_id: RunId },
}

impl Actor {
    /// The canonical JSON text of the actor, as stored.
    pub fn canonical_json(&self) -> String {
        let (kind, ids) = self.tag_and_ids();
        canonical_object(&mut actor_members(kind, &ids))
    }

    /// The members of the actor's JSON form: its `kind` tag, and its ids by name as text.
    fn tag_and_ids(&self) -> (&'static str, Vec<(&'static str, String)>) {
        match self {
            Actor::Operator => ("operator", Vec::new()),
            Actor::Member { member_id, key_id } => (
                "member",
                vec![
                    ("member_id", member_id.to_string()),
                    ("key_id", key_id.to_string()),
                ],
            ),
            Actor::ApiKey { key_id } => ("api_key", vec![("key_id", key_id.to_string())]),
            Actor::ConsoleMember { member_id } => {
                ("console_member", vec![("member_id", member_id.to_string())])
            }
            Actor::ConsoleVisitor => ("console_visitor", Vec::new()),
            Actor::Schedule { routine_id } => {
                ("schedule", vec![("routine_id", routine_id.to_string())])
            }
            Actor::Webhook { routine_id } => {
                ("webhook", vec![("routine_id", routine_id.to_string())])
            }
            Actor::Run { run_id } => ("run", vec![("run_id", run_id.to_string())]),
        }
    }
}

/// Declares [`AuditCategory`] with the stored name of each kind, from which both
/// [`AuditCategory::as_str`] and [`AuditCategory::from_name`] are made: a kind cannot have a
/// name one way and not the other.
macro_rules! audit_categories {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)+) => {
        /// What kind of thing happened. New kinds are added here as later features need them;
        /// the stored form is the text of [`AuditCategory::as_str`], so verification of old
        /// entries never depends on this list.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum AuditCategory {
            $($(#[$doc])* $variant,)+
        }

        impl AuditCategory {
            /// Every kind, in the order declared.
            pub const ALL: &'static [AuditCategory] = &[$(AuditCategory::$variant,)+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(AuditCategory::$variant => $name,)+
                }
            }

            /// The kind stored as `name`, if there is one.
            pub fn from_name(name: &str) -> Option<AuditCategory> {
                match name {
                    $($name => Some(AuditCategory::$variant),)+
                    _ => None,
                }
            }
        }
    };
}

audit_categories! {
    ProjectCreate => "project.create",
    MemberCreate => "member.create",
    KeyCreate => "key.create",
    KeyRevoke => "key.revoke",
    ModelConnectionCreate => "model_connection.create",
    ModelConnectionSetKey => "model_connection.set_key",
    ModelConnectionRevoke => "model_connection.revoke",
    RoutineApply => "routine.apply",
    RunStart => "run.start",
    RunCancel => "run.cancel",
    RunEnd => "run.end",
    ModelCall => "model.call",
    ToolCall => "tool.call",
    SecretUse => "secret.use",
    ToolConnectionCreate => "connection.create",
    ToolConnectionEnable => "connection.enable",
    ToolConnectionDisable => "connection.disable",
    /// An `http_api` connection's tools were replaced (written again or imported again).
    ToolConnectionUpdateTools => "connection.update_tools",
    /// A tool connection's live tools changed from its pins (S9).
    ToolConnectionQuarantine => "connection.quarantine",
    /// A tool connection was authorized (MCP authorization); never carries a token.
    ToolConnectionAuthorize => "connection.authorize",
    /// A tool connection's access token was refreshed; never carries a token.
    ToolConnectionTokenRefresh => "connection.token_refresh",
    /// A tool connection's authorization or refresh failed.
    ToolConnectionAuthorizeFailure => "connection.authorize_failure",
    /// A tool connection's server refused a run's call for its access token's scope: the
    /// connection's next authorization asks for the wider scope. Never carries a token.
    ToolConnectionScopeStepUp => "connection.scope_step_up",
    /// A run parked a tool call for a person's decision.
    ApprovalRequest => "approval.request",
    /// A person approved or denied a call.
    ApprovalDecide => "approval.decide",
    /// Nobody decided before the approval expired.
    ApprovalExpire => "approval.expire",
    /// A run used an approval to execute its call.
    ApprovalUse => "approval.use",
    /// The project's policy was set or reset.
    PolicySet => "policy.set",
    /// A routine's webhook secret was made or replaced.
    WebhookSecretRotate => "routine.webhook_secret",
    /// A member's role was changed.
    MemberRoleChange => "member.role_change",
    /// A member was invited to set a console password.
    MemberInvite => "member.invite",
    /// A member set their console password through an invitation.
    MemberSetPassword => "member.set_password",
    /// A single-use sign-in link was made for a member.
    MemberSignInLink => "member.sign_in_link",
    /// A member signed in to the console.
    ConsoleSignIn => "console.sign_in",
    /// A console sign-in was refused (wrong name or password, or locked out).
    ConsoleSignInFailure => "console.sign_in_failure",
    /// A member signed out of the console.
    ConsoleSignOut => "console.sign_out",
    /// A console session was ended by its member or by an admin.
    ConsoleSessionRevoke => "console.session_revoke",
    /// A notification route was made.
    NotificationRouteCreate => "notification_route.create",
    /// A notification route was deleted.
    NotificationRouteDelete => "notification_route.delete",
    /// A member linked a Slack identity from a console session.
    SlackIdentityLink => "slack.link",
    /// A Slack user pressed Approve or Deny: what came of it, decided or refused.
    SlackInteraction => "slack.interaction",
}

/// Serialized as its stored name ([`AuditCategory::as_str`]).
impl Serialize for AuditCategory {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for AuditCategory {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        AuditCategory::from_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("no audit category is named `{name}`")))
    }
}

impl fmt::Display for AuditCategory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event to append, before the writer gives it a number, a time and a place in the chain.
///
/// ```
/// # use wor_core::audit::{Actor, AuditCategory, AuditEvent};
/// # use wor_core::{MemberId, ProjectId};
/// let event = AuditEvent::new(ProjectId::new(), AuditCategory::MemberCreate, Actor::Operator)
///     .subject("member_id", MemberId::new())
///     .payload(serde_json::json!({"role": "viewer"}));
/// assert_eq!(event.category(), AuditCategory::MemberCreate);
/// ```
///
/// Its JSON form is how an event staged with the change it records waits in the database for
/// the writer (`wor-store`'s `audit_staged`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditEvent {
    project_id: ProjectId,
    category: AuditCategory,
    actor: Actor,
    subjects: BTreeMap<String, String>,
    root_run_id: Option<RunId>,
    parent_run_id: Option<RunId>,
    payload: Value,
}

impl AuditEvent {
    pub fn new(project_id: ProjectId, category: AuditCategory, actor: Actor) -> Self {
        AuditEvent {
            project_id,
            category,
            actor,
            subjects: BTreeMap::new(),
            root_run_id: None,
            parent_run_id: None,
            payload: Value::Object(serde_json::Map::new()),
        }
    }

    /// Names a resource the event is about, such as `("key_id", key.id)`.
    pub fn subject(mut self, name: &str, id: impl fmt::Display) -> Self {
        self.subjects.insert(name.to_owned(), id.to_string());
        self
    }

    /// The run tree the event belongs to.
    pub fn runs(mut self, root: RunId, parent: Option<RunId>) -> Self {
        self.root_run_id = Some(root);
        self.parent_run_id = parent;
        self
    }

    /// The event's details. The chain stores the digest of this full value and a redacted copy.
    pub fn payload(mut self, payload: Value) -> Self {
        self.payload = payload;
        self
    }

    pub fn project_id(&self) -> ProjectId {
        self.project_id
    }

    pub fn category(&self) -> AuditCategory {
        self.category
    }

    /// Turns the event into the entry that follows `prev_hash` at `seq`, and the canonical
    /// JSON text of its payload as stored. The digest is taken over the full payload first;
    /// `redact` then redacts the payload to be stored and says whether it replaced anything,
    /// so that a payload left as it was is written as canonical text once, not three times.
    pub fn into_entry(
        self,
        seq: i64,
        at: i64,
        prev_hash: String,
        redact: impl FnOnce(&mut Value) -> bool,
    ) -> (AuditEntry, String) {
        let full = to_canonical_json(&self.payload);
        let payload_digest = sha256_hex(full.as_bytes());
        let mut payload = self.payload;
        let stored = if redact(&mut payload) {
            to_canonical_json(&payload)
        } else {
            full
        };
        let mut entry = AuditEntry {
            project_id: self.project_id,
            seq,
            at,
            actor: self.actor,
            category: self.category.as_str().to_owned(),
            subjects: self.subjects,
            root_run_id: self.root_run_id,
            parent_run_id: self.parent_run_id,
            payload_digest,
            payload,
            prev_hash,
            hash: String::new(),
        };
        entry.hash = entry.hash_with_payload(Member::Canonical(&stored));
        // INVARIANT: `redact` says whether it replaced anything; one that changed the payload
        // and said it did not would have the full payload stored and hashed. Every test build
        // checks the stored text against the entry.
        debug_assert_eq!(stored, to_canonical_json(&entry.payload));
        (entry, stored)
    }
}

/// One entry of a project's chain, as stored and exported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    pub project_id: ProjectId,
    /// Position in the project's chain, from 1, without gaps.
    pub seq: i64,
    /// Milliseconds since the Unix epoch.
    pub at: i64,
    pub actor: Actor,
    pub category: String,
    pub subjects: BTreeMap<String, String>,
    pub root_run_id: Option<RunId>,
    pub parent_run_id: Option<RunId>,
    /// SHA-256 of the canonical JSON of the full, unredacted payload.
    pub payload_digest: String,
    /// The payload with secrets redacted.
    pub payload: Value,
    pub prev_hash: String,
    /// SHA-256 of [`AuditEntry::canonical_body`].
    pub hash: String,
}

impl AuditEntry {
    /// The canonical JSON text the entry's hash is taken over: every field but `hash`, plus
    /// `format`.
    pub fn canonical_body(&self) -> String {
        self.with_body(Member::Json(&self.payload), canonical_object)
    }

    /// The hash this entry should carry.
    pub fn compute_hash(&self) -> String {
        self.hash_with_payload(Member::Json(&self.payload))
    }

    /// The canonical JSON text of the entry's subjects, as stored.
    pub fn subjects_canonical_json(&self) -> String {
        canonical_object(&mut subject_members(&self.subjects))
    }

    /// [`AuditEntry::compute_hash`] with the payload given as a value or as its canonical text,
    /// hashed as the body is written.
    fn hash_with_payload(&self, payload: Member<'_>) -> String {
        self.with_body(payload, canonical_object_hash)
    }

    /// `write` given the members of [`AuditEntry::canonical_body`], the payload as given. Each
    /// field is borrowed as it is, except the ids, written as their text.
    fn with_body(
        &self,
        payload: Member<'_>,
        write: impl FnOnce(&mut [(&str, Member<'_>)]) -> String,
    ) -> String {
        let (actor_kind, actor_ids) = self.actor.tag_and_ids();
        let project_id = self.project_id.to_string();
        let root_run_id = self.root_run_id.map(|id| id.to_string());
        let parent_run_id = self.parent_run_id.map(|id| id.to_string());
        let mut members = [
            ("format", Member::Text(ENTRY_FORMAT)),
            ("project_id", Member::Text(&project_id)),
            ("seq", Member::Int(self.seq)),
            ("at", Member::Int(self.at)),
            (
                "actor",
                Member::Object(actor_members(actor_kind, &actor_ids)),
            ),
            ("category", Member::Text(&self.category)),
            ("subjects", Member::Object(subject_members(&self.subjects))),
            ("root_run_id", text_or_null(root_run_id.as_deref())),
            ("parent_run_id", text_or_null(parent_run_id.as_deref())),
            ("payload_digest", Member::Text(&self.payload_digest)),
            ("prev_hash", Member::Text(&self.prev_hash)),
            ("payload", payload),
        ];
        write(&mut members)
    }
}

/// The members of an actor's JSON object, from its [`Actor::tag_and_ids`].
fn actor_members<'a>(
    kind: &'static str,
    ids: &'a [(&'static str, String)],
) -> Vec<(&'a str, Member<'a>)> {
    let mut members: Vec<(&str, Member<'_>)> = ids
        .iter()
        .map(|(name, id)| (*name, Member::Text(id)))
        .collect();
    members.push(("kind", Member::Text(kind)));
    members
}

/// The members of the subjects' JSON object.
fn subject_members(subjects: &BTreeMap<String, String>) -> Vec<(&str, Member<'_>)> {
    subjects
        .iter()
        .map(|(name, value)| (name.as_str(), Member::Text(value)))
        .collect()
}

/// A text member, or `null` when there is none.
fn text_or_null(text: Option<&str>) -> Member<'_> {
    text.map_or(Member::Null, Member::Text)
}

/// A signed statement that entry `seq` of a project's chain has hash `entry_hash`. Since each
/// entry holds its predecessor's hash, it fixes every entry up to `seq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditCheckpoint {
    pub project_id: ProjectId,
    pub seq: i64,
    pub entry_hash: String,
    /// Milliseconds since the Unix epoch.
    pub at: i64,
    /// [`key_id`] of the verifying key.
    pub key_id: String,
    /// Lower-case hex of the 64-byte ed25519 signature over [`checkpoint_message`].
    pub signature: String,
}

/// The bytes a checkpoint's signature covers.
pub fn checkpoint_message(
    project_id: ProjectId,
    seq: i64,
    entry_hash: &str,
    at: i64,
    key_id: &str,
) -> Vec<u8> {
    to_canonical_json(&json!({
        "format": CHECKPOINT_FORMAT,
        "project_id": project_id,
        "seq": seq,
        "entry_hash": entry_hash,
        "at": at,
        "key_id": key_id,
    }))
    .into_bytes()
}

impl AuditCheckpoint {
    /// The bytes this checkpoint's signature should cover.
    pub fn message(&self) -> Vec<u8> {
        checkpoint_message(
            self.project_id,
            self.seq,
            &self.entry_hash,
            self.at,
            &self.key_id,
        )
    }

    /// Whether the signature is a valid (strict) ed25519 signature of [`Self::message`].
    pub fn signature_is_valid(&self, key: &VerifyingKey) -> bool {
        let Ok(bytes) = hex::decode(&self.signature) else {
            return false;
        };
        let Ok(bytes) = <[u8; 64]>::try_from(bytes.as_slice()) else {
            return false;
        };
        key.verify_strict(&self.message(), &Signature::from_bytes(&bytes))
            .is_ok()
    }
}

/// A short, public name of a verifying key: the first 16 hex digits of SHA-256 over it.
pub fn key_id(key: &VerifyingKey) -> String {
    sha256_hex(key.as_bytes()).chars().take(16).collect()
}

/// A fact known from outside the database — "entry `seq` had hash `hash`" — taken, for
/// example, from an earlier verification or export. It lets verification notice a chain cut
/// back to before `seq`, which checkpoints in the same database cannot show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anchor {
    pub seq: i64,
    pub hash: String,
}

impl std::str::FromStr for Anchor {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (seq, hash) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}` is not of the form `SEQ:HASH`"))?;
        let seq = seq
            .parse::<i64>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("`{seq}` is not a sequence number"))?;
        if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("`{hash}` is not a hex SHA-256"));
        }
        Ok(Anchor {
            seq,
            hash: hash.to_ascii_lowercase(),
        })
    }
}

/// Why a chain is not intact. Each names what was found, not a guess at what the attacker did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BreakReason {
    /// An entry of another project sits in this project's chain.
    WrongProject,
    /// A stored column could not be read (it was altered into something malformed).
    Unreadable { column: String },
    /// The next entry does not carry the next number: entries were deleted or renumbered.
    Gap { found: i64 },
    /// The entry's contents do not produce its stored hash: the entry was modified.
    HashMismatch,
    /// The entry does not hold its predecessor's hash: entries were inserted, deleted or
    /// reordered (and hashes recomputed).
    BrokenLink,
    /// A checkpoint's signature does not verify under the key.
    BadSignature,
    /// A checkpoint names a key other than the one verification uses.
    UnknownKey { key_id: String },
    /// A checkpoint's project differs from the chain's.
    CheckpointWrongProject,
    /// A checkpoint's signed hash differs from the entry's: entries up to here were rewritten.
    CheckpointMismatch,
    /// A checkpoint covers an entry the chain does not have: the chain was cut short.
    Truncated { head: i64 },
    /// An anchor from outside names an entry whose hash differs.
    AnchorMismatch,
    /// An anchor from outside names an entry the chain does not have.
    AnchorMissing { head: i64 },
}

impl fmt::Display for BreakReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BreakReason::WrongProject => f.write_str("entry belongs to another project"),
            BreakReason::Unreadable { column } => {
                write!(f, "column `{column}` holds a malformed value")
            }
            BreakReason::Gap { found } => write!(
                f,
                "entry is missing: the next entry found is number {found} (deleted or renumbered entries)"
            ),
            BreakReason::HashMismatch => {
                f.write_str("entry contents do not match its hash (modified entry)")
            }
            BreakReason::BrokenLink => f.write_str(
                "entry does not hold the previous entry's hash (inserted, deleted or reordered entries)",
            ),
            BreakReason::BadSignature => f.write_str("checkpoint signature is invalid (forged or altered checkpoint)"),
            BreakReason::UnknownKey { key_id } => {
                write!(f, "checkpoint is signed by key `{key_id}`, not the verifying key")
            }
            BreakReason::CheckpointWrongProject => {
                f.write_str("checkpoint belongs to another project")
            }
            BreakReason::CheckpointMismatch => f.write_str(
                "entry hash differs from the one its signed checkpoint covers (rewritten chain)",
            ),
            BreakReason::Truncated { head } => write!(
                f,
                "a signed checkpoint covers this entry but the chain ends at {head} (truncated chain)"
            ),
            BreakReason::AnchorMismatch => {
                f.write_str("entry hash differs from the anchor given (rewritten chain)")
            }
            BreakReason::AnchorMissing { head } => write!(
                f,
                "the anchor names this entry but the chain ends at {head} (truncated chain)"
            ),
        }
    }
}

/// The first place a chain is not intact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainBreak {
    /// The first bad sequence number.
    pub seq: i64,
    pub reason: BreakReason,
}

impl fmt::Display for ChainBreak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "entry {}: {}", self.seq, self.reason)
    }
}

/// An intact chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainSummary {
    pub entries: i64,
    /// Hash of the last entry ([`GENESIS_HASH`] for an empty chain).
    pub head_hash: String,
    pub checkpoints: usize,
    pub last_checkpoint_seq: Option<i64>,
    /// Entries after the last checkpoint: their integrity rests on the hash chain alone, which
    /// anyone with write access to the database can recompute.
    pub unsigned_tail: i64,
}

/// The outcome of verifying a chain: a value, not an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verification {
    Intact(ChainSummary),
    Broken(ChainBreak),
}

/// Checks one project's chain entry by entry, so a store can stream it page by page.
///
/// Feed every entry in stored order (ascending `seq`) with [`ChainVerifier::push`], or report
/// an unreadable row with [`ChainVerifier::push_unreadable`], then call
/// [`ChainVerifier::finish`].
#[derive(Debug)]
pub struct ChainVerifier {
    project_id: ProjectId,
    key_id: String,
    checkpoints: BTreeMap<i64, AuditCheckpoint>,
    checkpoint_count: usize,
    anchors: BTreeMap<i64, String>,
    head_seq: i64,
    head_hash: String,
    /// The first problem found in the entries; later entries are not examined further.
    entry_break: Option<ChainBreak>,
    /// The first problem found in a checkpoint or anchor, by sequence number.
    other_break: Option<ChainBreak>,
}

impl ChainVerifier {
    /// Starts verifying `project_id`'s chain against `key`, its signed `checkpoints` and any
    /// `anchors` known from outside. Checkpoint signatures are checked here.
    pub fn new(
        project_id: ProjectId,
        key: &VerifyingKey,
        checkpoints: Vec<AuditCheckpoint>,
        anchors: &[Anchor],
    ) -> Self {
        let mut verifier = ChainVerifier {
            project_id,
            key_id: key_id(key),
            checkpoints: BTreeMap::new(),
            checkpoint_count: checkpoints.len(),
            anchors: BTreeMap::new(),
            head_seq: 0,
            head_hash: GENESIS_HASH.to_owned(),
            entry_break: None,
            other_break: None,
        };
        for checkpoint in checkpoints {
            let seq = checkpoint.seq;
            let problem = if checkpoint.project_id != project_id {
                Some(BreakReason::CheckpointWrongProject)
            } else if checkpoint.key_id != verifier.key_id {
                Some(BreakReason::UnknownKey {
                    key_id: checkpoint.key_id.clone(),
                })
            } else if !checkpoint.signature_is_valid(key) {
                Some(BreakReason::BadSignature)
            } else {
                None
            };
            match problem {
                Some(reason) => verifier.note_other(seq, reason),
                None => match verifier.checkpoints.entry(seq) {
                    btree_map::Entry::Vacant(slot) => {
                        slot.insert(checkpoint);
                    }
                    // Two valid signatures over different hashes for one entry: the key
                    // signed two different chains.
                    btree_map::Entry::Occupied(existing) => {
                        if existing.get().entry_hash != checkpoint.entry_hash {
                            verifier.note_other(seq, BreakReason::CheckpointMismatch);
                        }
                    }
                },
            }
        }
        for anchor in anchors {
            verifier.anchors.insert(anchor.seq, anchor.hash.clone());
        }
        verifier
    }

    fn note_other(&mut self, seq: i64, reason: BreakReason) {
        if self.other_break.as_ref().is_none_or(|b| seq < b.seq) {
            self.other_break = Some(ChainBreak { seq, reason });
        }
    }

    /// Whether a problem has been found in the entries already (later entries are ignored).
    pub fn entries_broken(&self) -> bool {
        self.entry_break.is_some()
    }

    /// Reports that the row at `seq` could not be read.
    pub fn push_unreadable(&mut self, seq: i64, column: &str) {
        if self.entry_break.is_none() {
            self.entry_break = Some(ChainBreak {
                seq,
                reason: BreakReason::Unreadable {
                    column: column.to_owned(),
                },
            });
        }
    }

    /// Checks the next entry of the chain.
    pub fn push(&mut self, entry: &AuditEntry) {
        if self.entry_break.is_some() {
            return;
        }
        let expected = self.head_seq + 1;
        let problem = if entry.project_id != self.project_id {
            Some((entry.seq, BreakReason::WrongProject))
        } else if entry.seq != expected {
            Some((expected, BreakReason::Gap { found: entry.seq }))
        } else if entry.compute_hash() != entry.hash {
            Some((entry.seq, BreakReason::HashMismatch))
        } else if entry.prev_hash != self.head_hash {
            Some((entry.seq, BreakReason::BrokenLink))
        } else if self
            .checkpoints
            .get(&entry.seq)
            .is_some_and(|c| c.entry_hash != entry.hash)
        {
            Some((entry.seq, BreakReason::CheckpointMismatch))
        } else if self
            .anchors
            .get(&entry.seq)
            .is_some_and(|h| *h != entry.hash)
        {
            Some((entry.seq, BreakReason::AnchorMismatch))
        } else {
            None
        };
        match problem {
            Some((seq, reason)) => self.entry_break = Some(ChainBreak { seq, reason }),
            None => {
                self.head_seq = entry.seq;
                self.head_hash = entry.hash.clone();
            }
        }
    }

    /// The outcome: the lowest-numbered problem found, or the chain's summary.
    pub fn finish(mut self) -> Verification {
        if self.entry_break.is_none() {
            let head = self.head_seq;
            if let Some((&seq, _)) = self.checkpoints.range(head + 1..).next() {
                self.note_other(seq, BreakReason::Truncated { head });
            }
            if let Some((&seq, _)) = self.anchors.range(head + 1..).next() {
                self.note_other(seq, BreakReason::AnchorMissing { head });
            }
        }
        let first = match (self.entry_break, self.other_break) {
            (Some(a), Some(b)) => Some(if b.seq < a.seq { b } else { a }),
            (a, b) => a.or(b),
        };
        if let Some(found) = first {
            return Verification::Broken(found);
        }
        let last_checkpoint_seq = self.checkpoints.keys().next_back().copied();
        Verification::Intact(ChainSummary {
            entries: self.head_seq,
            head_hash: self.head_hash,
            checkpoints: self.checkpoint_count,
            last_checkpoint_seq,
            unsigned_tail: self.head_seq - last_checkpoint_seq.unwrap_or(0),
        })
    }
}

/// Verifies a whole chain held in memory (an export, a test).
pub fn verify_chain(
    project_id: ProjectId,
    key: &VerifyingKey,
    entries: &[AuditEntry],
    checkpoints: Vec<AuditCheckpoint>,
    anchors: &[Anchor],
) -> Verification {
    let mut verifier = ChainVerifier::new(project_id, key, checkpoints, anchors);
    for entry in entries {
        verifier.push(entry);
    }
    verifier.finish()
}

#[cfg(test)]
mod tests;
