//! Cron patterns and their ticks, in a time zone: what a schedule owes between two Redis times.
//!
//! Parsing and the calendar are the `croner` crate's, time zones `chrono-tz`'s (the IANA
//! database). A tick is a whole second, as ms since the Unix epoch. Around a change of the
//! clocks, a local time that does not exist (the hour skipped in spring) is moved to the first
//! instant after the gap, and a time that happens twice (the hour repeated in autumn) fires on
//! each pass for a pattern that matches every minute or hour of it, once for a fixed time:
//! croner's rules, pinned down by the tests below.

use std::collections::VecDeque;
use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;

use crate::protocol::schedules::Gap;

/// The `next` of a schedule whose pattern never fires again: 9999-12-31T23:59:59Z.
pub(crate) const NEVER: i64 = 253_402_300_799_000;

/// A parsed pattern in its time zone.
#[derive(Clone, Debug)]
pub(crate) struct Cron {
    cron: croner::Cron,
    tz: Tz,
}

impl Cron {
    /// Parses `pattern` (5 fields, minutes first; or 6, seconds first; `@daily` and the like) in
    /// time zone `tz` (an IANA name; `None`: UTC). The error names what is wrong.
    pub(crate) fn parse(pattern: &str, tz: Option<&str>) -> Result<Cron, String> {
        let cron = croner::Cron::from_str(pattern).map_err(|e| format!("invalid cron {pattern:?}: {e}"))?;
        let tz = match tz {
            None => Tz::UTC,
            Some(name) => Tz::from_str(name).map_err(|_| {
                format!(
                    "unknown time zone {name:?}: use an IANA name such as Europe/Rome or America/New_York"
                )
            })?,
        };
        let parsed = Cron { cron, tz };
        // A pattern that matches no date (the 30th of February) would be found out at every
        // firing: say so now.
        if parsed.next_after(0).is_none() && parsed.last_at_or_before(NEVER).is_none() {
            return Err(format!("cron {pattern:?} never fires"));
        }
        Ok(parsed)
    }

    fn at(&self, ms: i64) -> Option<DateTime<Tz>> {
        // Whole seconds: a tick is one, and croner steps in seconds.
        let secs = ms.div_euclid(1000);
        Some(Utc.timestamp_opt(secs, 0).single()?.with_timezone(&self.tz))
    }

    /// The first tick after `ms`.
    pub(crate) fn next_after(&self, ms: i64) -> Option<i64> {
        let found = self.cron.find_next_occurrence(&self.at(ms)?, false).ok()?.timestamp_millis();
        (found > ms).then_some(found)
    }

    /// The last tick at or before `ms`.
    pub(crate) fn last_at_or_before(&self, ms: i64) -> Option<i64> {
        let found = self.cron.find_previous_occurrence(&self.at(ms)?, true).ok()?.timestamp_millis();
        (found <= ms).then_some(found)
    }

    /// The ticks a firing owes: those from `next` up to `now`, not after `paused` (a pause under
    /// way) nor within a gap (a pause that ended), the last `keep` of them, oldest first. The
    /// walk forward from `next` is the reference; a walk back from `now` only finds where to
    /// start it when more than `keep` are due (a schedule left without workers for long).
    pub(crate) fn due(
        &self,
        next: i64,
        now: i64,
        paused: Option<i64>,
        gaps: &[Gap],
        keep: usize,
    ) -> Vec<i64> {
        let upper = paused.map_or(now, |p| p.min(now));
        if next > upper || keep == 0 {
            return Vec::new();
        }
        let in_gap = |t: i64| gaps.iter().find(|g| g.covers(t)).copied();
        let mut start = next;
        let mut back = self.last_at_or_before(upper);
        let mut found = 0;
        while let Some(t) = back.filter(|t| *t >= next) {
            if let Some(gap) = in_gap(t) {
                back = self.last_at_or_before(gap.paused);
                continue;
            }
            found += 1;
            if found == keep {
                start = t;
                break;
            }
            back = self.last_at_or_before(t - 1000);
        }
        let mut out = VecDeque::with_capacity(keep);
        let mut tick = self.next_after(start - 1);
        while let Some(t) = tick.filter(|t| *t <= upper) {
            if let Some(gap) = in_gap(t) {
                tick = self.next_after(gap.resumed);
                continue;
            }
            if out.len() == keep {
                out.pop_front();
            }
            out.push_back(t);
            tick = self.next_after(t);
        }
        out.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> i64 {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, s).single().expect("a valid time").timestamp_millis()
    }

    #[test]
    fn five_and_six_field_patterns_tick_on_whole_seconds() {
        let every5 = Cron::parse("*/5 * * * *", None).expect("parses");
        let t = utc(2026, 5, 1, 10, 2, 30) + 250;
        assert_eq!(every5.next_after(t), Some(utc(2026, 5, 1, 10, 5, 0)));
        assert_eq!(every5.last_at_or_before(t), Some(utc(2026, 5, 1, 10, 0, 0)));
        let tick = utc(2026, 5, 1, 10, 5, 0);
        assert_eq!(every5.next_after(tick), Some(utc(2026, 5, 1, 10, 10, 0)), "strictly after");
        assert_eq!(every5.last_at_or_before(tick), Some(tick), "at or before");
        let every2s = Cron::parse("*/2 * * * * *", None).expect("parses");
        assert_eq!(every2s.next_after(utc(2026, 5, 1, 10, 0, 59)), Some(utc(2026, 5, 1, 10, 1, 0)));
    }

