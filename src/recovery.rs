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
//! - **The take records' backstop** ([`scan_held`]): records whose worker is gone from the
//!   registry (its registry entry lost with a failover, say) are reclaimed too.
//!
//! The argument that none of this ever makes a token too many is in docs/architecture.md.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::Relaxed;

use fred::prelude::*;
use futures::stream::{self, StreamExt};

use crate::config::millis;
use crate::error::Result;
use crate::keys::{home_shard, token_shard};
use crate::protocol::index::{self, Arming};
use crate::protocol::operators::Requeued;
use crate::protocol::{Finished, Func, TakeRecord};
use crate::reply;
use crate::request::Priority;
use crate::shards::Placement;
use crate::store::Store;
use crate::worker::registry::{self, WorkerInfo};
use crate::worker::WorkerMetrics;

/// Requests claimed per pass per shard, and looked at concurrently.
const CLAIM_BATCH: i64 = 200;
const CONCURRENT: usize = 16;
/// Tokens per census call: bounds the time of one call for a request with a large limit.
const CENSUS_CHUNK: i64 = 1_000;

/// One pass over every configured shard's `active` index: returns how many requests it looked at.
pub(crate) async fn pass(store: &Store, metrics: &WorkerMetrics) -> Result<usize> {
    let mut n = 0;
    for shard in 0..store.keys.shards() {
        n += pass_shard(store, metrics, shard).await?;
    }
    Ok(n)
}

async fn pass_shard(store: &Store, metrics: &WorkerMetrics, shard: u32) -> Result<usize> {
    let (active, armed) = (store.keys.active(shard), store.keys.armed(shard));
    // Others skip a claimed request for a few leases; a claimer that dies is replaced after that.
    let claim_ms = millis(store.config.lease.saturating_mul(5)) as i64;
    let claimed = reply::array(
        store.fcall(Func::ClaimDue, &[&active, &armed], vec![CLAIM_BATCH.into(), claim_ms.into()]).await?,
    )?;
    let pairs: Vec<(String, i64)> = claimed
        .chunks(2)
        .filter_map(|p| match p {
            [kid, claim] => Some((kid.as_string()?, claim.as_i64()?)),
            _ => None,
        })
        .collect();
    let n = pairs.len();
    stream::iter(pairs)
        .for_each_concurrent(store.concurrency(CONCURRENT), |(key_id, claim)| async move {
            if let Err(e) = census(store, metrics, shard, &key_id, Some(claim)).await {
                tracing::warn!(request = key_id, error = %e, "census failed");
            }
        })
        .await;
    Ok(n)
}

/// The token shards a reply names (absent from requests of older builds: 1).
fn shards_of(v: Option<Value>) -> u32 {
    v.and_then(|v| reply::int(&v).ok()).map_or(1, |s| s.clamp(1, 1024) as u32)
}

