//! Tests of live-secret and shape redaction, with one positive and one negative sample per rule.

use std::collections::BTreeSet;

use super::*;

fn alnum(n: usize) -> String {
    "aB3dE5gH7jK9mN1pQ2sT4vW6yZ8"
        .chars()
        .cycle()
        .take(n)
        .collect()
}

fn hex(n: usize) -> String {
    "0a1b2c3d4e5f6789".chars().cycle().take(n).collect()
}

/// `(rule id, positive sample, negative sample)`; every rule must appear exactly once.
fn samples() -> Vec<(&'static str, String, String)> {
    vec![
        (
            "private-key",
            format!(
                "-----BEGIN RSA PRIVATE KEY-----\nMIIEow{}\n-----END RSA PRIVATE KEY-----",
                alnum(80)
            ),
            format!(
                "-----BEGIN PUBLIC KEY-----\nMIIBIj{}\n-----END PUBLIC KEY-----",
                alnum(80)
            ),
        ),
        (
            "aws-access-token",
            "AKIAZ7QRSTUVWXY23456".into(),
            "akiaz7qrstuvwxy23456 AKIA".into(),
        ),
        (
            "aws-secret-access-key",
            "aws_secret_access_key = \"wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\"".into(),
            "aws_secret_access_key = \"tooshort\"".into(),
        ),
        (
            "github-pat",
            format!("ghp_{}", alnum(36)),
            format!("ghp_{}", alnum(35)),
        ),
        (
            "github-fine-grained-pat",
            format!("github_pat_{}", alnum(82)),
            format!("github_pat_{}", alnum(20)),
        ),
        (
            "github-oauth",
            format!("gho_{}", alnum(36)),
            "gho_abc".into(),
        ),
        (
            "github-app-token",
            format!("ghs_{}", alnum(36)),
            "ghs_abc".into(),
        ),
        (
            "github-refresh-token",
            format!("ghr_{}", alnum(36)),
            "ghr_abc".into(),
        ),
        (
            "gitlab-pat",
            format!("glpat-{}", alnum(20)),
            "glpat-short".into(),
        ),
        (
            "gitlab-pipeline-trigger-token",
            format!("glptt-{}", hex(40)),
            format!("glptt-{}", "z".repeat(40)),
        ),
        (
            "gitlab-runner-registration-token",
            format!("GR1348941{}", alnum(20)),
            "GR1348941abc".into(),
        ),
        (
            "gitlab-runner-auth-token",
            format!("glrt-{}", alnum(24)),
            "glrt-short".into(),
        ),
        (
            "gitlab-deploy-token",
            format!("gldt-{}", alnum(24)),
            "gldt-short".into(),
        ),
        (
            "slack-bot-token",
            "xoxb-1234567890-1234567890123-AbCdEfGh".into(),
            "xoxb-123".into(),
        ),
        (
            "slack-user-token",
            format!("xoxp-1234567890-1234567890-1234567890-{}", alnum(32)),
            "xoxp-1-2-3-abc".into(),
        ),
        (
            "slack-app-token",
            "xapp-1-A0123ABCDEF-1234567890123-abcdef0123456789".into(),
            "xapp-x".into(),
        ),
        (
            "slack-webhook-url",
            format!("https://hooks.slack.com/services/T0123ABCD/B0123ABCD/{}", alnum(24)),
            "see https://hooks.slack.com/services/ for details".into(),
        ),
        (
            "discord-webhook-url",
            format!("https://discord.com/api/webhooks/123456789012345678/{}", alnum(64)),
            "https://discord.com/api/webhooks/ documentation".into(),
        ),
        (
            "stripe-access-token",
            format!("sk_live_{}", alnum(24)),
            "sk_live_short".into(),
        ),
        (
            "wor-api-key",
            format!("wor_{}", hex(64)),
            // The part of a key that listings show to identify it.
            format!("wor_{}", hex(8)),
        ),
        (
            "wor-run-token",
            format!("wrt_{}", hex(64)),
            format!("wrt_{}", hex(63)),
        ),
        (
            "wor-token",
            format!("wrs_{}", hex(64)),
            format!("wrx_{}", hex(64)),
        ),
        (
            "whsec-secret",
            format!("whsec_{}", alnum(32)),
            "whsec_abc".into(),
        ),
        (
            "openai-api-key",
            format!("sk-{}T3BlbkFJ{}", alnum(20), alnum(20)),
            format!("sk-{}T3BlbkFJ{}", alnum(5), alnum(5)),
        ),
        (
            "openai-project-key",
            format!("sk-proj-{}", alnum(48)),
            "sk-proj-short".into(),
        ),
        (
            "anthropic-api-key",
            format!("sk-ant-api03-{}AA", alnum(93)),
            "sk-ant-api03-short".into(),
        ),
        (
            "anthropic-admin-api-key",
            format!("sk-ant-admin01-{}AA", alnum(93)),
            "sk-ant-admin01-short".into(),
        ),
        (
            "gcp-api-key",
            format!("AIza{}", alnum(35)),
            "AIzashort".into(),
        ),
        (
            "google-oauth-client-secret",
            format!("GOCSPX-{}", alnum(28)),
            "GOCSPX-abc".into(),
        ),
        (
            "twilio-api-key",
            format!("SK{}", hex(32)),
            format!("ask the desk about SK{}", "g".repeat(32)),
        ),
        (
            "sendgrid-api-token",
            format!("SG.{}.{}", alnum(22), alnum(43)),
            "SG.short.short".into(),
        ),
        (
            "npm-access-token",
            format!("npm_{}", alnum(36)),
            "run npm_install".into(),
        ),
        (
            "pypi-upload-token",
            format!("pypi-AgEIcHlwaS5vcmc{}", alnum(60)),
            "pypi-AgEIcHlwaS5vcmcshort".into(),
        ),
        (
            "jwt",
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
                .into(),
            "eyJhbGciOiJIUzI1NiJ9 alone".into(),
        ),
        (
            "basic-auth-url",
            "postgres://admin:s3cr3tP4ss@db.example.com:5432/app".into(),
            "https://db.example.com:5432/app?user=admin".into(),
        ),
        (
            "bearer-token",
            format!("Authorization: Bearer {}", alnum(40)),
            "the bearer of bad news".into(),
        ),
        (
            "basic-auth-header",
            "Authorization: Basic dXNlcjpwYXNzd29yZA==".into(),
            "Authorization: required".into(),
        ),
        (
            "generic-credential-assignment",
            "{\"password\": \"correct-horse-battery\"}".into(),
            "{\"password_policy\": \"strong\", \"password\": \"x\"}".into(),
        ),
        (
            "age-secret-key",
            "AGE-SECRET-KEY-1QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7LQPZRY9X8GF2TVDW0S3JN54KHCE".into(),
            "AGE-SECRET-KEY-1short".into(),
        ),
        (
            "shopify-token",
            format!("shpat_{}", hex(32)),
            "shpat_xyz".into(),
        ),
        (
            "digitalocean-token",
            format!("dop_v1_{}", hex(64)),
            "dop_v1_abc".into(),
        ),
        (
            "doppler-api-token",
            format!("dp.pt.{}", alnum(43)),
            "dp.pt.short".into(),
        ),
        (
            "hashicorp-tf-api-token",
            format!("abcdefghijklmn.atlasv1.{}", alnum(64)),
            "foo.atlasv1.bar".into(),
        ),
        (
            "vault-token",
            format!("hvs.{}", alnum(100)),
            "hvs.short".into(),
        ),
        (
            "huggingface-access-token",
            format!("hf_{}", "abcdefghijklmnopqrstuvwxyzABCDEFGH"),
            "hf_abc123".into(),
        ),
        (
            "postman-api-token",
            format!("PMAK-{}-{}", hex(24), hex(34)),
            "PMAK-123".into(),
        ),
        (
            "pulumi-api-token",
            format!("pul-{}", hex(40)),
            "pul-request".into(),
        ),
        (
            "linear-api-key",
            format!("lin_api_{}", alnum(40)),
            "lin_api_docs".into(),
        ),
        (
            "databricks-api-token",
            format!("dapi{}", hex(32)),
            "dapi is an api".into(),
        ),
        (
            "atlassian-api-token",
            format!("ATATT3{}", alnum(186)),
            "ATATT3xyz".into(),
        ),
        (
            "grafana-service-account-token",
            format!("glsa_{}_{}", alnum(32), hex(8)),
            "glsa_short".into(),
        ),
        (
            "grafana-cloud-api-token",
            format!("glc_{}", alnum(40)),
            "glc_short".into(),
        ),
        (
            "new-relic-user-api-key",
            "NRAK-ABCDEFGHIJKLMNOPQRSTUVWXY12".into(),
            "NRAK-SHORT".into(),
        ),
        (
            "sentry-user-token",
            format!("sntryu_{}", hex(64)),
            "sntryu_abc".into(),
        ),
        (
            "sentry-org-token",
            format!("sntrys_eyJ{}", alnum(60)),
            "sntrys_abc".into(),
        ),
        (
            "flyio-access-token",
            format!("fo1_{}", alnum(43)),
            "fo1_abc".into(),
        ),
        (
            "planetscale-token",
            format!("pscale_tkn_{}", alnum(40)),
            "pscale_tkn_short".into(),
        ),
        (
            "rubygems-api-token",
            format!("rubygems_{}", hex(48)),
            "rubygems_org".into(),
        ),
        (
            "square-access-token",
            format!("sq0atp-{}", alnum(30)),
            "sq0atp-abc".into(),
        ),
        (
            "azure-ad-client-secret",
            format!("abc8Q~{}", alnum(32)),
            "abc8Q~short".into(),
        ),
        (
            "dockerhub-pat",
            format!("dckr_pat_{}", alnum(27)),
            "dckr_pat_abc".into(),
        ),
        (
            "mailgun-private-api-token",
            format!("key-{}", hex(32)),
            "key-value store".into(),
        ),
        (
            "telegram-bot-token",
            format!("123456789:AA{}", alnum(33)),
            "123456789:AAshort".into(),
        ),
    ]
}

