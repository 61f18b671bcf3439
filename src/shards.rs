//! Token shards: where a request's token elements, its `active` entry and its events live.
//!
//! A request submitted with S shards (meta field `shards`) has a home shard
//! `h = FNV-1a(key id) % S`: its `active` entry and its terminal event are there. Its token `k`
//! lives on shard `(h + k) % S`: every element of `k` is pushed to, taken from, swept from and
//! verified on that shard's list. Every call here touches the keys of one shard only, or (`seal`)
//! the request's own keys.

use std::collections::BTreeMap;

use fred::prelude::*;

use crate::config::millis;
use crate::error::{Error, Result};
use crate::keys::{home_shard, token_shard};
use crate::protocol::{Code, Func, Refusal, TokenElement};
use crate::reply;
use crate::request::Priority;
use crate::store::Store;

/// The token number of an element (0 if malformed: it then goes home).
fn element_token(element: &Value) -> u64 {
    element.as_string().and_then(|e| TokenElement::token_of(&e)).map_or(0, u64::from)
}

/// Elements grouped by the shard their token lives on.
pub(crate) fn by_shard(key_id: &str, shards: u32, elements: Vec<Value>) -> BTreeMap<u32, Vec<Value>> {
    let mut out: BTreeMap<u32, Vec<Value>> = BTreeMap::new();
    for e in elements {
        out.entry(token_shard(key_id, shards, element_token(&e))).or_default().push(e);
    }
    out
}

/// Where a request's tokens and index entry live.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Placement {
    pub(crate) priority: Priority,
    pub(crate) shards: u32,
}

/// A registration: when Redis recorded it, from which the producer's deadline follows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Registration {
    /// Redis time (ms) of the registration, on the home shard.
    pub(crate) at_ms: i64,
    /// The score it gave the request in the index (its first look).
    pub(crate) look: i64,
}

impl Registration {
    /// The deadline to pass to the call that creates the request: half the loading ttl after the
    /// registration (recovery drops an entry without a request only a whole loading ttl after it).
    pub(crate) fn deadline(&self, store: &Store) -> i64 {
        self.at_ms + millis(store.config.loading_ttl) as i64 / 2
    }
}

/// Enters a request in its home shard's `active` index before it is created. Producers never take
/// a registration back (it may be another producer's): recovery drops one whose request never came
/// to be (`drop_gone`).
pub(crate) async fn register(store: &Store, key_id: &str, place: Placement) -> Result<Registration> {
    let home = home_shard(key_id, place.shards);
    let (active, reg) = (store.keys.active(home), store.keys.registrations(home));
    let first_look = millis(store.config.grace()) as i64;
    let reply = store.fcall(Func::Register, &[&active, &reg], vec![key_id.into(), first_look.into()]).await?;
    let items = reply::array(reply)?;
    let at_ms = items.get(1).map(reply::int).transpose()?.unwrap_or(0);
    Ok(Registration { at_ms, look: at_ms + first_look })
}

/// How a push sets the request's next look by recovery.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Look {
    /// The push that follows a submit, made under this registration: the next look is `next_ms`
    /// from now unless recovery has looked since the registration (then it only moves earlier).
    First(Registration),
    /// Any later push: the next look only moves earlier.
    More,
}

/// Queues token elements: the home shard's through `push` with the index (which also makes sure
/// the request is indexed, and sets its next look `next_ms` from now as `look` says), the other
/// shards' through `push` without. The home shard's call is made even with no home element.
pub(crate) async fn push(
    store: &Store,
    key_id: &str,
    place: Placement,
    look: Look,
    next_ms: i64,
    elements: Vec<Value>,
) -> Result<()> {
    let home = home_shard(key_id, place.shards);
    let mut groups = by_shard(key_id, place.shards, elements);
    let mode = match look {
        Look::First(r) => format!("first:{}", r.look),
        Look::More => "more".to_owned(),
    };
    let mut args: Vec<Value> = vec![key_id.into(), next_ms.into(), mode.into()];
    args.extend(groups.remove(&home).unwrap_or_default());
    let (list, bell, active, reg) = (
        store.keys.token_list(home, place.priority),
        store.keys.bell(home),
        store.keys.active(home),
        store.keys.registrations(home),
    );
    store.fcall(Func::Push, &[&list, &bell, &active, &reg], args).await?;
    push_elsewhere(store, key_id, place.priority, groups).await
}

