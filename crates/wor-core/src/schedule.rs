//! Schedules: a routine's `[schedule]` (a cron expression in an IANA time zone), its firing
//! times, which missed slots to catch up after downtime, and a deterministic jitter.
//!
//! Times are Unix milliseconds (UTC). Cron expressions have five fields, six with seconds
//! first, or seven with seconds first and a year last, or are one of the nicknames
//! `@yearly` (`@annually`), `@monthly`, `@weekly`, `@daily` and `@hourly`. Daylight-saving
//! transitions follow croner: a fixed-time slot that falls into a spring-forward gap fires at
//! the first instant after the gap, and one that falls into a fall-back overlap fires once, at
//! the earlier instant. croner counts a pattern as fixed-time only when it names one time of
//! day; a pattern whose seconds, minutes and hours list fixed values (`30 2,14 * * *`,
//! `0 1-3 * * *`) is read here as one fixed-time pattern per time of day it names (at most
//! [`MAX_FIXED_TIMES`]), so each of its slots keeps those rules too. A wildcard or a step in
//! any of the three (`0 * * * *`, `*/15 9 * * *`) makes an interval pattern, which runs at
//! every real instant it names.

use std::str::FromStr;

use chrono::{TimeZone as _, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use serde::{Deserialize, Serialize};

use crate::canonical::sha256_hex;

/// How long after its time a slot still counts as on time rather than missed.
pub const ON_TIME_GRACE_MS: i64 = 60_000;
/// At most this many missed slots are caught up with `catch_up = "all"` (the latest ones).
pub const MAX_CATCH_UP: usize = 24;
/// Longest jitter a schedule may ask for.
pub const MAX_JITTER_SECONDS: u64 = 3600;
/// The most times of day a pattern of fixed values may name to be read as that many
/// fixed-time patterns; one naming more is an interval pattern.
pub const MAX_FIXED_TIMES: usize = 24;

/// What to do with slots missed while no scheduler ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CatchUp {
    /// Missed slots do not run.
    Skip,
    /// The latest missed slot runs once.
    #[default]
    One,
    /// Every missed slot runs, at most [`MAX_CATCH_UP`] of them (the latest).
    All,
}

/// `[schedule]` of a routine, as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSection {
    /// Five fields (minute hour day-of-month month day-of-week), six with seconds first, seven
    /// with a year last, or a nickname such as `@daily`.
    pub cron: String,
    /// An IANA time zone name such as `Europe/Berlin`.
    #[serde(default = "utc")]
    pub timezone: String,
    #[serde(default)]
    pub catch_up: CatchUp,
    /// Each slot runs up to this many seconds late, by an offset fixed per routine and slot.
    #[serde(default)]
    pub jitter_seconds: u64,
}

fn utc() -> String {
    "UTC".to_owned()
}

/// A schedule ready to compute with.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// The pattern, or, for one whose seconds, minutes and hours list fixed values, one
    /// pattern per time of day it names, each fixed-time to croner (the module's comment).
    crons: Vec<Cron>,
    tz: Tz,
    catch_up: CatchUp,
    jitter_ms: i64,
}

/// Why a `[schedule]` does not compile.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error(
        "`schedule.cron` `{cron}` is not a cron expression: {source}{}",
        six_fields_hint(cron)
    )]
    Cron {
        cron: String,
        #[source]
        source: croner::errors::CronError,
    },
    #[error("`schedule.timezone` `{0}` is not an IANA time zone (e.g. `Europe/Berlin`, `UTC`)")]
    TimeZone(String),
    #[error("`schedule.jitter_seconds` must be at most {MAX_JITTER_SECONDS}")]
    Jitter,
    /// A pattern that matches no time (30 February).
    #[error("`schedule.cron` `{0}` never fires")]
    NeverFires(String),
}

/// What a six-field pattern that does not parse may have meant: six fields are read with
/// seconds first, so a year needs all seven.
fn six_fields_hint(cron: &str) -> &'static str {
    if cron.split_whitespace().count() == 6 {
        " (six fields are read as second, minute, hour, day of month, month, day of week; a year comes seventh, after the seconds)"
    } else {
        ""
    }
}

