//! Chain and checkpoint verification over chains built in memory and then tampered with.

use ed25519_dalek::{Signer, SigningKey};
use serde_json::json;

use super::*;
use crate::canonical::canonical_hash;

fn signing_key(byte: u8) -> SigningKey {
    SigningKey::from_bytes(&[byte; 32])
}

fn sign(key: &SigningKey, entry: &AuditEntry) -> AuditCheckpoint {
    let id = key_id(&key.verifying_key());
    let at = entry.at + 1;
    let message = checkpoint_message(entry.project_id, entry.seq, &entry.hash, at, &id);
    AuditCheckpoint {
        project_id: entry.project_id,
        seq: entry.seq,
        entry_hash: entry.hash.clone(),
        at,
        key_id: id,
        signature: hex::encode(key.sign(&message).to_bytes()),
    }
}

/// Entries 1..=n of a fresh project's chain.
fn chain(project: ProjectId, n: i64) -> Vec<AuditEntry> {
    let mut entries: Vec<AuditEntry> = Vec::new();
    for seq in 1..=n {
        let prev = entries
            .last()
            .map_or(GENESIS_HASH.to_owned(), |e| e.hash.clone());
        let event = AuditEvent::new(project, AuditCategory::KeyCreate, Actor::Operator)
            .subject("key_id", ApiKeyId::new())
            .payload(json!({"name": format!("key {seq}"), "token": "sk-secret"}));
        let (entry, _) = event.into_entry(seq, 1_700_000_000_000 + seq, prev, |p| {
            p["token"] = json!("[REDACTED]");
            true
        });
        entries.push(entry);
    }
    entries
}

/// Recomputes every hash and link from `from` on, as an attacker with database access can.
fn relink(entries: &mut [AuditEntry]) {
    let mut prev = GENESIS_HASH.to_owned();
    for entry in entries {
        entry.prev_hash = prev;
        entry.hash = entry.compute_hash();
        prev = entry.hash.clone();
    }
}

struct Case {
    entries: Vec<AuditEntry>,
    checkpoints: Vec<AuditCheckpoint>,
    anchors: Vec<Anchor>,
}

fn intact() -> (ProjectId, SigningKey, Case) {
    let project = ProjectId::new();
    let key = signing_key(7);
    let entries = chain(project, 6);
    let checkpoints = vec![sign(&key, &entries[2]), sign(&key, &entries[4])];
    (
        project,
        key,
        Case {
            entries,
            checkpoints,
            anchors: Vec::new(),
        },
    )
}

fn check(project: ProjectId, key: &SigningKey, case: Case) -> Verification {
    verify_chain(
        project,
        &key.verifying_key(),
        &case.entries,
        case.checkpoints,
        &case.anchors,
    )
}

fn broken(seq: i64, reason: BreakReason) -> Verification {
    Verification::Broken(ChainBreak { seq, reason })
}

#[test]
fn intact_chain_verifies_and_reports_its_unsigned_tail() {
    let (project, key, case) = intact();
    let head = case.entries[5].hash.clone();
    assert_eq!(
        check(project, &key, case),
        Verification::Intact(ChainSummary {
            entries: 6,
            head_hash: head,
            checkpoints: 2,
            last_checkpoint_seq: Some(5),
            unsigned_tail: 1,
        })
    );
    let empty = verify_chain(project, &key.verifying_key(), &[], vec![], &[]);
    assert!(
        matches!(empty, Verification::Intact(ref s) if s.entries == 0),
        "{empty:?}"
    );
}

#[test]
fn the_digest_covers_the_full_payload_and_the_entry_the_redacted_one() {
    let entries = chain(ProjectId::new(), 1);
    assert_eq!(entries[0].payload["token"], "[REDACTED]");
    assert_eq!(
        entries[0].payload_digest,
        canonical_hash(&json!({"name": "key 1", "token": "sk-secret"}))
    );
    assert!(!entries[0].canonical_body().contains("sk-secret"));
}

