//! The operations a checker sequence is made of, and the seeded generator that draws them.
//!
//! A sequence is data: replaying the same operations against a fresh Redis reproduces the run
//! (every choice the code under test makes is deterministic under the checker, see
//! `Store::deterministic`). Operations that pick among what is parked (`Step`, `Kill`), or among
//! requests or processes in some state at that moment (`Reprioritize`, `Track`, `Purge`,
//! `FlushStats`), or among the token elements seen so far (`Plant`), hold an index taken modulo
//! the number of candidates, so that a shrunk sequence still replays.

use std::fmt;

use rand::rngs::StdRng;
use rand::Rng;

use super::gate::{Fault, Verdict};

/// Requests are drawn from a small pool of ids, so that producers race on the same id.
pub(crate) const REQUEST_IDS: u8 = 6;
/// Worker processes (each with [`SLOTS`] slots), replaced by a new incarnation when killed.
pub(crate) const WORKERS: u8 = 3;
pub(crate) const SLOTS: u8 = 2;
pub(crate) const PRODUCERS: u8 = 3;
/// Schedules are named `s0`, `s1`, ...: this many.
pub(crate) const SCHEDULES: u8 = 2;

/// What an operator does to a schedule (`Op::Schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum ScheduleAction {
    /// Adds it: cron `*/<every_s> * * * * *` (a tick every few seconds of the checker's virtual
    /// time), missed ticks caught up to `catch_up` (large, so that what is owed does not depend
    /// on when the workers' claims came). Refused while another spec has the name; the same one
    /// again changes nothing.
    Add {
        every_s: u8,
        catch_up: u8,
    },
    Pause,
    Resume,
    Remove,
}

/// How a request is submitted.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum Shape {
    /// `submit` of `parts` parts (one call when they fit in a chunk, else open/load/commit).
    Whole { parts: u8, delay_ms: u32 },
    /// `open`, then `add` of each count in turn, then `finalize` if `finalize`; with a window
    /// of `window` parts if it is above 0, its results discarded if `discard` (both absent in
    /// sequences recorded before windows).
    Streamed {
        adds: Vec<u8>,
        finalize: bool,
        #[serde(default)]
        window: u8,
        #[serde(default)]
        discard: bool,
    },
}

/// One request as a producer submits it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Submit {
    pub(crate) producer: u8,
    pub(crate) request: u8,
    pub(crate) shape: Shape,
    pub(crate) limit: u8,
    pub(crate) priority: u8,
    pub(crate) max_attempts: u8,
    pub(crate) backoff_ms: u32,
    pub(crate) fail_fast: bool,
    /// A small whole request takes a stream of its own instead of its lane
    /// (`RequestBuilder::own_stream`; absent in sequences recorded before lanes).
    #[serde(default)]
    pub(crate) own_stream: bool,
    /// Left out of the listing index (`RequestBuilder::unlisted`; absent in sequences recorded
    /// before it), when it takes a lane (see `unlisted_here`).
    #[serde(default)]
    pub(crate) unlisted: bool,
    /// A deadline this many ms (of the functions' clock) after the submit (0: none;
    /// `RequestBuilder::deadline_in`; absent in sequences recorded before deadlines).
    #[serde(default)]
    pub(crate) deadline_ms: u32,
    /// A rate limit: at most this many parts started per this many ms of the functions' clock
    /// (`RequestBuilder::rate`; absent in sequences recorded before rate limits).
    #[serde(default)]
    pub(crate) rate: Option<(u8, u16)>,
    /// Submitted after requests of the pool (`RequestBuilder::after`; absent in sequences recorded
    /// before dependencies), each picked as `Reprioritize` picks: with a multiple of 4, id `pick /
    /// 4` of the pool, whatever it is (unknown, loading, itself: refused); otherwise one of the
    /// pool's requests that exist at that moment, modulo their number. Refused with a delay, or
    /// streamed.
    #[serde(default)]
    pub(crate) after: Vec<u8>,
    /// With `after`: it runs once its upstreams ended however (`OnUpstreamFailure::Run`), instead
    /// of failing with a failed one.
    #[serde(default)]
    pub(crate) run_anyway: bool,
    /// Submitted under the first id of the pool from `request` on that has no request (none
    /// loading or existing, and no submit of it under way), if any: a new request rather than a
    /// duplicate (absent in sequences recorded before dependencies).
    #[serde(default)]
    pub(crate) fresh_id: bool,
    /// In tenant group `g<n>` (`RequestBuilder::group`; absent in sequences recorded before
    /// groups).
    #[serde(default)]
    pub(crate) group: Option<u8>,
    /// A whole request submitted through `Producer::submit_many` (a batch of this one request;
    /// absent in sequences recorded before it): a lane takes it with `lane_submit_many`, and
    /// any other goes the way `submit` takes it.
    #[serde(default)]
    pub(crate) bulk: bool,
    /// A whole request whose results are discarded (`RequestBuilder::discard_results`; absent in
    /// sequences recorded before whole requests could discard): on a lane or a stream of its own.
    /// A streamed one follows its `Shape::Streamed::discard`.
    #[serde(default)]
    pub(crate) discard: bool,
}

