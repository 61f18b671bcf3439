//! One slot: take a token, run sub-requests of its request for one quantum, give the token back.
//!
//! Round trips per sub-request in steady state: one (the ack, which also hands out the next
//! sub-request). Per token take: a `take` and an `acquire`; the token goes back when the quantum
//! ends, inside the slot's next `take` on the same shard (else with a `give_back` of its own). An
//! idle slot blocks on its shard's bell (BRPOP of one key) and then takes.
//!
//! What a slot took is recorded on the token side (`held`) in the same step as the take, and the
//! record ends only when the token is given back (or the slot's next take on that shard): if the
//! worker dies, recovery finds the record and reclaims the token. A slot whose own call failed
//! halfway (a lost reply, a dropped connection) reclaims its token itself in the same way.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{self, Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::*;
use rand::Rng;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::bound::{Bound, Counted};
use super::handler::{Context, Handler};
use super::higher::Higher;
use super::leases::{LeaseKey, Leases};
use super::{Quantum, WorkerMetrics};
use crate::codec;
use crate::error::{retry_transient, Error, Result};
use crate::keys::RequestKeys;
use crate::otel;
use crate::protocol::recovery::{self as calls, Reclaimed};
use crate::protocol::tokens::{self, Entry, Holding, Next, Policy, Report, Then};
use crate::protocol::TokenElement;
use crate::request::PartError;
use crate::request::Priority;
use crate::request::RequestId;
use crate::shards::Placement;
use crate::stats::{Counter, Recorder, Timing};
use crate::store::Store;

/// How long an aborted handler (attempt timeout, end of the shutdown grace) may take to stop before
/// the slot warns that it ignores its cancellation (it blocks or spins).
const ZOMBIE_WAIT: Duration = Duration::from_millis(100);

/// A parked token to wake when a retry falls due: recovery looks at its request then.
#[derive(Debug)]
pub(crate) struct Wake {
    pub(crate) key_id: String,
    pub(crate) shards: u32,
    pub(crate) at: tokio::time::Instant,
}

/// What all slots of a worker share.
pub(crate) struct Shared<H> {
    pub(crate) store: Store,
    pub(crate) handler: Arc<H>,
    /// This worker's id: its registration, its stream consumer name, and the prefix of its slots'
    /// holder names. A worker that learns it was declared dead takes a new one (`Shared::renew_id`).
    pub(crate) worker_id: Mutex<String>,
    pub(crate) quantum: Quantum,
    pub(crate) max_batch: u32,
    pub(crate) idle_poll: Duration,
    /// With more than one token shard: how long a slot waits on one shard's bell before it moves
    /// on to the next.
    pub(crate) shard_poll: Duration,
    pub(crate) shutdown_grace: Duration,
    pub(crate) leases: Leases,
    pub(crate) metrics: Arc<WorkerMetrics>,
    /// The worker's counts for the stats by stage, flushed by `Worker::run_until`.
    pub(crate) stats: Arc<Recorder>,
    /// Set when the worker stops: slots finish what runs and take no new token.
    pub(crate) stopping: CancellationToken,
    /// Where wake-ups for parked tokens go (the worker's liveness thread); none under the checker.
    pub(crate) wakes: Option<tokio::sync::mpsc::UnboundedSender<Wake>>,
    /// Higher priorities announced waiting, for busy slots to give way to (`higher`).
    pub(crate) higher: Arc<Higher>,
    /// Whether one of the worker's unreserved slots is its standby (`Slot::standby`).
    pub(crate) standby: AtomicBool,
    /// With an urgent slot (`WorkerBuilder::urgent`): the holds of every slot, against the
    /// worker's `slots` (`bound`). None under the checker and without one.
    pub(crate) bound: Option<Arc<Bound>>,
    /// The releases of lane requests' downstreams running in tasks of their own (`release`).
    pub(crate) releasing: Releasing,
}

/// The releases a worker's slots owe for the lane requests they finished, run in tasks of their
/// own, at most [`Releasing::AT_ONCE`] at a time (beyond that, the slot runs one itself).
#[derive(Clone, Debug)]
pub(crate) struct Releasing {
    running: Arc<tokio::sync::Semaphore>,
    /// Cancelled when the worker's future is dropped without a stop (`Worker::run_until`): its
    /// release tasks end with it, as they would with its process, and leave their releases in the
    /// outbox.
    pub(crate) gone: CancellationToken,
}

impl Default for Releasing {
    fn default() -> Self {
        Self {
            running: Arc::new(tokio::sync::Semaphore::new(Self::AT_ONCE as usize)),
            gone: CancellationToken::new(),
        }
    }
}

impl Releasing {
    const AT_ONCE: u32 = 64;

    /// Waits for the releases running to end (at a worker's stop).
    pub(crate) async fn drained(&self) {
        let _ = self.running.acquire_many(Self::AT_ONCE).await;
    }
}

impl<H> Shared<H> {
    /// The worker's current id.
    pub(crate) fn id(&self) -> String {
        self.worker_id.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes a new id: the worker was declared dead (cut off from Redis longer than the lease), its
    /// tokens reclaimed; it goes on as a new worker.
    pub(crate) fn renew_id(&self) -> String {
        let id = new_worker_id();
        *self.worker_id.lock().unwrap_or_else(|p| p.into_inner()) = id.clone();
        id
    }
}

/// A new worker id: `w-` and a random UUID.
pub(crate) fn new_worker_id() -> String {
    format!("w-{}", uuid::Uuid::new_v4().simple())
}

/// One slot's own state across its takes.
pub(crate) struct Slot {
    pub(crate) n: usize,
    /// The id of the next take (unique within the slot's worker), and per shard the id of the last
    /// take whose record may still be there.
    next_take: u64,
    last_take: Vec<Option<u64>>,
    /// A take sent whose reply has not come (the call failed): repeated with its id, or undone
    /// at a clean stop.
    pending: Option<u32>,
    /// That take offered a hand-off (under the id after its own): undone at a clean stop too.
    pending_offered: bool,
    /// The token the slot's last hold ended with ack's `requeue`, not given back yet: it goes back
    /// in the same call as the slot's next take on its shard (`take`'s give-back), or on its own
    /// before the slot takes on another shard or stops. Kept until a call that does it lands.
    owed: Option<tokens::GiveBack>,
    /// The last hold ended by giving way to a higher priority on its shard: the slot takes next
    /// there, not on the next shard in turn.
    stay: bool,
    /// The handler time the slot last saw under a lane's token (`Batching::mean_us`), which sizes
    /// the first batch of its next lane hold (`Turn::new`).
    lane_mean_us: Option<f64>,
    /// The same for a hold of a request of its own keys: it sizes the first batch of the slot's
    /// next such hold, within the request's share (`acquire`) and `GUESS_BUDGET`.
    own_mean_us: Option<f64>,
    /// A reserved slot's floor (`WorkerBuilder::reserve`): it takes no lower priority, and waits
    /// for work on the announcements at or above it (`heard`) rather than on the bell.
    pub(crate) floor: Option<Priority>,
    heard: Option<tokio::sync::watch::Receiver<Option<(u32, Priority)>>>,
    /// The shard a reserved slot heard of work on: it takes there next.
    go: Option<u32>,
    /// The shard on which the slot's last take found nothing and offered it a hand-off
    /// (lua/prelude.lua, "Hand-offs") under the id of its next take: a reserved slot waits on its
    /// hand list there. The slot's next take on that shard ends the offer (or gets the token
    /// handed meanwhile, as a re-sent take).
    offered: Option<u32>,
    /// This unreserved slot is its worker's standby (one at a time, `Shared::standby`): with one
    /// token shard, when its take finds nothing it offers to be handed the next token of any
    /// priority, and waits on its hand list and the bell at once. So a small request submitted to
    /// an idle worker starts in the submit's own step, and another request's token comes by its
    /// push, without a take after the bell. The slot stays the standby until it gets a token.
    standby: bool,
    /// The holder name (`<worker id>/<slot>`) the slot's takes, records, offer and owed token
    /// were made under. A worker declared dead goes on under a new id; the slot's next take then
    /// ends what the old name left, as a clean stop would (`release_all`).
    holder: Option<String>,
}

impl Slot {
    pub(crate) fn new(n: usize, shards: u32) -> Slot {
        Slot {
            n,
            next_take: 0,
            last_take: vec![None; shards as usize],
            pending: None,
            pending_offered: false,
            owed: None,
            stay: false,
            lane_mean_us: None,
            own_mean_us: None,
            floor: None,
            heard: None,
            go: None,
            offered: None,
            standby: false,
            holder: None,
        }
    }

