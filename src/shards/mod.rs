//! Token shards: where a request's token elements, its `active` entry and its events live.
//!
//! A request submitted with S shards (meta field `shards`) has a home shard
//! `h = FNV-1a(key id) % S`: its `active` entry and its terminal event are there. Its token `k`
//! lives on shard `(h + k) % S`: every element of `k` is pushed to, taken from, swept from and
//! verified on that shard's list. Every call here touches the keys of one shard only, or (`seal`)
//! the request's own keys.

pub(crate) mod dag;

use std::collections::BTreeMap;
use std::time::Duration;

use fred::prelude::*;

use crate::config::millis;
use crate::error::{Error, Result};
use crate::keys::{group_shard, home_shard, token_shard};
use crate::protocol::finish::{Indexed, Unindexed};
use crate::protocol::index::{Arming, PushLook};
use crate::protocol::lane::{self, LaneCancelled};
use crate::protocol::operators::Cancel;
use crate::protocol::operators::Requeued;
use crate::protocol::submit::{self, Finalized};
use crate::protocol::{finish, index, operators, ran_past_deadline, Finished, TokenElement};
use crate::request::{Cancelled, Priority, RequestId};
use crate::store::Store;

/// The token number of an element (0 if malformed: it then goes home).
fn element_token(element: &Value) -> u64 {
    element.as_string().and_then(|e| TokenElement::token_of(&e)).map_or(0, u64::from)
}

/// Elements grouped by the shard their token lives on.
pub(crate) fn by_shard(key_id: &str, place: &Placement, elements: Vec<Value>) -> BTreeMap<u32, Vec<Value>> {
    let mut out: BTreeMap<u32, Vec<Value>> = BTreeMap::new();
    for e in elements {
        out.entry(place.token_shard(key_id, element_token(&e))).or_default().push(e);
    }
    out
}

/// Where a request's tokens and index entry live.
#[derive(Clone, Debug)]
pub(crate) struct Placement {
    pub(crate) priority: Priority,
    pub(crate) shards: u32,
    /// Its tenant group, if any (`RequestBuilder::group`): every token then lives on the group's
    /// shard and waits in the group's queue.
    pub(crate) group: Option<String>,
}

impl Placement {
    /// A request's placement without a group.
    pub(crate) fn new(priority: Priority, shards: u32) -> Self {
        Self { priority, shards, group: None }
    }

    /// The shard token `k` of request `key_id` lives on.
    pub(crate) fn token_shard(&self, key_id: &str, k: u64) -> u32 {
        match &self.group {
            Some(name) => group_shard(name, self.shards),
            None => token_shard(key_id, self.shards, k),
        }
    }

    /// The list the request's token elements wait in on `shard` at `priority`: the shard's list
    /// of that priority, or its group's queue.
    pub(crate) fn list_at(&self, store: &Store, shard: u32, priority: Priority) -> String {
        match &self.group {
            Some(name) => store.keys.group_queue(shard, name, priority),
            None => store.keys.token_list(shard, priority),
        }
    }

