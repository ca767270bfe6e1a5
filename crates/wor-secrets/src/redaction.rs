//! Redaction of live secret values and common secret shapes from text and JSON.
//!
//! A [`Redactor`] is built from a project's live secret values. [`Redactor::redact`] replaces
//!
//! - every occurrence of a live secret, and of its standard base64, URL-safe base64,
//!   percent-encoded and JSON-escaped forms, with `[REDACTED]` (leftmost-longest, with an
//!   Aho–Corasick automaton behind a fingerprint table of the secrets' first bytes). Secrets shorter than [`MIN_LIVE_SECRET_LEN`] bytes are not matched
//!   exactly: they would redact ordinary words; the shape rules still apply. Base64 forms only
//!   match where the secret starts the encoded stream (a secret encoded mid-stream has no
//!   fixed encoding);
//! - every match of a secret-shape rule (provider key formats, JWTs, private key blocks,
//!   credentials in URLs and headers) with `[REDACTED:<rule id>]`. As in gitleaks, one
//!   case-insensitive Aho–Corasick pass finds the rules' keywords and each rule's regex runs
//!   only in a window around its keyword hits, so text without keywords costs one scan.
//!   A credential in a URL or an assignment loses only its secret part.
//!
//! [`redact_shapes`] applies the shape rules alone, for logs that have no project.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fmt;
use std::ops::Range;
use std::sync::LazyLock;

use aho_corasick::{AhoCorasick, AhoCorasickKind, Anchored, Input, MatchKind, StartKind};
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use regex::Regex;

mod rules;
mod stream;

use rules::{SHAPE_RULES, ShapeRule};
pub use stream::StreamRedactor;

/// Marker that replaces a live secret (or overlapping hits of different kinds).
pub const REDACTED_MARKER: &str = "[REDACTED]";

/// Live secrets shorter than this many bytes are not matched exactly.
pub const MIN_LIVE_SECRET_LEN: usize = 8;

/// What went wrong while building a [`Redactor`].
#[derive(Debug, thiserror::Error)]
pub enum RedactionError {
    /// The live secrets are too many or too large for the matcher.
    #[error("live secrets could not be compiled into a matcher: {reason}")]
    MatcherTooLarge {
        /// The matcher's explanation (it names no secret).
        reason: String,
    },
}

/// Redacts one project's live secrets and all secret shapes.
///
/// Its `Debug` output shows only counts.
pub struct Redactor {
    /// `None` when no live secret is long enough to match.
    live: Option<LiveSecretMatcher>,
    live_pattern_count: usize,
    /// The longest live pattern, in bytes.
    longest_live: usize,
    /// Every live pattern, sorted: which text could still grow into one of them.
    live_sorted: Vec<String>,
}

/// Bits in the fingerprint table of a [`LiveSecretMatcher`] (128 KiB).
const FINGERPRINT_BITS: u32 = 20;

/// Finds live secrets: an 8-byte fingerprint table says where a secret may start, and an
/// anchored leftmost-longest Aho–Corasick search confirms it.
///
/// Scanning every position through a many-thousand-pattern automaton is slower than this
/// table lookup, which rejects almost every position at once.
struct LiveSecretMatcher {
    automaton: AhoCorasick,
    /// One bit per fingerprint of some pattern's first [`MIN_LIVE_SECRET_LEN`] bytes.
    fingerprints: Vec<u64>,
}

fn fingerprint(prefix: &[u8; MIN_LIVE_SECRET_LEN]) -> usize {
    let mixed = u64::from_le_bytes(*prefix).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    usize::try_from(mixed >> (64 - FINGERPRINT_BITS)).unwrap_or_default()
}

