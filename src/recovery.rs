//! Recovery: every worker's share of keeping tokens and entries in circulation. There is no master.
//!
//! Each pass claims the requests whose check is due (`claim_due`: claimed requests are skipped
//! by other workers for one lease period), then for each one: `census` expires leases whose holder
//! stopped renewing (the entry becomes an orphan, handed out again first; the token is re-queued
//! under a new epoch, which fences the old holder), unparks tokens when work is waiting, and lists
//! tokens queued longer than the grace; `verify_tokens` pushes the restored elements and reports
//! which listed elements are missing from the list (popped into a reply nobody read, or never
//! pushed); `restore_tokens` re-queues those under a new epoch, but only if each is still queued
//! with the epoch that was checked. A request found terminal but still in `active` (its finisher
//! died or stalled before the last step after its finish) has those steps completed here
//! (`shards::finish`: event, seal, unindex, each done once whoever runs it).
//!
//! The argument that this never makes a token too many is in docs/architecture.md.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use fred::prelude::*;
use futures::stream::{self, StreamExt};
use rand::Rng;

use crate::config::millis;
use crate::error::Result;
use crate::keys::home_shard;
use crate::reply;
use crate::request::Priority;
use crate::scripts::Func;
use crate::store::Store;
use crate::worker::WorkerMetrics;

/// Requests claimed per pass, and censused concurrently.
const CLAIM_BATCH: i64 = 200;
const CONCURRENT: usize = 16;

pub(crate) async fn run(store: Store, metrics: Arc<WorkerMetrics>) {
    let interval = store.config.recovery_interval;
    loop {
        // Jitter spreads the passes of many workers over the interval.
        let jitter = interval.mul_f64(rand::thread_rng().gen_range(0.8..1.2));
        tokio::time::sleep(jitter).await;
        if let Err(e) = pass(&store, &metrics).await {
            tracing::warn!(error = %e, "recovery pass failed; retrying next interval");
        }
    }
}

/// One pass over every configured shard's `active` index: returns how many requests it looked at.
pub(crate) async fn pass(store: &Store, metrics: &WorkerMetrics) -> Result<usize> {
    let mut n = 0;
    for shard in 0..store.keys.shards() {
        n += pass_shard(store, metrics, shard).await?;
    }
    Ok(n)
}

async fn pass_shard(store: &Store, metrics: &WorkerMetrics, shard: u32) -> Result<usize> {
    let active = store.keys.active(shard);
    let claim_ms = millis(store.config.lease) as i64;
    let claimed = reply::array(
        store.fcall(Func::ClaimDue, &[&active], vec![CLAIM_BATCH.into(), claim_ms.into()]).await?,
    )?;
    let ids: Vec<String> = claimed.iter().filter_map(Value::as_string).collect();
    let n = ids.len();
    stream::iter(ids)
        .for_each_concurrent(CONCURRENT, |key_id| async move {
            if let Err(e) = census_one(store, metrics, shard, &key_id).await {
                tracing::warn!(request = key_id, error = %e, "census failed");
            }
        })
        .await;
    Ok(n)
}

/// The token shards a census reply names (absent from requests of older builds: 1).
fn shards_of(v: Option<Value>) -> u32 {
    v.and_then(|v| reply::int(&v).ok()).map_or(1, |s| s.clamp(1, 1024) as u32)
}

async fn census_one(store: &Store, metrics: &WorkerMetrics, shard: u32, key_id: &str) -> Result<()> {
    let keys = store.keys.request(key_id);
    let grace_ms = millis(store.config.lease) as i64;
    let args: Vec<Value> = vec![
        key_id.into(),
        grace_ms.into(),
        (millis(store.config.retention) as i64).into(),
        store.keys.done_channel().into(),
    ];
    let mut reply = reply::array(store.fcall(Func::Census, &keys.all(), args).await?)?.into_iter();
    let tag = reply.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    match tag.as_str() {
        "gone" => {
            // Expired while loading (its producer died), or after its retention once sealed (its
            // event was written before the seal), or after the hold of a finish nobody completed
            // (prelude.lua: only if no worker reached Redis for that long).
            store.client.zrem::<i64, _, _>(store.keys.active(shard), key_id).await?;
            store.client.del::<i64, _>(store.keys.finish_marks(shard, key_id)).await?;
        }
        "loading" => {}
        "finished" => {
            let state = reply.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
            let prio = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
            let shards = shards_of(reply.next());
            let gen = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
            let sealed = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0) == 1;
            let priority = Priority::new(prio as u8).unwrap_or_default();
            if sealed {
                // Its event was written before the seal: only the index entry is left.
                crate::shards::seal_and_unindex(store, key_id, home_shard(key_id, shards), gen).await?;
            } else {
                tracing::info!(
                    request = key_id,
                    state,
                    "completing the finish of a request (its finisher died or stalled)"
                );
                let finished = crate::shards::Finished { state, gen, sweep: Vec::new() };
                crate::shards::finish(store, key_id, shards, priority, finished).await?;
            }
        }
        "ok" => {
            let prio = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
            let push = reply::array(reply.next().unwrap_or(Value::Null))?;
            let check = reply::array(reply.next().unwrap_or(Value::Null))?;
            let expired = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
            let shards = shards_of(reply.next());
            let priority = Priority::new(prio as u8).unwrap_or_default();
            metrics.leases_expired.fetch_add(expired as u64, Relaxed);
            metrics.tokens_restored.fetch_add(push.len() as u64, Relaxed);
            if expired > 0 {
                tracing::warn!(request = key_id, expired, "leases expired; their entries will run again");
            }
            // Each token is pushed and verified on its own shard; the home shard's call, made
            // always, also re-arms the next census.
            let home = home_shard(key_id, shards);
            let mut pushes = crate::shards::by_shard(key_id, shards, push);
            let mut checks = crate::shards::by_shard(key_id, shards, check);
            let mut on: BTreeSet<u32> = pushes.keys().chain(checks.keys()).copied().collect();
            on.insert(home);
            let interval_ms = millis(store.config.recovery_interval) as i64;
            let verifies = on.into_iter().map(|s| {
                let push = pushes.remove(&s).unwrap_or_default();
                let check = checks.remove(&s).unwrap_or_default();
                let mut args: Vec<Value> =
                    vec![key_id.into(), interval_ms.into(), (push.len() as i64).into()];
                args.extend(push);
                args.extend(check);
                let (list, active) = (store.keys.token_list(s, priority), store.keys.active(s));
                async move { reply::array(store.fcall(Func::VerifyTokens, &[&list, &active], args).await?) }
            });
            let missing: Vec<Value> =
                futures::future::try_join_all(verifies).await?.into_iter().flatten().collect();
            if !missing.is_empty() {
                let mut args: Vec<Value> = vec![key_id.into()];
                args.extend(missing);
                let restored = reply::array(store.fcall(Func::RestoreTokens, &keys.all(), args).await?)?;
                if !restored.is_empty() {
                    tracing::warn!(
                        request = key_id,
                        tokens = restored.len(),
                        "restoring tokens lost in flight"
                    );
                    metrics.tokens_restored.fetch_add(restored.len() as u64, Relaxed);
                    crate::shards::push(store, key_id, shards, priority, restored).await?;
                }
            }
        }
        other => tracing::warn!(request = key_id, reply = other, "unexpected census reply"),
    }
    Ok(())
}