#[test]
fn the_stored_text_is_the_canonical_payload_whether_or_not_redaction_replaced_anything() {
    let full = json!({"z": 1, "a": "sk-secret"});
    let event = || {
        AuditEvent::new(ProjectId::new(), AuditCategory::KeyCreate, Actor::Operator)
            .payload(full.clone())
    };
    let (kept, text) = event().into_entry(1, 1_700_000_000_000, GENESIS_HASH.to_owned(), |_| false);
    assert_eq!(text, r#"{"a":"sk-secret","z":1}"#);
    assert_eq!(kept.hash, kept.compute_hash());
    assert_eq!(kept.payload_digest, canonical_hash(&full));

    let (redacted, text) = event().into_entry(1, 1_700_000_000_000, GENESIS_HASH.to_owned(), |p| {
        p["a"] = json!("[REDACTED]");
        true
    });
    assert_eq!(text, r#"{"a":"[REDACTED]","z":1}"#);
    assert_eq!(redacted.hash, redacted.compute_hash());
    assert_eq!(redacted.payload_digest, canonical_hash(&full));
    assert!(!redacted.canonical_body().contains("sk-secret"));
}

#[test]
fn every_tampering_is_found_at_the_first_bad_entry() {
    type Tamper = fn(&mut Case, &SigningKey);
    let cases: Vec<(&str, Tamper, Verification)> = vec![
        (
            "modified payload",
            |c, _| c.entries[1].payload = json!({"name": "other"}),
            broken(2, BreakReason::HashMismatch),
        ),
        (
            "modified actor, hashes recomputed",
            |c, _| {
                c.entries[1].actor = Actor::ApiKey {
                    key_id: ApiKeyId::new(),
                };
                relink(&mut c.entries);
            },
            broken(3, BreakReason::CheckpointMismatch),
        ),
        (
            "deleted entry",
            |c, _| {
                c.entries.remove(1);
            },
            broken(2, BreakReason::Gap { found: 3 }),
        ),
        (
            "deleted entry, renumbered",
            |c, _| {
                c.entries.remove(1);
                for (i, e) in c.entries.iter_mut().enumerate() {
                    e.seq = i as i64 + 1;
                    e.hash = e.compute_hash();
                }
            },
            broken(2, BreakReason::BrokenLink),
        ),
        (
            "inserted entry, renumbered and relinked",
            |c, _| {
                let extra = c.entries[0].clone();
                c.entries.insert(1, extra);
                for (i, e) in c.entries.iter_mut().enumerate() {
                    e.seq = i as i64 + 1;
                }
                relink(&mut c.entries);
            },
            broken(3, BreakReason::CheckpointMismatch),
        ),
        (
            "reordered entries",
            |c, _| {
                c.entries.swap(1, 2);
                c.entries[1].seq = 2;
                c.entries[2].seq = 3;
                c.entries[1].hash = c.entries[1].compute_hash();
                c.entries[2].hash = c.entries[2].compute_hash();
            },
            broken(2, BreakReason::BrokenLink),
        ),
        (
            "truncated behind the last checkpoint",
            |c, _| c.entries.truncate(4),
            broken(5, BreakReason::Truncated { head: 4 }),
        ),
        (
            "forged checkpoint",
            |c, _| {
                let mut forged = sign(&signing_key(9), &c.entries[5]);
                forged.key_id = c.checkpoints[0].key_id.clone();
                c.checkpoints.push(forged);
            },
            broken(6, BreakReason::BadSignature),
        ),
        (
            "checkpoint under another key",
            |c, _| c.checkpoints.push(sign(&signing_key(9), &c.entries[5])),
            broken(
                6,
                BreakReason::UnknownKey {
                    key_id: key_id(&signing_key(9).verifying_key()),
                },
            ),
        ),
        (
            "checkpoint moved to another entry",
            |c, _| c.checkpoints[0].seq = 2,
            broken(2, BreakReason::BadSignature),
        ),
        (
            "entry of another project",
            |c, _| {
                c.entries[3].project_id = ProjectId::new();
                relink(&mut c.entries);
            },
            broken(4, BreakReason::WrongProject),
        ),
        (
            "unsigned tail rewritten, caught by an anchor",
            |c, _| {
                c.anchors.push(Anchor {
                    seq: 6,
                    hash: c.entries[5].hash.clone(),
                });
                c.entries[5].payload = json!({});
                relink(&mut c.entries);
            },
            broken(6, BreakReason::AnchorMismatch),
        ),
        (
            "unsigned tail cut, caught by an anchor",
            |c, _| {
                c.anchors.push(Anchor {
                    seq: 6,
                    hash: c.entries[5].hash.clone(),
                });
                c.entries.truncate(5);
            },
            broken(6, BreakReason::AnchorMissing { head: 5 }),
        ),
    ];
    for (name, tamper, expected) in cases {
        let (project, key, mut case) = intact();
        tamper(&mut case, &key);
        assert_eq!(check(project, &key, case), expected, "{name}");
    }
}

#[test]
fn without_an_anchor_a_cut_unsigned_tail_is_not_detectable() {
    // Documented limit: entries after the last checkpoint rest on the hash chain alone.
    let (project, key, mut case) = intact();
    case.entries.truncate(5);
    assert!(matches!(
        check(project, &key, case),
        Verification::Intact(_)
    ));
}

#[test]
fn anchors_parse_strictly() {
    let hash = "ab".repeat(32);
    assert_eq!(
        format!("12:{hash}").parse::<Anchor>(),
        Ok(Anchor {
            seq: 12,
            hash: hash.clone()
        })
    );
    for bad in ["12", "0:{hash}", "x:{hash}", "3:abc"] {
        assert!(
            bad.replace("{hash}", &hash).parse::<Anchor>().is_err(),
            "{bad}"
        );
    }
}

#[test]
fn the_encoding_is_pinned() {
    // A change to this text changes every hash ever stored: it needs a new ENTRY_FORMAT.
    let entry = AuditEvent::new(
        "prj_0193b0c4d5e67f8091a2b3c4d5e6f708".parse().unwrap(),
        AuditCategory::MemberCreate,
        Actor::Member {
            member_id: "mem_0193b0c4d5e67f8091a2b3c4d5e6f709".parse().unwrap(),
            key_id: "key_0193b0c4d5e67f8091a2b3c4d5e6f70a".parse().unwrap(),
        },
    )
    .subject("member_id", "mem_0193b0c4d5e67f8091a2b3c4d5e6f70b")
    .payload(json!({"role": "viewer", "name": "pat"}))
    .into_entry(1, 1_700_000_000_000, GENESIS_HASH.to_owned(), |_| false)
    .0;
    assert_eq!(
        entry.canonical_body(),
        concat!(
            r#"{"actor":{"key_id":"key_0193b0c4d5e67f8091a2b3c4d5e6f70a","kind":"member","#,
            r#""member_id":"mem_0193b0c4d5e67f8091a2b3c4d5e6f709"},"at":1700000000000,"#,
            r#""category":"member.create","format":"wor-audit-entry/1","parent_run_id":null,"#,
            r#""payload":{"name":"pat","role":"viewer"},"payload_digest":"PD","#,
            r#""prev_hash":"0000000000000000000000000000000000000000000000000000000000000000","#,
            r#""project_id":"prj_0193b0c4d5e67f8091a2b3c4d5e6f708","root_run_id":null,"seq":1,"#,
            r#""subjects":{"member_id":"mem_0193b0c4d5e67f8091a2b3c4d5e6f70b"}}"#
        )
        .replace(
            "PD",
            &canonical_hash(&json!({"name": "pat", "role": "viewer"}))
        )
    );
    assert_eq!(entry.hash, sha256_hex(entry.canonical_body().as_bytes()));
}

#[test]
fn the_body_is_the_canonical_text_of_every_field_but_the_hash() {
    // The body as the entry's fields make it, each through its JSON value, whatever the
    // actor, the runs it names and the text in it.
    let project: ProjectId = "prj_0193b0c4d5e67f8091a2b3c4d5e6f708".parse().unwrap();
    let run: RunId = "run_0193b0c4d5e67f8091a2b3c4d5e6f70c".parse().unwrap();
    let parent: RunId = "run_0193b0c4d5e67f8091a2b3c4d5e6f70d".parse().unwrap();
    let key = "key_0193b0c4d5e67f8091a2b3c4d5e6f70a".parse().unwrap();
    let member = "mem_0193b0c4d5e67f8091a2b3c4d5e6f70b".parse().unwrap();
    let routine = "rtn_0193b0c4d5e67f8091a2b3c4d5e6f70e".parse().unwrap();
    // Every kind of actor, since the body writes each one's members itself: a kind added to
    // `Actor` fails to compile in this match until it has a place, and the list is checked to
    // hold every place.
    let place = |actor: &Actor| match actor {
        Actor::Operator => 0,
        Actor::ConsoleVisitor => 1,
        Actor::Run { .. } => 2,
        Actor::ApiKey { .. } => 3,
        Actor::Member { .. } => 4,
        Actor::ConsoleMember { .. } => 5,
        Actor::Schedule { .. } => 6,
        Actor::Webhook { .. } => 7,
    };
    let actors = [
        Actor::Operator,
        Actor::ConsoleVisitor,
        Actor::Run { run_id: run },
        Actor::ApiKey { key_id: key },
        Actor::Member {
            member_id: member,
            key_id: key,
        },
        Actor::ConsoleMember { member_id: member },
        Actor::Schedule {
            routine_id: routine,
        },
        Actor::Webhook {
            routine_id: routine,
        },
    ];
    let mut places: Vec<usize> = actors.iter().map(place).collect();
    places.sort_unstable();
    places.dedup();
    assert_eq!(places, (0..8).collect::<Vec<_>>());
    for (n, actor) in actors.into_iter().enumerate() {
        let mut event = AuditEvent::new(project, AuditCategory::MemberCreate, actor)
            .payload(json!({"text": "\"quoted\" \\ \u{1} é 😀", "n": n}));
        if n % 2 == 1 {
            event = event
                .subject("name", "tab\there \u{2028} \"q\"")
                .subject("member_id", "mem_1")
                .runs(run, Some(parent));
        }
        let (entry, _) = event.into_entry(
            i64::try_from(n).unwrap() + i64::MAX / 2,
            -1,
            "ab".repeat(32),
            |_| false,
        );
        let whole = json!({
            "format": ENTRY_FORMAT,
            "project_id": entry.project_id,
            "seq": entry.seq,
            "at": entry.at,
            "actor": entry.actor,
            "category": entry.category,
            "subjects": entry.subjects,
            "root_run_id": entry.root_run_id,
            "parent_run_id": entry.parent_run_id,
            "payload_digest": entry.payload_digest,
            "prev_hash": entry.prev_hash,
            "payload": entry.payload,
        });
        assert_eq!(entry.canonical_body(), to_canonical_json(&whole), "{n}");
        // The actor and the subjects are stored as the canonical text of their JSON values.
        assert_eq!(
            entry.actor.canonical_json(),
            to_canonical_json(&serde_json::to_value(&entry.actor).unwrap()),
            "{n}"
        );
        assert_eq!(
            entry.subjects_canonical_json(),
            to_canonical_json(&serde_json::to_value(&entry.subjects).unwrap()),
            "{n}"
        );
        assert_eq!(entry.hash, canonical_hash(&whole), "{n}");
        assert_eq!(entry.compute_hash(), entry.hash, "{n}");
    }
}

#[test]
fn every_category_is_read_back_from_its_stored_name_and_no_two_share_one() {
    let mut names = std::collections::BTreeSet::new();
    for &category in AuditCategory::ALL {
        assert!(names.insert(category.as_str()), "{category} named twice");
        assert_eq!(AuditCategory::from_name(category.as_str()), Some(category));
    }
    assert_eq!(AuditCategory::from_name("run.Start"), None);
    assert_eq!(AuditCategory::from_name(""), None);
}

#[test]
fn a_staged_event_reads_back_as_it_was_and_an_unknown_kind_or_field_is_refused() {
    let run = RunId::new();
    let event = AuditEvent::new(
        ProjectId::new(),
        AuditCategory::ApprovalDecide,
        Actor::ConsoleMember {
            member_id: MemberId::new(),
        },
    )
    .subject("run_id", run)
    .runs(run, None)
    .payload(json!({"decision": "approved", "nested": {"a": [1, 2.5, null]}}));
    let text = serde_json::to_string(&event).unwrap();
    let back: AuditEvent = serde_json::from_str(&text).unwrap();
    assert_eq!(back, event);
    // The entry made from the event read back is the one made from the event itself.
    let entry = |e: AuditEvent| e.into_entry(1, 5, GENESIS_HASH.to_owned(), |_| false);
    assert_eq!(entry(back), entry(event));

    let renamed = text.replace("approval.decide", "approval.decided");
    let refused = serde_json::from_str::<AuditEvent>(&renamed).unwrap_err();
    assert!(
        refused.to_string().contains("approval.decided"),
        "{refused}"
    );
    let mut extra: Value = serde_json::from_str(&text).unwrap();
    extra["seq"] = json!(3);
    assert!(serde_json::from_value::<AuditEvent>(extra).is_err());
}

/// The JSON form of a staged event is stored in the database across restarts and upgrades: a
/// change to it is a change to a stored format.
#[test]
fn a_staged_events_json_form_is_fixed() {
    let text = r#"{"project_id":"prj_0190d5b4c1a27c3e8f1a2b3c4d5e6f70","category":"run.cancel","actor":{"kind":"api_key","key_id":"key_0190d5b4c1a27c3e8f1a2b3c4d5e6f71"},"subjects":{"run_id":"run_0190d5b4c1a27c3e8f1a2b3c4d5e6f72"},"root_run_id":"run_0190d5b4c1a27c3e8f1a2b3c4d5e6f72","parent_run_id":null,"payload":{"status":"cancelled"}}"#;
    let event: AuditEvent = serde_json::from_str(text).unwrap();
    assert_eq!(event.category(), AuditCategory::RunCancel);
    assert_eq!(serde_json::to_string(&event).unwrap(), text);
}
