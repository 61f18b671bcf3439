//! Token shards: where a request's token elements, its `active` entry and its events live.
//!
//! A request submitted with S shards (meta field `shards`) has a home shard
//! `h = FNV-1a(key id) % S`: its `active` entry and its terminal event are there. Its token `k`
//! lives on shard `(h + k) % S`: every element of `k` is pushed to, popped from, swept from and
//! verified on that shard's list. Every call here touches the keys of one shard only, or (`seal`)
//! the request's own keys.

use std::collections::BTreeMap;

use fred::prelude::*;

use crate::config::millis;
use crate::error::{retry_not_executed, Result};
use crate::keys::{home_shard, token_shard};
use crate::reply;
use crate::request::Priority;
use crate::scripts::Func;
use crate::store::Store;

/// The token number of an element `<kid>|<k>|<epoch>` (0 if malformed: it then goes home).
fn element_token(element: &Value) -> u64 {
    element.as_string().and_then(|e| e.split('|').nth(1).and_then(|k| k.parse().ok())).unwrap_or(0)
}

/// Elements grouped by the shard their token lives on.
pub(crate) fn by_shard(key_id: &str, shards: u32, elements: Vec<Value>) -> BTreeMap<u32, Vec<Value>> {
    let mut out: BTreeMap<u32, Vec<Value>> = BTreeMap::new();
    for e in elements {
        out.entry(token_shard(key_id, shards, element_token(&e))).or_default().push(e);
    }
    out
}

/// Queues token elements of a registered request: the home shard's through `ring push` (which
/// pushes only while the request is active, and sets its next census `delay` from now), then the
/// other shards' with plain `LPUSH`es. The ring call is made even with no home element.
/// If the request finished in between, other shards may get elements of a finished request:
/// `acquire` answers `drop` to them.
pub(crate) async fn ring_push(
    store: &Store,
    key_id: &str,
    shards: u32,
    priority: Priority,
    delay_ms: i64,
    elements: Vec<Value>,
) -> Result<()> {
    let home = home_shard(key_id, shards);
    let mut groups = by_shard(key_id, shards, elements);
    let mut args: Vec<Value> = vec![key_id.into(), delay_ms.into(), "push".into()];
    args.extend(groups.remove(&home).unwrap_or_default());
    let (list, active) = (store.keys.token_list(home, priority), store.keys.active(home));
    store.fcall(Func::Ring, &[&list, &active], args).await?;
    lpush_groups(store, priority, groups).await
}

/// `LPUSH`es elements onto their tokens' shard lists (one command per shard, concurrently).
pub(crate) async fn push(
    store: &Store,
    key_id: &str,
    shards: u32,
    priority: Priority,
    elements: Vec<Value>,
) -> Result<()> {
    lpush_groups(store, priority, by_shard(key_id, shards, elements)).await
}

async fn lpush_groups(store: &Store, priority: Priority, groups: BTreeMap<u32, Vec<Value>>) -> Result<()> {
    let pushes = groups.into_iter().filter(|(_, e)| !e.is_empty()).map(|(shard, elements)| {
        let list = store.keys.token_list(shard, priority);
        async move {
            retry_not_executed("token push", store.config.unresponsive, || async {
                Ok(store.client.lpush::<i64, _, _>(list.as_str(), elements.clone()).await?)
            })
            .await
        }
    });
    futures::future::try_join_all(pushes).await?;
    Ok(())
}

/// Registers a request with recovery in its home shard's `active` index; true when this call
/// added it.
pub(crate) async fn register(store: &Store, key_id: &str, shards: u32, priority: Priority) -> Result<bool> {
    let home = home_shard(key_id, shards);
    let (list, active) = (store.keys.token_list(home, priority), store.keys.active(home));
    let delay = millis(store.config.lease) as i64;
    let added = store
        .fcall(Func::Ring, &[&list, &active], vec![key_id.into(), delay.into(), "register".into()])
        .await?;
    Ok(reply::int(&added)? == 1)
}

/// Takes back a registration this process added for a request that did not come to be.
pub(crate) async fn unregister(store: &Store, key_id: &str, shards: u32) {
    let active = store.keys.active(home_shard(key_id, shards));
    let removed: Result<i64, _> = store.client.zrem(active, key_id).await;
    if let Err(e) = removed {
        tracing::debug!(error = %e, "could not take back a registration; recovery will drop it");
    }
}