fn rule_by_id(id: &str) -> (usize, &'static ShapeRule) {
    SHAPE_RULES
        .iter()
        .enumerate()
        .find(|(_, r)| r.id == id)
        .unwrap_or_else(|| panic!("sample names unknown rule `{id}`"))
}

#[test]
fn every_rule_compiles_and_has_valid_keywords() {
    assert!(SHAPE_RULES.len() >= 30, "only {} rules", SHAPE_RULES.len());
    let scanner = shape_scanner();
    assert_eq!(scanner.regexes.len(), SHAPE_RULES.len());
    let mut ids = BTreeSet::new();
    for rule in SHAPE_RULES {
        assert!(ids.insert(rule.id), "duplicate rule id `{}`", rule.id);
        assert!(!rule.keywords.is_empty(), "`{}` has no keyword", rule.id);
        for keyword in rule.keywords {
            if rule.ignores_case() {
                assert_eq!(*keyword, keyword.to_lowercase(), "`{}`", rule.id);
            }
        }
    }
}

#[test]
fn every_rule_redacts_its_positive_and_spares_its_negative() {
    let samples = samples();
    let sampled: Vec<&str> = samples.iter().map(|(id, _, _)| *id).collect();
    let unique: BTreeSet<&str> = sampled.iter().copied().collect();
    assert_eq!(unique.len(), sampled.len(), "a rule is sampled twice");
    let all: BTreeSet<&str> = SHAPE_RULES.iter().map(|r| r.id).collect();
    assert_eq!(unique, all, "every rule needs exactly one sample row");

    for (id, positive, negative) in &samples {
        let (index, rule) = rule_by_id(id);
        let scanner = shape_scanner();
        let bounded = Bounded {
            rule,
            regex: &scanner.regexes[index],
            edges: scanner.edges[index],
        };
        let (whole, secret) = bounded
            .find(positive, positive, 0)
            .unwrap_or_else(|| panic!("`{id}` does not match its positive sample"));
        let secret = &positive[secret];
        let matched = &positive[whole.clone()];
        let holds_keyword = if rule.ignores_case() {
            let lower = matched.to_lowercase();
            rule.keywords.iter().any(|k| lower.contains(k))
        } else {
            rule.keywords.iter().any(|k| matched.contains(k))
        };
        assert!(
            holds_keyword,
            "`{id}`: its match holds none of its keywords"
        );
        let keyword_at = rule
            .keywords
            .iter()
            .filter_map(|k| matched.to_lowercase().find(&k.to_lowercase()))
            .min()
            .unwrap();
        assert!(
            keyword_at <= rule.before,
            "`{id}`: keyword too far from match start"
        );
        assert!(
            whole.len() - keyword_at <= rule.after,
            "`{id}`: match longer than `after` allows"
        );

        // Embedded in surrounding text, through the prefilter.
        let text = format!("before {positive} after");
        let redacted = redact_shapes(&text);
        assert!(!redacted.contains(secret), "`{id}` leaked: {redacted}");
        assert!(redacted.contains("[REDACTED"), "`{id}`: {redacted}");
        assert!(redacted.starts_with("before ") && redacted.ends_with(" after"));

        assert!(
            bounded.find(negative, negative, 0).is_none(),
            "`{id}` matches its negative sample"
        );
        let spared = redact_shapes(negative);
        assert_eq!(spared, negative.as_str(), "`{id}` negative was redacted");
        assert!(matches!(spared, Cow::Borrowed(_)));
    }
}