impl ScheduleSection {
    /// Parses the expression and the time zone.
    pub fn compile(&self) -> Result<Schedule, ScheduleError> {
        let cron = parser()
            .parse(&self.cron)
            .map_err(|source| ScheduleError::Cron {
                cron: self.cron.clone(),
                source,
            })?;
        let tz = Tz::from_str(&self.timezone)
            .map_err(|_| ScheduleError::TimeZone(self.timezone.clone()))?;
        if self.jitter_seconds > MAX_JITTER_SECONDS {
            return Err(ScheduleError::Jitter);
        }
        let schedule = Schedule {
            crons: fixed_times(&self.cron, &cron).unwrap_or_else(|| vec![cron]),
            tz,
            catch_up: self.catch_up,
            jitter_ms: i64::try_from(self.jitter_seconds.saturating_mul(1000)).unwrap_or(0),
        };
        // A pattern that never matches (e.g. 30 February) is refused now, not at run time. One
        // whose years have all passed did match: a version stored with it still reads (each
        // read compiles it) and simply fires no more.
        if schedule.next_after(0).is_none() {
            return Err(ScheduleError::NeverFires(self.cron.clone()));
        }
        Ok(schedule)
    }
}

/// Which slots to start now, and where the schedule stands afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuePlan {
    /// Slots to start now, oldest first.
    pub fire: Vec<i64>,
    /// The first slot not handled yet: the schedule's next slot after this tick.
    pub next_slot: Option<i64>,
}

impl Schedule {
    /// The first slot strictly after `after_ms`; `None` when the pattern never fires again.
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        let after = self.tz.timestamp_millis_opt(after_ms).single()?;
        self.crons
            .iter()
            .filter_map(|cron| cron.find_next_occurrence(&after, false).ok())
            .map(|t| t.timestamp_millis())
            .min()
    }

    /// The next `count` slots after `after_ms`.
    pub fn upcoming(&self, after_ms: i64, count: usize) -> Vec<i64> {
        let mut slots = Vec::with_capacity(count);
        let mut cursor = after_ms;
        while slots.len() < count {
            match self.next_after(cursor) {
                Some(slot) => {
                    slots.push(slot);
                    cursor = slot;
                }
                None => break,
            }
        }
        slots
    }

    /// The jitter of `slot` for `routine`: a fixed offset in `[0, jitter)`, the same in every
    /// scheduler process.
    pub fn jitter_of(&self, routine: &str, slot: i64) -> i64 {
        if self.jitter_ms <= 0 {
            return 0;
        }
        let digest = sha256_hex(format!("{routine}:{slot}").as_bytes());
        let value = digest
            .get(..12)
            .and_then(|h| i64::from_str_radix(h, 16).ok())
            .unwrap_or(0);
        value % self.jitter_ms
    }

    /// What to start at `now` for a schedule whose first unhandled slot is `next_slot`:
    /// on-time slots (within [`ON_TIME_GRACE_MS`]) whose jitter, and every earlier slot's, has
    /// passed, plus missed ones as the catch-up policy says. A slot whose jitter has not passed
    /// yet stays unhandled, with the slots after it.
    pub fn plan(&self, routine: &str, next_slot: i64, now: i64) -> DuePlan {
        // Bounded: a schedule that fires every second and was down for a year does not
        // enumerate its whole outage; it resumes from the on-time window instead.
        const LIMIT: usize = 10_000;
        let mut due = Vec::new();
        let mut cursor = Some(next_slot);
        while let Some(slot) = cursor {
            if slot > now {
                break;
            }
            if due.len() >= LIMIT {
                let window = now - ON_TIME_GRACE_MS - self.jitter_ms;
                let latest_missed = self.previous_before(window).filter(|s| *s >= next_slot);
                due = latest_missed.into_iter().collect();
                cursor = self.next_after(window.max(next_slot) - 1);
                while let Some(slot) = cursor.filter(|s| *s <= now) {
                    due.push(slot);
                    cursor = self.next_after(slot);
                }
                break;
            }
            due.push(slot);
            cursor = self.next_after(slot);
        }
        // A slot is due at its time plus its jitter, and not before the slot ahead of it: slots
        // start in order, so one whose jitter passed while an earlier slot's had not waits for
        // it, and its lateness counts from then. Only slots no scheduler looked at in time are
        // missed; a slot still starts within its jitter of its time, as every slot before it did.
        let mut missed = Vec::new();
        let mut on_time = Vec::new();
        let mut next = cursor;
        let mut ready_at = i64::MIN;
        for slot in due {
            let at = slot
                .saturating_add(self.jitter_of(routine, slot))
                .max(ready_at);
            ready_at = at;
            if at > now {
                // Not yet: this slot and everything after it wait for a later tick.
                next = Some(slot);
                break;
            }
            if now - at > ON_TIME_GRACE_MS {
                missed.push(slot);
            } else {
                on_time.push(slot);
            }
        }
        let mut fire = match self.catch_up {
            CatchUp::Skip => Vec::new(),
            CatchUp::One => missed.last().copied().into_iter().collect(),
            CatchUp::All => missed
                .iter()
                .copied()
                .skip(missed.len().saturating_sub(MAX_CATCH_UP))
                .collect(),
        };
        fire.extend(on_time);
        DuePlan {
            fire,
            next_slot: next,
        }
    }

    /// The last slot strictly before `before_ms`.
    fn previous_before(&self, before_ms: i64) -> Option<i64> {
        let before = self.tz.timestamp_millis_opt(before_ms).single()?;
        self.crons
            .iter()
            .filter_map(|cron| cron.find_previous_occurrence(&before, false).ok())
            .map(|t| t.timestamp_millis())
            .max()
    }
}