/// Pushes elements onto their tokens' shard lists without touching the index (`push` with two
/// keys), one call per shard.
pub(crate) async fn push_elsewhere(
    store: &Store,
    key_id: &str,
    priority: Priority,
    groups: BTreeMap<u32, Vec<Value>>,
) -> Result<()> {
    let calls = groups.into_iter().filter(|(_, e)| !e.is_empty()).map(|(shard, elements)| {
        let (list, bell) = (store.keys.token_list(shard, priority), store.keys.bell(shard));
        let mut args: Vec<Value> = vec![key_id.into(), 0.into(), "more".into()];
        args.extend(elements);
        async move { store.fcall(Func::Push, &[&list, &bell], args).await }
    });
    futures::future::try_join_all(calls).await?;
    Ok(())
}

/// Asks recovery to look at a request within `in_ms` (only ever earlier than planned).
pub(crate) async fn arm(store: &Store, key_id: &str, shards: u32, in_ms: i64) -> Result<()> {
    let home = home_shard(key_id, shards);
    let (active, armed) = (store.keys.active(home), store.keys.armed(home));
    store.fcall(Func::Arm, &[&active, &armed], vec![key_id.into(), in_ms.into()]).await?;
    Ok(())
}

/// How many times [`armed`] re-arms a step that Redis refused as late before it gives up.
const LATE_STEPS: usize = 5;

/// Runs `step`, a call whose follow-up (a push) this process might not live to make, after asking
/// recovery to look at the request a grace later: the look that finds what the step left undone.
/// `step` gets the deadline (Redis time, ms; 0 when the request is not indexed) that its function
/// checks, refusing with SGLATE once it has passed: a look is only sure to come after the step if
/// the step runs before the look falls due. A refused step is armed and run again.
pub(crate) async fn armed<T, F, Fut>(store: &Store, key_id: &str, shards: u32, mut step: F) -> Result<T>
where
    F: FnMut(i64) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let home = home_shard(key_id, shards);
    let (active, armed) = (store.keys.active(home), store.keys.armed(home));
    let grace = millis(store.config.grace()) as i64;
    for _ in 0..LATE_STEPS {
        let args: Vec<Value> = vec![key_id.into(), grace.into(), "".into(), "step".into()];
        let due = reply::int(&store.fcall(Func::Arm, &[&active, &armed], args).await?)?;
        // Half a grace of margin: the step runs on the request's own master, whose clock may
        // differ a little from the home shard's.
        let deadline = if due > 0 { due - grace / 2 } else { 0 };
        match step(deadline).await {
            Err(e) if Refusal::is(&e, Code::Late).is_some() => continue,
            other => return other,
        }
    }
    Err(Error::Protocol(format!(
        "a step on request \"{key_id}\" ran past its deadline {LATE_STEPS} times in a row: Redis is overloaded, or \
         the clock of the request's master is ahead of its home shard's by more than half a grace ({} ms)",
        grace / 2
    )))
}

/// A request that has just turned terminal, as a finishing function reports it
/// (`{'finished', state, lifecycle, sweep...}`, the part after the tag).
#[derive(Debug)]
pub(crate) struct Finished {
    /// The terminal state.
    pub(crate) state: String,
    /// The lifecycle that finished: `created * 1000 + gen` (gen counts reopenings by requeue).
    pub(crate) lifecycle: i64,
    /// Stale token elements to sweep from the lists.
    pub(crate) sweep: Vec<Value>,
}

