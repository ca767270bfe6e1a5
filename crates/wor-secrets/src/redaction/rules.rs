//! Secret-shape rules: provider key formats, tokens, private keys and credentials in text.
//!
//! Rule ids, keyword lists and the token formats they describe are adapted from gitleaks
//! (<https://github.com/gitleaks/gitleaks>, `config/gitleaks.toml`), used under the MIT License:
//!
//! > Copyright (c) 2019 Zachary Rice
//! >
//! > Permission is hereby granted, free of charge, to any person obtaining a copy of this
//! > software and associated documentation files (the "Software"), to deal in the Software
//! > without restriction, including without limitation the rights to use, copy, modify, merge,
//! > publish, distribute, sublicense, and/or sell copies of the Software, and to permit persons
//! > to whom the Software is furnished to do so, subject to the following conditions: The above
//! > copyright notice and this permission notice shall be included in all copies or substantial
//! > portions of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND.
//!
//! The regexes are rewritten for the Rust `regex` dialect (no lookaround, no entropy checks) and
//! lean towards redacting: a false positive hides a harmless string, a false negative leaks a
//! credential. A `\b` at either end of a pattern is checked by the scanner rather than the
//! regex, with a word character other than `_` (a letter, a decimal digit, a mark) the only
//! thing that joins a match to what is beside it: a regex's `\b` takes `_` for part of a
//! word, so `retry_ghp_…` or `DB_PASSWORD=…` would not match.
//!
//! A few rules (`basic-auth-url`, `bearer-token`, `basic-auth-header`,
//! `generic-credential-assignment`, `whsec-secret`, `dockerhub-pat`, and `wor-api-key`,
//! `wor-run-token` and `wor-token` for this project's own API keys, run credentials and other
//! tokens: invitations, sign-in links, sessions, worker enrolments and Slack links) are this
//! project's own.
//!
//! One keyword of a rule occurs in every match of it: exactly as written for case-sensitive
//! rules, in any case for rules whose pattern starts with `(?i)` (their keywords are lower
//! case). The scanner finds keywords case-insensitively, drops hits whose case cannot match,
//! and runs a rule's regex only from `before` bytes ahead of a hit to `after` bytes past it.

/// One secret shape.
#[derive(Debug)]
pub(crate) struct ShapeRule {
    /// Stable id, shown in the redaction marker.
    pub(crate) id: &'static str,
    /// Keywords, one of which occurs in every match (see the module docs for their case).
    pub(crate) keywords: &'static [&'static str],
    /// Regex in the Rust `regex` dialect.
    pub(crate) pattern: &'static str,
    /// Capture group holding the secret part; 0 redacts the whole match.
    pub(crate) secret_group: usize,
    /// Upper bound, in bytes, from the start of a match to the start of its keyword.
    pub(crate) before: usize,
    /// Upper bound, in bytes, from the end of a keyword to the end of its match.
    pub(crate) after: usize,
}

impl ShapeRule {
    /// Whether the pattern ignores case, so keyword hits in any case count.
    pub(crate) fn ignores_case(&self) -> bool {
        self.pattern.starts_with("(?i)")
    }
}

const fn rule(
    id: &'static str,
    (before, after): (usize, usize),
    keywords: &'static [&'static str],
    pattern: &'static str,
) -> ShapeRule {
    ShapeRule {
        id,
        keywords,
        pattern,
        secret_group: 0,
        before,
        after,
    }
}

const fn rule_group(
    id: &'static str,
    (before, after): (usize, usize),
    keywords: &'static [&'static str],
    pattern: &'static str,
) -> ShapeRule {
    ShapeRule {
        id,
        keywords,
        pattern,
        secret_group: 1,
        before,
        after,
    }
}