/// `text` (which parsed as `cron`) as one fixed-time pattern per time of day it names, when
/// its seconds, minutes and hours each list fixed values (no wildcard, no step) and name
/// between 2 and [`MAX_FIXED_TIMES`] times of day; `None` otherwise, `cron` then being read as
/// it is. Each is the same text with those three fields one value each.
fn fixed_times(text: &str, cron: &Cron) -> Option<Vec<Cron>> {
    let listed = |field: &croner::CronComponent| field.step == 1 && !field.from_wildcard;
    let pattern = &cron.pattern;
    if !(listed(&pattern.seconds) && listed(&pattern.minutes) && listed(&pattern.hours)) {
        return None;
    }
    let (seconds, minutes, hours) = (
        pattern.seconds.values(),
        pattern.minutes.values(),
        pattern.hours.values(),
    );
    let count = seconds.len() * minutes.len() * hours.len();
    if !(2..=MAX_FIXED_TIMES).contains(&count) {
        return None;
    }
    // The fields after the hour: day of month, month, day of week and, when given, year.
    let fields: Vec<&str> = text.split_whitespace().collect();
    let rest = match fields.len() {
        5 => fields.get(2..)?,
        6 | 7 => fields.get(3..)?,
        _ => return None,
    }
    .join(" ");
    let mut crons = Vec::with_capacity(count);
    for hour in &hours {
        for minute in &minutes {
            for second in &seconds {
                crons.push(
                    parser()
                        .parse(&format!("{second} {minute} {hour} {rest}"))
                        .ok()?,
                );
            }
        }
    }
    Some(crons)
}

/// The parser of every schedule: five fields, six with seconds first, or seven with a year
/// last, so that routines stored with a year read as they were applied.
fn parser() -> CronParser {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Optional)
        .build()
}

