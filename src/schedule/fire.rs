//! Firing: a worker's recovery pass on shard 0 turns the due ticks of the schedules it claimed
//! into requests, exactly once per tick across any number of workers.
//!
//! Per schedule: read its spec and state (`sched_get`); compute, from the Redis time the claim
//! returned, the ticks it owes (from `next` up to that time, its missed policy applied) and the
//! first tick after it; move them into its debt with `sched_fire`, a compare-and-set on the
//! `gen` and `next` read, so that of racing workers one moves them, once; then submit every tick
//! owed (its own, and any left by a worker that died) as request `<name>@<tick>`, and pay each
//! with `sched_paid` once its submit answered Ok or found the request there already. A tick
//! leaves the debt only after its request exists; the id makes every other submit of it a
//! refused duplicate while the first request lives or is retained. This is the chain of
//! docs/design/workflows.md, "The rule for cross-slot steps": the debt is the anchor, every call
//! is idempotent, and the anchor goes last.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use super::cron::NEVER;
use super::spec::ScheduleSpec;
use crate::error::{Error, Result};
use crate::producer::Producer;
use crate::protocol::schedules::{self, Firing, Gap};
use crate::store::Store;

/// Reads and compare-and-sets of one schedule in one pass, at most.
const FIRE_TRIES: usize = 3;

/// Where the firings are counted, as each happens (the worker's metrics): a worker that dies
/// part-way through a pass has counted every request it submitted.
pub(crate) struct Counts<'a> {
    /// Ticks whose submit created their request.
    pub(crate) submitted: &'a AtomicU64,
    /// Ticks whose request was there already (submitted by another worker, or by this one before
    /// a lost reply).
    pub(crate) duplicates: &'a AtomicU64,
    /// Firings refused because the schedule changed since it was read (another worker fired it,
    /// or an operator paused, resumed or replaced it).
    pub(crate) conflicts: &'a AtomicU64,
}

/// Fires schedules `names`, claimed by `claim_due` at Redis time `now`; ticks owed are left to
/// others for `claim` while this worker submits them. A schedule that fails is logged and left
/// to the next claim.
pub(crate) async fn fire(
    store: &Store,
    producer: &Producer,
    now: i64,
    names: &[String],
    claim: Duration,
    counts: &Counts<'_>,
) {
    for name in names {
        if let Err(e) = fire_one(store, producer, name, now, claim, counts).await {
            tracing::warn!(schedule = name.as_str(), error = %e, "firing a schedule failed; it is tried again after its claim");
        }
    }
}

async fn fire_one(
    store: &Store,
    producer: &Producer,
    name: &str,
    now: i64,
    claim: Duration,
    counts: &Counts<'_>,
) -> Result<()> {
    // A conflict means the state moved since it was read: another worker fired these ticks, or
    // an operator paused, resumed or replaced the schedule. Read again and fire from there (the
    // second try, against a worker, moves nothing and only sets the next look).
    let mut fired = None;
    for _ in 0..FIRE_TRIES {
        let read = schedules::get(store, name).await?;
        let (Some(json), Some(gen)) = (read.spec, read.state.gen) else {
            return Ok(()); // removed since the claim
        };
        let spec = ScheduleSpec::from_json(name, &json)?;
        let cron = spec.cron()?;
        let state = read.state;
        let next = state.next.or_else(|| cron.next_after(state.from));
        let (ticks, new_next) = match next {
            Some(next) if next <= now => (
                cron.due(next, now, state.paused, &state.gaps, spec.missed_policy().keep()),
                cron.next_after(now).unwrap_or(NEVER),
            ),
            Some(next) => (Vec::new(), next),
            None => (Vec::new(), NEVER),
        };
        // A gap that ended before the new next can cover no tick to come.
        let gaps: Vec<Gap> = state.gaps.iter().filter(|g| g.resumed >= new_next).copied().collect();
        let firing = Firing { name, gen, next: state.next, new_next, gaps: &gaps, ticks: &ticks, claim };
        let answer = schedules::fire(store, &firing).await?;
        let moved = answer.moved;
        fired = Some((spec, answer.owe));
        if moved {
            break;
        }
        counts.conflicts.fetch_add(1, Relaxed);
    }
    let Some((spec, owe)) = fired else { return Ok(()) };
    for tick in owe {
        let (builder, parts) = spec.request(producer.request(), tick)?;
        match builder.submit_encoded(parts).await {
            Ok(_) => counts.submitted.fetch_add(1, Relaxed),
            Err(Error::DuplicateRequestId(_)) => counts.duplicates.fetch_add(1, Relaxed),
            Err(e) => return Err(e),
        };
        schedules::paid(store, name, tick).await?;
    }
    Ok(())
}