/// Completes the steps after a finish, from the reply items after a 'finished' tag of census or
/// reclaim: `state, priority, shards, lifecycle, sealed`.
pub(crate) async fn finish_reported(
    store: &Store,
    key_id: &str,
    mut items: impl Iterator<Item = Value>,
) -> Result<()> {
    let state = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    let prio = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
    let shards = shards_of(items.next());
    let lifecycle = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
    let sealed = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0) == 1;
    let place = Placement { priority: Priority::new(prio as u8).unwrap_or_default(), shards };
    let reopened = if sealed {
        // Its event was written before the seal: only the index entry is left.
        crate::shards::seal_and_unindex(store, key_id, home_shard(key_id, shards), lifecycle).await?
    } else {
        tracing::info!(
            request = key_id,
            state,
            "completing the finish of a request (its finisher died or stalled)"
        );
        crate::shards::finish(store, key_id, place, Finished { state, lifecycle, sweep: Vec::new() }).await?
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
    let claimed = claim;
    let claim: Value = index::claim_arg(claim);
    let keys = store.keys.request(key_id);
    let cfg = &store.config;
    let grace = millis(cfg.grace()) as i64;
    let mut from: i64 = 0;
    // Each chunk's reply carries the earliest look asked for so far; the next chunk starts from it,
    // so that the last chunk's look (the one verify sets) accounts for every chunk.
    let mut look_so_far = millis(cfg.census_interval) as i64;
    loop {
        let args: Vec<Value> = vec![
            key_id.into(),
            grace.into(),
            (millis(cfg.retention) as i64).into(),
            store.keys.done_channel().into(),
            from.into(),
            CENSUS_CHUNK.into(),
            look_so_far.into(),
        ];
        let mut reply = reply::array(store.fcall(Func::Census, &keys.all(), args).await?)?.into_iter();
        let tag = reply.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
        match tag.as_str() {
            "gone" => {
                // Not created (yet), or expired: dropped once no producer can still create it.
                let (active, reg, marks, armed) = (
                    store.keys.active(shard),
                    store.keys.registrations(shard),
                    store.keys.finish_marks(shard, key_id),
                    store.keys.armed(shard),
                );
                let ttl = millis(cfg.loading_ttl) as i64;
                let args: Vec<Value> = vec![key_id.into(), ttl.into(), claim.clone(), grace.into()];
                store.fcall(Func::DropGone, &[&active, &reg, &marks, &armed], args).await?;
                return Ok(());
            }
            "loading" => {
                // Its producer is writing it, or died doing so (the keys expire with the loading
                // ttl), or committed it just now and may die before it pushes: look again soon.
                index::arm(store, key_id, shard, cfg.grace(), Arming::Census { claim: claimed }).await?;
                return Ok(());
            }
            "finished" => return finish_reported(store, key_id, reply).await,
            "ok" => {}
            other => {
                tracing::warn!(request = key_id, reply = other, "unexpected census reply");
                return Ok(());
            }
        }
        let prio = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
        let shards = shards_of(reply.next());
        let next = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(-1);
        let look = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(1);
        look_so_far = look;
        let push = reply::array(reply.next().unwrap_or(Value::Null))?;
        let check = reply::array(reply.next().unwrap_or(Value::Null))?;
        let held = reply::array(reply.next().unwrap_or(Value::Null))?;
        let place = Placement { priority: Priority::new(prio as u8).unwrap_or_default(), shards };
        metrics.tokens_restored.fetch_add(push.len() as u64, Relaxed);
        // The home shard's verify sets the next look: only after the last chunk, whose reply
        // carries it, and always made, so that the look is set even with nothing to push or check.
        let last = next < 0;
        verify(store, metrics, key_id, place, push, check, last.then_some((look, claim.clone()))).await?;
        reclaim_dead_holders(store, metrics, key_id, place, held).await?;
        if last {
            return Ok(());
        }
        from = next;
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
    look: Option<(i64, Value)>,
) -> Result<()> {
    let home = home_shard(key_id, place.shards);
    let mut pushes = crate::shards::by_shard(key_id, place.shards, push);
    let mut checks = crate::shards::by_shard(key_id, place.shards, check);
    let mut on: BTreeSet<u32> = pushes.keys().chain(checks.keys()).copied().collect();
    if look.is_some() {
        on.insert(home);
    }
    let grace = millis(store.config.grace()) as i64;
    let mut missing: Vec<Value> = Vec::new();
    for s in on {
        let push = pushes.remove(&s).unwrap_or_default();
        let check = checks.remove(&s).unwrap_or_default();
        let rearm = look.as_ref().filter(|_| s == home);
        let next = rearm.map_or(0, |(l, _)| *l);
        let mut args: Vec<Value> = vec![key_id.into(), next.into(), grace.into(), (push.len() as i64).into()];
        args.extend(push);
        args.extend(check);
        if let Some((_, claim)) = rearm {
            args.push(claim.clone());
        }
        let (list, bell, active, armed) = (
            store.keys.token_list(s, place.priority),
            store.keys.bell(s),
            store.keys.active(s),
            store.keys.armed(s),
        );
        let keys: Vec<&str> =
            if rearm.is_some() { vec![&list, &bell, &active, &armed] } else { vec![&list, &bell] };
        missing.extend(reply::array(store.fcall(Func::Verify, &keys, args).await?)?);
    }
    if missing.is_empty() {
        return Ok(());
    }
    let mut args: Vec<Value> = vec![key_id.into()];
    args.extend(missing);
    let restored = reply::array(store.fcall(Func::Restore, &store.keys.request(key_id).all(), args).await?)?;
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
    held: Vec<Value>,
) -> Result<()> {
    let mut holds = Vec::new();
    for h in held {
        let f = reply::array(h)?;
        if let [k, epoch, holder] = &f[..] {
            holds.push((reply::int(k)?, reply::text(epoch)?, reply::text(holder)?));
        }
    }
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
            let shard = token_shard(key_id, place.shards, k as u64);
            let list = store.keys.token_list(shard, place.priority);
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
    let keys = store.keys.request(key_id);
    let args: Vec<Value> = vec![key_id.into(), k.into(), epoch.into(), holder.into()];
    let mut reply = reply::array(store.fcall(Func::Reclaim, &keys.all(), args).await?)?.into_iter();
    let held = store.keys.held(shard);
    let end_record = |record_holder: &str, take: &str| {
        let args: Vec<Value> = vec![record_holder.into(), take.into()];
        let held = held.clone();
        async move { store.fcall(Func::Release, &[&held], args).await.map(|_| ()) }
    };
    match reply.next().map(|v| reply::text(&v)).transpose()?.as_deref() {
        Some("push") => {
            metrics.holds_reclaimed.fetch_add(1, Relaxed);
            metrics.tokens_restored.fetch_add(1, Relaxed);
            let element: Vec<Value> = reply.collect();
            match take {
                Some((record_holder, take)) => {
                    let bell = store.keys.bell(shard);
                    let mut args: Vec<Value> = vec![record_holder.into(), take.into()];
                    args.extend(element);
                    store.fcall(Func::GiveBack, &[&held, &bell, list], args).await?;
                }
                None => {
                    index::push(store, key_id, shard, list, element).await?;
                }
            }
        }
        Some("finished") => {
            finish_reported(store, key_id, reply).await?;
            if let Some((record_holder, take)) = take {
                end_record(record_holder, take).await?;
            }
        }
        Some("wake") => {
            let wake = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(1);
            let wake = std::time::Duration::from_millis(wake.max(0) as u64);
            crate::shards::arm(store, key_id, placement_shards(store, key_id).await?, wake).await?;
            if let Some((record_holder, take)) = take {
                end_record(record_holder, take).await?;
            }
        }
        _ => {
            if let Some((record_holder, take)) = take {
                end_record(record_holder, take).await?;
            }
        }
    }
    Ok(())
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

/// The backstop for take records: any whose worker is gone from the registry (and not being
/// reaped), and any a live slot abandoned ("/lost/"), are reclaimed.
pub(crate) async fn scan_held(store: &Store, metrics: &WorkerMetrics) -> Result<()> {
    for shard in 0..store.keys.shards() {
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

/// The token shards a request was submitted with (1 if it is gone).
async fn placement_shards(store: &Store, key_id: &str) -> Result<u32> {
    let meta = store.keys.request(key_id).meta;
    Ok(crate::shards::placement(store, &meta).await?.map_or(1, |p| p.shards))
}

/// Looks at one request now (a parked token's retry fell due): the census of its home shard.
pub(crate) async fn look_at(store: &Store, metrics: &WorkerMetrics, key_id: &str, shards: u32) -> Result<()> {
    census(store, metrics, home_shard(key_id, shards), key_id, None).await
}