/// A slot as RFC 3339 in UTC, for people.
pub fn slot_rfc3339(slot: i64) -> String {
    Utc.timestamp_millis_opt(slot)
        .single()
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| slot.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(cron: &str, tz: &str, catch_up: CatchUp, jitter: u64) -> Schedule {
        ScheduleSection {
            cron: cron.to_owned(),
            timezone: tz.to_owned(),
            catch_up,
            jitter_seconds: jitter,
        }
        .compile()
        .unwrap()
    }

    fn utc_ms(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> i64 {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, s)
            .single()
            .unwrap()
            .timestamp_millis()
    }

    #[test]
    fn bad_expressions_and_zones_are_refused_with_the_field_named() {
        let section = |cron: &str, tz: &str| ScheduleSection {
            cron: cron.to_owned(),
            timezone: tz.to_owned(),
            catch_up: CatchUp::One,
            jitter_seconds: 0,
        };
        let err = section("61 * * * *", "UTC").compile().unwrap_err();
        assert!(matches!(err, ScheduleError::Cron { .. }), "{err}");
        assert!(err.to_string().contains("`schedule.cron`"), "{err}");
        let err = section("* * * * *", "Mars/Olympus").compile().unwrap_err();
        assert!(matches!(err, ScheduleError::TimeZone(_)), "{err}");
        assert!(err.to_string().contains("`schedule.timezone`"), "{err}");
        // A seventh field is a year; a pattern whose years are all past never fires.
        let in_2030 = section("0 0 12 1 1 * 2030", "UTC").compile().unwrap();
        assert_eq!(
            in_2030.next_after(utc_ms(2026, 11, 29, 10, 0, 0)),
            Some(utc_ms(2030, 1, 1, 12, 0, 0))
        );
        let in_2020 = section("0 0 12 1 1 * 2020", "UTC").compile().unwrap();
        assert_eq!(in_2020.next_after(utc_ms(2026, 11, 29, 10, 0, 0)), None);
        // Six fields are read with seconds first: a year there is out of a day of week's range,
        // and the refusal says how the six were read.
        let err = section("0 0 1 1 * 2020", "UTC").compile().unwrap_err();
        assert!(
            err.to_string().contains("six fields are read as second"),
            "{err}"
        );
        let err = section("61 * * * *", "UTC").compile().unwrap_err();
        assert!(!err.to_string().contains("six fields"), "{err}");
        // The nicknames are five-field patterns.
        assert!(section("@daily", "UTC").compile().is_ok());
        let err = section("0 0 30 2 *", "UTC").compile().unwrap_err();
        assert!(matches!(err, ScheduleError::NeverFires(_)), "{err}");
        assert!(err.to_string().contains("never fires"), "{err}");
        let mut jittery = section("* * * * *", "UTC");
        jittery.jitter_seconds = MAX_JITTER_SECONDS + 1;
        assert!(matches!(jittery.compile(), Err(ScheduleError::Jitter)));
    }

    #[test]
    fn minutes_and_seconds_fire_where_expected() {
        let every_minute = schedule("* * * * *", "UTC", CatchUp::One, 0);
        let start = utc_ms(2026, 11, 29, 10, 0, 30);
        assert_eq!(
            every_minute.upcoming(start, 3),
            [
                utc_ms(2026, 11, 29, 10, 1, 0),
                utc_ms(2026, 11, 29, 10, 2, 0),
                utc_ms(2026, 11, 29, 10, 3, 0)
            ]
        );
        let every_two_seconds = schedule("*/2 * * * * *", "UTC", CatchUp::One, 0);
        assert_eq!(
            every_two_seconds.next_after(start),
            Some(utc_ms(2026, 11, 29, 10, 0, 32))
        );
    }

    #[test]
    fn daylight_saving_transitions_fire_once_per_day() {
        // Europe/Berlin: 2026-03-29 02:00 CET jumps to 03:00 CEST; 2026-10-25 03:00 CEST falls
        // back to 02:00 CET, so 02:30 happens twice.
        let daily = schedule("30 2 * * *", "Europe/Berlin", CatchUp::One, 0);
        let spring = daily.upcoming(utc_ms(2026, 3, 27, 12, 0, 0), 3);
        assert_eq!(
            spring,
            [
                utc_ms(2026, 3, 28, 1, 30, 0), // 02:30 CET
                utc_ms(2026, 3, 29, 1, 0, 0), // no 02:30 that day: the first instant after the gap, 03:00 CEST
                utc_ms(2026, 3, 30, 0, 30, 0), // 02:30 CEST
            ]
        );
        let autumn = daily.upcoming(utc_ms(2026, 10, 24, 12, 0, 0), 2);
        assert_eq!(
            autumn,
            [
                utc_ms(2026, 10, 25, 0, 30, 0), // the earlier 02:30 (CEST) only
                utc_ms(2026, 10, 26, 1, 30, 0), // 02:30 CET
            ]
        );
        // An hourly job still fires every real hour across the overlap.
        let hourly = schedule("0 * * * *", "Europe/Berlin", CatchUp::One, 0);
        let hours = hourly.upcoming(utc_ms(2026, 10, 24, 23, 30, 0), 4);
        assert_eq!(
            hours,
            [
                utc_ms(2026, 10, 25, 0, 0, 0),
                utc_ms(2026, 10, 25, 1, 0, 0),
                utc_ms(2026, 10, 25, 2, 0, 0),
                utc_ms(2026, 10, 25, 3, 0, 0),
            ]
        );
    }

    #[test]
    fn a_pattern_listing_times_of_day_keeps_each_one_fixed_across_daylight_saving() {
        // Europe/Berlin in 2026: 29 March jumps from 02:00 CET to 03:00 CEST; 25 October
        // falls back from 03:00 CEST to 02:00 CET.
        let berlin = |cron| schedule(cron, "Europe/Berlin", CatchUp::One, 0);
        let from_spring = utc_ms(2026, 3, 28, 12, 0, 0);
        let from_autumn = utc_ms(2026, 10, 24, 12, 0, 0);
        assert_eq!(
            berlin("30 2,14 29 3 *").upcoming(from_spring, 2),
            [
                utc_ms(2026, 3, 29, 1, 0, 0),   // 02:30 is in the gap: 03:00 CEST
                utc_ms(2026, 3, 29, 12, 30, 0), // 14:30 CEST
            ]
        );
        // Both times in the gap start one run, at the first instant after it.
        assert_eq!(
            berlin("0,30 2 29 3 *").upcoming(from_spring, 1),
            [utc_ms(2026, 3, 29, 1, 0, 0)]
        );
        assert_eq!(
            berlin("30 2,14 25 10 *").upcoming(from_autumn, 2),
            [
                utc_ms(2026, 10, 25, 0, 30, 0),  // the earlier 02:30 only
                utc_ms(2026, 10, 25, 13, 30, 0), // 14:30 CET
            ]
        );
        assert_eq!(
            berlin("0 1-3 25 10 *").upcoming(from_autumn, 3),
            [
                utc_ms(2026, 10, 24, 23, 0, 0), // 01:00 CEST
                utc_ms(2026, 10, 25, 0, 0, 0),  // 02:00 CEST, once
                utc_ms(2026, 10, 25, 2, 0, 0),  // 03:00 CET
            ]
        );
        // A step still makes an interval pattern, which runs at every real instant it names.
        assert_eq!(
            berlin("0 */1 25 10 *").upcoming(utc_ms(2026, 10, 24, 23, 30, 0), 3),
            [
                utc_ms(2026, 10, 25, 0, 0, 0),
                utc_ms(2026, 10, 25, 1, 0, 0),
                utc_ms(2026, 10, 25, 2, 0, 0),
            ]
        );
        // And the last slot before a time is found among every time of day.
        let twice = berlin("0 9,17 * * *");
        assert_eq!(
            twice.previous_before(utc_ms(2026, 6, 1, 12, 0, 0)),
            Some(utc_ms(2026, 6, 1, 7, 0, 0))
        );
    }

    #[test]
    fn catch_up_policies_choose_among_missed_slots() {
        let start = utc_ms(2026, 11, 29, 10, 0, 0);
        let now = utc_ms(2026, 11, 29, 10, 5, 10); // 10:00 … 10:05 are due; 10:05 is on time
        let plan = |catch_up| schedule("* * * * *", "UTC", catch_up, 0).plan("r", start, now);
        let on_time = utc_ms(2026, 11, 29, 10, 5, 0);
        let next = Some(utc_ms(2026, 11, 29, 10, 6, 0));
        assert_eq!(
            plan(CatchUp::Skip),
            DuePlan {
                fire: vec![on_time],
                next_slot: next
            }
        );
        assert_eq!(
            plan(CatchUp::One),
            DuePlan {
                fire: vec![utc_ms(2026, 11, 29, 10, 4, 0), on_time],
                next_slot: next
            }
        );
        let all = plan(CatchUp::All);
        assert_eq!(all.fire.len(), 6);
        assert_eq!(all.next_slot, next);
        // A long outage catches up at most MAX_CATCH_UP slots, the latest ones.
        let day_later = start + 24 * 3600 * 1000 + 10_000;
        let long = schedule("* * * * *", "UTC", CatchUp::All, 0).plan("r", start, day_later);
        assert_eq!(long.fire.len(), MAX_CATCH_UP + 1);
        assert_eq!(long.fire.last(), Some(&(start + 24 * 3600 * 1000)));
    }

    #[test]
    fn a_scheduler_ticking_every_second_starts_every_jittered_slot_once_and_in_order() {
        // Slots two seconds apart with up to two minutes of jitter: a slot whose jitter is short
        // comes due while one before it still waits for a long one.
        let start = utc_ms(2026, 3, 1, 12, 0, 0);
        for catch_up in [CatchUp::Skip, CatchUp::One, CatchUp::All] {
            let jittery = schedule("*/2 * * * * *", "UTC", catch_up, 120);
            let mut next = Some(start);
            let mut fired = Vec::new();
            let end = start + 10 * 60_000;
            for now in (start..end).step_by(1_000) {
                let plan = jittery.plan("rtn_j", next.unwrap(), now);
                for slot in &plan.fire {
                    let late = now - (slot + jittery.jitter_of("rtn_j", *slot));
                    assert!(late >= 0, "{slot} started before its jitter passed");
                    assert!(
                        *slot + 120_000 + 1_000 >= now,
                        "{slot} started past its jitter"
                    );
                }
                fired.extend(plan.fire);
                next = plan.next_slot;
            }
            let expected: Vec<i64> = (start..end - 120_000).step_by(2_000).collect();
            assert!(fired.starts_with(&expected), "{catch_up:?}: {fired:?}");
            assert!(
                fired.windows(2).all(|w| w[0] < w[1]),
                "{catch_up:?}: in order, once"
            );
        }
    }

    #[test]
    fn jitter_is_fixed_per_slot_and_delays_within_its_bound() {
        let jittery = schedule("* * * * *", "UTC", CatchUp::Skip, 30);
        let slot = utc_ms(2026, 11, 29, 10, 0, 0);
        let offset = jittery.jitter_of("rtn_a", slot);
        assert!((0..30_000).contains(&offset));
        assert_eq!(
            offset,
            jittery.jitter_of("rtn_a", slot),
            "the same in every process"
        );
        let before = jittery.plan("rtn_a", slot, slot + offset - 1);
        assert!(before.fire.is_empty());
        assert_eq!(
            before.next_slot,
            Some(slot),
            "the slot waits, it is not skipped"
        );
        let after = jittery.plan("rtn_a", slot, slot + offset);
        assert_eq!(after.fire, [slot]);
        assert_eq!(
            schedule("* * * * *", "UTC", CatchUp::Skip, 0).jitter_of("rtn_a", slot),
            0
        );
        // A jitter longer than the on-time grace still runs the slot, on time.
        let long = schedule("0 * * * *", "UTC", CatchUp::Skip, 1800);
        let offset = long.jitter_of("rtn_b", slot);
        let plan = long.plan("rtn_b", slot, slot + offset + 1_000);
        assert_eq!(plan.fire, [slot], "offset {offset}");
    }

    #[test]
    fn a_very_long_outage_catches_up_within_bounds() {
        let every_second = schedule("* * * * * *", "UTC", CatchUp::One, 0);
        let start = utc_ms(2026, 11, 1, 0, 0, 0);
        let now = start + 30 * 24 * 3600 * 1000; // a month of one-second slots missed
        let plan = every_second.plan("r", start, now);
        // The latest missed slot once, then the on-time window (60 s of slots).
        assert!(plan.fire.len() <= 62, "{}", plan.fire.len());
        assert_eq!(plan.fire.last(), Some(&now));
        assert_eq!(plan.next_slot, Some(now + 1000));
        let missed = plan.fire.first().unwrap();
        assert!(now - missed > ON_TIME_GRACE_MS);
    }
}