    /// Whether this slot is, or now becomes, its worker's standby (`standby`): only an unreserved
    /// slot, one at a time, and not once the worker stops. (A slot the checker gives a floor for
    /// a take leaves the role.)
    fn claim_standby<H>(&mut self, shared: &Shared<H>) -> bool {
        if self.floor.is_some() || shared.stopping.is_cancelled() {
            self.leave_standby(shared);
        } else if !self.standby {
            self.standby =
                shared.standby.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok();
        }
        self.standby
    }

    /// The slot got a token: another idle slot may be the standby now.
    fn leave_standby<H>(&mut self, shared: &Shared<H>) {
        if std::mem::take(&mut self.standby) {
            shared.standby.store(false, Ordering::Release);
        }
    }

    /// A slot kept for priorities `floor` and higher, woken by what `higher` hears.
    pub(crate) fn reserved(n: usize, shards: u32, floor: Priority, higher: &Higher) -> Slot {
        Slot { floor: Some(floor), heard: Some(higher.hear()), ..Slot::new(n, shards) }
    }
}

/// A token this slot holds.
struct Token {
    /// The element it was taken as: request key id, token number, epoch.
    element: TokenElement,
    request_id: RequestId,
    keys: RequestKeys,
    priority: Priority,
    /// The shard and list it was taken from: where it goes back.
    shard: u32,
    list: String,
    /// The take that recorded it.
    take: u64,
    /// A lane's token comes acquired: the first answer of its hold.
    acquired: Option<Next>,
    /// Taken for one part only (a rate-limited tenant group's: `take`'s 'one').
    one_part: bool,
}

impl Policy {
    /// Whether a failure of `attempt` dead-letters the part (permanent, or its last attempt),
    /// rather than scheduling a retry.
    fn is_last(&self, attempt: u32, permanent: bool) -> bool {
        permanent || attempt >= self.max_attempts
    }

