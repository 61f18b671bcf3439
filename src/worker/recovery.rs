//! Recovery: every worker's share of keeping tokens and entries in circulation. There is no master.
//!
//! Three duties, all run on each worker's liveness thread (`worker::liveness`):
//! - **Reaping** ([`reap`]): a worker whose registration expired (dead, frozen, or cut off longer
//!   than the lease) is claimed by the next beat of any other worker; its slots' take records
//!   (`held`) name every token they had, and `reclaim` puts each back in circulation (the batch a
//!   slot held becomes orphans, run again first). This is what brings a killed worker's work back
//!   within a lease and a heartbeat.
//! - **Looks that fell due** ([`pass`]): `claim_due` takes the requests whose next look has come
//!   (a registration whose producer may have died before pushing, a delayed request's time, a
//!   retry a parked token waits for, a step whose caller may have died, and at least every census
//!   interval), and `census` looks at each: promotes, expires, wakes parked tokens, lists tokens
//!   queued longer than the grace for `verify` to check in their list (O(1)), and lists held tokens
//!   for a check that their holders' workers are alive. A request found terminal but still indexed
//!   (its finisher died) has the steps after its finish completed (`shards::finish`).
//! - **Schedules** (`crate::schedule`, `schedules` feature): the same claim on shard 0 also takes
//!   the schedules whose next tick is due, and the pass fires them: their ticks' requests are
//!   submitted, exactly once per tick however many workers race.
//! - **The take records' backstop** ([`scan_held`]): records whose worker is gone from the
//!   registry (its registry entry lost with a failover, say) are reclaimed too.
//!
//! The argument that none of this ever makes a token too many is in docs/architecture.md.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use fred::prelude::*;
use futures::stream::{self, StreamExt};

use super::registry::{self, WorkerInfo};
use super::WorkerMetrics;
use crate::config::millis;
use crate::error::Result;
use crate::keys::{group_of_queue, home_shard};
use crate::protocol::index::{self, Arming};
use crate::protocol::operators::Requeued;
use crate::protocol::recovery::{self as calls, Census, HeldToken, Rearm, Reclaimed, Unfinished};
use crate::protocol::{tokens, Finished, TakeRecord};
use crate::request::Priority;
use crate::shards::Placement;
use crate::stats::Recorder;
use crate::store::Store;

/// Requests claimed per pass per shard, and looked at concurrently.
const CLAIM_BATCH: i64 = 200;
const CONCURRENT: usize = 16;
/// Tokens per census call: bounds the time of one call for a request with a large limit.
const CENSUS_CHUNK: i64 = 1_000;

/// One pass over every configured shard's `active` index: returns how many requests it looked at.
/// The schedules it fires submit through a producer counting in `stats`, the worker's.
pub(crate) async fn pass(store: &Store, metrics: &WorkerMetrics, stats: &Arc<Recorder>) -> Result<usize> {
    let mut n = 0;
    for shard in 0..store.keys.shards() {
        n += pass_shard(store, metrics, stats, shard).await?;
    }
    Ok(n)
}

async fn pass_shard(
    store: &Store,
    metrics: &WorkerMetrics,
    stats: &Arc<Recorder>,
    shard: u32,
) -> Result<usize> {
    // Others skip a claimed request for a few leases; a claimer that dies is replaced after that.
    let claim = store.config.lease.saturating_mul(5);
    let due = calls::claim_due(store, shard, CLAIM_BATCH, claim, cfg!(feature = "schedules")).await?;
    #[cfg(feature = "schedules")]
    if let Some((now, names)) = due.schedules.filter(|(_, names)| !names.is_empty()) {
        let producer = crate::producer::Producer::from_store(store.clone(), stats.clone());
        let counts = crate::schedule::fire::Counts {
            submitted: &metrics.schedule_submits,
            duplicates: &metrics.schedule_duplicates,
            conflicts: &metrics.schedule_conflicts,
        };
        crate::schedule::fire::fire(store, &producer, now, &names, claim, &counts).await;
    }
    #[cfg(not(feature = "schedules"))]
    let _ = stats;
    // Releases their finishers did not run (they died, or stalled past the outbox's due time).
    for ukid in &due.releases {
        tracing::info!(upstream = ukid.as_str(), "running a release its finisher left undone");
        if let Err(e) = crate::shards::dag::release(store, shard, ukid, 0).await {
            tracing::warn!(upstream = ukid.as_str(), error = %e, "release failed");
        }
    }
    let claimed = due.requests;
    let n = claimed.len();
    stream::iter(claimed)
        .for_each_concurrent(store.concurrency(CONCURRENT), |c| async move {
            if let Err(e) = census(store, metrics, shard, &c.key_id, Some(c.claim)).await {
                tracing::warn!(request = c.key_id, error = %e, "census failed");
            }
        })
        .await;
    Ok(n)
}