#[test]
fn an_underscore_beside_a_token_does_not_hide_it() {
    let token = format!("ghp_{}", alnum(36));
    for text in [
        format!("retry_{token}"),
        format!("{token}_old"),
        format!("X_{token}_Y"),
        format!("-{token}-"),
    ] {
        let redacted = redact_shapes(&text);
        assert!(!redacted.contains(&token), "{text} became {redacted}");
        assert!(redacted.contains("[REDACTED:github-pat]"), "{redacted}");
    }
    assert_eq!(
        redact_shapes(&format!("retry_{token}")),
        "retry_[REDACTED:github-pat]"
    );
    let stripe = format!("sk_live_{}", alnum(24));
    assert_eq!(
        redact_shapes(&format!("key_{stripe}_2")),
        "key_[REDACTED:stripe-access-token]_2"
    );
    // An environment dump's `DB_PASSWORD=…` is an assignment of a password.
    assert_eq!(
        redact_shapes("DB_PASSWORD=hunter2hunter2 next"),
        "DB_PASSWORD=[REDACTED:generic-credential-assignment] next"
    );

    // A letter or a digit still joins: these are parts of longer words, not tokens.
    for text in [
        format!("x{token}"),
        format!("{token}x"),
        format!("é{token}"),
        format!("ghp_{}", alnum(37)),
    ] {
        assert_eq!(redact_shapes(&text), text.as_str(), "{text}");
    }
}