    /// Exponential backoff with "equal jitter": half fixed, half random, capped. `deterministic`
    /// (the checker) takes the middle of the range instead of a random point.
    fn backoff(&self, attempt: u32, deterministic: bool) -> Duration {
        let exp = self.backoff_base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let delay = exp.min(self.backoff_max);
        let half = delay / 2;
        let jitter = if deterministic { 0.5 } else { rand::thread_rng().gen::<f64>() };
        half + half.mul_f64(jitter)
    }
}

/// How one run of the handler ended.
enum Outcome {
    Done(Bytes),
    Failed {
        message: String,
        permanent: bool,
    },
    /// Not run (shutdown, or a first batch past its budget: `GUESS_BUDGET`), abandoned when
    /// shutdown's grace ran out, or failed after its hold ended: handed out again first, no
    /// attempt spent.
    Skipped,
}

pub(crate) async fn run<H: Handler>(shared: Arc<Shared<H>>, mut slot: Slot, blocking: Client) {
    let mut backoff = Duration::from_millis(50);
    // Slots serve the shards in turn, one take each, starting at different shards.
    let shards = shared.store.keys.shards();
    let mut shard = (slot.n as u32) % shards;
    while !shared.stopping.is_cancelled() {
        match take_and_serve(&shared, &mut slot, &blocking, shard).await {
            Ok(()) => {
                backoff = Duration::from_millis(50);
                if let Some(heard) = slot.go.take() {
                    shard = heard % shards;
                } else if !std::mem::take(&mut slot.stay) {
                    shard = (shard + 1) % shards;
                }
            }
            // A call refused because the shard's slot is moving (a redirection, which our clients
            // hand back with the slot map refreshed): the new owner is known, go now.
            Err(e) if e.is_not_executed() => {
                tracing::debug!(slot = slot.n, error = %e, "token lists moving; taking again");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // The same shard again: a take whose reply was lost is repeated with its id, and gets
            // the element it took.
            Err(e) => {
                tracing::warn!(slot = slot.n, error = %e, "slot error; retrying after {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
    release_all(&shared, &mut slot).await;
    let _ = blocking.quit().await;
}

/// At a clean stop: ends the slot's records of tokens it no longer holds, and undoes a take whose
/// reply it never saw, under the holder name they were made under (the worker's id may have
/// changed since: it had been declared dead). Also what the slot's first take under a new id does
/// with what the old one left.
pub(crate) async fn release_all<H: Handler>(shared: &Shared<H>, slot: &mut Slot) {
    let holder = slot.holder.clone().unwrap_or_else(|| format!("{}/{}", shared.id(), slot.n));
    if let Some(shard) = slot.pending.take() {
        match tokens::untake(&shared.store, shard, &holder, slot.next_take).await {
            Ok(took) => {
                if took {
                    reclaim_untaken(shared, shard, &holder, slot.next_take).await;
                }
                slot.next_take += 1;
                // A take that happened gave back what it carried, in the same step.
                if took && slot.owed.as_ref().is_some_and(|gb| gb.shard == shard) {
                    slot.owed = None;
                }
                // A take that offered, and happened finding nothing, may have been handed a token
                // since, under the id after its own (the slot's next now): undone below as the
                // offer's.
                if std::mem::take(&mut slot.pending_offered) && !took {
                    slot.offered = Some(shard);
                }
            }
            Err(e) => tracing::debug!(error = %e, "could not undo a take; recovery will reclaim it"),
        }
    }
    if let Err(e) = end_offer(shared, slot, &holder).await {
        tracing::debug!(error = %e, "could not end a hand-off's offer; it lapses");
    }
    // (Pushed again if a take that carried it ran and found nothing: an extra copy is refused
    // when taken.)
    // The record of a token that could not be given back stays, for recovery to reclaim it by.
    let unsettled = match settle_owed(shared, slot, &holder).await {
        Ok(()) => None,
        Err(e) => {
            tracing::debug!(error = %e, "could not give a token back; recovery will reclaim it");
            slot.owed.as_ref().map(|gb| gb.shard)
        }
    };
    for (shard, last) in slot.last_take.iter_mut().enumerate() {
        if let Some(id) = last.take() {
            if unsettled == Some(shard as u32) {
                continue;
            }
            if let Err(e) = tokens::release(&shared.store, shard as u32, &holder, &id.to_string()).await {
                tracing::debug!(error = %e, "could not end a take record; recovery will");
            }
        }
    }
}

/// Ends the slot's offer of a hand-off, if it made one: a token handed meanwhile and not read is
/// undone as the take it stands for (pushed back onto its list, its record ended).
async fn end_offer<H: Handler>(shared: &Shared<H>, slot: &mut Slot, holder: &str) -> Result<()> {
    if let Some(shard) = slot.offered {
        let took = tokens::untake(&shared.store, shard, holder, slot.next_take).await?;
        if took {
            reclaim_untaken(shared, shard, holder, slot.next_take).await;
        }
        slot.next_take += u64::from(took);
        slot.offered = None;
    }
    Ok(())
}

/// A take (or a hand-off) that `untake` undid: a lane's token it carried is reclaimed at once
/// (`recovery::reclaim_untaken`). Should that fail, recovery's backstop still finds the record.
async fn reclaim_untaken<H: Handler>(shared: &Shared<H>, shard: u32, holder: &str, take: u64) {
    if let Err(e) =
        super::recovery::reclaim_untaken(&shared.store, &shared.metrics, shard, holder, take).await
    {
        tracing::warn!(error = %e, "could not reclaim a lane token a take undone carried; recovery will");
    }
}

/// Before an unreserved slot waits for room in the worker's bound (`bound`): the token it owes
/// goes back on its own, and its offer of a hand-off ends, so that nothing waits for it meanwhile.
async fn make_room<H: Handler>(shared: &Shared<H>, slot: &mut Slot, holder: &str) -> Result<()> {
    settle_owed(shared, slot, holder).await?;
    end_offer(shared, slot, holder).await
}

/// An unreserved slot's hold, claimed before it takes (`bound`): while the worker's holds fill its
/// slots, the slot makes room and waits for one to end. `None`: the worker stops meanwhile.
async fn claim<H: Handler>(
    shared: &Shared<H>,
    bound: &Arc<Bound>,
    slot: &mut Slot,
    holder: &str,
) -> Result<Option<Counted>> {
    loop {
        if let Some(counted) = bound.claim() {
            return Ok(Some(counted));
        }
        // A take whose reply was lost goes ahead: re-sent, it gets what it took, which would
        // otherwise wait in its record for as long as this slot waits.
        if slot.pending.is_some() {
            return Ok(Some(bound.hold()));
        }
        make_room(shared, slot, holder).await?;
        bound.room(&shared.stopping).await;
        if shared.stopping.is_cancelled() {
            return Ok(None);
        }
    }
}

/// One token take on one shard: take (after waiting on the bell if nothing is waiting), acquire,
/// then serve the request until the quantum ends.
pub(crate) async fn take_and_serve<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    blocking: &Client,
    shard: u32,
) -> Result<()> {
    let holder = format!("{}/{}", shared.id(), slot.n);
    // The worker went on under a new id (it had been declared dead, and its registration was
    // claimed for reaping): what the slot left under its old holder name, which no take uses
    // again, ends as at a clean stop, which is what the slot's next take under that name would
    // have done (its hold ended before this take). Else the records stay until recovery's backstop
    // finds their worker gone, and none at all runs if the fleet stops first.
    if slot.holder.as_deref() != Some(holder.as_str()) {
        if slot.holder.is_some() {
            release_all(shared, slot).await;
        }
        slot.holder = Some(holder.clone());
    }
    // An unreserved slot claims its hold before it takes, or, while the worker's holds fill its
    // slots (its urgent slot runs one), makes room and waits (`bound`). A take whose reply was
    // lost goes ahead: re-sent, it gets what it took. (The checker draws takes in that state,
    // `Op::Take::room`, without the wait.)
    let mut counted = None;
    if slot.floor.is_none() {
        if shared.store.checker_makes_room() {
            make_room(shared, slot, &holder).await?;
        }
        if let Some(bound) = &shared.bound {
            counted = match claim(shared, bound, slot, &holder).await? {
                Some(counted) => Some(counted),
                None => return Ok(()),
            };
        }
    }
    // A token owed to another shard goes back first, on its own: the record ended below would
    // otherwise end without its push.
    if slot.owed.as_ref().is_some_and(|gb| gb.shard != shard) {
        settle_owed(shared, slot, &holder).await?;
    }
    // A record left on another shard (this slot's previous take there) ends before the slot moves
    // on: on its own shard the next take would end it.
    for s in 0..slot.last_take.len() as u32 {
        if s != shard {
            if let Some(id) = slot.last_take[s as usize] {
                tokens::release(&shared.store, s, &holder, &id.to_string()).await?;
                slot.last_take[s as usize] = None;
            }
        }
    }
    // (Under the checker, whose time is its own, a slot that offered to be handed a token looks at
    // its hand list when it next acts; a slot that waits for real popped it already. Every other
    // time, by the offered id's parity, it does not look, and its take under that id gets what was
    // handed as a re-sent take does: the checker searches both ways.)
    if slot.offered == Some(shard) && shared.store.deterministic() && slot.next_take % 2 == 0 {
        if let Some(token) = handed(shared, slot, blocking, &holder, shard, None).await? {
            shared.higher.answered(shard, token.priority);
            return serve(shared, slot, &holder, token, counted).await;
        }
    }
    // A reserved slot has heard everything announced so far: what comes during its take wakes it.
    if let Some(heard) = slot.heard.as_mut() {
        heard.borrow_and_update();
    }
    let token = match take(shared, slot, &holder, shard, false).await? {
        Took::Token(token) => *token,
        Took::Paused => return paused(shared).await,
        Took::Nothing(refill) if slot.floor.is_some() => {
            match reserved_wait(shared, slot, blocking, &holder, shard, refill).await? {
                Some(token) => token,
                None => return Ok(()),
            }
        }
        Took::Nothing(refill) => 'idle: {
            // No hold claimed while the slot waits: a token handed to it meanwhile is counted
            // as it comes, and after the bell the slot claims again.
            drop(counted.take());
            let store = &shared.store;
            let wait = if store.keys.shards() == 1 { shared.idle_poll } else { shared.shard_poll };
            // A group's rate limit refills sooner: the take after it queues the group's token.
            let wait = refill.map_or(wait, |r| r.min(wait)).max(Duration::from_millis(1));
            // The bell is never abandoned mid-flight: it runs to its server-side timeout, or until
            // the worker's stop unblocks it (`unblock_idle`). A lost bell only delays a take.
            let bell = store.keys.bell(shard);
            // (Under the checker, whose time is its own, the wait is a plain RPOP.)
            let deterministic = store.deterministic();
            let woken = if slot.offered == Some(shard) && !deterministic {
                // The standby, offered a hand-off, waits on its hand list and the bell at once.
                let hand = store.keys.hand(shard, &holder);
                match tokens::hand_or_bell(store, blocking, &hand, &bell, wait).await? {
                    tokens::Woken::Handed(took) => match handed_token(shared, slot, shard, took) {
                        Some(token) => break 'idle token,
                        None => return Ok(()),
                    },
                    tokens::Woken::Bell => true,
                    tokens::Woken::Timeout => false,
                }
            } else {
                store
                    .call("brpop", &bell, || async {
                        if deterministic {
                            let rang: Option<String> = store.client.rpop(bell.as_str(), None).await?;
                            return Ok(rang.is_some());
                        }
                        let rang: Option<(String, String)> =
                            match blocking.brpop(bell.as_str(), wait.as_secs_f64()).await {
                                Ok(v) => v,
                                Err(e) if *e.kind() == fred::error::ErrorKind::Timeout => None,
                                Err(e) => return Err(e.into()),
                            };
                        Ok(rang.is_some())
                    })
                    .await?
            };
            if let Some(bound) = &shared.bound {
                match bound.claim() {
                    Some(claimed) => counted = Some(claimed),
                    // The holds filled the slots meanwhile: the next take makes room and waits.
                    None => return Ok(()),
                }
            }
            match take(shared, slot, &holder, shard, woken).await? {
                Took::Token(token) => *token,
                Took::Paused => return paused(shared).await,
                Took::Nothing(_) => return Ok(()),
            }
        }
    };
    shared.higher.answered(shard, token.priority);
    let span = tracing::info_span!("token", request_id = %token.request_id, token = %token.element.k, priority = token.priority.get());
    serve(shared, slot, &holder, token, counted).instrument(span).await
}

/// A reserved slot that found nothing at or above its floor waits for a token handed to it (its
/// take offered it a hand-off: `Slot::offered`), an announcement it covers, an idle poll (a shard
/// poll with several shards; sooner when a group's rate limit refills), or the stop. A handed token
/// is returned, to be served; otherwise the slot takes again: on the shard it heard of
/// (`Slot::go`), else on the next one. Not on the bell: every push of any priority rings it, and
/// a reserved slot woken by a flood it does not take would spin. An announcement the subscription
/// lost waits for the poll.
async fn reserved_wait<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    blocking: &Client,
    holder: &str,
    shard: u32,
    refill: Option<Duration>,
) -> Result<Option<Token>> {
    // (Under the checker, whose time is its own, a take finding nothing ends the op.)
    if shared.store.deterministic() {
        return Ok(None);
    }
    let wait = if shared.store.keys.shards() == 1 { shared.idle_poll } else { shared.shard_poll };
    let wait = refill.map_or(wait, |r| r.min(wait)).max(Duration::from_millis(1));
    let _idle = shared.higher.idle_reserved();
    if slot.offered != Some(shard) {
        let Some(heard) = slot.heard.as_mut() else { return Ok(None) };
        tokio::select! {
            _ = shared.stopping.cancelled() => {}
            changed = tokio::time::timeout(wait, heard.changed()) => {
                if let Ok(Ok(())) = changed {
                    slot.go = heard.borrow_and_update().map(|(shard, _)| shard);
                }
            }
        }
        return Ok(None);
    }
    // An announcement heard during the take, or the stop, ends the wait before it starts.
    let heard_now = slot.heard.as_ref().is_some_and(|h| h.has_changed().unwrap_or(false));
    if heard_now || shared.stopping.is_cancelled() {
        slot.go = slot.heard.as_mut().and_then(|h| *h.borrow_and_update()).map(|(shard, _)| shard);
        return Ok(None);
    }
    // The pop is never abandoned mid-flight (a message it then popped would be read by no one):
    // an announcement or the stop unblocks it (`CLIENT UNBLOCK`, from another connection), and
    // it ends. An unblock that comes before the pop is blocked in Redis finds nothing to unblock,
    // so it is sent again every few ms until the pop returns.
    let hand = shared.store.keys.hand(shard, holder);
    let pop = tokens::hand(&shared.store, blocking, &hand, Some(wait));
    tokio::pin!(pop);
    let mut unblocking = false;
    let popped = loop {
        let heard = slot.heard.as_mut();
        tokio::select! {
            biased;
            popped = &mut pop => break popped,
            _ = shared.stopping.cancelled(), if !unblocking => {}
            Ok(()) = async { match heard { Some(h) => h.changed().await, None => std::future::pending().await } }, if !unblocking => {
                slot.go = slot.heard.as_mut().and_then(|h| *h.borrow_and_update()).map(|(shard, _)| shard);
            }
            _ = tokio::time::sleep(Duration::from_millis(5)), if unblocking => {}
        }
        unblocking = true;
        let _ = blocking.unblock_self(Some(fred::types::ClientUnblockFlag::Timeout)).await;
    };
    match popped? {
        Some(took) => Ok(handed_token(shared, slot, shard, took)),
        None => Ok(None),
    }
}

/// The token handed to this slot, if its hand list holds it (`wait`: how long to block for it;
/// `None`: not at all).
async fn handed<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    blocking: &Client,
    holder: &str,
    shard: u32,
    wait: Option<Duration>,
) -> Result<Option<Token>> {
    let hand = shared.store.keys.hand(shard, holder);
    match tokens::hand(&shared.store, blocking, &hand, wait).await? {
        Some(took) => Ok(handed_token(shared, slot, shard, took)),
        None => Ok(None),
    }
}

/// A hand-off's take, as the slot's take under the id its offer named: its record on `shard`
/// carries that id.
fn handed_token<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    shard: u32,
    took: tokens::Take,
) -> Option<Token> {
    let tokens::Take::Took(tokens::Taken { list, element, acquired, one_part }) = took else { return None };
    let id = slot.next_take;
    slot.offered = None;
    slot.leave_standby(shared);
    shared.metrics.handed_off.fetch_add(1, Relaxed);
    slot.last_take[shard as usize] = Some(id);
    slot.next_take += 1;
    match parse_token(&shared.store, &list, &element, shard, id) {
        Some(token) => Some(Token { acquired, one_part, ..token }),
        None => {
            tracing::warn!(list, element, "dropping a malformed token element");
            None
        }
    }
}

/// While an operator has paused the namespace (`Admin::pause`), a slot asks again after an idle
/// poll, without touching the bell: the wake-ups stay for the elements waiting.
async fn paused<H: Handler>(shared: &Shared<H>) -> Result<()> {
    if !shared.store.deterministic() {
        tokio::select! {
            _ = shared.stopping.cancelled() => {}
            _ = tokio::time::sleep(shared.idle_poll) => {}
        }
    }
    Ok(())
}

/// What a slot's `take` came back with.
enum Took {
    Token(Box<Token>),
    /// Nothing to take; a group token waits for its rate limit, refilled in this long.
    Nothing(Option<Duration>),
    Paused,
}

/// `take` on one shard: pops the highest priority element and records it for this holder.
async fn take<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    holder: &str,
    shard: u32,
    woken: bool,
) -> Result<Took> {
    let store = &shared.store;
    let id = slot.next_take;
    let prev = slot.last_take[shard as usize];
    // On error the id is kept: the take is repeated as it was, and returns what it took.
    slot.pending = Some(shard);
    // Only a lane's token comes acquired, with a first batch of this size.
    let want = Turn::new(shared, false, slot.lane_mean_us).want();
    // A reserved slot offers to be handed the next token of its priorities, and the standby one of
    // any, under its next take's id, for as long as it waits and a second more (one shard: with
    // several, the slot moves on). (Under the checker, whose clock jumps by seconds between a
    // slot's steps, for a minute.)
    let lasts = if store.deterministic() {
        Duration::from_secs(60)
    } else {
        shared.idle_poll + Duration::from_secs(1)
    };
    // (A stopping worker's slots offer nothing: an offer made now would outlive the slot's wait.)
    let standby = store.keys.shards() == 1 && slot.claim_standby(shared);
    let offers =
        store.keys.shards() == 1 && !shared.stopping.is_cancelled() && (slot.floor.is_some() || standby);
    let offer = offers.then_some((id + 1, lasts));
    slot.pending_offered = offer.is_some();
    let owed = slot.owed.as_ref().filter(|gb| gb.shard == shard);
    let floor = slot.floor.unwrap_or(Priority::MIN);
    let taken =
        tokens::take(store, shard, holder, &shared.id(), id, prev, woken, want, floor, offer, owed).await?;
    if owed.is_some() {
        slot.owed = None;
    }
    slot.pending = None;
    slot.offered = None;
    slot.last_take[shard as usize] = Some(id);
    slot.next_take += 1;
    let tokens::Taken { list, element, acquired, one_part } = match taken {
        tokens::Take::Took(taken) => {
            slot.leave_standby(shared);
            taken
        }
        tokens::Take::Empty => {
            if offer.is_some() {
                slot.offered = Some(shard);
            }
            return Ok(Took::Nothing(None));
        }
        tokens::Take::Wait(refill) => return Ok(Took::Nothing(Some(refill))),
        tokens::Take::Paused => return Ok(Took::Paused),
    };
    match parse_token(store, &list, &element, shard, id) {
        Some(token) => Ok(Took::Token(Box::new(Token { acquired, one_part, ..token }))),
        None => {
            tracing::warn!(list, element, "dropping a malformed token element");
            Ok(Took::Nothing(None))
        }
    }
}

