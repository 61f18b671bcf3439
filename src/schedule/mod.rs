//! Schedules: requests submitted by a cron pattern, leaderless and exactly once per tick
//! (docs/operations.md, "Schedules"; docs/protocol.md for the keys and functions).
//!
//! A schedule is a spec ([`ScheduleSpec`]: a pattern, a time zone, a missed-ticks policy, a
//! request template) and a state on shard 0. Operators add, pause, resume and remove them through
//! `Admin` (admin/schedules.rs); no worker is in charge of them: every worker's recovery pass claims
//! the due ones on shard 0 as it claims requests, and fires them (`fire`). Ticks are computed
//! here, in Rust, from Redis time (`cron`), never from a worker's clock.

mod cron;
pub(crate) mod fire;
mod spec;

pub use spec::{
    check_schedule_name, Missed, ScheduleSpec, MAX_CATCH_UP, MAX_SCHEDULE_NAME_BYTES, MAX_SPEC_BYTES,
};

use serde::Serialize;

/// A schedule as `Admin::schedules` lists it.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Schedule {
    /// Its name.
    pub name: String,
    /// Its cron pattern.
    pub cron: String,
    /// Its time zone (`None`: UTC).
    pub time_zone: Option<String>,
    /// Its missed-ticks policy.
    pub missed: Missed,
    /// When it was added, or last replaced (ms, Redis time): ticks after it are owed.
    pub added_ms: i64,
    /// When it was paused (ms, Redis time), while it is.
    pub paused_ms: Option<i64>,
    /// The next tick not owed yet (ms; at or before now when a firing is due); `None` when
    /// paused, or when its pattern never fires again.
    pub next_ms: Option<i64>,
    /// The latest tick whose request was submitted.
    pub last_ms: Option<i64>,
    /// Ticks owed whose requests are not submitted yet (a firing under way, or left by a worker
    /// that died: the next claim submits them), oldest first.
    pub owed_ms: Vec<i64>,
    /// Parts of each tick's request.
    pub parts: usize,
    /// Each tick's request's priority.
    pub priority: u8,
    /// Each tick's request's tags.
    pub tags: Vec<String>,
    /// Each tick's request discards its results ([`ScheduleSpec::discard_results`]).
    pub discard_results: bool,
}

impl Schedule {
    /// The listing of one schedule, from its spec and state.
    pub(crate) fn from_read(spec: &ScheduleSpec, state: &crate::protocol::schedules::State) -> Schedule {
        let next = match (state.paused, state.next) {
            (Some(_), _) => None,
            (None, Some(next)) => Some(next),
            // Never fired yet: its first tick.
            (None, None) => spec.cron().ok().and_then(|c| c.next_after(state.from)),
        };
        Schedule {
            name: spec.name().to_owned(),
            cron: spec.pattern().to_owned(),
            time_zone: spec.zone().map(str::to_owned),
            missed: spec.missed_policy(),
            added_ms: state.from,
            paused_ms: state.paused,
            next_ms: next.filter(|n| *n < cron::NEVER),
            last_ms: state.last,
            owed_ms: state.owe.clone(),
            parts: spec.part_count(),
            priority: spec.request_priority(),
            tags: spec.request_tags(),
            discard_results: spec.discards_results(),
        }
    }
}
