//! Redaction of text that arrives in pieces (a model's streamed deltas).
//!
//! A [`StreamRedactor`] lets text out as soon as no secret can still be growing in it, and
//! holds back only the tail that could be the start of one:
//!
//! - for live secrets, the longest tail that is a proper prefix of one of their encoded forms;
//! - for secret shapes, everything from the earliest position where some rule could still be
//!   matching. A lazy DFA of all the rules' patterns (anchored, every match kept, word
//!   boundaries dropped so it accepts more than the rules do, never less) is run from every
//!   position as the text arrives; a position is let go once the DFA from it is dead. Runs in
//!   the same DFA state are merged, keeping the earliest start, so the work per byte is the
//!   number of distinct live states, not the number of positions.
//!
//! Keyword-led rules whose matches span whitespace (`password = …`, `Bearer …`, PEM blocks)
//! stay alive across pieces exactly as long as their pattern can still continue. A rule that
//! can keep matching indefinitely (an unterminated PEM block, a very long token) is bounded by
//! the scanner's own window: no match reaches further than [`SHAPE_REACH`] bytes from where it
//! starts, so no position is held back longer than that.

use std::collections::HashSet;
use std::fmt;
use std::sync::LazyLock;

use regex_automata::hybrid::LazyStateID;
use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::nfa::thompson;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};

use super::rules::SHAPE_RULES;
use super::{Redactor, Span, apply};

/// The furthest, in bytes, a shape match reaches from where it starts: the longest rule's
/// `before`, keyword and `after` (a private key's 64 KiB body).
pub(super) static SHAPE_REACH: LazyLock<usize> = LazyLock::new(|| {
    SHAPE_RULES
        .iter()
        .map(|rule| {
            let keyword = rule.keywords.iter().map(|k| k.len()).max().unwrap_or(0);
            rule.before + keyword + rule.after
        })
        .max()
        .unwrap_or(0)
});

/// Memory for one stream's lazy DFA states.
const PROBE_CACHE_BYTES: usize = 4 << 20;

/// The rules' patterns as lazy DFAs that answer "could a match still be growing from here".
///
/// Rules with only greedy repetition share one DFA that keeps every match (it accepts at
/// least what each rule does on its own). A rule with a lazy repetition (a private key's body
/// up to its first `-----END`) gets a DFA of its own with the regex's leftmost-first
/// preference, which stops at the first end as the rule does; kept together with the others
/// it would run on past its end to the reach.
pub(super) struct ShapeProbe {
    lanes: Vec<DFA>,
}

/// The pattern a rule's probe runs: the rule's own with its word boundaries taken out, so
/// the probe accepts every string the rule does (and some more), whatever comes before.
pub(super) fn probe_pattern(pattern: &str) -> String {
    pattern.replace(r"\b", "")
}

pub(super) fn has_lazy_repetition(pattern: &str) -> bool {
    ["*?", "+?", "}?"].iter().any(|lazy| pattern.contains(lazy))
}

pub(super) fn shape_probe() -> &'static ShapeProbe {
    static PROBE: LazyLock<ShapeProbe> = LazyLock::new(ShapeProbe::build);
    &PROBE
}

impl ShapeProbe {
    #[expect(
        clippy::expect_used,
        reason = "the rules are constants; `the_shape_probe_builds_from_every_rule` builds it"
    )]
    fn build() -> Self {
        let build = |kind: MatchKind, patterns: &[String]| {
            DFA::builder()
                .configure(
                    DFA::config()
                        .match_kind(kind)
                        .cache_capacity(PROBE_CACHE_BYTES),
                )
                .thompson(thompson::Config::new().shrink(true))
                .build_many(patterns)
                .expect("the shape probe builds")
        };
        let (lazy, greedy): (Vec<_>, Vec<_>) = SHAPE_RULES
            .iter()
            .map(|rule| probe_pattern(rule.pattern))
            .partition(|pattern| has_lazy_repetition(pattern));
        let mut lanes = vec![build(MatchKind::All, &greedy)];
        lanes.extend(
            lazy.iter()
                .map(|pattern| build(MatchKind::LeftmostFirst, std::slice::from_ref(pattern))),
        );
        Self { lanes }
    }
}

/// One lane of the probe as a stream runs it.
struct Lane {
    dfa: &'static DFA,
    cache: Cache,
    /// Live runs, earliest start first, at most one per DFA state.
    runs: Vec<Run>,
}

impl Lane {
    /// Whether a run in `state` cannot go on matching: it is dead, or it only reports a
    /// match that ended before the last byte (the DFA reports matches one byte late) and no
    /// byte leads anywhere from it.
    fn finished(dfa: &DFA, cache: &mut Cache, state: LazyStateID) -> Option<bool> {
        if state.is_dead() {
            return Some(true);
        }
        if !state.is_match() {
            return Some(false);
        }
        for unit in dfa.byte_classes().representatives(..) {
            let Some(byte) = unit.as_u8() else {
                continue;
            };
            if !dfa.next_state(cache, state, byte).ok()?.is_dead() {
                return Some(false);
            }
        }
        Some(true)
    }