impl Finished {
    /// Reads the reply items that follow the `finished` tag.
    pub(crate) fn from_reply(mut items: impl Iterator<Item = Value>) -> Result<Finished> {
        let state = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
        let lifecycle = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
        Ok(Finished { state, lifecycle, sweep: items.collect() })
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
///
/// Returns the lifecycle a requeue marked (`reopen`) when the request stays indexed for it.
pub(crate) async fn finish(
    store: &Store,
    key_id: &str,
    place: Placement,
    finished: Finished,
) -> Result<Option<i64>> {
    let Finished { state, lifecycle, sweep } = finished;
    let home = home_shard(key_id, place.shards);
    let mut groups = by_shard(key_id, place.shards, sweep);
    let home_sweep = groups.remove(&home).unwrap_or_default();
    let sweeps = groups.into_iter().filter(|(_, e)| !e.is_empty()).map(|(shard, elements)| {
        let (list, bell) = (store.keys.token_list(shard, place.priority), store.keys.bell(shard));
        async move { store.fcall(Func::Sweep, &[&list, &bell], elements).await }
    });
    futures::future::try_join_all(sweeps).await?;
    let retention = millis(store.config.retention) as i64;
    let mut args: Vec<Value> = vec![key_id.into(), state.into(), retention.into(), lifecycle.into()];
    args.extend(home_sweep);
    let (active, events, list, marks, bell) = (
        store.keys.active(home),
        store.keys.events(home),
        store.keys.token_list(home, place.priority),
        store.keys.finish_marks(home, key_id),
        store.keys.bell(home),
    );
    store.fcall(Func::FinishIndex, &[&active, &events, &list, &marks, &bell], args).await?;
    seal_and_unindex(store, key_id, home, lifecycle).await
}

/// Steps 2 and 3 of [`finish`]; alone, for a request whose event is already recorded. Returns the
/// lifecycle a requeue marked (`reopen`) when the request stays indexed for it.
pub(crate) async fn seal_and_unindex(
    store: &Store,
    key_id: &str,
    home: u32,
    lifecycle: i64,
) -> Result<Option<i64>> {
    let retention = millis(store.config.retention) as i64;
    let keys = store.keys.request(key_id);
    let sealed = store.fcall(Func::Seal, &keys.all(), vec![lifecycle.into(), retention.into()]).await?;
    if reply::int(&sealed)? == 1 {
        let (active, marks, reg, armed) = (
            store.keys.active(home),
            store.keys.finish_marks(home, key_id),
            store.keys.registrations(home),
            store.keys.armed(home),
        );
        let args: Vec<Value> = vec![key_id.into(), lifecycle.into(), retention.into()];
        let left = reply::int(&store.fcall(Func::Unindex, &[&active, &marks, &reg, &armed], args).await?)?;
        return Ok((left > lifecycle).then_some(left));
    }
    Ok(None)
}

/// One `requeue_dead` call, armed (see [`armed`]): its reply's items. `reopen_as` is the lifecycle
/// a failed request reopens as ("" until `reopen` marked one); `resume` is recovery's completion
/// of a requeue whose caller died after that mark.
pub(crate) async fn requeue_dead(
    store: &Store,
    key_id: &str,
    shards: u32,
    reopen_as: &str,
    resume: bool,
) -> Result<Vec<Value>> {
    let keys = store.keys.request(key_id);
    let keys = keys.all();
    let reply = armed(store, key_id, shards, |deadline| {
        let mut args: Vec<Value> = vec![key_id.into(), reopen_as.into(), deadline.into()];
        if resume {
            args.push("resume".into());
        }
        let keys = &keys;
        async move { store.fcall(Func::RequeueDead, keys, args).await }
    })
    .await?;
    reply::array(reply)
}

/// Before requeue reopens a failed request as `lifecycle`: indexes it again and marks the new
/// lifecycle on the home shard, so that a late `unindex` of the failed one leaves it indexed.
pub(crate) async fn reopen(store: &Store, key_id: &str, shards: u32, lifecycle: i64) -> Result<()> {
    let home = home_shard(key_id, shards);
    let (active, reg, marks) =
        (store.keys.active(home), store.keys.registrations(home), store.keys.finish_marks(home, key_id));
    let first_look = millis(store.config.grace()) as i64;
    let args: Vec<Value> = vec![key_id.into(), first_look.into(), lifecycle.into()];
    store.fcall(Func::Reopen, &[&active, &reg, &marks], args).await?;
    Ok(())
}

/// A request's priority and token shards, from its meta hash; `None` if it is unknown.
pub(crate) async fn placement(store: &Store, meta: &str) -> Result<Option<Placement>> {
    let (prio, shards): (Option<u8>, Option<u32>) = store
        .call("hmget", meta, || async { Ok(store.client.hmget(meta, vec!["prio", "shards"]).await?) })
        .await?;
    Ok(prio.map(|p| Placement {
        priority: Priority::new(p).unwrap_or_default(),
        shards: shards.unwrap_or(1).max(1),
    }))
}