/// Completes the steps after a finish of a request found terminal but still indexed (census's or
/// reclaim's report).
pub(crate) async fn finish_reported(store: &Store, key_id: &str, unfinished: Unfinished) -> Result<()> {
    let Unfinished { state, priority, shards, lifecycle, sealed, group } = unfinished;
    let place = Placement { priority, shards, group };
    let reopened = if sealed {
        // Its event was written before the seal: only the index entry is left.
        crate::shards::seal_and_unindex(store, key_id, home_shard(key_id, shards), lifecycle, &state).await?
    } else {
        tracing::info!(
            request = key_id,
            state,
            "completing the finish of a request (its finisher died or stalled)"
        );
        crate::shards::finish(
            store,
            key_id,
            place.clone(),
            Finished { state, lifecycle, sweep: Vec::new(), shards: None },
        )
        .await?
    };
    match reopened {
        Some(next) => resume_requeue(store, key_id, place, next).await,
        None => Ok(()),
    }
}

/// A request that stays indexed for the lifecycle a requeue marked (`reopen`): if that requeue's
/// caller died before it reopened the request (still the failed lifecycle just before), it is
/// completed here, so the request neither stays failed nor lingers in the index; otherwise
/// (already reopened) nothing happens.
async fn resume_requeue(store: &Store, key_id: &str, place: Placement, lifecycle: i64) -> Result<()> {
    let requeued =
        crate::shards::requeue_dead(store, key_id, place.shards, &lifecycle.to_string(), true).await?;
    let elements = match requeued {
        Requeued::Done { elements, .. } => elements,
        Requeued::FinishFirst(_) | Requeued::ReopenFirst(_) => Vec::new(),
    };
    if !elements.is_empty() {
        tracing::warn!(request = key_id, "completing a requeue whose caller died half-way");
        let grace = store.config.grace();
        crate::shards::push(store, key_id, place, crate::shards::Look::More, grace, elements).await?;
    }
    Ok(())
}

/// Recovery's look at one request whose home shard is `shard` (see `lua/census.lua`); `claim` is
/// the score its claim wrote, if it was claimed.
pub(crate) async fn census(
    store: &Store,
    metrics: &WorkerMetrics,
    shard: u32,
    key_id: &str,
    claim: Option<i64>,
) -> Result<()> {
    let cfg = &store.config;
    let mut from: i64 = 0;
    // Each chunk's reply carries the earliest look asked for so far; the next chunk starts from it,
    // so that the last chunk's look (the one verify sets) accounts for every chunk.
    let mut look_so_far = millis(cfg.census_interval) as i64;
    loop {
        let chunk = match calls::census(store, key_id, from, CENSUS_CHUNK, look_so_far).await? {
            Census::Gone => {
                // Not created (yet), or expired: dropped once no producer can still create it.
                calls::drop_gone(store, key_id, shard, claim).await?;
                return Ok(());
            }
            Census::Loading => {
                // Its producer is writing it, or died doing so (the keys expire with the loading
                // ttl), or committed it just now and may die before it pushes: look again soon.
                index::arm(store, key_id, shard, cfg.grace(), Arming::Census { claim }).await?;
                return Ok(());
            }
            Census::Waiting { shards, look, upstreams } => {
                // Its releases come from its upstreams' side; this look only checks that none of
                // them vanished without one.
                let look = std::time::Duration::from_millis(look.max(1) as u64);
                index::arm(store, key_id, shard, look, Arming::Census { claim }).await?;
                return crate::shards::dag::check_waiting(store, key_id, shards, &upstreams).await;
            }
            Census::Finished(unfinished) => return finish_reported(store, key_id, unfinished).await,
            Census::Chunk(chunk) => chunk,
            Census::Unexpected(other) => {
                tracing::warn!(request = key_id, reply = other, "unexpected census reply");
                return Ok(());
            }
        };
        look_so_far = chunk.look;
        let place = Placement { priority: chunk.priority, shards: chunk.shards, group: chunk.group };
        metrics.tokens_restored.fetch_add(chunk.push.len() as u64, Relaxed);
        // The home shard's verify sets the next look: only after the last chunk, whose reply
        // carries it, and always made, so that the look is set even with nothing to push or check.
        let rearm = chunk.next.is_none().then_some(Rearm { look: chunk.look, claim });
        verify(store, metrics, key_id, place.clone(), chunk.push, chunk.check, rearm).await?;
        reclaim_dead_holders(store, metrics, key_id, place, chunk.held).await?;
        match chunk.next {
            Some(next) => from = next,
            None => return Ok(()),
        }
    }
}