    /// Reads `byte` at `at`; a run starts there first when `at` is a char boundary.
    fn read(&mut self, at: usize, starts: bool, byte: u8, reach: usize) {
        let dfa = self.dfa;
        let cache = &mut self.cache;
        let clears = cache.clear_count();
        if starts {
            let config = start::Config::new().anchored(Anchored::Yes);
            let state = dfa.start_state(cache, &config).ok();
            self.runs.push(Run { start: at, state });
        }
        for run in &mut self.runs {
            if let Some(state) = run.state {
                run.state = dfa.next_state(cache, state, byte).ok();
            }
        }
        let read = at + 1;
        self.runs.retain_mut(|run| {
            if read.saturating_sub(run.start) > reach {
                return false;
            }
            let Some(state) = run.state else {
                return true;
            };
            match Self::finished(dfa, cache, state) {
                Some(finished) => !finished,
                None => {
                    run.state = None;
                    true
                }
            }
        });
        if cache.clear_count() != clears {
            // The states held before the clear mean nothing now: every run is unknown, and
            // the earliest stands for them all.
            for run in &mut self.runs {
                run.state = None;
            }
        }
        let mut seen: HashSet<LazyStateID> = HashSet::new();
        let mut unknown = false;
        self.runs.retain_mut(|run| {
            // A DFA that gave up (it has no word boundaries to give up on) knows nothing.
            if run.state.is_some_and(|state| state.is_quit()) {
                run.state = None;
            }
            match run.state {
                None => !std::mem::replace(&mut unknown, true),
                Some(state) => seen.insert(state),
            }
        });
    }
}

/// A run of the shape probe from `start`; `state` is `None` once the run is no longer known
/// exactly (its DFA cache was cleared), and such a run counts as alive until [`SHAPE_REACH`].
#[derive(Debug, Clone, Copy)]
struct Run {
    start: usize,
    state: Option<LazyStateID>,
}

/// Redacts text that arrives in pieces: each piece is added to everything before it, and
/// only text that no secret can still be spanning is let out, redacted.
///
/// INVARIANT: no match over everything seen so far, nor any match the text could still grow
/// into, crosses the end of what was let out; so what comes out, piece by piece, is exactly
/// what redacting the whole text at once gives.
pub struct StreamRedactor<'r> {
    redactor: &'r Redactor,
    text: String,
    /// Bytes of `text` already let out.
    emitted: usize,
    /// Bytes of `text` the shape probe has read.
    probed: usize,
    /// The probe's lanes, made when the first text arrives: a stream that carries none (a
    /// model turn that only asks for calls) never sets up a DFA cache.
    lanes: Option<Vec<Lane>>,
}

impl fmt::Debug for StreamRedactor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamRedactor")
            .field("seen", &self.text.len())
            .field("emitted", &self.emitted)
            .field(
                "runs",
                &self
                    .lanes
                    .iter()
                    .flatten()
                    .map(|l| l.runs.len())
                    .sum::<usize>(),
            )
            .finish()
    }
}

impl<'r> StreamRedactor<'r> {
    pub(super) fn new(redactor: &'r Redactor) -> Self {
        Self {
            redactor,
            text: String::new(),
            emitted: 0,
            probed: 0,
            lanes: None,
        }
    }

    /// Adds `piece`; returns the redacted text that may be let out now (often all of it but
    /// the last word).
    pub fn push(&mut self, piece: &str) -> String {
        self.text.push_str(piece);
        self.probe();
        let mut cut = self.text.len();
        for lane in self.lanes.iter().flatten() {
            if let Some(run) = lane.runs.first() {
                cut = cut.min(run.start);
            }
        }
        if let Some(at) = self.redactor.live_prefix_start(&self.text, self.emitted) {
            cut = cut.min(at);
        }
        self.let_out(cut, false)
    }

    /// The rest, redacted, once the stream has ended.
    pub fn finish(mut self) -> String {
        let end = self.text.len();
        self.let_out(end, true)
    }

    /// Whether the shape probe has been set up (it is, at the first text).
    #[cfg(test)]
    pub(super) fn probing(&self) -> bool {
        self.lanes.is_some()
    }

    /// Bytes received and not let out yet.
    pub fn held_back(&self) -> usize {
        self.text.len() - self.emitted
    }

    /// Feeds the probe the bytes it has not read: every char boundary starts a run, runs
    /// that die or reach past [`SHAPE_REACH`] end, and runs that meet in one state merge.
    fn probe(&mut self) {
        let reach = *SHAPE_REACH;
        if self.probed == self.text.len() {
            return;
        }
        let lanes = self.lanes.get_or_insert_with(|| {
            shape_probe()
                .lanes
                .iter()
                .map(|dfa| Lane {
                    dfa,
                    cache: dfa.create_cache(),
                    runs: Vec::new(),
                })
                .collect()
        });
        while let Some(&byte) = self.text.as_bytes().get(self.probed) {
            let at = self.probed;
            let starts = self.text.is_char_boundary(at);
            for lane in lanes.iter_mut() {
                lane.read(at, starts, byte, reach);
            }
            self.probed = at + 1;
        }
    }

    fn let_out(&mut self, cut: usize, last: bool) -> String {
        let spans = self.redactor.spans_from(&self.text, self.emitted);
        let mut cut = cut;
        if !last {
            // Never cut inside a match: it waits whole.
            while let Some(start) = spans
                .iter()
                .filter(|s| s.reach.0 < cut && s.reach.1 > cut)
                .map(|s| s.reach.0)
                .min()
            {
                cut = start;
            }
        }
        while !self.text.is_char_boundary(cut) {
            cut = cut.saturating_sub(1);
        }
        if cut <= self.emitted {
            return String::new();
        }
        let inside: Vec<Span> = spans
            .into_iter()
            .filter(|s| s.start >= self.emitted && s.end <= cut)
            .map(|s| Span {
                start: s.start - self.emitted,
                end: s.end - self.emitted,
                reach: s.reach,
                marker: s.marker,
            })
            .collect();
        let piece = self.text.get(self.emitted..cut).unwrap_or_default();
        let out = apply(piece, inside).into_owned();
        self.emitted = cut;
        out
    }
}