impl Submit {
    /// Whether the submit asks to be unlisted: only a request that takes a lane may be (a whole
    /// one, not delayed, not of its own stream; the checker's are at most 5 parts).
    pub(crate) fn unlisted_here(&self) -> bool {
        self.unlisted
            && !self.own_stream
            && self.deadline_ms == 0
            && self.rate.is_none()
            && self.after.is_empty()
            && self.group.is_none()
            && matches!(self.shape, Shape::Whole { delay_ms: 0, .. })
    }
}

/// One step of a sequence.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum Op {
    /// A producer starts submitting.
    Submit(Submit),
    /// A producer submits several whole requests in one `Producer::submit_many` (each with `bulk`
    /// set; ids may repeat, and an id in use earlier in the batch is refused; absent in sequences
    /// recorded before it).
    SubmitMany {
        producer: u8,
        requests: Vec<Submit>,
    },
    /// Slot `slot` of worker `worker` takes one token and serves it (if it is idle); with a
    /// `floor`, as a reserved slot of that floor takes (`WorkerBuilder::reserve`: no lower
    /// priority; absent in sequences recorded before it).
    Take {
        worker: u8,
        slot: u8,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        floor: Option<u8>,
        /// Priority 99 is announced on the shard first (`higher`): the slot, holding a lower one,
        /// gives way at its first batch's end (`Turn::then`). Absent in sequences recorded before it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        way: bool,
        /// The releases its lane finishes owe run as actors of their own, as a worker's tasks do
        /// (`slot::release`), rather than in the slot, as once a worker has many running. Absent
        /// in sequences recorded before it (they ran in the slot).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        apart: bool,
        /// The hold's first batch hands back what follows its first part, as a first batch sized
        /// by a guess does once it has run for its budget (`slot::GUESS_BUDGET`; the checker's
        /// batches are not sized by timing, so the budget never runs out otherwise). Absent in
        /// sequences recorded before it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cut: bool,
        /// The hold asks for batches of up to four entries within a quantum of six parts
        /// (`gate::WIDE`), instead of two within three: an `ack` settles runs of several outcomes
        /// (skips after a cut, retries and dead letters beside results, a lane's entries of
        /// several requests) in one call. Absent in sequences recorded before it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        wide: bool,
        /// The worker's holds fill its slots, as while its urgent slot runs one over them
        /// (`worker::bound`): unless reserved, the slot gives back what it owes on its own before
        /// it takes, and gives its token back at its first batch's end. Absent in sequences
        /// recorded before it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        room: bool,
    },
    /// Worker `worker` renews the leases its slots hold.
    Beat {
        worker: u8,
    },
    /// Worker `worker` runs one recovery pass.
    Recover {
        worker: u8,
    },
    /// An operator cancels, requeues the dead letters of, or finalizes a request.
    Cancel {
        request: u8,
    },
    Requeue {
        request: u8,
    },
    /// An operator requeues a failed request: picked as `Reprioritize` picks, among the pool's
    /// failed requests at that moment (drawn for dependencies: an upstream that failed its
    /// downstreams, requeued, releases them again when it completes).
    RequeueFailed {
        pick: u8,
    },
    /// An operator requeues the dead letters of a running request, picked among the pool's
    /// running requests at that moment: its parts go back in line while its others run (a lane
    /// request's then join its lane's tail, out of submission order). Absent in sequences
    /// recorded before it.
    RequeueRunning {
        pick: u8,
    },
    /// An operator cancels a request picked among the pool's queued requests at that moment (a
    /// single-part lane request's record reads queued while its entry waits in its lane, and
    /// also once handed out without its record): the cancel of an entry not yet handed out, which
    /// `Cancel`'s blind ids rarely reach (not once in some runs of the CI budget). Absent in
    /// sequences recorded before it.
    CancelQueued {
        pick: u8,
    },
    Finalize {
        request: u8,
    },
    /// An operator changes a request's priority (`Admin::reprioritize`) to one of those requests
    /// are drawn with, so that the drain finds every list it looks at. The request: with `pick`
    /// a multiple of 4, id `pick / 4` of the pool, whatever it is (often unknown, finished, or a
    /// small one in a lane: refused); otherwise one of the pool's requests that are live with keys
    /// of their own at that moment, modulo their number (those whose tokens can move).
    Reprioritize {
        pick: u8,
        priority: u8,
    },
    /// An operator marks a request as tracked, or unmarks it (`Admin::track`); the request is
    /// picked as `Reprioritize`'s, but among every request of the pool that exists (any state).
    Track {
        pick: u8,
        on: bool,
    },
    /// An operator purges one request's keys now (`Admin::purge`): with `pick` a multiple of 4,
    /// id `pick / 4` of the pool, whatever it is (unknown or live: refused, nothing changes);
    /// otherwise one of the pool's finished requests at that moment, modulo their number.
    Purge {
        pick: u8,
    },
    /// An operator purges the finished requests in state `state` (0 completed, 1 failed, 2
    /// cancelled) submitted at least `older_than_ms` ago by the functions' clock
    /// (`Admin::purge_finished`).
    PurgeFinished {
        state: u8,
        older_than_ms: u32,
    },
    /// A producer or a running worker adds what its recorder counted to the stats by stage
    /// (`stats_add`), as its flush task does every flush interval: among the producers and workers
    /// (in that order) that counted something since their last flush, the one at `pick` modulo
    /// their number (none: nothing happens).
    FlushStats {
        pick: u8,
    },
    /// An operator pauses the namespace (`None`) or one priority, or resumes it (`None`: all).
    Pause {
        priority: Option<u8>,
    },
    /// An operator sets tenant group `g<group>`'s limit (`Admin::set_group`; the groups start at
    /// the default limit), and with `rate` its rate limit: at most this many parts started per
    /// this many ms of the functions' clock (`Admin::set_group_rate`; absent in sequences recorded
    /// before group rates).
    SetGroup {
        group: u8,
        limit: u8,
        #[serde(default)]
        rate: Option<(u8, u16)>,
    },
    Resume {
        priority: Option<u8>,
    },
    /// A reader takes the next page (of `count` outcomes at most) of a streamed request's results
    /// (`RequestHandle::results_from`, from where its last page ended).
    ReadResults {
        request: u8,
        count: u8,
    },
    /// Resumes one parked call (with `fault`) or handler run (ending as `verdict`).
    Step {
        pick: u16,
        fault: Fault,
        verdict: Verdict,
    },
    /// Time passes (the functions' clock; leases and backoffs run out by it).
    Advance {
        ms: u32,
    },
    /// The process of a parked actor dies (SIGKILL): a producer, an operator, or a whole worker.
    Kill {
        pick: u16,
    },
    /// redis-server is killed and restarted from its append-only file (`appendfsync always`).
    Restart,
    /// An operator adds, pauses, resumes or removes schedule `s<name>` (`Admin::schedule_add`,
    /// ...). Workers fire it in their recovery passes (`Op::Recover`), each tick's request
    /// `s<name>@<tick>` (one part; `s0`'s take a lane, `s1`'s a stream of their own).
    Schedule {
        name: u8,
        action: ScheduleAction,
    },
    /// A copy of a token element once seen on a list is pushed onto that list again (`pick`
    /// modulo the elements the steps have seen, in the order first seen): at its head, as a
    /// re-sent push leaves one, or with `tail` at its tail, as a slot's clean stop puts back a
    /// take it never saw the reply of. Often the copy is stale by now: its token moved on, or its
    /// request finished, or was purged and its id submitted again (docs/protocol.md §3, "Epoch
    /// rule"). With `current`, the pick is among the elements whose token (of a request with keys
    /// of its own, under the element's id) is queued now, and the copy carries the epoch it is
    /// queued with and goes onto any list seen so far: as a copy an earlier request under the id
    /// left on a list it used may, since epochs are times (the next request's token can be issued
    /// in the same millisecond). On a list of another kind than the token's own (a tenant group's
    /// queue, or a shard's list for a grouped request), only `acquire`'s group guard stands between
    /// it and a run outside its group's limit. Absent in sequences recorded before it.
    Plant {
        pick: u16,
        tail: bool,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        current: bool,
    },
    /// Everything drains as at the end of a sequence (no faults; every request finishes, nothing
    /// runs), and the sequence goes on: what follows meets finished requests (purges, tracks, ids
    /// submitted again).
    Drain,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Submit(s) => write!(f, "{s:?}"),
            other => write!(f, "{other:?}"),
        }
    }
}