/// Pushes `push` and checks `check` on each token's shard list; restores what is missing.
async fn verify(
    store: &Store,
    metrics: &WorkerMetrics,
    key_id: &str,
    place: Placement,
    push: Vec<Value>,
    check: Vec<Value>,
    rearm: Option<Rearm>,
) -> Result<()> {
    let home = home_shard(key_id, place.shards);
    let mut pushes = crate::shards::by_shard(key_id, &place, push);
    let mut checks = crate::shards::by_shard(key_id, &place, check);
    let mut on: BTreeSet<u32> = pushes.keys().chain(checks.keys()).copied().collect();
    if rearm.is_some() {
        on.insert(home);
    }
    let mut missing: Vec<Value> = Vec::new();
    for s in on {
        let push = pushes.remove(&s).unwrap_or_default();
        let check = checks.remove(&s).unwrap_or_default();
        let rearm = rearm.filter(|_| s == home);
        let list = place.list(store, s);
        missing.extend(calls::verify(store, key_id, s, &list, push, check, rearm).await?);
    }
    if missing.is_empty() {
        return Ok(());
    }
    let restored = calls::restore(store, key_id, missing).await?;
    if !restored.is_empty() {
        tracing::warn!(
            request = key_id,
            tokens = restored.len(),
            "restoring tokens whose elements were lost"
        );
        metrics.tokens_restored.fetch_add(restored.len() as u64, Relaxed);
        let grace = store.config.grace();
        crate::shards::push(store, key_id, place, crate::shards::Look::More, grace, restored).await?;
    }
    Ok(())
}

/// Held tokens (`{k, epoch, holder}` from census) whose holder's worker is gone from the registry
/// and not being reaped (its take record lost): reclaimed here.
async fn reclaim_dead_holders(
    store: &Store,
    metrics: &WorkerMetrics,
    key_id: &str,
    place: Placement,
    held: Vec<HeldToken>,
) -> Result<()> {
    let holds: Vec<(i64, String, String)> = held.into_iter().map(|h| (h.k, h.epoch, h.holder)).collect();
    let workers: Vec<String> = holds
        .iter()
        .map(|(_, _, h)| h.split('/').next().unwrap_or_default().to_owned())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let gone: BTreeMap<String, bool> =
        workers.iter().cloned().zip(registry::gone(store, &workers).await?).collect();
    for (k, epoch, holder) in holds {
        let worker = holder.split('/').next().unwrap_or_default();
        if gone.get(worker) == Some(&true) {
            tracing::warn!(
                request = key_id,
                holder,
                "a token is held by a worker that is gone; reclaiming it"
            );
            let shard = place.token_shard(key_id, k as u64);
            let list = place.list(store, shard);
            reclaim(store, metrics, key_id, k, &epoch, &holder, shard, &list, None).await?;
        }
    }
    Ok(())
}