/// All rules, checked in this order (order only matters for the marker of overlapping hits).
pub(crate) const SHAPE_RULES: &[ShapeRule] = &[
    rule(
        "private-key",
        (2, 1 << 16),
        &["-----begin"],
        r"(?i)-----BEGIN[ A-Z0-9_-]{0,100}PRIVATE KEY(?: BLOCK)?-----(?:[\s\S]*?-----END[ A-Z0-9_-]{0,100}PRIVATE KEY(?: BLOCK)?-----|[A-Za-z0-9+/=\s\\]*)",
    ),
    rule(
        "aws-access-token",
        (2, 32),
        &["A3T", "AKIA", "ASIA", "ABIA", "ACCA"],
        r"\b(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16}\b",
    ),
    rule_group(
        "aws-secret-access-key",
        (2, 160),
        &["aws"],
        r#"(?i)\baws_?secret(?:_?access)?_?key\b["']?\s*[:=]\s*["']?([A-Za-z0-9/+]{40})\b"#,
    ),
    rule("github-pat", (2, 48), &["ghp_"], r"\bghp_[0-9A-Za-z]{36}\b"),
    rule(
        "github-fine-grained-pat",
        (2, 100),
        &["github_pat_"],
        r"\bgithub_pat_[A-Za-z0-9_]{82}\b",
    ),
    rule(
        "github-oauth",
        (2, 48),
        &["gho_"],
        r"\bgho_[0-9A-Za-z]{36}\b",
    ),
    rule(
        "github-app-token",
        (2, 48),
        &["ghu_", "ghs_"],
        r"\b(?:ghu|ghs)_[0-9A-Za-z]{36}\b",
    ),
    rule(
        "github-refresh-token",
        (2, 48),
        &["ghr_"],
        r"\bghr_[0-9A-Za-z]{36}\b",
    ),
    rule(
        "gitlab-pat",
        (2, 128),
        &["glpat-"],
        r"\bglpat-[A-Za-z0-9_.-]{20,100}",
    ),
    rule(
        "gitlab-pipeline-trigger-token",
        (2, 56),
        &["glptt-"],
        r"\bglptt-[0-9a-f]{40}\b",
    ),
    rule(
        "gitlab-runner-registration-token",
        (2, 40),
        &["GR1348941"],
        r"\bGR1348941[A-Za-z0-9_-]{20}\b",
    ),
    rule(
        "gitlab-runner-auth-token",
        (2, 128),
        &["glrt-"],
        r"\bglrt-[A-Za-z0-9_.-]{20,100}",
    ),
    rule(
        "gitlab-deploy-token",
        (2, 128),
        &["gldt-"],
        r"\bgldt-[A-Za-z0-9_.-]{20,100}",
    ),
    rule(
        "slack-bot-token",
        (2, 128),
        &["xoxb-"],
        r"\bxoxb-[0-9]{10,13}-[0-9]{10,13}[A-Za-z0-9-]*",
    ),
    rule(
        "slack-user-token",
        (2, 128),
        &["xoxp-", "xoxe-"],
        r"\bxox[pe](?:-[0-9]{10,13}){3}-[A-Za-z0-9-]{28,34}",
    ),
    rule(
        "slack-app-token",
        (2, 160),
        &["xapp-"],
        r"(?i)\bxapp-\d-[A-Z0-9]+-\d+-[a-z0-9]+",
    ),
    rule(
        "slack-webhook-url",
        (10, 128),
        &["hooks.slack.com"],
        r"(?:https?://)?hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9+/]{43,56}",
    ),
    rule(
        "discord-webhook-url",
        (10, 200),
        &["discord.com/api/webhooks", "discordapp.com/api/webhooks"],
        r"https://(?:ptb\.|canary\.)?discord(?:app)?\.com/api/webhooks/\d+/[A-Za-z0-9_-]{60,}",
    ),
    rule(
        "stripe-access-token",
        (2, 112),
        &[
            "sk_test_", "sk_live_", "sk_prod_", "rk_test_", "rk_live_", "rk_prod_",
        ],
        r"\b(?:sk|rk)_(?:test|live|prod)_[A-Za-z0-9]{10,99}\b",
    ),
    rule("wor-api-key", (2, 72), &["wor_"], r"\bwor_[0-9a-f]{64}\b"),
    rule("wor-run-token", (2, 72), &["wrt_"], r"\bwrt_[0-9a-f]{64}\b"),
    rule(
        "wor-token",
        (2, 72),
        &["wri_", "wrl_", "wrs_", "wet_", "wsl_"],
        r"\b(?:wri|wrl|wrs|wet|wsl)_[0-9a-f]{64}\b",
    ),
    rule(
        "whsec-secret",
        (2, 128),
        &["whsec_"],
        r"\bwhsec_[A-Za-z0-9+/=]{24,100}",
    ),
    rule(
        "openai-api-key",
        (120, 112),
        &["T3BlbkFJ"],
        r"\bsk-(?:(?:proj|svcacct|admin)-)?[A-Za-z0-9_-]{20,100}T3BlbkFJ[A-Za-z0-9_-]{20,100}",
    ),
    rule(
        "openai-project-key",
        (2, 256),
        &["sk-proj-", "sk-svcacct-", "sk-admin-"],
        r"\bsk-(?:proj|svcacct|admin)-[A-Za-z0-9_-]{40,200}",
    ),
    rule(
        "anthropic-api-key",
        (2, 128),
        &["sk-ant-api03"],
        r"\bsk-ant-api03-[A-Za-z0-9_-]{93}AA",
    ),
    rule(
        "anthropic-admin-api-key",
        (2, 128),
        &["sk-ant-admin01"],
        r"\bsk-ant-admin01-[A-Za-z0-9_-]{93}AA",
    ),
    rule(
        "gcp-api-key",
        (2, 48),
        &["AIza"],
        r"\bAIza[A-Za-z0-9_-]{35}",
    ),
    rule(
        "google-oauth-client-secret",
        (2, 40),
        &["GOCSPX-"],
        r"\bGOCSPX-[A-Za-z0-9_-]{28}",
    ),
    rule("twilio-api-key", (1, 40), &["SK"], r"\bSK[0-9a-fA-F]{32}\b"),
    rule(
        "sendgrid-api-token",
        (2, 80),
        &["SG."],
        r"\bSG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}\b",
    ),
    rule(
        "npm-access-token",
        (2, 48),
        &["npm_"],
        r"(?i)\bnpm_[a-z0-9]{36}\b",
    ),
    rule(
        "pypi-upload-token",
        (2, 1100),
        &["pypi-AgEIcHlwaS5vcmc"],
        r"\bpypi-AgEIcHlwaS5vcmc[A-Za-z0-9_-]{50,}",
    ),
    rule(
        "jwt",
        (2, 1 << 14),
        &["eyJ"],
        r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]*",
    ),
    rule_group(
        "basic-auth-url",
        (40, 300),
        &["://"],
        r#"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/?#"'<>]+:([^\s@/?#"'<>]+)@"#,
    ),
    rule_group(
        "bearer-token",
        (2, 4096),
        &["bearer"],
        r"(?i)\bbearer\s+([A-Za-z0-9._~+/-]{20,}=*)",
    ),
    rule_group(
        "basic-auth-header",
        (2, 300),
        &["authorization"],
        r#"(?i)\bauthorization["']?\s*[:=]\s*["']?basic\s+([A-Za-z0-9+/]{8,}={0,2})"#,
    ),
    rule_group(
        "generic-credential-assignment",
        (2, 300),
        &[
            "password",
            "passwd",
            "pwd",
            "secret",
            "api_key",
            "api-key",
            "apikey",
            "access_token",
            "access-token",
            "auth_token",
            "auth-token",
        ],
        r#"(?i)\b(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?token|auth[_-]?token|client[_-]?secret)\b["']?\s*[:=]\s*["']?([^\s"',;&\[][^\s"',;&]{7,})"#,
    ),
    rule(
        "age-secret-key",
        (2, 80),
        &["AGE-SECRET-KEY-1"],
        r"\bAGE-SECRET-KEY-1[QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L]{58}\b",
    ),
    rule(
        "shopify-token",
        (2, 40),
        &["shpat_", "shpca_", "shppa_", "shpss_"],
        r"\bshp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}\b",
    ),
    rule(
        "digitalocean-token",
        (2, 80),
        &["dop_v1_", "doo_v1_", "dor_v1_"],
        r"\bdo[por]_v1_[a-f0-9]{64}\b",
    ),
    rule(
        "doppler-api-token",
        (2, 64),
        &["dp.pt.", "dp.st."],
        r"\bdp\.(?:pt|st)\.[A-Za-z0-9]{40,44}\b",
    ),
    rule(
        "hashicorp-tf-api-token",
        (16, 100),
        &["atlasv1"],
        r"(?i)\b[a-z0-9]{14}\.atlasv1\.[a-z0-9=_-]{60,70}\b",
    ),
    rule(
        "vault-token",
        (2, 260),
        &["hvs.", "hvb."],
        r"\bhv[sb]\.[A-Za-z0-9_-]{90,}\b",
    ),
    rule(
        "huggingface-access-token",
        (2, 40),
        &["hf_"],
        r"\bhf_[A-Za-z]{34}\b",
    ),
    rule(
        "postman-api-token",
        (2, 72),
        &["PMAK-"],
        r"\bPMAK-[a-fA-F0-9]{24}-[a-fA-F0-9]{34}\b",
    ),
    rule(
        "pulumi-api-token",
        (2, 48),
        &["pul-"],
        r"\bpul-[a-f0-9]{40}\b",
    ),
    rule(
        "linear-api-key",
        (2, 56),
        &["lin_api_"],
        r"\blin_api_[A-Za-z0-9]{40}\b",
    ),
    rule(
        "databricks-api-token",
        (2, 48),
        &["dapi"],
        r"\bdapi[a-f0-9]{32}(?:-\d)?\b",
    ),
    rule(
        "atlassian-api-token",
        (2, 200),
        &["ATATT3"],
        r"\bATATT3[A-Za-z0-9_=-]{186}",
    ),
    rule(
        "grafana-service-account-token",
        (2, 56),
        &["glsa_"],
        r"\bglsa_[A-Za-z0-9]{32}_[A-Fa-f0-9]{8}\b",
    ),
    rule(
        "grafana-cloud-api-token",
        (2, 420),
        &["glc_"],
        r"\bglc_[A-Za-z0-9+/]{32,}={0,2}",
    ),
    rule(
        "new-relic-user-api-key",
        (2, 40),
        &["NRAK-"],
        r"\bNRAK-[A-Z0-9]{27}\b",
    ),
    rule(
        "sentry-user-token",
        (2, 80),
        &["sntryu_"],
        r"\bsntryu_[a-f0-9]{64}\b",
    ),
    rule(
        "sentry-org-token",
        (2, 1024),
        &["sntrys_"],
        r"\bsntrys_eyJ[A-Za-z0-9+/=_-]{50,}",
    ),
    rule(
        "flyio-access-token",
        (2, 56),
        &["fo1_"],
        r"\bfo1_[A-Za-z0-9_-]{43}\b",
    ),
    rule(
        "planetscale-token",
        (2, 88),
        &["pscale_"],
        r"\bpscale_(?:tkn|pw|oauth)_[A-Za-z0-9_=.-]{32,64}\b",
    ),
    rule(
        "rubygems-api-token",
        (2, 64),
        &["rubygems_"],
        r"\brubygems_[a-f0-9]{48}\b",
    ),
    rule(
        "square-access-token",
        (2, 72),
        &["EAAA", "sq0atp-"],
        r"\b(?:EAAA|sq0atp-)[A-Za-z0-9_-]{22,60}\b",
    ),
    rule(
        "azure-ad-client-secret",
        (6, 48),
        &["Q~"],
        r"[A-Za-z0-9_~.]{3}\dQ~[A-Za-z0-9_~.-]{31,34}",
    ),
    rule(
        "dockerhub-pat",
        (2, 40),
        &["dckr_pat_"],
        r"\bdckr_pat_[A-Za-z0-9_-]{27}\b",
    ),
    rule(
        "mailgun-private-api-token",
        (2, 40),
        &["key-"],
        r"\bkey-[a-f0-9]{32}\b",
    ),
    rule(
        "telegram-bot-token",
        (12, 56),
        &[":AA"],
        r"\b\d{8,10}:AA[A-Za-z0-9_-]{33}\b",
    ),
];