fn parse_token(store: &Store, list: &str, element: &str, shard: u32, take: u64) -> Option<Token> {
    let (_, priority) = store.keys.priority_of_list(list)?;
    let element = TokenElement::parse(element)?;
    Some(Token {
        request_id: RequestId::from_key_id(&element.key_id).ok()?,
        keys: store.keys.request(&element.key_id),
        element,
        priority,
        shard,
        list: list.to_owned(),
        take,
        acquired: None,
        one_part: false,
    })
}

/// How long a batch of fast handlers should take: entries handed out together wait for each other,
/// so batches only grow while handlers are quick.
const BATCH_TARGET: Duration = Duration::from_millis(2);

/// How long a hold's first batch, sized from an earlier hold's handler times (`Turn::new`), may run
/// before the rest of it is handed back unrun (`skip`): a request slower than the one that sized
/// it then runs its next batches at its own pace, so the quantum and a give-way to a higher
/// priority still come between parts.
const GUESS_BUDGET: Duration = Duration::from_millis(8);

/// How long a hold's first batch of more than one entry may run: `GUESS_BUDGET`, its size being a
/// guess. The checker's batches are not sized by timing (`Store::deterministic`), so its budget
/// never runs out, except that a take may draw one spent at once (`Op::Take::cut`): that batch
/// hands back what follows its first part, as one whose first part ran past the budget does.
fn first_budget<H: Handler>(shared: &Shared<H>) -> Option<Duration> {
    if shared.store.deterministic() {
        return shared.store.cuts_first_batch().then_some(Duration::ZERO);
    }
    Some(GUESS_BUDGET)
}