/// A request that has just turned terminal, as a finishing function reports it
/// (`{'finished', state, gen, sweep...}`, the part after the tag).
#[derive(Debug)]
pub(crate) struct Finished {
    /// The terminal state.
    pub(crate) state: String,
    /// The lifecycle that finished (meta `gen`: bumped each time requeue reopens the request).
    pub(crate) gen: i64,
    /// Stale token elements to sweep from the lists.
    pub(crate) sweep: Vec<Value>,
}

impl Finished {
    /// Reads the reply items that follow the `finished` tag.
    pub(crate) fn from_reply(mut items: impl Iterator<Item = Value>) -> Result<Finished> {
        let state = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
        let gen = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
        Ok(Finished { state, gen, sweep: items.collect() })
    }
}

/// What follows a request turning terminal, on the token side and back on the request's keys; each
/// step is repeatable, and recovery repeats whatever a dead or stalled finisher left undone (the
/// request stays in `active` until the last step):
/// 1. stale elements swept from their shards' lists, and on the home shard the one event of this
///    lifecycle (`finish_index`);
/// 2. the request's retention started (`seal`; until then its keys are held, so a finish whose
///    event is late is neither lost nor unannounced);
/// 3. the request leaves `active` (`unindex`).
pub(crate) async fn finish(
    store: &Store,
    key_id: &str,
    shards: u32,
    priority: Priority,
    finished: Finished,
) -> Result<()> {
    let Finished { state, gen, sweep } = finished;
    let home = home_shard(key_id, shards);
    let mut groups = by_shard(key_id, shards, sweep);
    let home_sweep = groups.remove(&home).unwrap_or_default();
    let sweeps = groups.into_iter().flat_map(|(shard, elements)| {
        let list = store.keys.token_list(shard, priority);
        elements.into_iter().map(move |e| {
            let list = list.clone();
            async move {
                retry_not_executed("token sweep", store.config.unresponsive, || async {
                    Ok(store.client.lrem::<i64, _, _>(list.as_str(), 0, e.clone()).await?)
                })
                .await
            }
        })
    });
    futures::future::try_join_all(sweeps).await?;
    let retention = millis(store.config.retention) as i64;
    let mut args: Vec<Value> = vec![key_id.into(), state.into(), retention.into(), gen.into()];
    args.extend(home_sweep);
    let (active, events, list, marks) = (
        store.keys.active(home),
        store.keys.events(home),
        store.keys.token_list(home, priority),
        store.keys.finish_marks(home, key_id),
    );
    store.fcall(Func::FinishIndex, &[&active, &events, &list, &marks], args).await?;
    seal_and_unindex(store, key_id, home, gen).await
}

/// Steps 2 and 3 of [`finish`]; alone, for a request whose event is already recorded.
pub(crate) async fn seal_and_unindex(store: &Store, key_id: &str, home: u32, gen: i64) -> Result<()> {
    let retention = millis(store.config.retention) as i64;
    let keys = store.keys.request(key_id);
    let sealed = store.fcall(Func::Seal, &keys.all(), vec![gen.into(), retention.into()]).await?;
    if reply::int(&sealed)? == 1 {
        let (active, marks) = (store.keys.active(home), store.keys.finish_marks(home, key_id));
        let args: Vec<Value> = vec![key_id.into(), gen.into(), retention.into()];
        store.fcall(Func::Unindex, &[&active, &marks], args).await?;
    }
    Ok(())
}

/// Marks a request that requeue reopened as lifecycle `gen`, and makes sure it is in `active`.
pub(crate) async fn reopen(
    store: &Store,
    key_id: &str,
    shards: u32,
    priority: Priority,
    gen: i64,
) -> Result<()> {
    let home = home_shard(key_id, shards);
    let (list, active, marks) = (
        store.keys.token_list(home, priority),
        store.keys.active(home),
        store.keys.finish_marks(home, key_id),
    );
    let delay = millis(store.config.lease) as i64;
    let args: Vec<Value> = vec![key_id.into(), delay.into(), "reopen".into(), gen.into()];
    store.fcall(Func::Ring, &[&list, &active, &marks], args).await?;
    Ok(())
}

/// A request's priority and token shards, from its meta hash; `None` if it is unknown.
pub(crate) async fn placement(store: &Store, meta: &str) -> Result<Option<(Priority, u32)>> {
    let (prio, shards): (Option<u8>, Option<u32>) = store.client.hmget(meta, vec!["prio", "shards"]).await?;
    Ok(prio.map(|p| (Priority::new(p).unwrap_or_default(), shards.unwrap_or(1).max(1))))
}