/// Puts a token a dead slot had taken back in circulation (`reclaim`), and ends the slot's record
/// in the same step as the push (`give_back`, when the record is known: `take`), or completes the
/// finish the slot left undone.
#[allow(clippy::too_many_arguments)]
async fn reclaim(
    store: &Store,
    metrics: &WorkerMetrics,
    key_id: &str,
    k: i64,
    epoch: &str,
    holder: &str,
    shard: u32,
    list: &str,
    take: Option<(&str, &str)>,
) -> Result<()> {
    let end_record = |record_holder: &str, take: &str| {
        let (record_holder, take) = (record_holder.to_owned(), take.to_owned());
        async move { tokens::release(store, shard, &record_holder, &take).await.map(|_| ()) }
    };
    match calls::reclaim(store, key_id, k, epoch, holder, list, None).await? {
        Reclaimed::Push(element, priority) => {
            metrics.holds_reclaimed.fetch_add(1, Relaxed);
            metrics.tokens_restored.fetch_add(1, Relaxed);
            let list = requeue_list(store, shard, list, priority);
            match take {
                Some((record_holder, take)) => {
                    tokens::give_back(store, shard, &list, record_holder, take, element).await?;
                }
                None => {
                    index::push(store, key_id, shard, &list, element).await?;
                }
            }
        }
        Reclaimed::Finished(unfinished) => {
            finish_reported(store, key_id, unfinished).await?;
            if let Some((record_holder, take)) = take {
                end_record(record_holder, take).await?;
            }
        }
        Reclaimed::Wake(wake) => {
            crate::shards::arm(store, key_id, placement_shards(store, key_id).await?, wake).await?;
            if let Some((record_holder, take)) = take {
                end_record(record_holder, take).await?;
            }
        }
        Reclaimed::Nothing => {
            if let Some((record_holder, take)) = take {
                end_record(record_holder, take).await?;
            }
        }
    }
    Ok(())
}

/// The list a token's element issued anew (ack's re-queue, `reclaim`) goes to on `shard`, from the
/// list it was taken from and the request's priority now (`None` from an older library: the list
/// it was taken from). An operator may have changed the priority since the take. A request in a
/// tenant group keeps its priority (reprioritize refuses it) and its element goes back to its
/// group's queue, never to a shard's list, where a slot would take it without a group token.
pub(crate) fn requeue_list(store: &Store, shard: u32, taken: &str, priority: Option<Priority>) -> String {
    match (priority, group_of_queue(taken)) {
        (None, _) => taken.to_owned(),
        (Some(p), Some(group)) => store.keys.group_queue(shard, group, p),
        (Some(p), None) => store.keys.token_list(shard, p),
    }
}

/// Reclaims every token the slots of dead worker `id` had taken, then takes it out of the registry.
pub(crate) async fn reap(
    store: &Store,
    metrics: &WorkerMetrics,
    id: &str,
    info: Option<&WorkerInfo>,
) -> Result<()> {
    // Without its description (lost), every shard and a generous number of slots are searched.
    let (slots, shards) = info.map_or((256, store.keys.shards()), |i| (i.slots.max(1), i.shards.max(1)));
    tracing::warn!(worker = id, "a worker stopped beating; reclaiming what its slots held");
    for shard in 0..shards {
        let held = store.keys.held(shard);
        let fields: Vec<String> = (0..slots).map(|n| format!("{id}/{n}")).collect();
        // Its slots' offers of hand-offs end first: nothing more is handed to them, and what was
        // handed already has its record, read next.
        let offers = store.keys.offers(shard);
        let _: i64 = store
            .call("hdel", &offers, || async { Ok(store.client.hdel(offers.as_str(), fields.clone()).await?) })
            .await?;
        let records: Vec<Option<String>> = store
            .call("hmget", &held, || async { Ok(store.client.hmget(held.as_str(), fields.clone()).await?) })
            .await?;
        for (holder, record) in fields.iter().zip(records) {
            if let Some(record) = record {
                reclaim_record(store, metrics, shard, holder, &record).await?;
            }
        }
    }
    registry::leave(store, id).await
}

async fn reclaim_record(
    store: &Store,
    metrics: &WorkerMetrics,
    shard: u32,
    field: &str,
    record: &str,
) -> Result<()> {
    let Some(r) = TakeRecord::parse(record) else {
        tracing::warn!(field, record, "dropping a malformed take record");
        let held = store.keys.held(shard);
        let _: i64 = store
            .call("hdel", &held, || async { Ok(store.client.hdel(held.as_str(), field).await?) })
            .await?;
        return Ok(());
    };
    // The holder the token field names: the record's field, without a "/lost/<take>" suffix.
    let holder = field.split("/lost/").next().unwrap_or(field);
    let (t, epoch) = (&r.token, r.token.epoch.to_string());
    reclaim(store, metrics, &t.key_id, i64::from(t.k), &epoch, holder, shard, &r.list, Some((field, &r.take)))
        .await
}