/// Picks how many entries to ask for next, from how long handlers have been taking.
struct Batching {
    max: u32,
    /// Exponentially weighted mean handler time (µs); None until one has run.
    mean_us: Option<f64>,
    /// Always ask for `max` (the checker: batch sizes must not depend on timing).
    fixed: bool,
}

impl Batching {
    fn observe(&mut self, took: Duration) {
        let us = took.as_secs_f64() * 1e6;
        self.mean_us = Some(self.mean_us.map_or(us, |m| 0.8 * m + 0.2 * us));
    }

    fn want(&self, quantum_left: u32) -> u32 {
        let fits = match (self.fixed, self.mean_us) {
            (true, _) => f64::from(self.max),
            (false, None) => 1.0,
            (false, Some(m)) => BATCH_TARGET.as_secs_f64() * 1e6 / m.max(1.0),
        };
        (fits as u32).clamp(1, self.max).min(quantum_left.max(1))
    }
}

/// The quantum of one hold of a token: how much has run under it, and how big the next batch is.
struct Turn {
    batching: Batching,
    started: Instant,
    ran: u32,
    /// Parts it may run: the quantum's, or one for a token taken for one part (`Token::one_part`),
    /// plus a quantum's for each time it ran on (`then`).
    parts: u32,
    /// A quantum's parts: `Quantum::parts`, or the checker's for a hold it draws wide
    /// (`Store::checker_batches`).
    quantum: u32,
    /// It ended by giving way to a higher priority waiting on its shard.
    gave_way: bool,
    /// The first batch was sized from an earlier hold's handler times (`mean_us`): how long it may
    /// run before it hands back what it has not run (`first_budget`).
    guessed: Option<Duration>,
    /// The hold is a reserved slot's (the urgent slot's among them): it never gives way to the
    /// bound on the worker's holds (`bound`).
    urgent: bool,
    /// The hold as the worker's bound counts it (`bound`), while the turn lasts.
    counted: Option<Counted>,
}

impl Turn {
    /// A hold's first batch is sized from the handler time of the slot's last hold of the same
    /// kind (`mean_us`: `Slot::lane_mean_us` or `Slot::own_mean_us`), or is one entry when the slot
    /// has none. Starting each hold from one entry made a hold of a 100-part request pay a
    /// one-part `ack` before its batches grew, and a lane's hold a third of its calls for single
    /// parts. A guess from another request could make a slow request run its parts one after
    /// another in one slot, below its limit, and hold its token past its quantum: `acquire` hands
    /// a hold at most its share of the request's parts left (`left / limit`, rounded up), so the
    /// request's other tokens find theirs, and the batch hands back what it has not run once it
    /// has taken `GUESS_BUDGET` (`guessed`).
    fn new<H: Handler>(shared: &Shared<H>, one_part: bool, mean_us: Option<f64>) -> Self {
        let fixed = shared.store.deterministic();
        let (max, quantum) =
            shared.store.checker_batches().unwrap_or((shared.max_batch, shared.quantum.parts));
        let batching = Batching { max, mean_us, fixed };
        let parts = if one_part { 1 } else { quantum };
        let mut turn = Self {
            batching,
            started: Instant::now(),
            ran: 0,
            parts,
            quantum,
            gave_way: false,
            guessed: None,
            urgent: false,
            counted: None,
        };
        turn.guessed = if turn.want() > 1 { first_budget(shared) } else { None };
        turn
    }

    /// The next batch's size: what runs in about `BATCH_TARGET`, within what is left of the quantum.
    fn want(&self) -> u32 {
        self.batching.want(self.parts.saturating_sub(self.ran))
    }

    /// After a batch: keep the token for another, or give it back (quantum used up, stopping).
    /// Also gives the token back when a higher priority than its own became waiting on its shard
    /// (the first slot of this worker to end a batch gives way, and takes next on that shard;
    /// `higher`).
    ///
    /// A quantum's parts used up before its time, with nothing paused on the shard and no token
    /// waiting there at any priority (its bell is empty), run on for another quantum of parts:
    /// giving the token back would only have it taken again, at the cost of a `take` and an
    /// `acquire`. A token that starts waiting later ends the run at the next quantum's end, a higher
    /// priority at the next batch's (`higher`). Not for a token taken for one part, nor for a
    /// tenant group's (its group's other requests wait in the group's queue, not on the shard's
    /// lists).
    async fn then<H: Handler>(&mut self, shared: &Shared<H>, token: &Token) -> Then {
        if self.ran >= self.parts
            && self.parts > 1
            && crate::keys::group_of_queue(&token.list).is_none()
            && self.started.elapsed() < shared.quantum.time
            && !shared.stopping.is_cancelled()
            && matches!(tokens::may_run_on(&shared.store, token.shard).await, Ok(true))
        {
            self.parts = self.parts.saturating_add(self.quantum);
        }
        let keep_going = self.ran < self.parts
            && self.started.elapsed() < shared.quantum.time
            && !shared.stopping.is_cancelled();
        if keep_going && shared.higher.claim_above(token.shard, token.priority) {
            self.gave_way = true;
            return Then::GiveBack;
        }
        // The urgent slot runs a hold over the worker's slots: this one makes room (`bound`).
        if keep_going && !self.urgent {
            let over = self.counted.as_mut().is_some_and(Counted::make_room);
            if over || shared.store.checker_makes_room() {
                return Then::GiveBack;
            }
        }
        if keep_going {
            Then::More(self.want())
        } else {
            Then::GiveBack
        }
    }
}

/// How a hold of a token ended.
enum Served {
    /// The library's last answer (anything but a batch to run), and the request's policy if
    /// `acquire` reported it.
    Answer(Next, Option<Policy>),
    /// An ack failed: whether it ran is unknown.
    AckLost(Error),
}