    /// [`list_at`](Self::list_at) the request's priority.
    pub(crate) fn list(&self, store: &Store, shard: u32) -> String {
        self.list_at(store, shard, self.priority)
    }
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
pub(crate) async fn register(
    store: &Store,
    key_id: &str,
    place: Placement,
    row: &str,
) -> Result<Registration> {
    let home = home_shard(key_id, place.shards);
    let first_look = store.config.grace();
    let registered = index::register(store, key_id, home, first_look, row).await?;
    let at_ms = registered.at_ms;
    Ok(Registration { at_ms, look: at_ms + millis(first_look) as i64 })
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
/// the request is indexed, and sets its next look `next` from now as `look` says), the other
/// shards' through `push` without. The home shard's call is made even with no home element.
pub(crate) async fn push(
    store: &Store,
    key_id: &str,
    place: Placement,
    look: Look,
    next: Duration,
    elements: Vec<Value>,
) -> Result<()> {
    let home = home_shard(key_id, place.shards);
    let mut groups = by_shard(key_id, &place, elements);
    let look = match look {
        Look::First(r) => PushLook::First { score: r.look },
        Look::More => PushLook::More,
    };
    let home_elements = groups.remove(&home).unwrap_or_default();
    index::push_home(store, key_id, home, &place.list(store, home), next, look, home_elements).await?;
    push_elsewhere(store, key_id, &place, groups).await
}

/// Pushes elements onto their tokens' shard lists without touching the index (`push` with two
/// keys), one call per shard.
pub(crate) async fn push_elsewhere(
    store: &Store,
    key_id: &str,
    place: &Placement,
    groups: BTreeMap<u32, Vec<Value>>,
) -> Result<()> {
    let calls = groups.into_iter().filter(|(_, e)| !e.is_empty()).map(|(shard, elements)| {
        let list = place.list(store, shard);
        async move { index::push(store, key_id, shard, &list, elements).await }
    });
    futures::future::try_join_all(calls).await?;
    Ok(())
}

/// Asks recovery to look at a request within `within` (only ever earlier than planned).
pub(crate) async fn arm(store: &Store, key_id: &str, shards: u32, within: Duration) -> Result<()> {
    index::arm(store, key_id, home_shard(key_id, shards), within, Arming::Look).await?;
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
    let grace = millis(store.config.grace()) as i64;
    for _ in 0..LATE_STEPS {
        let due = index::arm(store, key_id, home, store.config.grace(), Arming::Step).await?;
        // Half a grace of margin: the step runs on the request's own master, whose clock may
        // differ a little from the home shard's.
        let deadline = due.map_or(0, |due| due - grace / 2);
        match step(deadline).await {
            Err(e) if ran_past_deadline(&e) => continue,
            other => return other,
        }
    }
    Err(Error::Protocol(format!(
        "a step on request \"{key_id}\" ran past its deadline {LATE_STEPS} times in a row: Redis is overloaded, or \
         the clock of the request's master is ahead of its home shard's by more than half a grace ({} ms)",
        grace / 2
    )))
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
/// 4. with downstreams, their release (`dag::release`), which `finish_index` put in the home
///    shard's outbox in the same step as the event, so that recovery runs it if this does not.
///
/// Returns the lifecycle a requeue marked (`reopen`) when the request stays indexed for it.
pub(crate) async fn finish(
    store: &Store,
    key_id: &str,
    place: Placement,
    finished: Finished,
) -> Result<Option<i64>> {
    finish_at(store, key_id, place, finished, 0).await
}

/// [`finish()`] as the `depth`-th finish of a cascade (a downstream failed by its upstream's
/// release is the first): past [`dag::INLINE_DEPTH`] its own release is left to recovery.
fn finish_at<'a>(
    store: &'a Store,
    key_id: &'a str,
    place: Placement,
    finished: Finished,
    depth: usize,
) -> futures::future::BoxFuture<'a, Result<Option<i64>>> {
    Box::pin(async move {
        let Finished { state, lifecycle, sweep, .. } = finished;
        let home = home_shard(key_id, place.shards);
        let mut groups = by_shard(key_id, &place, sweep);
        let home_sweep = groups.remove(&home).unwrap_or_default();
        let sweeps = groups.into_iter().filter(|(_, e)| !e.is_empty()).map(|(shard, elements)| {
            let list = place.list(store, shard);
            async move { finish::sweep(store, shard, &list, elements).await }
        });
        futures::future::try_join_all(sweeps).await?;
        let home_list = place.list(store, home);
        let indexed =
            finish::finish_index(store, key_id, home, &home_list, &state, lifecycle, home_sweep).await?;
        if indexed == Indexed::ReleaseOwed {
            // Its downstreams first (their wait is the latency users see); the seal and unindex
            // after, as ever (the request stays in `active` meanwhile).
            let ended = dag::Ended { lifecycle, state: state.clone() };
            dag::release_owed(store, home, key_id, Some(ended), None, depth).await;
        }
        seal_and_unindex(store, key_id, home, lifecycle, &state).await
    })
}

/// Steps 2 and 3 of [`finish()`]; alone, for a request whose event is already recorded. Returns the
/// lifecycle a requeue marked (`reopen`) when the request stays indexed for it.
pub(crate) async fn seal_and_unindex(
    store: &Store,
    key_id: &str,
    home: u32,
    lifecycle: i64,
    state: &str,
) -> Result<Option<i64>> {
    if finish::seal(store, key_id, lifecycle).await? {
        return Ok(match finish::unindex(store, key_id, home, lifecycle, state).await? {
            Unindexed::StaysFor(next) => Some(next),
            Unindexed::Done => None,
        });
    }
    Ok(None)
}

/// One `requeue_dead` call, armed (see [`armed`]). `reopen_as` is the lifecycle
/// a failed request reopens as ("" until `reopen` marked one); `resume` is recovery's completion
/// of a requeue whose caller died after that mark.
pub(crate) async fn requeue_dead(
    store: &Store,
    key_id: &str,
    shards: u32,
    reopen_as: &str,
    resume: bool,
) -> Result<Requeued> {
    armed(store, key_id, shards, |deadline| {
        operators::requeue_dead(store, key_id, reopen_as, deadline, resume)
    })
    .await
}

/// Hands the dead letters of request `key_id` (of its own stream, placed at `place`) out again;
/// a failed one reopens (also a downstream its upstream had failed, once its gate is open again).
/// A failed request is reopened only after its own lifecycle is announced and sealed, and after
/// `reopen` indexed it again and marked the new lifecycle (so that no late unindex of the failed
/// one removes it): `requeue_dead` says which step is missing, in that order. Recovery looks after
/// each call, in case this process dies between waking tokens and pushing them (a request not
/// indexed, a failed one, is indexed again by `reopen` with its own look). Returns how many dead
/// letters were requeued.
pub(crate) async fn requeue(store: &Store, key_id: &str, place: Placement) -> Result<u64> {
    let grace = store.config.grace();
    let mut reopen_as = String::new();
    for _ in 0..4 {
        match requeue_dead(store, key_id, place.shards, &reopen_as, false).await? {
            Requeued::FinishFirst(lifecycle) => {
                // A failure whose steps after the finish are not done (its worker died, and
                // recovery has not come by yet): announce it first, so that its lifecycle keeps
                // its one event.
                let finished =
                    Finished { state: "failed".into(), lifecycle, sweep: Vec::new(), shards: None };
                finish(store, key_id, place.clone(), finished).await?;
            }
            Requeued::ReopenFirst(lifecycle) => {
                reopen(store, key_id, place.shards, lifecycle).await?;
                reopen_as = lifecycle.to_string();
            }
            Requeued::Done { n, elements } => {
                if !elements.is_empty() {
                    push(store, key_id, place, Look::More, grace, elements).await?;
                }
                return Ok(n.max(0) as u64);
            }
        }
    }
    Err(Error::Protocol(format!("request \"{key_id}\" kept changing while it was being requeued; try again")))
}

/// Before requeue reopens a failed request as `lifecycle`: indexes it again and marks the new
/// lifecycle on the home shard, so that a late `unindex` of the failed one leaves it indexed.
pub(crate) async fn reopen(store: &Store, key_id: &str, shards: u32, lifecycle: i64) -> Result<()> {
    index::reopen(store, key_id, home_shard(key_id, shards), store.config.grace(), lifecycle).await?;
    Ok(())
}

/// The shard a lane request `key_id` submitted here would call home (its record is there): with
/// this component's token shards. Producers of a namespace use the same setting; lookups by id
/// that may come from another setting use [`lane_home_found`].
pub(crate) fn lane_home(store: &Store, key_id: &str) -> u32 {
    home_shard(key_id, store.keys.shards())
}

/// The shard holding lane request `key_id`'s record, for an operator looking it up by id: this
/// component's home for it ([`lane_home`]) when its record is there; otherwise the home another
/// shard count (1 to 1,024) gives it, where its record is, since an operator's `token_shards` may
/// differ from the producer's (while a change rolls out, or when the operator's tool was not told).
/// This component's home when no record is found (unknown, or expired). Costs one `EXISTS`, and
/// one pipeline of them when the record is elsewhere.
pub(crate) async fn lane_home_found(store: &Store, key_id: &str) -> Result<u32> {
    let own = lane_home(store, key_id);
    let here: u32 = store.client.exists(store.keys.record(own, key_id)).await?;
    if here == 1 {
        return Ok(own);
    }
    let candidates: std::collections::BTreeSet<u32> =
        (1..=crate::config::MAX_TOKEN_SHARDS).map(|s| home_shard(key_id, s)).filter(|h| *h != own).collect();
    let pipe = store.client.pipeline();
    for shard in &candidates {
        pipe.exists::<(), _>(store.keys.record(*shard, key_id)).await?;
    }
    let found: Vec<u32> = pipe.all().await?;
    Ok(candidates.into_iter().zip(found).find(|(_, n)| *n == 1).map_or(own, |(shard, _)| shard))
}

/// A request's priority and token shards, from its meta hash; `None` if it is unknown.
pub(crate) async fn placement(store: &Store, meta: &str) -> Result<Option<Placement>> {
    let (prio, shards, group): (Option<u8>, Option<u32>, Option<String>) = store
        .call("hmget", meta, || async { Ok(store.client.hmget(meta, vec!["prio", "shards", "grp"]).await?) })
        .await?;
    Ok(prio.map(|p| Placement {
        priority: Priority::new(p).unwrap_or_default(),
        shards: shards.unwrap_or(1).max(1),
        group,
    }))
}

/// Cancels a request and runs the steps after its finish (`Admin::cancel`,
/// `RequestHandle::cancel`).
pub(crate) async fn cancel(store: &Store, id: &RequestId) -> Result<Cancelled> {
    let key_id = id.key_id();
    let keys = store.keys.request(&key_id);
    let placement = placement(store, &keys.meta).await?;
    match operators::cancel(store, &key_id).await? {
        Cancel::Unknown => {
            let home = lane_home_found(store, &key_id).await?;
            match lane::cancel(store, home, &key_id).await? {
                LaneCancelled::Now { release_owed } => {
                    if release_owed {
                        dag::release_owed(store, home, &key_id, None, None, 0).await;
                    }
                    Ok(Cancelled::Now)
                }
                LaneCancelled::Already(state) => Ok(Cancelled::AlreadyFinished(state.parse()?)),
                LaneCancelled::Unknown => Err(Error::UnknownRequest(id.clone())),
            }
        }
        Cancel::Already(state) => Ok(Cancelled::AlreadyFinished(state.parse()?)),
        Cancel::Finished(finished) => {
            let place = placement.unwrap_or(Placement::new(Priority::default(), 1));
            finish(store, &key_id, place, finished).await?;
            Ok(Cancelled::Now)
        }
    }
}

/// Closes a streamed request (`nonce` empty: an operator's finalize).
pub(crate) async fn finalize(store: &Store, key_id: &str, nonce: &str) -> Result<()> {
    if let Finalized::Finished(finished) = submit::stream_finalize(store, key_id, nonce).await? {
        let meta = store.keys.request(key_id).meta;
        let place = placement(store, &meta).await?.unwrap_or(Placement::new(Priority::default(), 1));
        finish(store, key_id, place, finished).await?;
    }
    Ok(())
}