/// After `untake` undid take `take` of `holder` on `shard`: a lane's token, acquired by the take
/// (or the hand-off it stands for), was kept for recovery as "<holder>/lost/<take>"; it is
/// reclaimed now (its batch orphaned, the token pushed again) rather than at the backstop's next
/// pass ([`scan_held`], every census interval), which would leave the lane's token out of
/// circulation for that long. No such record: nothing to do.
pub(crate) async fn reclaim_untaken(
    store: &Store,
    metrics: &WorkerMetrics,
    shard: u32,
    holder: &str,
    take: u64,
) -> Result<()> {
    let (held, field) = (store.keys.held(shard), format!("{holder}/lost/{take}"));
    let record: Option<String> = store
        .call("hget", &held, || async { Ok(store.client.hget(held.as_str(), field.as_str()).await?) })
        .await?;
    match record {
        Some(record) => reclaim_record(store, metrics, shard, &field, &record).await,
        None => Ok(()),
    }
}

/// The backstop for take records: any whose worker is gone from the registry (and not being
/// reaped), and any a live slot abandoned ("/lost/"), are reclaimed.
pub(crate) async fn scan_held(store: &Store, metrics: &WorkerMetrics) -> Result<()> {
    for shard in 0..store.keys.shards() {
        audit_groups(store, metrics, shard).await?;
        let held = store.keys.held(shard);
        let records: BTreeMap<String, String> =
            store.call("hgetall", &held, || async { Ok(store.client.hgetall(held.as_str()).await?) }).await?;
        if records.is_empty() {
            continue;
        }
        let workers: Vec<String> = records
            .keys()
            .map(|f| f.split('/').next().unwrap_or_default().to_owned())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let gone: BTreeMap<String, bool> =
            workers.iter().cloned().zip(registry::gone(store, &workers).await?).collect();
        for (field, record) in &records {
            let worker = field.split('/').next().unwrap_or_default();
            if field.contains("/lost/") || gone.get(worker) == Some(&true) {
                reclaim_record(store, metrics, shard, field, record).await?;
            }
        }
    }
    Ok(())
}

/// Recovery's audit of the tenant groups on `shard` (`group_audit`): repairs what the function
/// can tell alone (a rate wait missing from `gwake`, a queued group token whose element was lost),
/// and gives back a held group token that no take record names once its holder's worker is gone
/// from the registry (a live slot keeps its token even if the shard's records expired).
async fn audit_groups(store: &Store, metrics: &WorkerMetrics, shard: u32) -> Result<()> {
    let mut cursor = "0".to_owned();
    loop {
        let audit = crate::protocol::groups::audit(store, shard, &cursor, GROUP_AUDIT_CHUNK).await?;
        if audit.repaired > 0 {
            tracing::warn!(
                shard,
                tokens = audit.repaired,
                "repairing group tokens (a rate wait or an element lost)"
            );
            metrics.tokens_restored.fetch_add(audit.repaired as u64, Relaxed);
        }
        if !audit.unnamed.is_empty() {
            let workers: Vec<String> = audit
                .unnamed
                .iter()
                .map(|(_, h)| h.split('/').next().unwrap_or_default().to_owned())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let gone: BTreeMap<String, bool> =
                workers.iter().cloned().zip(registry::gone(store, &workers).await?).collect();
            let ended: Vec<String> = audit
                .unnamed
                .into_iter()
                .filter(|(_, h)| gone.get(h.split('/').next().unwrap_or_default()) == Some(&true))
                .map(|(token, _)| token)
                .collect();
            if !ended.is_empty() {
                let n = crate::protocol::groups::end(store, shard, &ended).await?;
                if n > 0 {
                    tracing::warn!(
                        shard,
                        tokens = n,
                        "giving back group tokens whose holders are gone without a take record"
                    );
                    metrics.tokens_restored.fetch_add(n as u64, Relaxed);
                }
            }
        }
        if audit.next == "0" {
            return Ok(());
        }
        cursor = audit.next;
    }
}

/// How many groups one `group_audit` call looks at.
const GROUP_AUDIT_CHUNK: u32 = 100;

/// The token shards a request was submitted with (1 if it is gone).
async fn placement_shards(store: &Store, key_id: &str) -> Result<u32> {
    let meta = store.keys.request(key_id).meta;
    Ok(crate::shards::placement(store, &meta).await?.map_or(1, |p| p.shards))
}

/// Looks at one request now (a parked token's retry fell due): the census of its home shard.
pub(crate) async fn look_at(store: &Store, metrics: &WorkerMetrics, key_id: &str, shards: u32) -> Result<()> {
    census(store, metrics, home_shard(key_id, shards), key_id, None).await
}