impl LiveSecretMatcher {
    fn build(patterns: &BTreeSet<String>) -> Result<Self, RedactionError> {
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .start_kind(StartKind::Anchored)
            // The contiguous NFA keeps memory linear in the secrets' total length; a DFA
            // over thousands of random strings would be hundreds of megabytes.
            .kind(Some(AhoCorasickKind::ContiguousNFA))
            .build(patterns)
            .map_err(|e| RedactionError::MatcherTooLarge {
                reason: e.to_string(),
            })?;
        let mut fingerprints = vec![0u64; 1 << (FINGERPRINT_BITS - 6)];
        for pattern in patterns {
            if let Some(prefix) = pattern.as_bytes().first_chunk() {
                let bit = fingerprint(prefix);
                if let Some(word) = fingerprints.get_mut(bit / 64) {
                    *word |= 1 << (bit % 64);
                }
            }
        }
        Ok(Self {
            automaton,
            fingerprints,
        })
    }

    fn may_start(&self, prefix: &[u8; MIN_LIVE_SECRET_LEN]) -> bool {
        let bit = fingerprint(prefix);
        self.fingerprints
            .get(bit / 64)
            .is_some_and(|word| word & (1 << (bit % 64)) != 0)
    }

    fn find(&self, text: &str, from: usize, spans: &mut Vec<Span>) {
        let bytes = text.as_bytes();
        let mut at = from;
        while let Some(prefix) = bytes.get(at..).and_then(|rest| rest.first_chunk()) {
            if self.may_start(prefix) {
                let input = Input::new(text)
                    .span(at..text.len())
                    .anchored(Anchored::Yes);
                if let Some(found) = self.automaton.find(input) {
                    spans.push(Span {
                        start: found.start(),
                        end: found.end(),
                        reach: (found.start(), found.end()),
                        marker: Marker::LiveSecret,
                    });
                    at = found.end();
                    continue;
                }
            }
            at += 1;
        }
    }
}

impl fmt::Debug for Redactor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redactor")
            .field("live_patterns", &self.live_pattern_count)
            .field("shape_rules", &SHAPE_RULES.len())
            .finish()
    }
}

impl Redactor {
    /// Builds a redactor from the live secret values of a project.
    ///
    /// # Errors
    /// [`RedactionError::MatcherTooLarge`] if the secrets exceed the matcher's size limits.
    pub fn new<S: AsRef<str>>(
        live_secrets: impl IntoIterator<Item = S>,
    ) -> Result<Self, RedactionError> {
        let mut patterns = BTreeSet::new();
        for secret in live_secrets {
            let secret = secret.as_ref();
            if secret.len() >= MIN_LIVE_SECRET_LEN {
                patterns.extend(encoded_forms(secret));
            }
        }
        let live_pattern_count = patterns.len();
        let longest_live = patterns.iter().map(String::len).max().unwrap_or(0);
        let live = if patterns.is_empty() {
            None
        } else {
            Some(LiveSecretMatcher::build(&patterns)?)
        };
        Ok(Self {
            live,
            live_pattern_count,
            longest_live,
            live_sorted: patterns.into_iter().collect(),
        })
    }