#[test]
fn a_match_whose_end_joins_a_word_gives_way_to_a_shorter_one() {
    // `(?:-\d)?` at the end: `-1` is followed by a letter, so the match without it is the
    // one whose end holds, as a regex's own `\b` would have backtracked to.
    let token = format!("dapi{}", hex(32));
    assert_eq!(
        redact_shapes(&format!("{token}-1x")),
        "[REDACTED:databricks-api-token]-1x"
    );
    assert_eq!(
        redact_shapes(&format!("{token}-1 ")),
        "[REDACTED:databricks-api-token] "
    );
}

#[test]
fn a_numeral_that_is_not_a_digit_does_not_join_a_token() {
    // A footnote mark or a circled number is no word character of a regex's `\b`.
    let token = format!("ghp_{}", alnum(36));
    for text in [format!("{token}¹"), format!("①{token}")] {
        assert!(!redact_shapes(&text).contains(&token), "{text}");
    }
}

#[test]
fn a_secret_that_ends_in_a_slash_is_redacted_before_a_quote() {
    // The key's last character is not a word character: a regex's `\b` before the quote
    // found no boundary there, and the key went out whole.
    let text = "aws_secret_access_key = \"wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKE/\"";
    assert_eq!(
        redact_shapes(text),
        "aws_secret_access_key = \"[REDACTED:aws-secret-access-key]\""
    );
}

#[test]
fn a_token_longer_than_its_window_is_redacted_as_far_as_the_window_reaches() {
    // `vault-token` has no upper bound: a match reaching the window's cut holds there, as it
    // did against the regex's own `\b`.
    let token = format!("hvs.{}", alnum(400));
    let text = format!("token {token} end");
    let redacted = redact_shapes(&text);
    assert!(
        redacted.starts_with("token [REDACTED:vault-token]"),
        "{redacted}"
    );
    assert!(!redacted.contains(&token[..200]), "{redacted}");
}

#[test]
fn no_rule_with_an_end_to_check_repeats_lazily() {
    // A shorter match is looked for by cutting the text, which finds the longest one only for
    // greedy repetition.
    for rule in SHAPE_RULES {
        assert!(
            !(rule.pattern.ends_with(r"\b") && stream::has_lazy_repetition(rule.pattern)),
            "{}",
            rule.id
        );
    }
}

#[test]
fn shape_marker_names_the_rule() {
    let token = format!("ghp_{}", alnum(36));
    assert_eq!(
        redact_shapes(&format!("token {token}.")),
        "token [REDACTED:github-pat]."
    );
}