    #[test]
    fn bad_patterns_and_zones_are_refused_with_what_is_wrong() {
        let e = Cron::parse("61 * * * *", None).unwrap_err();
        assert!(e.contains("invalid cron \"61 * * * *\""), "{e}");
        let e = Cron::parse("every day", None).unwrap_err();
        assert!(e.contains("invalid cron"), "{e}");
        let e = Cron::parse("* * * * *", Some("Mars/Olympus")).unwrap_err();
        assert!(e.contains("unknown time zone \"Mars/Olympus\""), "{e}");
        let e = Cron::parse("0 0 30 2 *", None).unwrap_err();
        assert!(e.contains("never fires"), "{e}");
        assert!(Cron::parse("@daily", Some("Europe/Rome")).is_ok());
    }

    #[test]
    fn due_ticks_follow_the_missed_policy_and_skip_pauses() {
        let every_s = Cron::parse("* * * * * *", None).expect("parses");
        let t0 = utc(2026, 1, 1, 0, 0, 0);
        let s = |n: i64| t0 + n * 1000;
        // Ten seconds due: catch-up 100 owes all of them, skip only the latest, catch-up 3 the last 3.
        assert_eq!(every_s.due(s(1), s(10) + 400, None, &[], 100), (1..=10).map(s).collect::<Vec<_>>());
        assert_eq!(every_s.due(s(1), s(10) + 400, None, &[], 1), [s(10)]);
        assert_eq!(every_s.due(s(1), s(10), None, &[], 3), [s(8), s(9), s(10)]);
        // Nothing due yet.
        assert_eq!(every_s.due(s(11), s(10) + 999, None, &[], 100), Vec::<i64>::new());
        // Paused at 4.5: what fell due before the pause is owed, nothing after.
        assert_eq!(every_s.due(s(1), s(10), Some(s(4) + 500), &[], 100), [s(1), s(2), s(3), s(4)]);
        // A pause from 2.5 to 6 (resumed exactly on a tick: not owed) and one from 8 to 9.2.
        let gaps = [Gap { paused: s(2) + 500, resumed: s(6) }, Gap { paused: s(8), resumed: s(9) + 200 }];
        assert_eq!(every_s.due(s(1), s(10), None, &gaps, 100), [s(1), s(2), s(7), s(8), s(10)]);
        assert_eq!(every_s.due(s(1), s(10), None, &gaps, 2), [s(8), s(10)]);
        // A week without workers: only the last ticks are computed, quickly.
        let started = std::time::Instant::now();
        let week = s(7 * 24 * 3600);
        assert_eq!(every_s.due(s(1), week, None, &[], 3), [week - 2000, week - 1000, week]);
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "{:?}", started.elapsed());
    }

    /// Europe/Rome goes from 02:00 to 03:00 on 29 March 2026 and from 03:00 back to 02:00 on
    /// 25 October 2026.
    #[test]
    fn around_a_change_of_the_clocks_a_fixed_time_fires_once_a_day() {
        let rome = Cron::parse("0 30 2 * * *", Some("Europe/Rome")).expect("parses");
        let local = |d: u32, mo: u32, h: u32, mi: u32, offset_h: i64| {
            utc(2026, mo, d, h, mi, 0) - offset_h * 3_600_000
        };
        // Spring: 02:30 does not exist on the 29th; croner fires at the first instant after the
        // gap, 03:00 CEST (01:00 UTC), and at 02:30 the days around it.
        let spring = rome.due(local(28, 3, 0, 0, 1), local(31, 3, 0, 0, 2), None, &[], 100);
        assert_eq!(spring, [local(28, 3, 2, 30, 1), local(29, 3, 3, 0, 2), local(30, 3, 2, 30, 2)]);
        // Autumn: 02:30 happens twice on the 25th (CEST, then CET): it fires once, on the first.
        let autumn = rome.due(local(24, 10, 0, 0, 2), local(27, 10, 0, 0, 1), None, &[], 100);
        assert_eq!(autumn, [local(24, 10, 2, 30, 2), local(25, 10, 2, 30, 2), local(26, 10, 2, 30, 1)]);
        // Every 30 minutes through the repeated hour: 02:00 and 02:30 fire on both passes.
        let half_hourly = Cron::parse("0 */30 * * * *", Some("Europe/Rome")).expect("parses");
        let repeated = half_hourly.due(local(25, 10, 1, 45, 2), local(25, 10, 3, 15, 1), None, &[], 100);
        let expected = [
            local(25, 10, 2, 0, 2),
            local(25, 10, 2, 30, 2),
            local(25, 10, 2, 0, 1),
            local(25, 10, 2, 30, 1),
            local(25, 10, 3, 0, 1),
        ];
        assert_eq!(repeated, expected);
    }
}