/// Holds a token taken from the lists: acquires it, runs batches under it until its quantum is
/// used up or the library says otherwise, then does what the last answer says.
async fn serve<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    holder: &str,
    mut token: Token,
    counted: Option<Counted>,
) -> Result<()> {
    let consumer = shared.id();
    let lane = crate::keys::lane_of(&token.element.key_id).is_some();
    let mut turn = Turn::new(shared, token.one_part, if lane { slot.lane_mean_us } else { slot.own_mean_us });
    turn.urgent = slot.floor.is_some();
    // Counted from the take (claimed before it by an unreserved slot) to the hold's last answer:
    // the urgent slot's hold, or a token handed to a waiting slot, may put the worker one over its
    // slots until another slot's batch ends (`Turn::then`).
    turn.counted = counted.or_else(|| shared.bound.as_ref().map(Bound::hold));
    let acquired = token.acquired.take();
    let holding = Holding { element: &token.element, holder, consumer: &consumer };
    let first = match acquired {
        Some(first) => first,
        None => match tokens::acquire(&shared.store, &holding, &token.list, turn.want()).await {
            Ok(next) => next,
            // Whether the acquire ran is unknown: recovery's own step settles it either way.
            Err(e) => return reclaim_own(shared, slot, holder, &token, e).await,
        },
    };
    // The quantum's time counts from the first batch, not from the acquire's round trip.
    turn.started = Instant::now();
    let served = run_batches(shared, slot, &holding, &token, first, &mut turn).await?;
    slot.stay = turn.gave_way;
    if lane {
        slot.lane_mean_us = turn.batching.mean_us;
    } else {
        slot.own_mean_us = turn.batching.mean_us;
    }
    match served {
        Served::Answer(last, policy) => settle(shared, slot, holder, &token, last, policy).await,
        Served::AckLost(e) => reclaim_own(shared, slot, holder, &token, e).await,
    }
}

/// Runs the batches `acquire` and then each `ack` hand out, while the slot keeps the token.
async fn run_batches<H: Handler>(
    shared: &Shared<H>,
    slot: &Slot,
    holding: &Holding<'_>,
    token: &Token,
    first: Next,
    turn: &mut Turn,
) -> Result<Served> {
    let lease = LeaseKey {
        meta_key: token.keys.meta.clone(),
        token: token.element.k.to_string(),
        epoch: token.element.epoch.to_string(),
        holder: holding.holder.to_owned(),
        record: None,
    };
    let mut policy = None;
    let mut next = first;
    // The trace contexts of the requests this hold runs parts of, read as they come (`otel`).
    let mut carried = otel::Carried::new();
    loop {
        let entries = match next {
            Next::Run(entries, p) => {
                policy = p.or(policy);
                entries
            }
            other => return Ok(Served::Answer(other, policy)),
        };
        let Some(policy) = policy else {
            return Err(Error::Protocol("acquire did not report the request's policy".into()));
        };
        carried.learn(&shared.store, &token.keys.meta, token.shard, &entries).await;
        // Not a child of `stopping`: a graceful stop lets the running handler finish.
        let cancel = CancellationToken::new();
        shared.leases.hold(slot.n, lease.clone(), cancel.clone());
        let mut outcomes = Vec::with_capacity(entries.len());
        // A first batch sized by a guess hands back what it has not run past its budget (its first
        // part always runs).
        let budget = turn.guessed.take().map(|b| Instant::now() + b);
        for entry in &entries {
            if let Some(waited) = entry.started_after {
                // This hand-out started the request: its queue wait, reported by the library.
                shared.metrics.queue_wait.observe(waited);
                shared.stats.count(token.priority, Counter::Started, 1);
                shared.stats.time(token.priority, Timing::Wait, waited);
            }
            // Once stopping (or once the grace ran out), or once a guessed first batch has run for
            // its budget, the rest of the batch is handed back; past the request's deadline, no
            // part starts.
            if shared.stopping.is_cancelled()
                || matches!(outcomes.last(), Some(Outcome::Skipped))
                || entry.policy(policy).deadline.is_some_and(|d| Instant::now() >= d)
                || (!outcomes.is_empty() && budget.is_some_and(|b| Instant::now() >= b))
            {
                outcomes.push(Outcome::Skipped);
                continue;
            }
            // A lane entry's hold also ends with its own request (cancelled, failed fast).
            let cancel = match &entry.lane {
                Some(lane) => {
                    let cancel = CancellationToken::new();
                    let record = shared.store.keys.record(token.shard, &lane.key_id);
                    let lease = LeaseKey { record: Some((record, lane.lifecycle.clone())), ..lease.clone() };
                    shared.leases.hold(slot.n, lease, cancel.clone());
                    cancel
                }
                None => cancel.clone(),
            };
            let began = Instant::now();
            shared.metrics.busy_slots.fetch_add(1, Relaxed);
            let outcome =
                run_handler(shared, token, entry, entry.policy(policy), cancel, carried.of(entry)).await;
            shared.metrics.busy_slots.fetch_sub(1, Relaxed);
            let took = began.elapsed();
            shared.metrics.run_time.observe(took);
            shared.stats.time(token.priority, Timing::Run, took);
            turn.batching.observe(took);
            turn.ran += 1;
            outcomes.push(outcome);
        }
        let acked =
            ack(shared, holding, token.priority, &entries, policy, outcomes, turn.then(shared, token).await)
                .await;
        shared.leases.release(slot.n);
        next = match acked {
            Ok(next) => next,
            Err(e) => return Ok(Served::AckLost(e)),
        };
    }
}

/// Does what the library's last answer to a hold says: owe the token's give-back to the slot's
/// next take (`Slot::owed`), run the steps after a finish, wake a parked token when its retry
/// falls due, or settle a fenced ack.
async fn settle<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    holder: &str,
    token: &Token,
    last: Next,
    policy: Option<Policy>,
) -> Result<()> {
    let shards = match &last {
        // An acquire that ended the request at its deadline says its shards; no policy came.
        Next::Finished(f) if policy.is_none() => f.shards.unwrap_or(1),
        // So does an acquire that parked the token.
        Next::Park(_, Some(shards)) if policy.is_none() => *shards,
        _ => policy.map_or(1, |p| p.shards),
    };
    let group = crate::keys::group_of_queue(&token.list).map(str::to_owned);
    let place = Placement { priority: token.priority, shards, group };
    match last {
        Next::Requeue(element, priority) => {
            slot.owed = Some(owed(shared, token, priority, vec![element.into()]));
        }
        Next::Finished(finished) => {
            tracing::info!(state = finished.state, "request finished");
            shared.stats.finished(token.priority, &finished.state, finished.lifecycle);
            crate::shards::finish(&shared.store, &token.element.key_id, place, finished).await?;
        }
        // A retry falls due later: the token is woken then.
        Next::Park(wake, _) if !wake.is_zero() => {
            wake_later(shared, &token.element.key_id, place.shards, wake).await?
        }
        Next::Fenced => {
            shared.metrics.fenced.fetch_add(1, Relaxed);
            shared.stats.count(token.priority, Counter::Fenced, 1);
            tracing::warn!("fenced: this slot no longer holds the token as it was (the request was cancelled, this worker was declared dead, or the ack was re-sent after it ran); its results were dropped");
            // A re-sent ack whose first copy ran is fenced too, and that copy may have handed this
            // slot a batch it never saw: settle it as recovery would (a no-op if the token moved on).
            // Else the token may stay held under this live worker with a batch nobody runs.
            reclaim_or_forget(shared, slot, holder, token).await?;
        }
        Next::Park(..) | Next::Drop | Next::Stale | Next::Run(..) => {}
    }
    Ok(())
}

/// The give-back of the token's new `elements`, ending the take's record: onto the list of
/// `priority`, the request's priority when the elements were issued (an operator may have changed
/// it since the take: `Admin::reprioritize`), on the token's shard; onto the list it was taken
/// from when the library did not say.
fn owed<H: Handler>(
    shared: &Shared<H>,
    token: &Token,
    priority: Option<Priority>,
    elements: Vec<Value>,
) -> tokens::GiveBack {
    let list = super::recovery::requeue_list(&shared.store, token.shard, &token.list, priority);
    tokens::GiveBack { shard: token.shard, list, take: token.take.to_string(), elements }
}

/// Pushes the elements back and ends the take's record, in one step; repeated while Redis is
/// unreachable (the record makes recovery do it if this process dies first).
async fn give_back<H: Handler>(shared: &Shared<H>, holder: &str, gb: &tokens::GiveBack) -> Result<()> {
    let store = &shared.store;
    retry_transient("give back", || {
        tokens::give_back(store, gb.shard, &gb.list, holder, &gb.take, gb.elements.clone())
    })
    .await?;
    Ok(())
}