/// How a sequence is drawn.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mix {
    /// Operations before the drain.
    pub(crate) len: usize,
    /// Share of `Step`s that meet a fault.
    pub(crate) faults: f64,
    /// Allow `Restart`.
    pub(crate) restarts: bool,
    /// Share of sequences with an `Op::Drain` (somewhere in their second half).
    pub(crate) drains: f64,
    /// Share of operations drawn for dependencies between requests: submits after others (under
    /// a free id, one attempt per part), and the requeues and cancels that fail and reopen their
    /// downstreams; with it, handlers fail permanently more often.
    pub(crate) dags: f64,
}

/// Draws one operation; `drained`: an `Op::Drain` came before, and an operator's commands on
/// finished requests are drawn more often.
pub(crate) fn draw(rng: &mut StdRng, mix: &Mix, drained: bool) -> Op {
    if drained && rng.gen_bool(0.2) {
        return match rng.gen_range(0..6) {
            0 | 1 => Op::Purge { pick: rng.gen() },
            2 => Op::Track { pick: rng.gen(), on: rng.gen_bool(0.75) },
            3 => Op::FlushStats { pick: rng.gen() },
            4 => draw_plant(rng),
            _ => draw_purge_finished(rng),
        };
    }
    if mix.dags > 0.0 && rng.gen_bool(mix.dags) {
        return match rng.gen_range(0..10) {
            0..=4 => {
                let mut submit = draw_submit(rng);
                if submit.after.is_empty() {
                    submit.after.push(rng.gen());
                }
                submit.shape = Shape::Whole { parts: rng.gen_range(1..=3), delay_ms: 0 };
                submit.fresh_id = true;
                // A failure ends its part at once: upstreams fail more often, and downstreams with
                // them.
                submit.max_attempts = 1;
                Op::Submit(submit)
            }
            5..=7 => Op::RequeueFailed { pick: rng.gen() },
            8 => Op::Cancel { request: rng.gen_range(0..REQUEST_IDS) },
            _ => Op::CancelQueued { pick: rng.gen() },
        };
    }
    // Schedules: one operation in 25, the others' weights scaled alike.
    if cfg!(feature = "schedules") && rng.gen_bool(0.04) {
        return draw_schedule(rng);
    }
    let roll = rng.gen_range(0..1000);
    match roll {
        0..=399 => {
            let verdict =
                if mix.dags > 0.0 && rng.gen_bool(0.3) { Verdict::Permanent } else { draw_verdict(rng) };
            Op::Step { pick: rng.gen(), fault: draw_fault(rng, mix.faults), verdict }
        }
        400..=409 => draw_plant(rng),
        410..=429 => Op::Reprioritize { pick: rng.gen(), priority: [10, 50, 90][rng.gen_range(0..3)] },
        430..=569 => Op::Take {
            worker: rng.gen_range(0..WORKERS),
            slot: rng.gen_range(0..SLOTS),
            floor: (rng.gen_range(0..3) == 0).then(|| [50, 90][rng.gen_range(0..2)]),
            way: rng.gen_range(0..4) == 0,
            apart: rng.gen_bool(0.5),
            cut: rng.gen_bool(0.5),
            wide: rng.gen_bool(0.3),
            room: rng.gen_range(0..6) == 0,
        },
        570..=659 => {
            let mut submit = draw_submit(rng);
            // Drawn for dependencies, half the other submits take a lane (whole, small, nothing
            // that gives a request keys of its own): upstreams in lanes, whose releases a lane
            // finish owes (`Op::Take::apart`), are otherwise about one submit in eight.
            if mix.dags > 0.0 && rng.gen_bool(0.5) {
                if let Shape::Whole { delay_ms, .. } = &mut submit.shape {
                    *delay_ms = 0;
                }
                submit.own_stream = false;
                (submit.deadline_ms, submit.rate, submit.group) = (0, None, None);
                submit.after.clear();
            }
            if submit.bulk && rng.gen_bool(0.5) {
                draw_batch(rng, submit)
            } else {
                Op::Submit(submit)
            }
        }
        660..=709 => Op::Recover { worker: rng.gen_range(0..WORKERS) },
        710..=759 => Op::Beat { worker: rng.gen_range(0..WORKERS) },
        760..=836 => Op::Advance {
            ms: if rng.gen_bool(0.7) { rng.gen_range(50..400) } else { rng.gen_range(900..2500) },
        },
        837..=842 => Op::Requeue { request: rng.gen_range(0..REQUEST_IDS) },
        843..=848 => Op::RequeueRunning { pick: rng.gen() },
        849 => Op::Pause { priority: draw_pause(rng) },
        850..=851 => Op::SetGroup {
            group: rng.gen_range(0..GROUPS),
            limit: rng.gen_range(1..=3),
            rate: rng.gen_bool(0.5).then(|| (rng.gen_range(1..=3), rng.gen_range(200..2000))),
        },
        852..=856 => Op::Resume { priority: draw_pause(rng) },
        857..=866 => Op::ReadResults { request: rng.gen_range(0..REQUEST_IDS), count: rng.gen_range(1..=3) },
        867..=874 => Op::Cancel { request: rng.gen_range(0..REQUEST_IDS) },
        875..=886 => Op::CancelQueued { pick: rng.gen() },
        887..=906 => Op::Finalize { request: rng.gen_range(0..REQUEST_IDS) },
        907..=946 => Op::Kill { pick: rng.gen() },
        947..=956 => Op::Reprioritize { pick: rng.gen(), priority: [10, 50, 90][rng.gen_range(0..3)] },
        957..=968 => Op::Purge { pick: rng.gen() },
        969..=972 => draw_purge_finished(rng),
        973..=980 => Op::Track { pick: rng.gen(), on: rng.gen_bool(0.75) },
        981..=996 => Op::FlushStats { pick: rng.gen() },
        // A restart costs a few hundred ms of reconnects: about one sequence in six has one.
        _ if mix.restarts && rng.gen_bool(0.9) => Op::Advance { ms: 100 },
        _ if mix.restarts => Op::Restart,
        _ => Op::Advance { ms: 100 },
    }
}