#[test]
fn group_rules_redact_only_the_secret_part() {
    let redacted = redact_shapes("url postgres://admin:s3cr3tP4ss@db.example.com/app");
    assert_eq!(
        redacted,
        "url postgres://admin:[REDACTED:basic-auth-url]@db.example.com/app"
    );
}

#[test]
fn unterminated_private_key_is_still_redacted() {
    let body = alnum(200);
    let text = format!("-----BEGIN PRIVATE KEY-----\\n{body}\\n");
    let redacted = redact_shapes(&text);
    assert!(!redacted.contains(&body[..40]), "{redacted}");
}

#[test]
fn private_key_in_json_string_is_redacted() {
    let body = alnum(120);
    let mut value = serde_json::json!({
        "type": "service_account",
        "private_key": format!("-----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----\n"),
    });
    Redactor::new(Vec::<String>::new())
        .unwrap()
        .redact_json(&mut value);
    let rendered = value.to_string();
    assert!(!rendered.contains(&body[..40]), "{rendered}");
    assert!(rendered.contains("service_account"));
}

const LIVE: &str = "live-secret-Value/42+x";

#[test]
fn live_secret_and_its_encodings_are_redacted() {
    let redactor = Redactor::new([LIVE]).unwrap();
    let forms = [
        LIVE.to_owned(),
        STANDARD.encode(LIVE),
        URL_SAFE_NO_PAD.encode(LIVE),
        "live-secret-Value%2F42%2Bx".to_owned(),
        "live-secret-Value%2f42%2bx".to_owned(),
    ];
    for form in &forms {
        let text = format!("result: {form} (end)");
        assert_eq!(
            redactor.redact(&text),
            "result: [REDACTED] (end)",
            "form `{form}`"
        );
    }
    let quoted = Redactor::new(["pass\"word\\with-escapes"]).unwrap();
    let json = serde_json::json!({ "v": "pass\"word\\with-escapes" }).to_string();
    assert!(!quoted.redact(&json).contains("word"), "{json}");
}

#[test]
fn leftmost_longest_secret_wins() {
    let redactor = Redactor::new(["abcdefgh12", "abcdefgh1234"]).unwrap();
    assert_eq!(redactor.redact("x abcdefgh1234 y"), "x [REDACTED] y");
    assert_eq!(redactor.redact("x abcdefgh12 y"), "x [REDACTED] y");
}

#[test]
fn short_secrets_are_not_matched_exactly() {
    let redactor = Redactor::new(["short", "longer-secret"]).unwrap();
    assert_eq!(redactor.redact("short longer-secret"), "short [REDACTED]");
}

#[test]
fn unchanged_text_is_borrowed() {
    let redactor = Redactor::new([LIVE]).unwrap();
    assert!(matches!(
        redactor.redact("nothing to see here, ask the task desk"),
        Cow::Borrowed(_)
    ));
}

#[test]
fn overlapping_live_and_shape_hits_merge() {
    let token = format!("ghp_{}", alnum(36));
    let redactor = Redactor::new([token.as_str()]).unwrap();
    assert_eq!(redactor.redact(&format!("a {token} b")), "a [REDACTED] b");
}

#[test]
fn multibyte_text_near_keywords_does_not_break() {
    let token = format!("ghp_{}", alnum(36));
    let text = format!("é€😀 {token} 😀€é sk ŝk ghp_ é");
    let redacted = redact_shapes(&text);
    assert_eq!(redacted, "é€😀 [REDACTED:github-pat] 😀€é sk ŝk ghp_ é");
}

#[test]
fn secrets_deep_in_large_text_are_found() {
    let token = format!("ghp_{}", alnum(36));
    let mut text = "lorem ipsum dolor sit amet, ".repeat(40_000);
    text.push_str(&token);
    text.push(' ');
    text.push_str(LIVE);
    let redactor = Redactor::new([LIVE]).unwrap();
    let redacted = redactor.redact(&text);
    assert!(!redacted.contains(&token));
    assert!(!redacted.contains(LIVE));
    assert!(redacted.ends_with("[REDACTED:github-pat] [REDACTED]"));
}