    /// Returns `text` with live secrets and secret shapes replaced; borrowed when unchanged.
    pub fn redact<'t>(&self, text: &'t str) -> Cow<'t, str> {
        apply(text, self.spans(text))
    }

    fn spans(&self, text: &str) -> Vec<Span> {
        self.spans_from(text, 0)
    }

    /// The matches in `text` that start at or after `from` (a char boundary), as a scan of
    /// the whole text finds them when no match crosses `from`.
    fn spans_from(&self, text: &str, from: usize) -> Vec<Span> {
        let mut spans = Vec::new();
        if let Some(live) = &self.live {
            live.find(text, from, &mut spans);
        }
        shape_scanner().find(text, from, &mut spans);
        spans
    }

    /// Where the longest tail of `text` after `from` that is still the start of a live
    /// pattern (a proper prefix of one) begins; `None` when no tail is.
    fn live_prefix_start(&self, text: &str, from: usize) -> Option<usize> {
        let bytes = text.as_bytes();
        let earliest = from.max(
            bytes
                .len()
                .saturating_sub(self.longest_live.saturating_sub(1)),
        );
        (earliest..bytes.len()).find(|&at| {
            let tail = bytes.get(at..).unwrap_or_default();
            let first = self
                .live_sorted
                .partition_point(|pattern| pattern.as_bytes() < tail);
            // Patterns that start with `tail` sort together from `first`; `tail` itself (a
            // whole pattern) sorts first among them and a longer one right after it.
            self.live_sorted
                .get(first..)
                .unwrap_or_default()
                .iter()
                .take(2)
                .any(|pattern| pattern.len() > tail.len() && pattern.as_bytes().starts_with(tail))
        })
    }

    /// Whether `text` holds one of the live secret values (in any of its encoded forms); the
    /// secret shapes are not looked for.
    pub fn holds_live_secret(&self, text: &str) -> bool {
        self.live.as_ref().is_some_and(|live| {
            let mut spans = Vec::new();
            live.find(text, 0, &mut spans);
            !spans.is_empty()
        })
    }

    /// A redactor for text that arrives in pieces (a model's streamed deltas).
    pub fn stream(&self) -> StreamRedactor<'_> {
        StreamRedactor::new(self)
    }

    /// Redacts every string in `value` in place: string values at any depth and object keys.
    ///
    /// Keys that redact to the same text collapse into one entry (the last one wins). Returns
    /// whether anything was redacted: `false` only when no string or key changed.
    pub fn redact_json(&self, value: &mut serde_json::Value) -> bool {
        redact_json_with(value, &|text| self.redact(text))
    }
}

/// Redacts secret shapes only (no live secrets), for logs and other text with no project.
pub fn redact_shapes(text: &str) -> Cow<'_, str> {
    let mut spans = Vec::new();
    shape_scanner().find(text, 0, &mut spans);
    apply(text, spans)
}

/// Redacts secret shapes only (no live secrets) from every string in `value` in place, as
/// [`Redactor::redact_json`] does with a project's secrets, and says whether anything was.
pub fn redact_shapes_json(value: &mut serde_json::Value) -> bool {
    redact_json_with(value, &redact_shapes)
}