fn draw_schedule(rng: &mut StdRng) -> Op {
    let action = match rng.gen_range(0..20) {
        0..=7 => ScheduleAction::Add { every_s: rng.gen_range(1..=3), catch_up: 100 },
        8..=11 => ScheduleAction::Pause,
        12..=16 => ScheduleAction::Resume,
        _ => ScheduleAction::Remove,
    };
    Op::Schedule { name: rng.gen_range(0..SCHEDULES), action }
}

fn draw_plant(rng: &mut StdRng) -> Op {
    Op::Plant { pick: rng.gen(), tail: rng.gen_bool(0.5), current: rng.gen_bool(0.5) }
}

fn draw_purge_finished(rng: &mut StdRng) -> Op {
    let older_than_ms = if rng.gen_bool(0.5) { 0 } else { rng.gen_range(100..3000) };
    Op::PurgeFinished { state: rng.gen_range(0..3), older_than_ms }
}

/// The whole namespace, or one of the priorities requests are drawn with.
fn draw_pause(rng: &mut StdRng) -> Option<u8> {
    rng.gen_bool(0.5).then(|| [10, 50, 90][rng.gen_range(0..3)])
}

fn draw_fault(rng: &mut StdRng, share: f64) -> Fault {
    if !rng.gen_bool(share) {
        return Fault::None;
    }
    match rng.gen_range(0..5) {
        0 => Fault::LoseReply,
        1 => Fault::Resend,
        2 => Fault::Refuse,
        3 => Fault::Unrouted,
        _ => Fault::DieAfter,
    }
}