#[test]
fn json_strings_and_keys_are_redacted() {
    let redactor = Redactor::new([LIVE]).unwrap();
    let mut value = serde_json::json!({
        "ok": "fine",
        "nested": [1, true, null, { "deep": format!("x {LIVE} y") }],
        LIVE: "key was a secret",
        "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    });
    assert!(redactor.redact_json(&mut value), "it says it redacted");
    let rendered = value.to_string();
    assert!(!rendered.contains(LIVE), "{rendered}");
    assert!(!rendered.contains("dozjgNryP4J3"), "{rendered}");
    assert_eq!(value["nested"][3]["deep"], "x [REDACTED] y");
    assert_eq!(value["[REDACTED]"], "key was a secret");
    assert_eq!(value["ok"], "fine");
    assert_eq!(value["nested"][1], true);
}

#[test]
fn debug_output_holds_no_secret() {
    let redactor = Redactor::new([LIVE]).unwrap();
    let rendered = format!("{redactor:?}");
    assert!(!rendered.contains(LIVE));
    assert!(!rendered.contains(&STANDARD.encode(LIVE)));
    assert!(rendered.contains("live_patterns"));
}

#[test]
fn a_secret_split_across_stream_pieces_never_gets_out() {
    const SECRET: &str = "zq-live-7Hc2Xw9Pk4Rm8Tn3Vb6Yd1";
    let redactor = Redactor::new([SECRET]).unwrap();
    let text = format!(
        "The key is {SECRET}, and a token ghp_{} follows. {}Done.",
        alnum(36),
        "filler words ".repeat(40)
    );
    let whole = redactor.redact(&text).into_owned();
    assert!(!whole.contains(SECRET));
    // Every way of cutting the text into three pieces, around the secret and the token.
    let bytes: Vec<usize> = (0..text.len())
        .filter(|i| text.is_char_boundary(*i))
        .collect();
    for &a in bytes.iter().step_by(5) {
        for &b in bytes.iter().filter(|b| **b >= a).step_by(13) {
            let mut stream = redactor.stream();
            let mut out = Vec::new();
            for piece in [&text[..a], &text[a..b], &text[b..]] {
                out.push(stream.push(piece));
            }
            out.push(stream.finish());
            for part in &out {
                for window in [12, 20] {
                    assert!(
                        !SECRET
                            .as_bytes()
                            .windows(window)
                            .any(|w| part.as_bytes().windows(window).any(|p| p == w)),
                        "a part of the secret got out at cuts {a}/{b}: {part}"
                    );
                }
            }
            assert_eq!(out.concat(), whole, "cuts {a}/{b}");
        }
    }
}

#[test]
fn a_stream_lets_text_out_before_it_ends() {
    let redactor = Redactor::new(["zq-live-7Hc2Xw9Pk4Rm8Tn3Vb6Yd1"]).unwrap();
    let mut stream = redactor.stream();
    let long = "word ".repeat(200);
    let first = stream.push(&long);
    assert_eq!(first, long, "text that ends in a space starts no secret");
    assert_eq!(stream.held_back(), 0);
    let second = stream.push("and then some");
    assert_eq!(second, "and then ", "only the last word waits");
    assert_eq!(stream.held_back(), "some".len());
    assert_eq!(
        format!("{first}{second}{}", stream.finish()),
        format!("{long}and then some")
    );
}

#[test]
fn a_stream_holds_back_only_what_could_start_a_secret() {
    const SECRET: &str = "zq-live-7Hc2Xw9Pk4Rm8Tn3Vb6Yd1";
    let redactor = Redactor::new([SECRET]).unwrap();
    // The start of a live secret waits, as long as it could still be one.
    let mut stream = redactor.stream();
    assert_eq!(stream.push("the key is zq-live-7H"), "the key is ");
    assert_eq!(stream.held_back(), "zq-live-7H".len());
    assert_eq!(stream.push("x and more "), "zq-live-7Hx and more ");
    assert_eq!(stream.held_back(), 0);
    // A keyword-led shape waits across whitespace while it can still match.
    let mut stream = redactor.stream();
    assert_eq!(stream.push("login with password"), "login with ");
    assert_eq!(stream.push(" = "), "");
    assert_eq!(
        stream.push("hunter2hunter2 "),
        "password = [REDACTED:generic-credential-assignment] "
    );
    let mut stream = redactor.stream();
    assert_eq!(
        stream.push("send Authorization: Bearer"),
        "send Authorization: "
    );
    assert_eq!(stream.push("   "), "");
    assert_eq!(stream.push("not-a-token "), "Bearer   not-a-token ");
    // A PEM block waits until it ends.
    let mut stream = redactor.stream();
    let mut out = stream.push("here: -----BEGIN PRIVATE KEY-----\nMIIEvQ");
    assert_eq!(out, "here: ");
    out.push_str(&stream.push(&"QUJD\n".repeat(500)));
    assert_eq!(
        out, "here: ",
        "the body of a key is never let out while it lasts"
    );
    // The end line could still be growing (`-----END PRIVATE KEY----- AND MORE PRIVATE KEY-----`
    // would match further) until a byte that cannot be in it.
    out.push_str(&stream.push("-----END PRIVATE KEY-----"));
    assert_eq!(out, "here: ");
    out.push_str(&stream.push("\ndone "));
    assert_eq!(out, "here: [REDACTED:private-key]\ndone ");
}

/// Words of ordinary prose, with punctuation and some non-ASCII.
const PROSE: &[&str] = &[
    "the",
    "model",
    "said",
    "that",
    "résumé",
    "naïve",
    "data.",
    "ok,",
    "Yes!",
    "a-b",
    "x_y",
    "42",
    "(see",
    "notes)",
    "über",
    "日本語",
    "key",
    "token",
    "pass",
    "sk",
    "AKIA",
    "eyJ",
    "https",
    "bearer",
    "secret",
    "--",
    "::",
    "@",
];

/// Secrets of several kinds, each as it appears in text.
fn secret_texts(live: &str) -> Vec<String> {
    vec![
        live.to_owned(),
        STANDARD.encode(live),
        format!("ghp_{}", alnum(36)),
        format!("password = \"{}\"", alnum(14)),
        format!("Authorization: Bearer\n  {}", alnum(40)),
        format!("https://user:{}@example.com/x", alnum(12)),
        format!("AKIA{}", "ABCDEFGHIJKLMNOP"),
        format!(
            "-----BEGIN RSA PRIVATE KEY-----\n{}\n{}\n-----END RSA PRIVATE KEY-----",
            alnum(64),
            alnum(40)
        ),
        format!("eyJ{}.eyJ{}.{}", alnum(20), alnum(30), alnum(20)),
        format!("sk-proj-{}", alnum(48)),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Random text with secrets in it, cut at random points: the pieces let out, joined, are
    /// the whole text redacted, and no piece ever holds a secret's bytes.
    #[test]
    fn a_stream_of_random_pieces_equals_redacting_the_whole(
        live in "[A-Za-z0-9]{8,40}",
        words in proptest::collection::vec(0..PROSE.len(), 0..40),
        secrets in proptest::collection::vec((0usize..10, 0usize..41), 1..4),
        separators in proptest::collection::vec(0usize..4, 0..40),
        cuts in proptest::collection::vec(0usize..10_000, 0..12),
    ) {
        let live = format!("zq{live}");
        let redactor = Redactor::new([live.as_str()]).unwrap();
        let kinds = secret_texts(&live);
        let mut pieces: Vec<String> = words
            .iter()
            .zip(separators.iter().chain(std::iter::repeat(&0)))
            .map(|(&w, &sep)| format!("{}{}", PROSE[w], [" ", "\n", "", "  "][sep]))
            .collect();
        let mut planted = Vec::new();
        for &(kind, at) in &secrets {
            let secret = kinds[kind].clone();
            let at = at.min(pieces.len());
            pieces.insert(at, format!(" {secret} "));
            planted.push(secret);
        }
        let text = pieces.concat();
        let whole = redactor.redact(&text).into_owned();
        let mut bounds: Vec<usize> = cuts
            .iter()
            .map(|c| c % (text.len() + 1))
            .map(|c| text.floor_char_boundary(c))
            .collect();
        bounds.push(0);
        bounds.push(text.len());
        bounds.sort_unstable();
        bounds.dedup();
        let mut stream = redactor.stream();
        let mut out = String::new();
        for pair in bounds.windows(2) {
            let part = stream.push(&text[pair[0]..pair[1]]);
            proptest::prop_assert!(
                !part.contains(live.as_str()),
                "the live secret got out in {part:?}"
            );
            out.push_str(&part);
        }
        out.push_str(&stream.finish());
        proptest::prop_assert_eq!(&out, &whole);
        proptest::prop_assert!(!out.contains(live.as_str()));
    }

    /// Ordinary prose is let out up to its last word: the held-back tail is never longer than
    /// the text after the last whitespace.
    #[test]
    fn a_stream_of_prose_holds_back_at_most_its_last_word(
        words in proptest::collection::vec(0..PROSE.len(), 1..60),
        cuts in proptest::collection::vec(0usize..10_000, 0..12),
    ) {
        let redactor = Redactor::new(["zq-live-7Hc2Xw9Pk4Rm8Tn3Vb6Yd1"]).unwrap();
        // Keyword-led rules wait across whitespace (`bearer `, `secret :`), so leave them out.
        let prose: Vec<&str> = PROSE
            .iter()
            .copied()
            .filter(|w| !["bearer", "secret"].contains(w))
            .collect();
        let text = words
            .iter()
            .map(|&w| prose[w % prose.len()])
            .collect::<Vec<_>>()
            .join(" ");
        let mut bounds: Vec<usize> = cuts
            .iter()
            .map(|c| text.floor_char_boundary(c % (text.len() + 1)))
            .collect();
        bounds.push(0);
        bounds.push(text.len());
        bounds.sort_unstable();
        bounds.dedup();
        let mut stream = redactor.stream();
        for pair in bounds.windows(2) {
            stream.push(&text[pair[0]..pair[1]]);
            let seen = &text[..pair[1]];
            let last_word = seen.len() - seen.rfind(char::is_whitespace).map_or(0, |at| at + 1);
            proptest::prop_assert!(
                stream.held_back() <= last_word,
                "held back {} bytes of {seen:?}",
                stream.held_back()
            );
        }
    }
}

#[test]
fn the_shape_probe_builds_from_every_rule() {
    for rule in SHAPE_RULES {
        assert!(
            !rule.pattern.contains(r"\\b"),
            "{}: an escaped backslash before `b` would lose its meaning in the probe",
            rule.id
        );
        assert!(
            Regex::new(&stream::probe_pattern(rule.pattern)).is_ok(),
            "{}",
            rule.id
        );
    }
    let _ = stream::shape_probe();
    assert!(
        *stream::SHAPE_REACH >= 1 << 16,
        "a private key's body fits in the reach"
    );
}

#[test]
fn a_stream_sets_up_its_shape_probe_only_when_text_arrives() {
    let redactor = Redactor::new([LIVE]).unwrap();
    let mut stream = redactor.stream();
    assert_eq!(stream.push(""), "");
    assert!(!stream.probing());
    let mut out = stream.push("key ghp_");
    assert!(stream.probing());
    out.push_str(&stream.push("0123456789abcdefghijklmnopqrstuvwxyz and more"));
    out.push_str(&stream.finish());
    assert_eq!(
        out,
        redactor
            .redact("key ghp_0123456789abcdefghijklmnopqrstuvwxyz and more")
            .into_owned()
    );
    assert!(!out.contains("ghp_0123"));

    let empty = redactor.stream();
    assert!(!empty.probing());
    assert_eq!(empty.finish(), "");
}

#[test]
fn redacting_json_says_whether_anything_changed() {
    let redactor = Redactor::new([LIVE]).unwrap();
    let mut clean = serde_json::json!({"ok": ["fine", 1, {"still": "fine"}]});
    let before = clean.clone();
    assert!(!redactor.redact_json(&mut clean));
    assert_eq!(clean, before);
    // A change anywhere, however deep and whatever comes after it, is reported.
    for mut value in [
        serde_json::json!([format!("{LIVE}"), "fine"]),
        serde_json::json!(["fine", {"a": [{"b": format!("x{LIVE}")}]}, "fine"]),
        serde_json::json!({ LIVE: "a key" }),
        serde_json::json!({"shape": "ghp_0123456789abcdefghijklmnopqrstuvwxyz"}),
    ] {
        let before = value.clone();
        assert!(redactor.redact_json(&mut value), "{before}");
        assert_ne!(value, before);
    }
    // Each string is redacted, not only the first that changes.
    let mut twice = serde_json::json!([LIVE, {"a": LIVE, "b": LIVE}, LIVE]);
    assert!(redactor.redact_json(&mut twice));
    assert!(!twice.to_string().contains(LIVE), "{twice}");
    let mut shaped = serde_json::json!(["ghp_0123456789abcdefghijklmnopqrstuvwxyz"]);
    assert!(super::redact_shapes_json(&mut shaped));
    assert!(!super::redact_shapes_json(&mut serde_json::json!(["fine"])));
}