/// Replaces each string and key of `value` that `redact` gives anew; whether any was.
fn redact_json_with(value: &mut serde_json::Value, redact: &dyn Fn(&str) -> Cow<'_, str>) -> bool {
    use serde_json::Value;
    match value {
        Value::String(text) => match redact(text) {
            Cow::Owned(redacted) => {
                *text = redacted;
                true
            }
            Cow::Borrowed(_) => false,
        },
        Value::Array(items) => {
            // Every item is redacted: no shortcut once one has changed.
            let mut changed = false;
            for item in items {
                changed |= redact_json_with(item, redact);
            }
            changed
        }
        Value::Object(map) => {
            let keys_change = map.keys().any(|k| matches!(redact(k), Cow::Owned(_)));
            if keys_change {
                let entries = std::mem::take(map);
                for (key, mut item) in entries {
                    redact_json_with(&mut item, redact);
                    map.insert(redact(&key).into_owned(), item);
                }
                true
            } else {
                let mut changed = false;
                for item in map.values_mut() {
                    changed |= redact_json_with(item, redact);
                }
                changed
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

/// The forms in which a secret commonly appears in tool output and payloads.
fn encoded_forms(secret: &str) -> Vec<String> {
    let bytes = secret.as_bytes();
    let mut forms = vec![
        secret.to_owned(),
        STANDARD.encode(bytes),
        STANDARD_NO_PAD.encode(bytes),
        URL_SAFE.encode(bytes),
        URL_SAFE_NO_PAD.encode(bytes),
        percent_encode(bytes, b"0123456789ABCDEF"),
        percent_encode(bytes, b"0123456789abcdef"),
    ];
    if let Ok(quoted) = serde_json::to_string(secret)
        && let Some(inner) = quoted.get(1..quoted.len().saturating_sub(1))
    {
        forms.push(inner.to_owned());
    }
    forms
}

/// Percent-encodes every byte outside RFC 3986's unreserved set.
fn percent_encode(bytes: &[u8], digits: &[u8; 16]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for &byte in bytes {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push('%');
            for nibble in [byte >> 4, byte & 0x0f] {
                let digit = digits.get(usize::from(nibble)).copied().unwrap_or(b'0');
                out.push(char::from(digit));
            }
        }
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    LiveSecret,
    Shape(&'static str),
}

#[derive(Debug, Clone, Copy)]
struct Span {
    /// The part to replace.
    start: usize,
    end: usize,
    /// The whole match around it (a credential's name, a URL's user), which a stream must
    /// not cut either.
    reach: (usize, usize),
    marker: Marker,
}

/// Replaces the union of `spans` in `text`; overlapping spans of different kinds get the
/// generic marker.
fn apply(text: &str, mut spans: Vec<Span>) -> Cow<'_, str> {
    if spans.is_empty() {
        return Cow::Borrowed(text);
    }
    spans.sort_unstable_by_key(|s| (s.start, std::cmp::Reverse(s.end)));
    let mut merged: Vec<Span> = Vec::with_capacity(spans.len());
    for span in spans {
        match merged.last_mut() {
            Some(last) if span.start < last.end => {
                last.end = last.end.max(span.end);
                if last.marker != span.marker {
                    last.marker = Marker::LiveSecret;
                }
            }
            _ => merged.push(span),
        }
    }
    let mut out = String::with_capacity(text.len());
    let mut cursor = 0;
    for span in merged {
        // INVARIANT: spans come from matches on `text`, so they lie on char boundaries.
        out.push_str(text.get(cursor..span.start).unwrap_or_default());
        match span.marker {
            Marker::LiveSecret => out.push_str(REDACTED_MARKER),
            Marker::Shape(id) => {
                out.push_str("[REDACTED:");
                out.push_str(id);
                out.push(']');
            }
        }
        cursor = span.end;
    }
    out.push_str(text.get(cursor..).unwrap_or_default());
    Cow::Owned(out)
}

/// Finds secret shapes: a keyword prefilter, then each rule's regex near its keyword hits.
struct ShapeScanner {
    /// Every rule keyword, lower-cased and deduplicated, matched ignoring ASCII case.
    keywords: AhoCorasick,
    /// For each keyword pattern, the rules it belongs to with the keyword as they spell it.
    keyword_rules: Vec<Vec<(usize, &'static str)>>,
    /// Each rule's regex, without the `\b` at its ends (see [`Edges`]).
    regexes: Vec<Regex>,
    /// Each rule's ends that its pattern bounds with `\b`.
    edges: Vec<Edges>,
}

/// The ends of a rule's match that its pattern bounds with `\b`.
///
/// The scanner checks them itself, with a word character other than `_` as the only thing
/// that joins ([`joins`]): `\b` in a regex takes `_` for part of a word, so `retry_ghp_…` or
/// `ghp_…_old` would hide a token from a rule whose pattern starts or ends with it.
#[derive(Clone, Copy, Debug, Default)]
struct Edges {
    /// No letter or digit may come just before the match.
    lead: bool,
    /// No letter or digit may come just after the match.
    trail: bool,
}

impl Edges {
    /// The pattern without a `\b` at its start (after a leading `(?i)`) or its end, and which
    /// of them it had.
    fn split(pattern: &str) -> (String, Self) {
        let (flags, body) = match pattern.strip_prefix("(?i)") {
            Some(body) => ("(?i)", body),
            None => ("", pattern),
        };
        let (lead, body) = match body.strip_prefix(r"\b") {
            Some(rest) => (true, rest),
            None => (false, body),
        };
        // No pattern holds `\\b` (`the_shape_probe_builds_from_every_rule`), so a `\b` at
        // the end is a boundary.
        let (trail, body) = match body.strip_suffix(r"\b") {
            Some(rest) => (true, rest),
            None => (false, body),
        };
        (format!("{flags}{body}"), Self { lead, trail })
    }

    fn hold_before(self, text: &str, at: usize) -> bool {
        !self.lead || !joins(text.get(..at).and_then(|t| t.chars().next_back()))
    }

    fn hold_after(self, text: &str, at: usize) -> bool {
        !self.trail || !joins(text.get(at..).and_then(|t| t.chars().next()))
    }
}

/// Whether a character next to a match makes it part of a longer word: a word character of a
/// regex's `\b` (letters, decimal digits, marks), but for `_`.
fn joins(next: Option<char>) -> bool {
    next.is_some_and(|c| {
        c != '_' && regex_syntax::try_is_word_character(c).unwrap_or_else(|_| c.is_alphanumeric())
    })
}

fn shape_scanner() -> &'static ShapeScanner {
    static SCANNER: LazyLock<ShapeScanner> = LazyLock::new(ShapeScanner::build);
    &SCANNER
}

impl ShapeScanner {
    #[expect(
        clippy::expect_used,
        reason = "the rules are constants; `every_rule_compiles_and_has_valid_keywords` builds them"
    )]
    fn build() -> Self {
        let mut keywords: Vec<String> = Vec::new();
        let mut keyword_rules: Vec<Vec<(usize, &'static str)>> = Vec::new();
        for (index, rule) in SHAPE_RULES.iter().enumerate() {
            for &keyword in rule.keywords {
                let folded = keyword.to_ascii_lowercase();
                let at = match keywords.iter().position(|k| *k == folded) {
                    Some(at) => at,
                    None => {
                        keywords.push(folded);
                        keyword_rules.push(Vec::new());
                        keywords.len() - 1
                    }
                };
                if let Some(list) = keyword_rules.get_mut(at) {
                    list.push((index, keyword));
                }
            }
        }
        let keywords = AhoCorasick::builder()
            .ascii_case_insensitive(true)
            .build(&keywords)
            .expect("keyword matcher builds");
        let (regexes, edges) = SHAPE_RULES
            .iter()
            .map(|rule| {
                let (pattern, edges) = Edges::split(rule.pattern);
                (Regex::new(&pattern).expect("rule pattern compiles"), edges)
            })
            .unzip();
        Self {
            keywords,
            keyword_rules,
            regexes,
            edges,
        }
    }

    /// Finds the matches that start at or after `from`.
    fn find(&self, text: &str, from: usize, spans: &mut Vec<Span>) {
        // Per rule, the merged windows around its keyword hits; made at the first hit, as
        // most strings have none.
        let mut windows: Vec<Vec<(usize, usize)>> = Vec::new();
        // A keyword lies inside its match, so one that starts before `from` is in no match
        // that starts at or after it.
        let input = Input::new(text).span(from.min(text.len())..text.len());
        for hit in self.keywords.find_overlapping_iter(input) {
            let Some(rule_keywords) = self.keyword_rules.get(hit.pattern().as_usize()) else {
                continue;
            };
            for &(index, keyword) in rule_keywords {
                let Some(rule) = SHAPE_RULES.get(index) else {
                    continue;
                };
                if !rule.ignores_case()
                    && text.as_bytes().get(hit.range()) != Some(keyword.as_bytes())
                {
                    continue;
                }
                if windows.is_empty() {
                    windows = vec![Vec::new(); SHAPE_RULES.len()];
                }
                let Some(list) = windows.get_mut(index) else {
                    continue;
                };
                let start = hit.start().saturating_sub(rule.before).max(from);
                let end = hit.end().saturating_add(rule.after).min(text.len());
                match list.last_mut() {
                    Some(last) if start <= last.1 => {
                        last.0 = last.0.min(start);
                        last.1 = last.1.max(end);
                    }
                    _ => list.push((start, end)),
                }
            }
        }
        let rules = SHAPE_RULES.iter().zip(&self.regexes).zip(&self.edges);
        for (((rule, regex), &edges), list) in rules.zip(&windows) {
            for &(start, end) in list {
                find_in_window(text, Bounded { rule, regex, edges }, start, end, spans);
            }
        }
    }
}

/// A rule with its regex and the ends the scanner checks.
#[derive(Clone, Copy)]
struct Bounded<'r> {
    rule: &'r ShapeRule,
    regex: &'r Regex,
    edges: Edges,
}

impl Bounded<'_> {
    /// The first match in `haystack` (a prefix of `text`) that starts at or after `at` and
    /// whose ends hold, as its whole range and its secret's.
    ///
    /// Where a match's end does not hold, shorter matches from the same start are tried, each
    /// ending before a character that does not join (the only places an end can hold), as a
    /// regex's own `\b` would backtrack to them (the rules with an end to check repeat
    /// greedily: `no_rule_with_an_end_to_check_repeats_lazily`). A match that reaches the cut
    /// of a window short of the text holds there, as it did against the regex's `\b`: the
    /// window's `after` is as long as a match may be, but for a rule without an upper bound.
    fn find(
        self,
        text: &str,
        haystack: &str,
        mut at: usize,
    ) -> Option<(Range<usize>, Range<usize>)> {
        let ends_held = |end: usize| {
            (end == haystack.len() && end < text.len()) || self.edges.hold_after(text, end)
        };
        while at < haystack.len() {
            let (whole, secret) = self.search(haystack, at)?;
            let start = whole.start;
            if self.edges.hold_before(text, start) {
                if ends_held(whole.end) {
                    return Some((whole, secret));
                }
                let mut end = whole.end;
                while let Some(shorter) = last_separator_before(text, start, end) {
                    let Some(found) = haystack.get(..shorter).and_then(|h| self.search(h, start))
                    else {
                        break;
                    };
                    if found.0.start != start {
                        break;
                    }
                    if self.edges.hold_after(text, found.0.end) {
                        return Some(found);
                    }
                    end = found.0.end;
                }
            }
            at = text.ceil_char_boundary(start.saturating_add(1));
        }
        None
    }

    fn search(self, haystack: &str, at: usize) -> Option<(Range<usize>, Range<usize>)> {
        if self.rule.secret_group == 0 {
            self.regex
                .find_at(haystack, at)
                .map(|m| (m.range(), m.range()))
        } else {
            self.regex.captures_at(haystack, at).and_then(|caps| {
                let whole = caps.get(0)?.range();
                Some((whole, caps.get(self.rule.secret_group)?.range()))
            })
        }
    }
}

/// The last position after `start` and before `end` where a character that does not join a
/// word begins: where a shorter match's end could hold.
fn last_separator_before(text: &str, start: usize, end: usize) -> Option<usize> {
    let between = text.get(start..end)?;
    between
        .char_indices()
        .rev()
        .find(|&(offset, c)| offset > 0 && !joins(Some(c)))
        .map(|(offset, _)| start + offset)
}

fn find_in_window(text: &str, rule: Bounded<'_>, start: usize, end: usize, spans: &mut Vec<Span>) {
    let start = text.floor_char_boundary(start);
    let end = text.ceil_char_boundary(end);
    // Searching `text[..end]` from `start` keeps the context before the window visible to
    // the regex; matches end within `after` bytes of their keyword, so the cut at `end` loses
    // none. The ends a rule bounds are checked against `text` itself.
    let Some(haystack) = text.get(..end) else {
        return;
    };
    let marker = Marker::Shape(rule.rule.id);
    let mut at = start;
    while at < haystack.len() {
        let Some((whole, secret)) = rule.find(text, haystack, at) else {
            break;
        };
        let match_end = whole.end;
        if !secret.is_empty() {
            spans.push(Span {
                start: secret.start,
                end: secret.end,
                reach: (whole.start, whole.end),
                marker,
            });
        }
        at = if match_end > at {
            match_end
        } else {
            text.ceil_char_boundary(at.saturating_add(1))
        };
    }
}

#[cfg(test)]
mod tests;