fn draw_verdict(rng: &mut StdRng) -> Verdict {
    match rng.gen_range(0..10) {
        0..=5 => Verdict::Ok,
        6..=8 => Verdict::Fail,
        _ => Verdict::Permanent,
    }
}

/// Tenant groups the submits draw from: `g0`, `g1`.
pub(crate) const GROUPS: u8 = 2;

/// The name of tenant group `n`.
pub(crate) fn group_name(n: u8) -> String {
    format!("g{n}")
}

/// A batch of `first` and one to three more whole requests of its producer, for `submit_many`.
fn draw_batch(rng: &mut StdRng, first: Submit) -> Op {
    let (producer, priority) = (first.producer, first.priority);
    // Half the batches end in a burst: single-part requests of the first one's priority, on its
    // lane, submitted in one millisecond, which one lane call may finish together (the terminal
    // sets then hold them as one member: prelude.lua, "The listing index").
    let burst = rng.gen_bool(0.5);
    let mut requests = vec![first];
    for _ in 0..rng.gen_range(1..=3) {
        let mut s = draw_submit(rng);
        s.producer = producer;
        s.bulk = true;
        if burst {
            (s.priority, s.own_stream, s.shape) = (priority, false, Shape::Whole { parts: 1, delay_ms: 0 });
        }
        requests.push(s);
    }
    // (`submit_many` takes whole requests only.)
    for s in &mut requests {
        if let Shape::Streamed { .. } = s.shape {
            s.shape = Shape::Whole { parts: rng.gen_range(1..=5), delay_ms: 0 };
        }
    }
    Op::SubmitMany { producer, requests }
}