/// Gives back the token the slot owes on its own (`Slot::owed`), if any.
async fn settle_owed<H: Handler>(shared: &Shared<H>, slot: &mut Slot, holder: &str) -> Result<()> {
    if let Some(gb) = &slot.owed {
        give_back(shared, holder, gb).await?;
        slot.owed = None;
    }
    Ok(())
}

/// After a call of this slot failed halfway (its reply lost, the connection dropped), the slot
/// cannot know where its token is: it runs recovery's own step on it ([`reclaim_or_forget`]),
/// which puts the token back in circulation whatever the failed call did, and then returns the
/// error.
async fn reclaim_own<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    holder: &str,
    token: &Token,
    error: Error,
) -> Result<()> {
    tracing::warn!(error = %error, "a call failed halfway; reclaiming the token");
    reclaim_or_forget(shared, slot, holder, token).await?;
    Err(error)
}

/// [`reclaim`] on the slot's own token. If that fails (not for want of Redis, which it waits
/// out), the take's record is left to recovery: the slot forgets it, so that its next take on the
/// shard keeps it as a lost record (`take`), which recovery's backstop reclaims, instead of ending
/// it.
async fn reclaim_or_forget<H: Handler>(
    shared: &Shared<H>,
    slot: &mut Slot,
    holder: &str,
    token: &Token,
) -> Result<()> {
    if let Err(e) = reclaim(shared, holder, token).await {
        slot.last_take[token.shard as usize] = None;
        tracing::error!(error = %e, "could not reclaim the token; leaving its take record to recovery");
        return Err(e);
    }
    Ok(())
}

/// Recovery's step (`reclaim`) on this slot's own token: whatever a call of unknown fate did, the
/// token ends up in circulation (its batch, if this slot held one, orphaned and run again first).
/// Recovery is asked to look at the request within a grace first: the slot's take record may be
/// gone already (this worker was declared dead and reaped meanwhile), and without a record nothing
/// else would cover the new epoch `reclaim` issues if this process died before pushing it.
async fn reclaim<H: Handler>(shared: &Shared<H>, holder: &str, token: &Token) -> Result<()> {
    let store = &shared.store;
    let meta = token.keys.meta.as_str();
    let shards =
        retry_transient("placement", || crate::shards::placement(store, meta)).await?.map_or(1, |p| p.shards);
    let TokenElement { key_id, k, epoch } = &token.element;
    let epoch = epoch.to_string();
    let reclaimed = retry_transient("reclaim", || {
        crate::shards::armed(store, key_id, shards, |deadline| {
            calls::reclaim(store, key_id, i64::from(*k), &epoch, holder, &token.list, Some(deadline))
        })
    })
    .await?;
    match reclaimed {
        Reclaimed::Push(elements, priority) => {
            give_back(shared, holder, &owed(shared, token, priority, elements)).await?
        }
        Reclaimed::Finished(unfinished) => {
            super::recovery::finish_reported(store, key_id, unfinished).await?
        }
        Reclaimed::Wake(wake) => wake_later(shared, key_id, shards, wake).await?,
        Reclaimed::Nothing => {}
    }
    Ok(())
}

/// A parked token whose retry falls due in `wake`: this worker wakes it itself at that time,
/// and recovery is asked to look then too (in case this process dies). The own wake comes first:
/// if Redis refuses the arm, the retry is still on time while this process lives (else the census
/// backstop wakes it).
async fn wake_later<H: Handler>(shared: &Shared<H>, key_id: &str, shards: u32, wake: Duration) -> Result<()> {
    if let Some(wakes) = &shared.wakes {
        let at = tokio::time::Instant::now() + wake;
        let _ = wakes.send(Wake { key_id: key_id.to_owned(), shards, at });
    }
    retry_transient("arm", || crate::shards::arm(&shared.store, key_id, shards, wake)).await?;
    Ok(())
}

/// Runs the handler in its own task, so that a panic is caught and recorded, not fatal; applies
/// the request's per-attempt timeout and the worker's shutdown grace. The run has its process span
/// (`otel`), child of the send span whose context its request carries (`carried`), current while
/// the handler runs.
///
/// A handler aborted at its timeout (or at the end of the grace) that does not stop, because it
/// blocks or spins and so never reaches an await, still runs: the slot waits for it to end before
/// it reports the outcome, keeping its token meanwhile, so that no other part of the request
/// starts in its place and the limit holds (invariant 2). Such a handler is logged.
async fn run_handler<H: Handler>(
    shared: &Shared<H>,
    token: &Token,
    entry: &Entry,
    policy: Policy,
    cancel: CancellationToken,
    carried: &str,
) -> Outcome {
    // A lane entry's request is its own, not the lane's.
    let request_id = match &entry.lane {
        Some(lane) => match RequestId::from_key_id(&lane.key_id) {
            Ok(id) => id,
            Err(e) => {
                return Outcome::Failed {
                    message: format!("lane entry names no request: {e}"),
                    permanent: true,
                }
            }
        },
        None => token.request_id.clone(),
    };
    let namespace = shared.store.config.namespace_str();
    let span =
        otel::ProcessSpan::start(namespace, &request_id, token.priority, entry.index, entry.attempt, carried);
    let ctx = Context {
        request_id,
        index: entry.index,
        attempt: entry.attempt,
        priority: token.priority,
        cancelled: cancel.clone(),
        store: shared.store.clone(),
    };
    let outcome = supervise(shared, entry, policy, cancel, ctx, &span).await;
    span.end(match &outcome {
        Outcome::Done(_) => otel::Ended::Ok,
        Outcome::Skipped => otel::Ended::Skipped,
        Outcome::Failed { message, permanent } => otel::Ended::Failed {
            message,
            permanent: *permanent,
            last: policy.is_last(entry.attempt, *permanent),
        },
    });
    outcome
}