fn draw_submit(rng: &mut StdRng) -> Submit {
    let request = rng.gen_range(0..REQUEST_IDS);
    // A third of the submits come after one or two other requests of the pool, mostly whole and
    // not delayed (streamed or delayed, or after an unknown request or itself: refused).
    let after: Vec<u8> =
        if rng.gen_bool(0.33) { (0..rng.gen_range(1..=2)).map(|_| rng.gen()).collect() } else { Vec::new() };
    let shape = if !after.is_empty() && rng.gen_bool(0.9) {
        Shape::Whole { parts: rng.gen_range(1..=3), delay_ms: 0 }
    } else if rng.gen_bool(0.3) {
        let adds = (0..rng.gen_range(1..=3)).map(|_| rng.gen_range(1..=3)).collect();
        // More often than not a window of 1 to 3 parts, below most such requests' sizes, so that
        // add waits; the results discarded now and then.
        let window = if rng.gen_bool(0.6) { rng.gen_range(1..=3) } else { 0 };
        Shape::Streamed { adds, finalize: rng.gen_bool(0.85), window, discard: rng.gen_bool(0.2) }
    } else {
        let delay_ms = if rng.gen_bool(0.15) { rng.gen_range(100..1500) } else { 0 };
        Shape::Whole { parts: rng.gen_range(1..=5), delay_ms }
    };
    Submit {
        producer: rng.gen_range(0..PRODUCERS),
        request,
        shape,
        limit: rng.gen_range(1..=3),
        priority: [10, 50, 90][rng.gen_range(0..3)],
        max_attempts: rng.gen_range(1..=3),
        backoff_ms: if rng.gen_bool(0.5) { 0 } else { rng.gen_range(50..600) },
        fail_fast: rng.gen_bool(0.2),
        own_stream: rng.gen_bool(0.4),
        unlisted: rng.gen_bool(0.25),
        deadline_ms: if rng.gen_bool(0.15) { rng.gen_range(100..3000) } else { 0 },
        rate: rng.gen_bool(0.15).then(|| (rng.gen_range(1..=3), rng.gen_range(200..2000))),
        after,
        run_anyway: rng.gen_bool(0.3),
        fresh_id: false,
        group: rng.gen_bool(0.3).then(|| rng.gen_range(0..GROUPS)),
        bulk: rng.gen_bool(0.3),
        discard: rng.gen_bool(0.2),
    }
}