/// [`run_handler`]'s run of the handler on `entry` as `ctx` says, with `span` current.
async fn supervise<H: Handler>(
    shared: &Shared<H>,
    entry: &Entry,
    policy: Policy,
    cancel: CancellationToken,
    ctx: Context,
    span: &otel::ProcessSpan,
) -> Outcome {
    let input: H::Input = match codec::decode(&entry.payload) {
        Ok(input) => input,
        Err(e) => {
            return Outcome::Failed { message: format!("payload does not decode: {e}"), permanent: true }
        }
    };
    let handler = shared.handler.clone();
    let (index, attempt) = (entry.index, entry.attempt);
    let logged = tracing::info_span!("handle", request_id = %ctx.request_id, index, attempt);
    let mut task =
        tokio::spawn(span.attach(async move { handler.handle(ctx, input).await }).instrument(logged));
    // A slot dropped with its worker (a crash, not a stop) takes its running handler with it.
    let _dies_with_slot = AbortOnDrop(task.abort_handle());
    let timeout = async {
        match policy.timeout {
            Some(limit) => tokio::time::sleep(limit).await,
            None => std::future::pending().await,
        }
    };
    let grace_over = async {
        shared.stopping.cancelled().await;
        tokio::time::sleep(shared.shutdown_grace).await;
    };
    let deadline = async {
        match policy.deadline {
            Some(at) => tokio::time::sleep_until(at.into()).await,
            None => std::future::pending().await,
        }
    };
    let (abandoned, why) = tokio::select! {
        // A run that ended as a limit fell due counts as ended: its outcome is recorded.
        biased;
        joined = &mut task => {
            // Cancelled from outside (its hold ended, or this worker was declared dead): a failure
            // it returns is the cancellation's, not the sub-request's, so no attempt is spent
            // (if the ack still gets through, the entry is handed back as after a clean stop).
            let outcome = outcome_of(joined);
            return match outcome {
                Outcome::Failed { message, .. } if cancel.is_cancelled() => {
                    tracing::info!(index = entry.index, error = %message, "sub-request cancelled (its request was cancelled, or its hold taken back); not dead-lettered");
                    Outcome::Skipped
                }
                other => other,
            };
        }
        _ = timeout => {
            let limit = policy.timeout.unwrap_or_default();
            (Outcome::Failed { message: format!("attempt timed out after {limit:?}"), permanent: false }, "timed out")
        }
        _ = grace_over => {
            tracing::warn!(index = entry.index, "shutdown grace ran out; handing the sub-request back");
            (Outcome::Skipped, "outlived the shutdown grace")
        }
        _ = deadline => {
            // Its ack, past the deadline, ends the request: nothing of this run is recorded,
            // unless the handler had succeeded by the time it was stopped (below).
            tracing::info!(index = entry.index, "the request's deadline passed; stopping the sub-request");
            (Outcome::Skipped, "ran past its request's deadline")
        }
    };
    let ended = abandon(task, &cancel, entry.index, why).await;
    match ended {
        // It succeeded as it was being stopped (at the deadline, or at the end of the grace):
        // the part is done, and its result kept.
        Some(Ok(Ok(output))) if matches!(abandoned, Outcome::Skipped) => {
            outcome_of::<H::Output>(Ok(Ok(output)))
        }
        _ => abandoned,
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Stops a handler the slot no longer waits for (`why`: it timed out, outlived the shutdown
/// grace, or ran past its request's deadline): cancels its context, aborts its task, and waits for
/// it to end. Returns how it ended, unless it ignored its cancellation for [`ZOMBIE_WAIT`].
async fn abandon<T>(
    mut task: tokio::task::JoinHandle<T>,
    cancel: &CancellationToken,
    index: u64,
    why: &str,
) -> Option<std::result::Result<T, tokio::task::JoinError>> {
    cancel.cancel();
    task.abort();
    // An abort takes effect at the handler's next await: one that blocks or spins goes on.
    match tokio::time::timeout(ZOMBIE_WAIT, &mut task).await {
        Ok(ended) => Some(ended),
        Err(_) => {
            tracing::warn!(
                index,
                "a handler that {why} ignores its cancellation (it blocks or spins): its slot keeps the token \
                 until it ends, so that the request's limit holds"
            );
            let _ = task.await;
            None
        }
    }
}

fn outcome_of<O: serde::Serialize>(
    joined: std::result::Result<std::result::Result<O, super::HandlerError>, tokio::task::JoinError>,
) -> Outcome {
    match joined {
        Ok(Ok(output)) => match codec::encode(&output) {
            Ok(bytes) => Outcome::Done(bytes.into()),
            Err(e) => Outcome::Failed { message: e.to_string(), permanent: true },
        },
        Ok(Err(e)) => Outcome::Failed { message: e.message().to_owned(), permanent: e.is_permanent() },
        Err(join) if join.is_panic() => {
            let text = super::panic_text(&*join.into_panic());
            Outcome::Failed { message: format!("handler panicked: {text}"), permanent: false }
        }
        Err(_) => Outcome::Failed { message: "handler task was cancelled".into(), permanent: false },
    }
}

/// Reports a batch's outcomes (`policy` decides which failures are retried) and asks for more or
/// gives the token back (`then`). The stats by stage count the outcomes, and the lane requests the
/// call finished, once the library accepted them (not when the ack is fenced).
#[allow(clippy::too_many_arguments)]
async fn ack<H: Handler>(
    shared: &Shared<H>,
    holding: &Holding<'_>,
    priority: Priority,
    entries: &[Entry],
    policy: Policy,
    outcomes: Vec<Outcome>,
    then: Then,
) -> Result<Next> {
    let store = &shared.store;
    let m = &shared.metrics;
    // Succeeded, retried, dead-lettered.
    let mut counts = [0u64; 3];
    let mut reports = Vec::with_capacity(entries.len());
    for (entry, outcome) in entries.iter().zip(outcomes) {
        let policy = entry.policy(policy);
        let reported = match outcome {
            Outcome::Done(bytes) => {
                m.succeeded.fetch_add(1, Relaxed);
                counts[0] += 1;
                tokens::Outcome::Ok(bytes)
            }
            Outcome::Skipped => {
                m.handed_back.fetch_add(1, Relaxed);
                tokens::Outcome::Skip
            }
            Outcome::Failed { message, permanent } => {
                let last = policy.is_last(entry.attempt, permanent);
                let record = PartError { message, attempts: entry.attempt, permanent };
                let body: Bytes =
                    serde_json::to_vec(&record).map_err(|e| Error::Codec(e.to_string()))?.into();
                if last {
                    m.dead_lettered.fetch_add(1, Relaxed);
                    counts[2] += 1;
                    tracing::warn!(index = entry.index, attempt = entry.attempt, error = %record.message, "sub-request dead-lettered");
                    tokens::Outcome::Dead(body)
                } else {
                    m.retried.fetch_add(1, Relaxed);
                    counts[1] += 1;
                    let delay = policy.backoff(entry.attempt, store.deterministic());
                    tracing::info!(index = entry.index, attempt = entry.attempt, ?delay, error = %record.message, "sub-request will be retried");
                    tokens::Outcome::Retry { record: body, delay }
                }
            }
        };
        let lane = entry.lane.as_ref().map(|l| (l.key_id.as_str(), l.lifecycle.as_str()));
        reports.push(Report {
            id: &entry.id,
            outcome: reported,
            attempt: entry.attempt,
            index: entry.index,
            lane,
        });
    }
    let (next, finishes) = tokens::ack(store, holding, then, reports)
        .instrument(tracing::debug_span!("ack", entries = entries.len()))
        .await?;
    if !matches!(next, Next::Fenced) {
        let stats = &shared.stats;
        for (counter, n) in
            [Counter::Succeeded, Counter::Retried, Counter::DeadLettered].into_iter().zip(counts)
        {
            stats.count(priority, counter, n);
        }
        for d in finishes.done {
            stats.finished(priority, &d.state, d.lifecycle);
        }
    }
    // Lane requests with downstreams that this call finished: their releases are owed (in the
    // outbox, for recovery if this fails).
    if let Some((shard, _)) = crate::keys::lane_of(&holding.element.key_id) {
        for owed in finishes.releases {
            // Boxed: a release's future is large, and most acks release nothing.
            Box::pin(release(shared, shard, owed)).await;
        }
    }
    Ok(next)
}

/// Runs a release that a `lane_ack` owes, in a task of its own: the slot goes on meanwhile, to its
/// next batch or its next take, where it may offer a hand-off (the standby) that the release's push
/// of an opened downstream then hands it, one round trip sooner than a take after the bell. With
/// [`Releasing::AT_ONCE`] running already, the slot runs it itself. A task that dies with its
/// worker leaves the release in the outbox, for recovery. Under the checker the release is an
/// actor of its own or runs in the slot, as the take drew (`Gate::apart`).
async fn release<H>(shared: &Shared<H>, shard: u32, owed: tokens::Owed) {
    let run = move |store: Store| async move {
        crate::shards::dag::release_owed(&store, shard, &owed.key_id, Some(owed.ended), owed.downstreams, 0)
            .await
    };
    #[cfg(test)]
    if let Some(gate) = &shared.store.gate {
        if let Some(work) = gate.apart(run(shared.store.clone())) {
            work.await;
        }
        return;
    }
    if let Ok(permit) = shared.releasing.running.clone().try_acquire_owned() {
        let (store, gone) = (shared.store.clone(), shared.releasing.gone.clone());
        tokio::spawn(
            async move {
                tokio::select! {
                    _ = run(store) => {}
                    _ = gone.cancelled() => {}
                }
                drop(permit);
            }
            .instrument(tracing::Span::current()),
        );
        return;
    }
    run(shared.store.clone()).await
}
