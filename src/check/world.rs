//! One checker run: the processes (producers, workers, an operator), the actors they run, and the
//! scheduler that resumes one parked call at a time.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::gate::{Drawn, Event, Fault, Gate, Verdict};
use super::model::{Model, Outcome};
use super::ops::{Op, Shape, Submit, PRODUCERS, SLOTS, WORKERS};
use crate::config::Config;
use crate::request::Cancelled;
use crate::request::Priority;
use crate::request::RequestId;
use crate::stats::Recorder;
use crate::store::Store;
use crate::worker::{slot, Context, Handler, HandlerError, Quantum, WorkerMetrics};
use crate::{async_trait, Admin, Producer};

/// How long an actor may take to reach its next call before the run is declared stuck (a call
/// that is not gated, or a hang in the code under test). Generous: BRPOPs block for real, and a
/// machine loaded by other builds and suites stretched a step past 10 s twice (the sequences
/// replayed at once without it).
const STEP_LIMIT: Duration = Duration::from_secs(30);

/// The checker's handler: each run parks until the scheduler gives its verdict. Part `n` yields
/// `3 n`.
pub(crate) struct CheckHandler {
    gate: Arc<Gate>,
}

#[async_trait]
impl Handler for CheckHandler {
    type Input = u64;
    type Output = u64;
    async fn handle(&self, ctx: Context, n: u64) -> Result<u64, HandlerError> {
        match self.gate.handler(ctx.request_id().to_string(), ctx.index(), ctx.attempt(), n).await {
            Verdict::Ok => Ok(n * 3),
            Verdict::Fail => Err(HandlerError::new("a failure chosen by the checker")),
            Verdict::Permanent => Err(HandlerError::permanent("a permanent failure chosen by the checker")),
        }
    }
}

/// Who runs an actor: a SIGKILL takes the whole process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Process {
    Producer(u8),
    Operator,
    /// The process that reads results with `results_from`.
    Reader,
    /// Worker `index`, incarnation `n`.
    Worker(u8, u32),
}

/// What an actor does (the request indexes are for traces).
#[derive(Clone, Debug)]
#[allow(dead_code)]
pub(crate) enum Task {
    Submit(Submit),
    /// One `submit_many` of these requests.
    SubmitMany(Vec<Submit>),
    Take {
        slot: u8,
    },
    Beat,
    Recover,
    Cancel(u8),
    Requeue(u8),
    Finalize(u8),
    Reprioritize(u8),
    Track(u8),
    Purge(u8),
    PurgeFinished,
    /// A producer's or a worker's flush of its stats by stage.
    Flush,
    Pause,
    /// An operator's action on schedule `.0`.
    Schedule(u8),
    /// A reader of request `.0`'s results, from part `.1`, spawned while the model had seen `.2`
    /// purges of the id (a page that ends after another purge is of a request it no longer knows).
    Read(u8, u64, u32),
    /// Work a slot started in a task of its own (a lane finish's release, `Gate::apart`), by the
    /// actor that started it.
    Apart(u64),
}

struct Actor {
    task: Option<JoinHandle<Outcome>>,
    process: Process,
    what: Task,
    /// How its take was drawn: whether it starts its work apart (`Op::Take::apart`,
    /// `Gate::apart`), whether its hold's first batch hands back what follows its first part
    /// (`Op::Take::cut`, `Gate::cuts`), whether it asks for wide batches (`Op::Take::wide`),
    /// whether it finds its worker's holds filling its slots (`Op::Take::room`, `Gate::rooms`).
    drawn: Drawn,
}

/// Work an actor started apart, not yet an actor itself: it becomes one once its starter parks.
struct Started {
    by: u64,
    process: Process,
    work: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

/// Something parked: an actor's next call, or a handler run.
pub(crate) enum Parked {
    Call { actor: u64, what: String, key: String, resume: oneshot::Sender<Fault> },
    Handler { actor: u64, request: String, index: u64, attempt: u32, resume: oneshot::Sender<Verdict> },
}

impl Parked {
    fn actor(&self) -> u64 {
        match self {
            Parked::Call { actor, .. } | Parked::Handler { actor, .. } => *actor,
        }
    }
}

/// One worker process.
struct WorkerProc {
    incarnation: u32,
    shared: Arc<slot::Shared<CheckHandler>>,
    /// What each slot keeps across its takes.
    slots: Vec<Arc<tokio::sync::Mutex<slot::Slot>>>,
    /// The actor each slot runs, if any.
    busy: [Option<u64>; SLOTS as usize],
    /// Whether its next beat is a first one (at its start, and after it learned it was declared
    /// dead and took a new id).
    first_beat: Arc<std::sync::atomic::AtomicBool>,
}

/// What a runner's worlds share.
pub(crate) struct Connections {
    config: Config,
    gate: Arc<Gate>,
    store: Store,
    blocking: Vec<Client>,
    events: Option<mpsc::UnboundedReceiver<Event>>,
}

/// A sequence's world, on a redis-server of its own (the runner flushes it between sequences).
pub(crate) struct World {
    pub(crate) config: Config,
    pub(crate) store: Store,
    gate: Arc<Gate>,
    events: mpsc::UnboundedReceiver<Event>,
    /// Ungated: what the invariants read.
    pub(crate) reader: Client,
    /// One blocking connection per worker slot (reused by later incarnations).
    blocking: Vec<Client>,
    workers: Vec<Option<WorkerProc>>,
    incarnations: [u32; WORKERS as usize],
    actors: HashMap<u64, Actor>,
    next_actor: u64,
    /// Work started apart by the actor running now (`Task::Apart`).
    started: Vec<Started>,
    pub(crate) parked: Vec<Parked>,
    /// Handler runs each actor resumed since its last call: a batch's runs, counted into
    /// `model::WIDE_BATCHES` at the call that reports them.
    runs: HashMap<u64, u32>,
    producers_busy: [bool; PRODUCERS as usize],
    /// What each producer process counted for the stats by stage and has not flushed (a new
    /// recorder when the process is started again after a kill).
    producer_stats: [Option<Arc<Recorder>>; PRODUCERS as usize],
    pub(crate) model: Model,
    /// The ms the functions' clock runs ahead of Redis's.
    pub(crate) clock_ms: u64,
    /// Every token element seen on a list after a step, with that list, in the order first seen
    /// (`Op::Plant` pushes copies of them back), and those pairs as a set.
    elements: Vec<(String, String)>,
    elements_seen: HashSet<(String, String)>,
}

/// Every token list of the namespace (the shards' priority lists, the tenant groups' queues) and
/// its elements: {list, element, list, element, ...}.
const TOKEN_ELEMENTS: &str = r"
local out = {}
local cursor = '0'
repeat
  local page = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000, 'TYPE', 'list')
  cursor = page[1]
  for _, key in ipairs(page[2]) do
    for _, element in ipairs(redis.call('LRANGE', key, 0, -1)) do
      out[#out + 1] = key
      out[#out + 1] = element
    end
  end
until cursor == '0'
return out
";

/// Shortens every expiry of the namespace by ARGV[1] ms (deleting what that expires).
const AGE_KEYS: &str = r"
local cursor = '0'
local by = tonumber(ARGV[1])
repeat
  local page = redis.call('SCAN', cursor, 'MATCH', ARGV[2], 'COUNT', 1000)
  cursor = page[1]
  for _, key in ipairs(page[2]) do
    local ttl = redis.call('PTTL', key)
    if ttl > 0 then
      if ttl <= by then redis.call('DEL', key) else redis.call('PEXPIRE', key, ttl - by) end
    end
  end
until cursor == '0'
return 0
";

pub(crate) fn request_id(index: u8) -> RequestId {
    RequestId::new(format!("r{index}")).expect("a valid id")
}

impl World {
    /// The configuration of every component of a world.
    pub(crate) fn config(url: &str) -> Config {
        Config::new(url)
            .namespace("ck")
            .lease(Duration::from_millis(1000))
            .heartbeat(Duration::from_millis(300))
            .retention(Duration::from_secs(24 * 3600))
            .loading_ttl(Duration::from_secs(3600))
            // A windowed producer's poll: the checker's time is its own.
            .window_poll(Duration::from_millis(1))
    }

    /// The connections a world's processes share (kept across the worlds of one runner: making
    /// them, and loading the library, is most of a short sequence's time otherwise).
    pub(crate) async fn connections(url: &str) -> crate::Result<Connections> {
        let config = Self::config(url);
        let (gate, events) = Gate::new(2);
        let gate = Arc::new(gate);
        let store = Store::for_checker(&config, gate.clone()).await?;
        store.load_library().await?;
        let mut blocking = Vec::new();
        for _ in 0..(WORKERS * SLOTS) {
            blocking.push(store.blocking_client().await?);
        }
        Ok(Connections { config, gate, store, blocking, events: Some(events) })
    }

    pub(crate) fn new(conns: &mut Connections, reader: Client) -> World {
        let mut events = conns.events.take().expect("one world at a time");
        // Nothing of an earlier world may reach this one.
        while events.try_recv().is_ok() {}
        let (config, gate, store, blocking) =
            (conns.config.clone(), conns.gate.clone(), conns.store.clone(), conns.blocking.clone());
        World {
            config,
            store,
            gate,
            events,
            reader,
            blocking,
            workers: (0..WORKERS).map(|_| None).collect(),
            incarnations: [0; WORKERS as usize],
            actors: HashMap::new(),
            next_actor: 0,
            started: Vec::new(),
            parked: Vec::new(),
            runs: HashMap::new(),
            producers_busy: [false; PRODUCERS as usize],
            producer_stats: Default::default(),
            model: Model::default(),
            clock_ms: 0,
            elements: Vec::new(),
            elements_seen: HashSet::new(),
        }
    }

    /// Ends the world: aborts what still runs, and hands the event receiver back.
    pub(crate) fn end(mut self, conns: &mut Connections) {
        for (_, mut actor) in self.actors.drain() {
            if let Some(task) = actor.task.take() {
                task.abort();
            }
        }
        self.parked.clear();
        conns.events = Some(self.events);
    }

    /// The worker process `w`, started (as a new incarnation) if it is not running. A new worker's
    /// first beat is made before anything else, as `Worker::run_until` does.
    async fn worker(&mut self, w: u8) -> Result<&mut WorkerProc, String> {
        if self.workers[w as usize].is_none() {
            self.incarnations[w as usize] += 1;
            let incarnation = self.incarnations[w as usize];
            let shared = Arc::new(slot::Shared {
                store: self.store.clone(),
                handler: Arc::new(CheckHandler { gate: self.gate.clone() }),
                worker_id: std::sync::Mutex::new(worker_id(w, incarnation)),
                quantum: Quantum { parts: 3, time: Duration::from_secs(3600) },
                max_batch: 2,
                // An idle slot's wait on the bell: short, since the checker's time is its own.
                idle_poll: Duration::from_millis(1),
                shard_poll: Duration::from_millis(1),
                shutdown_grace: Duration::from_secs(3600),
                leases: Default::default(),
                metrics: Arc::new(WorkerMetrics::default()),
                stats: Arc::new(Recorder::new(self.config.stats_keep())),
                stopping: CancellationToken::new(),
                wakes: None,
                higher: Default::default(),
                standby: Default::default(),
                bound: None,
                releasing: Default::default(),
            });
            let slots = (0..SLOTS)
                .map(|n| Arc::new(tokio::sync::Mutex::new(slot::Slot::new(n as usize, 1))))
                .collect();
            let first_beat = Arc::new(std::sync::atomic::AtomicBool::new(true));
            self.workers[w as usize] =
                Some(WorkerProc { incarnation, shared, slots, busy: [None; SLOTS as usize], first_beat });
            self.apply_beat(w).await?;
            // The first beat runs to its end at once.
            while let Some(i) = self.parked.iter().position(|p| {
                self.actors.get(&p.actor()).is_some_and(|a| {
                    matches!(a.what, Task::Beat) && a.process == Process::Worker(w, incarnation)
                })
            }) {
                let parked = self.parked.remove(i);
                self.resume(parked, Fault::None, Verdict::Ok).await?;
            }
        }
        self.workers[w as usize].as_mut().ok_or_else(|| format!("worker {w} died during its first beat"))
    }

    /// Starts a beat of worker `w`: its registration, reaping of the dead workers it claims, and
    /// the check of its slots' holds.
    async fn apply_beat(&mut self, w: u8) -> Result<(), String> {
        let p = self.workers[w as usize].as_ref().ok_or("no such worker")?;
        let (shared, process, first) =
            (p.shared.clone(), Process::Worker(w, p.incarnation), p.first_beat.clone());
        self.spawn(process, Task::Beat, async move {
            let info = crate::worker::WorkerInfo {
                id: shared.id(),
                slots: SLOTS as usize,
                pid: 0,
                host: "checker".into(),
                started_ms: 0,
                shards: 1,
                registration_expires_ms: None,
                version: None,
                label: None,
                busy: Vec::new(),
            };
            let store = &shared.store;
            match crate::worker::registry::beat(store, &info, first.load(Relaxed)).await {
                Ok(found) => {
                    first.store(false, Relaxed);
                    if !found.alive {
                        shared.leases.cancel_all();
                        shared.renew_id();
                        first.store(true, Relaxed);
                    }
                    for (id, described) in found.dead {
                        if let Err(e) =
                            crate::worker::recovery::reap(store, &shared.metrics, &id, described.as_ref())
                                .await
                        {
                            return Outcome::Error(e.to_string());
                        }
                    }
                }
                Err(e) => return Outcome::Error(e.to_string()),
            }
            shared.leases.check(store, Duration::ZERO, &shared.metrics.leases_lost).await;
            Outcome::Done
        })
        .await
    }

    /// Applies one operation; `Err` names a broken invariant or a stuck actor.
    pub(crate) async fn apply(&mut self, op: &Op) -> Result<(), String> {
        match op {
            Op::Submit(s) => {
                if self.producers_busy[s.producer as usize] {
                    return Ok(());
                }
                self.producers_busy[s.producer as usize] = true;
                let (s, sent) = self.prepare(s).await?;
                let producer = Producer::from_store(self.store.clone(), self.producer_stats(s.producer));
                self.spawn(Process::Producer(s.producer), Task::Submit(s), async move {
                    submit(&producer, &sent).await
                })
                .await
            }
            Op::SubmitMany { producer: p, requests } => {
                if self.producers_busy[*p as usize] {
                    return Ok(());
                }
                self.producers_busy[*p as usize] = true;
                let (mut batch, mut sent) = (Vec::new(), Vec::new());
                for s in requests {
                    let (s, s2) = self.prepare(&Submit { producer: *p, ..s.clone() }).await?;
                    batch.push(s);
                    sent.push(s2);
                }
                let producer = Producer::from_store(self.store.clone(), self.producer_stats(*p));
                self.spawn(Process::Producer(*p), Task::SubmitMany(batch), async move {
                    submit_many(&producer, &sent).await
                })
                .await
            }
            Op::Take { worker, slot, floor, way, apart, cut, wide, room } => {
                let blocking = self.blocking[(*worker * SLOTS + *slot) as usize].clone();
                self.worker(*worker).await?;
                let id = self.next_actor;
                let w = self.worker(*worker).await?;
                if w.busy[*slot as usize].is_some() {
                    return Ok(());
                }
                let (shared, state) = (w.shared.clone(), w.slots[*slot as usize].clone());
                let process = Process::Worker(*worker, w.incarnation);
                w.busy[*slot as usize] = Some(id);
                let floor = floor.map(Priority::new).transpose().map_err(|e| e.to_string())?;
                if *way {
                    shared.higher.announce(0, Priority::MAX);
                }
                let drawn = Drawn { apart: *apart, cut: *cut, wide: *wide, room: *room };
                self.spawn_as(process, Task::Take { slot: *slot }, drawn, async move {
                    let mut state = state.lock().await;
                    state.floor = floor;
                    match slot::take_and_serve(&shared, &mut state, &blocking, 0).await {
                        Ok(()) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::Beat { worker } => {
                self.worker(*worker).await?;
                self.apply_beat(*worker).await
            }
            Op::Recover { worker } => {
                let w = self.worker(*worker).await?;
                let (shared, process) = (w.shared.clone(), Process::Worker(*worker, w.incarnation));
                self.spawn(process, Task::Recover, async move {
                    if let Err(e) =
                        crate::worker::recovery::pass(&shared.store, &shared.metrics, &shared.stats).await
                    {
                        return Outcome::Error(e.to_string());
                    }
                    match crate::worker::recovery::scan_held(&shared.store, &shared.metrics).await {
                        Ok(_) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::Cancel { request } => {
                let admin = Admin::from_store(self.store.clone());
                let id = request_id(*request);
                self.spawn(Process::Operator, Task::Cancel(*request), async move {
                    match admin.cancel(&id).await {
                        // Already cancelled: maybe by this very call, re-sent after it ran.
                        Ok(Cancelled::Now | Cancelled::AlreadyFinished(crate::RequestState::Cancelled)) => {
                            Outcome::Cancelled
                        }
                        Ok(_) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::ReadResults { request, count } => {
                let producer = Producer::from_store(self.store.clone(), Arc::new(Recorder::off()));
                let (first, purges) =
                    self.model.requests.get(request).map_or((0, 0), |r| (r.read_next, r.purges));
                let (i, count) = (*request, usize::from(*count));
                self.spawn(Process::Reader, Task::Read(i, first, purges), async move {
                    let handle = producer.handle(request_id(i));
                    match handle.results_from::<u64>(first, count).await {
                        Ok(page) => Outcome::Read {
                            first: page.first,
                            terminal: page.state.is_terminal(),
                            results: page.results.into_iter().map(|r| r.map_err(|e| e.attempts)).collect(),
                        },
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::RequeueFailed { pick } => {
                let request = self.pick_target(*pick, &["failed"], true).await?;
                Box::pin(self.apply(&Op::Requeue { request })).await
            }
            Op::CancelQueued { pick } => {
                let request = self.pick_target(*pick, &["queued"], true).await?;
                Box::pin(self.apply(&Op::Cancel { request })).await
            }
            Op::RequeueRunning { pick } => {
                let request = self.pick_target(*pick, &["running"], true).await?;
                Box::pin(self.apply(&Op::Requeue { request })).await
            }
            Op::Requeue { request } => {
                self.model.requests.entry(*request).or_default().requeue_tried = true;
                let admin = Admin::from_store(self.store.clone());
                let id = request_id(*request);
                self.spawn(Process::Operator, Task::Requeue(*request), async move {
                    match admin.requeue_dead(&id).await {
                        Ok(n) => Outcome::Requeued(n),
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::Finalize { request } => {
                let admin = Admin::from_store(self.store.clone());
                let id = request_id(*request);
                self.spawn(Process::Operator, Task::Finalize(*request), async move {
                    match admin.finalize(&id).await {
                        Ok(()) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::Reprioritize { pick, priority } => {
                let request = self.pick_target(*pick, &["scheduled", "queued", "running"], false).await?;
                let admin = Admin::from_store(self.store.clone());
                let id = request_id(request);
                let priority = crate::Priority::new(*priority).expect("drawn in range");
                self.spawn(Process::Operator, Task::Reprioritize(request), async move {
                    match admin.reprioritize(&id, priority).await {
                        Ok(_) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::Track { pick, on } => {
                let request = self
                    .pick_target(
                        *pick,
                        &["loading", "scheduled", "queued", "running", "completed", "failed", "cancelled"],
                        true,
                    )
                    .await?;
                let admin = Admin::from_store(self.store.clone());
                let (id, on) = (request_id(request), *on);
                self.spawn(Process::Operator, Task::Track(request), async move {
                    match admin.track(&id, on).await {
                        Ok(()) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::Purge { pick } => {
                let request = self.pick_target(*pick, &["completed", "failed", "cancelled"], true).await?;
                self.model.purging(request);
                let admin = Admin::from_store(self.store.clone());
                let id = request_id(request);
                self.spawn(Process::Operator, Task::Purge(request), async move {
                    match admin.purge(&id).await {
                        Ok(purged) => Outcome::Purged(purged),
                        Err(crate::Error::Refused(why)) => Outcome::Refused(why),
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::PurgeFinished { state, older_than_ms } => {
                use crate::ListState;
                let state =
                    [ListState::Completed, ListState::Failed, ListState::Cancelled][*state as usize % 3];
                let older_than = Duration::from_millis(u64::from(*older_than_ms));
                for i in 0..super::ops::REQUEST_IDS {
                    self.model.purging(i);
                }
                let admin = Admin::from_store(self.store.clone());
                self.spawn(Process::Operator, Task::PurgeFinished, async move {
                    match admin.purge_finished(state, older_than).await {
                        Ok(_) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::FlushStats { pick } => {
                // The producers and the running workers that counted something, in that order.
                let mut counted: Vec<(Process, Arc<Recorder>, Store)> = Vec::new();
                for (p, recorder) in self.producer_stats.iter().enumerate() {
                    if let Some(r) = recorder.as_ref().filter(|r| !r.is_empty()) {
                        counted.push((Process::Producer(p as u8), r.clone(), self.store.clone()));
                    }
                }
                for (w, proc_) in self.workers.iter().enumerate() {
                    if let Some(p) = proc_.as_ref().filter(|p| !p.shared.stats.is_empty()) {
                        let process = Process::Worker(w as u8, p.incarnation);
                        counted.push((process, p.shared.stats.clone(), p.shared.store.clone()));
                    }
                }
                if counted.is_empty() {
                    return Ok(());
                }
                let (process, recorder, store) = counted.swap_remove(*pick as usize % counted.len());
                self.spawn(process, Task::Flush, async move {
                    match recorder.flush(&store).await {
                        Ok(()) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::SetGroup { group, limit, rate } => {
                let admin = Admin::from_store(self.store.clone());
                let (name, limit) = (super::ops::group_name(*group), u32::from(*limit));
                let rate = rate.map(|(n, per_ms)| (u32::from(n), Duration::from_millis(u64::from(per_ms))));
                self.spawn(Process::Operator, Task::Pause, async move {
                    let set = match admin.set_group(&name, limit).await {
                        Ok(()) if rate.is_some() => admin.set_group_rate(&name, rate).await,
                        other => other,
                    };
                    match set {
                        Ok(()) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::Pause { priority } | Op::Resume { priority } => {
                let admin = Admin::from_store(self.store.clone());
                let priority = priority.map(|p| crate::Priority::new(p).expect("drawn in range"));
                let pause = matches!(op, Op::Pause { .. });
                self.spawn(Process::Operator, Task::Pause, async move {
                    let done = if pause { admin.pause(priority).await } else { admin.resume(priority).await };
                    match done {
                        Ok(()) => Outcome::Done,
                        Err(e) => Outcome::Error(e.to_string()),
                    }
                })
                .await
            }
            Op::Step { pick, fault, verdict } => {
                if self.parked.is_empty() {
                    return Ok(());
                }
                let parked = self.parked.remove(*pick as usize % self.parked.len());
                self.resume(parked, *fault, *verdict).await
            }
            Op::Advance { ms } => {
                self.clock_ms += u64::from(*ms);
                let _: () = self
                    .reader
                    .set("sgcheck:clock", self.clock_ms, None, None, false)
                    .await
                    .map_err(|e| e.to_string())?;
                // Expiries age by the same amount: Redis expires keys by its own clock, which the
                // checker does not move.
                let pattern = format!("{}:*", self.config.namespace_str());
                let _: Value = self
                    .reader
                    .eval(AGE_KEYS, Vec::<String>::new(), vec![ms.to_string(), pattern])
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(())
            }
            Op::Plant { pick, tail, current } => {
                if self.elements.is_empty() {
                    return Ok(());
                }
                let (list, element) = if *current {
                    // Among the elements whose token is queued now, under its epoch now, onto any
                    // list seen so far (an earlier request under the id may have used it).
                    let copies = self.queued_copies().await?;
                    if copies.is_empty() {
                        return Ok(());
                    }
                    let mut lists: Vec<&String> = Vec::new();
                    for (list, _) in &self.elements {
                        if !lists.contains(&list) {
                            lists.push(list);
                        }
                    }
                    let n = *pick as usize;
                    (lists[n / copies.len() % lists.len()].clone(), copies[n % copies.len()].clone())
                } else {
                    self.elements[*pick as usize % self.elements.len()].clone()
                };
                let pushed: Result<i64, _> = if *tail {
                    self.reader.rpush(&list, element.as_str()).await
                } else {
                    self.reader.lpush(&list, element.as_str()).await
                };
                pushed.map_err(|e| e.to_string())?;
                if std::env::var("SLUICEGATE_CHECK_TRACE").is_ok() {
                    eprintln!("    planted {element} on {list} (of {} seen)", self.elements.len());
                }
                super::model::PLANTED.fetch_add(1, Relaxed);
                Ok(())
            }
            Op::Kill { pick } => {
                if self.parked.is_empty() {
                    return Ok(());
                }
                let actor = self.parked[*pick as usize % self.parked.len()].actor();
                if let Some(process) = self.actors.get(&actor).map(|a| a.process) {
                    self.kill(process);
                }
                Ok(())
            }
            #[cfg(feature = "schedules")]
            Op::Schedule { name, action } => {
                let admin = Admin::from_store(self.store.clone());
                let (name, action) = (*name % super::ops::SCHEDULES, *action);
                self.spawn(Process::Operator, Task::Schedule(name), async move {
                    match super::schedules::act(&admin, name, action).await {
                        Ok(()) => Outcome::Done,
                        Err(e) => Outcome::Error(e),
                    }
                })
                .await
            }
            #[cfg(not(feature = "schedules"))]
            Op::Schedule { .. } => Ok(()),
            Op::Restart | Op::Drain => Ok(()), // done by the runner
        }
    }

    /// The elements seen so far whose tokens (of requests with keys of their own) are queued now,
    /// each under the epoch its token is queued with now.
    async fn queued_copies(&self) -> Result<Vec<String>, String> {
        let ns = self.config.namespace_str();
        let mut epochs: HashMap<(String, u32), Option<u64>> = HashMap::new();
        let mut out = Vec::new();
        for (_, seen) in &self.elements {
            let Some(mut copy) = crate::protocol::TokenElement::parse(seen) else { continue };
            let at = (copy.key_id.clone(), copy.k);
            if !epochs.contains_key(&at) {
                let token: Option<String> = self
                    .reader
                    .hget(format!("{ns}:r:{{{}}}", copy.key_id), format!("t{}", copy.k))
                    .await
                    .map_err(|e| e.to_string())?;
                let queued = token.as_deref().and_then(|t| t.strip_prefix("q|"));
                epochs.insert(at.clone(), queued.and_then(|q| q.split('|').next()?.parse().ok()));
            }
            if let Some(epoch) = epochs[&at] {
                copy.epoch = epoch;
                out.push(copy.to_string());
            }
        }
        Ok(out)
    }

    /// Notes the token elements on the namespace's lists that it has not seen before
    /// (`Op::Plant`): those of one step in the order of their lists' names, then positions.
    pub(crate) async fn note_elements(&mut self) -> Result<(), String> {
        let pattern = format!("{}:*:p:*", self.config.namespace_str());
        let found: Vec<String> = self
            .reader
            .eval(TOKEN_ELEMENTS, Vec::<String>::new(), vec![pattern])
            .await
            .map_err(|e| e.to_string())?;
        let mut found: Vec<(usize, (String, String))> = found
            .chunks_exact(2)
            .enumerate()
            .map(|(at, pair)| (at, (pair[0].clone(), pair[1].clone())))
            .collect();
        // (SCAN's order of lists varies; an element's position in its list does not.)
        found.sort_by(|a, b| a.1 .0.cmp(&b.1 .0).then(a.0.cmp(&b.0)));
        for (_, pair) in found {
            if self.elements_seen.insert(pair.clone()) {
                self.elements.push(pair);
            }
        }
        Ok(())
    }

    /// The request an operator's `pick` names (`Op::Reprioritize`, `Op::Track`, `Op::Purge`):
    /// with `pick` a multiple of 4, id `pick / 4` of the pool, whatever it is; otherwise one of
    /// the pool's requests in one of `states` at this moment, modulo their number (those with keys
    /// of their own, or also lane requests if `lanes`), and with none, id `pick` of the pool.
    async fn pick_target(&self, pick: u8, states: &[&str], lanes: bool) -> Result<u8, String> {
        if pick % 4 == 0 {
            return Ok(pick / 4 % super::ops::REQUEST_IDS);
        }
        let ns = self.config.namespace_str();
        let mut found = Vec::new();
        for i in 0..super::ops::REQUEST_IDS {
            let kid = request_id(i).key_id();
            let mut state: Option<String> =
                self.reader.hget(format!("{ns}:r:{{{kid}}}"), "state").await.map_err(|e| e.to_string())?;
            if state.is_none() && lanes {
                let record: Option<Vec<u8>> = self
                    .reader
                    .hget(format!("{ns}:{{{ns}.q0}}:s:{kid}"), "state")
                    .await
                    .map_err(|e| e.to_string())?;
                state = record.map(|s| String::from_utf8_lossy(&s).into_owned());
            }
            if state.as_deref().is_some_and(|s| states.contains(&s)) {
                found.push(i);
            }
        }
        Ok(if found.is_empty() { pick % super::ops::REQUEST_IDS } else { found[pick as usize % found.len()] })
    }

    /// A submit about to be sent: under a free id if it asks for one, counted by the model as under
    /// way, and (the copy that is sent) with its upstreams picked.
    async fn prepare(&mut self, s: &Submit) -> Result<(Submit, Submit), String> {
        let s = self.fresh(s).await?;
        self.model.submitting(&s);
        let mut s2 = s.clone();
        // Its upstreams, picked as `Reprioritize` picks (mostly among the pool's requests
        // that exist now, whatever their state; now and then an id that may not exist).
        const ANY: [&str; 8] =
            ["loading", "scheduled", "waiting", "queued", "running", "completed", "failed", "cancelled"];
        s2.after.clear();
        for pick in &s.after {
            let mut up = self.pick_target(*pick, &ANY, true).await?;
            if up == s.request && pick % 4 != 0 {
                // Itself is refused at once: pick another, if any.
                up = self.pick_target(pick.wrapping_add(1) | 1, &ANY, true).await?;
            }
            s2.after.push(up);
        }
        Ok((s, s2))
    }

    /// `s`, under a free id of the pool if it asks for one (`Submit::fresh_id`).
    async fn fresh(&self, s: &Submit) -> Result<Submit, String> {
        let mut s = s.clone();
        if !s.fresh_id {
            return Ok(s);
        }
        let ns = self.config.namespace_str();
        for n in 0..super::ops::REQUEST_IDS {
            let i = (s.request + n) % super::ops::REQUEST_IDS;
            let kid = request_id(i).key_id();
            let keys: i64 = self
                .reader
                .exists(vec![format!("{ns}:r:{{{kid}}}"), format!("{ns}:{{{ns}.q0}}:s:{kid}")])
                .await
                .map_err(|e| e.to_string())?;
            if keys == 0 && self.model.requests.get(&i).map_or(true, |r| r.submitting == 0) {
                s.request = i;
                break;
            }
        }
        Ok(s)
    }

    /// The recorder of producer process `p`: what it counted since its last flush.
    fn producer_stats(&mut self, p: u8) -> Arc<Recorder> {
        let keep = self.config.stats_keep();
        self.producer_stats[p as usize % PRODUCERS as usize]
            .get_or_insert_with(|| Arc::new(Recorder::new(keep)))
            .clone()
    }

    /// Starts an actor and runs it to its first park (or its end).
    async fn spawn<F>(&mut self, process: Process, what: Task, body: F) -> Result<(), String>
    where
        F: std::future::Future<Output = Outcome> + Send + 'static,
    {
        self.spawn_as(process, what, Drawn::default(), body).await
    }

    /// [`spawn`](Self::spawn), for a slot's take, as it was drawn (`Gate::set_drawn`).
    async fn spawn_as<F>(&mut self, process: Process, what: Task, drawn: Drawn, body: F) -> Result<(), String>
    where
        F: std::future::Future<Output = Outcome> + Send + 'static,
    {
        let id = self.next_actor;
        self.next_actor += 1;
        let task = tokio::spawn(body);
        self.actors.insert(id, Actor { task: Some(task), process, what, drawn });
        Box::pin(self.run_until_parked(id)).await?;
        Box::pin(self.start_apart()).await
    }

    /// Makes the work started apart actors of their own, each run to its first park: only now is
    /// it polled, so that each event still comes from the one actor running.
    async fn start_apart(&mut self) -> Result<(), String> {
        while let Some(Started { by, process, work }) = self.started.pop() {
            let id = self.next_actor;
            self.next_actor += 1;
            let task = tokio::spawn(async move {
                work.await;
                Outcome::Done
            });
            self.actors.insert(
                id,
                Actor { task: Some(task), process, what: Task::Apart(by), drawn: Drawn::default() },
            );
            self.run_until_parked(id).await?;
        }
        Ok(())
    }

    /// Resumes one parked thing and runs its actor to its next park (or its end).
    pub(crate) async fn resume(
        &mut self,
        parked: Parked,
        fault: Fault,
        verdict: Verdict,
    ) -> Result<(), String> {
        let actor = parked.actor();
        if std::env::var("SLUICEGATE_CHECK_TRACE").is_ok() {
            let what = self.actors.get(&actor).map(|a| format!("{:?}", a.what)).unwrap_or_default();
            match &parked {
                Parked::Call { what: call, key, .. } => {
                    eprintln!("      actor {actor} {what}: {call} {key} ({fault:?})")
                }
                Parked::Handler { request, index, attempt, .. } => {
                    eprintln!("      actor {actor} {what}: handler {request}[{index}] attempt {attempt} -> {verdict:?}")
                }
            }
        }
        match parked {
            Parked::Call { resume, what, key, .. } => {
                if self.runs.remove(&actor).is_some_and(|n| n > 2) {
                    super::model::WIDE_BATCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                self.model.call(actor, &what, &key, fault);
                let _ = resume.send(fault);
            }
            Parked::Handler { resume, request, index, attempt, .. } => {
                *self.runs.entry(actor).or_default() += 1;
                self.model.verdict(&request, index, attempt, verdict);
                let _ = resume.send(verdict);
            }
        }
        Box::pin(self.run_until_parked(actor)).await?;
        Box::pin(self.start_apart()).await
    }

    async fn run_until_parked(&mut self, id: u64) -> Result<(), String> {
        let Some(actor) = self.actors.get_mut(&id) else { return Ok(()) };
        self.gate.set_drawn(actor.drawn);
        let (Some(mut task), process) = (actor.task.take(), actor.process) else { return Ok(()) };
        let limit = tokio::time::sleep(STEP_LIMIT);
        tokio::pin!(limit);
        let event = loop {
            let event = tokio::select! {
                biased;
                ev = self.events.recv() => Some(ev),
                end = &mut task => {
                    let outcome = end.unwrap_or_else(|e| Outcome::Error(format!("actor panicked: {e}")));
                    self.finished(id, outcome);
                    return Ok(());
                }
                _ = &mut limit => None,
            };
            match event {
                Some(Some(Event::Apart(work))) => self.started.push(Started { by: id, process, work }),
                other => break other,
            }
        };
        let actor = self.actors.get_mut(&id).expect("a running actor is known");
        match event {
            Some(Some(Event::Call { what, key, resume })) => {
                actor.task = Some(task);
                self.parked.push(Parked::Call { actor: id, what, key, resume });
                Ok(())
            }
            Some(Some(Event::Handler { request, index, attempt, input, resume })) => {
                actor.task = Some(task);
                let now =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                let at_ms = now.as_millis() as u64 + self.clock_ms;
                self.model.handler_started(id, &request, index, attempt, input, at_ms);
                self.parked.push(Parked::Handler { actor: id, request, index, attempt, resume });
                Ok(())
            }
            Some(Some(Event::Dying)) => {
                actor.task = Some(task);
                let process = actor.process;
                self.kill(process);
                Ok(())
            }
            Some(Some(Event::Apart(_))) => unreachable!("work started apart is kept above"),
            Some(None) => Err("the checker's event channel closed".into()),
            None => {
                let what = actor.what.clone();
                task.abort();
                Err(format!("actor {id} ({what:?}) reached no call within {STEP_LIMIT:?}"))
            }
        }
    }

    fn finished(&mut self, id: u64, outcome: Outcome) {
        if std::env::var("SLUICEGATE_CHECK_TRACE").is_ok() {
            eprintln!("      actor {id} ended: {outcome:?}");
        }
        if let Some(actor) = self.actors.remove(&id) {
            if matches!(actor.what, Task::Apart(_)) {
                super::model::RELEASED_APART.fetch_add(1, Relaxed);
            }
            self.release(id, &actor);
            self.model.ended(&actor.what, outcome);
        }
    }

    /// Forgets what an actor occupied (its slot, its producer).
    fn release(&mut self, id: u64, actor: &Actor) {
        match (actor.process, &actor.what) {
            (Process::Worker(w, inc), Task::Take { slot }) => {
                if let Some(proc_) = self.workers[w as usize].as_mut().filter(|p| p.incarnation == inc) {
                    if proc_.busy[*slot as usize] == Some(id) {
                        proc_.busy[*slot as usize] = None;
                    }
                }
            }
            (Process::Producer(p), Task::Submit(_) | Task::SubmitMany(_)) => {
                self.producers_busy[p as usize] = false
            }
            _ => {}
        }
    }

    /// SIGKILL: every actor of `process` dies where it is parked; a worker's handlers with it.
    pub(crate) fn kill(&mut self, process: Process) {
        let dead: Vec<u64> =
            self.actors.iter().filter(|(_, a)| a.process == process).map(|(id, _)| *id).collect();
        for id in &dead {
            if let Some(mut actor) = self.actors.remove(id) {
                if let Some(task) = actor.task.take() {
                    task.abort();
                }
                self.release(*id, &actor);
                self.model.died(*id, &actor.what);
            }
        }
        self.parked.retain(|p| !dead.contains(&p.actor()));
        // What its actors started apart and that has not run yet dies with them.
        self.started.retain(|s| s.process != process);
        if let Process::Producer(p) = process {
            // What it counted and had not flushed dies with it.
            self.producer_stats[p as usize] = None;
            self.model.stats_lost = true;
        }
        if let Process::Worker(w, inc) = process {
            if let Some(p) = self.workers[w as usize].take_if(|p| p.incarnation == inc) {
                self.model.schedule_submits_before += p.shared.metrics.schedule_submits.load(Relaxed);
                super::model::HANDED_OFF.fetch_add(p.shared.metrics.handed_off.load(Relaxed), Relaxed);
                super::model::HANDED_BACK.fetch_add(p.shared.metrics.handed_back.load(Relaxed), Relaxed);
            }
        }
    }

    /// Stops every worker process cleanly, as `Worker::run_until` does at its end: its slots end
    /// their take records, it flushes its stats by stage and leaves the registry; the producers
    /// flush theirs (calls made outside the gate).
    pub(crate) async fn stop_workers(&mut self) -> Result<(), String> {
        // The drain left no actor running; whatever is left (none) stops here, workers stay.
        for (_, mut actor) in self.actors.drain() {
            if let Some(task) = actor.task.take() {
                task.abort();
            }
        }
        self.parked.clear();
        let mut plain = self.store.clone();
        plain.gate = None;
        for w in self.workers.iter_mut() {
            let Some(p) = w.take() else { continue };
            self.model.schedule_submits_before += p.shared.metrics.schedule_submits.load(Relaxed);
            super::model::HANDED_OFF.fetch_add(p.shared.metrics.handed_off.load(Relaxed), Relaxed);
            super::model::HANDED_BACK.fetch_add(p.shared.metrics.handed_back.load(Relaxed), Relaxed);
            let shared = slot::Shared {
                store: plain.clone(),
                handler: p.shared.handler.clone(),
                worker_id: std::sync::Mutex::new(p.shared.id()),
                quantum: p.shared.quantum,
                max_batch: p.shared.max_batch,
                idle_poll: p.shared.idle_poll,
                shard_poll: p.shared.shard_poll,
                shutdown_grace: p.shared.shutdown_grace,
                leases: Default::default(),
                metrics: p.shared.metrics.clone(),
                stats: p.shared.stats.clone(),
                stopping: CancellationToken::new(),
                wakes: None,
                higher: Default::default(),
                standby: Default::default(),
                bound: None,
                releasing: Default::default(),
            };
            for state in &p.slots {
                slot::release_all(&shared, &mut *state.lock().await).await;
            }
            // Its last flush of the stats by stage, after its slots stopped.
            shared.stats.flush(&plain).await.map_err(|e| e.to_string())?;
            crate::worker::registry::leave(&plain, &shared.id()).await.map_err(|e| e.to_string())?;
        }
        // The producers flush once more too (as their last handle does when it is dropped).
        for recorder in self.producer_stats.iter_mut().filter_map(Option::take) {
            recorder.flush(&plain).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The workers alive now, as (index, worker id).
    pub(crate) fn live_workers(&self) -> Vec<(u8, String)> {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(w, p)| p.as_ref().map(|p| (w as u8, p.shared.id())))
            .collect()
    }

    /// The holder (`<worker id>/<slot>`) of the slot actor `actor`, if it is one.
    pub(crate) fn holder_of(&self, actor: u64) -> Option<String> {
        let a = self.actors.get(&actor)?;
        match (a.process, &a.what) {
            (Process::Worker(w, inc), Task::Take { slot }) => {
                let p = self.workers[w as usize].as_ref().filter(|p| p.incarnation == inc)?;
                Some(format!("{}/{slot}", p.shared.id()))
            }
            _ => None,
        }
    }

    pub(crate) fn actor_count(&self) -> usize {
        self.actors.len()
    }

    /// Whether an actor that touches request `kid` is mid-way (parked between its calls).
    pub(crate) fn busy_with(&self, kid: &str) -> bool {
        self.actors.keys().any(|id| self.model.touched(*id, kid))
    }
}

fn worker_id(w: u8, incarnation: u32) -> String {
    format!("w{w}i{incarnation}")
}

/// The payload of part `index` of request `request`: distinct across requests.
pub(crate) fn payload(request: u8, index: u64) -> u64 {
    u64::from(request) * 1000 + index + 1
}

/// The request `s` describes, as its producer builds it (its parts aside).
fn builder<'a>(producer: &'a Producer, s: &Submit) -> crate::Result<crate::producer::RequestBuilder<'a>> {
    let id = request_id(s.request).to_string();
    let b = producer
        .request()
        .id(id.clone())?
        .priority(s.priority)?
        .concurrency(u32::from(s.limit))?
        .max_attempts(u32::from(s.max_attempts))?
        .backoff(
            Duration::from_millis(u64::from(s.backoff_ms)),
            Duration::from_millis(u64::from(s.backoff_ms) * 4),
        )?
        .fail_fast(s.fail_fast)
        .own_stream(s.own_stream)
        .discard_results(s.discard);
    let b =
        if s.deadline_ms > 0 { b.deadline_in(Duration::from_millis(u64::from(s.deadline_ms))) } else { b };
    let b = match s.rate {
        Some((n, per_ms)) => b.rate(u32::from(n), Duration::from_millis(u64::from(per_ms)))?,
        None => b,
    };
    let policy = if s.run_anyway { crate::OnUpstreamFailure::Run } else { crate::OnUpstreamFailure::Fail };
    let b = b.after(s.after.iter().map(|u| request_id(*u))).on_upstream_failure(policy);
    let b = match s.group {
        Some(g) => b.group(&super::ops::group_name(g))?,
        None => b,
    };
    Ok(if s.unlisted_here() { b.unlisted() } else { b })
}

/// One `submit_many` of whole requests: each answer as `submit`'s.
async fn submit_many(producer: &Producer, batch: &[Submit]) -> Outcome {
    let mut answers: Vec<Option<Outcome>> = Vec::new();
    let mut sent = Vec::new();
    let mut asked = Vec::new();
    for s in batch {
        let Shape::Whole { parts, delay_ms } = s.shape else {
            answers.push(Some(Outcome::Error("submit_many takes whole requests".into())));
            continue;
        };
        match builder(producer, s) {
            Ok(b) => {
                let b = b.delay(Duration::from_millis(u64::from(delay_ms)));
                sent.push((b, (0..u64::from(parts)).map(|i| payload(s.request, i)).collect::<Vec<u64>>()));
                asked.push((answers.len(), u64::from(parts)));
                answers.push(None);
            }
            Err(e) => answers.push(Some(Outcome::from_submit(Err(e)))),
        }
    }
    let got = producer.submit_many(sent).await;
    if got.len() != asked.len() {
        return Outcome::Error(format!("submit_many gave {} answers to {} requests", got.len(), asked.len()));
    }
    for ((at, parts), answer) in asked.into_iter().zip(got) {
        answers[at] = Some(Outcome::from_submit(answer.map(|_| parts)));
    }
    Outcome::Many(answers.into_iter().map(|a| a.expect("every request answered")).collect())
}

async fn submit(producer: &Producer, s: &Submit) -> Outcome {
    let build = || builder(producer, s);
    let result = match &s.shape {
        Shape::Whole { parts, delay_ms } => {
            let parts: Vec<u64> = (0..u64::from(*parts)).map(|i| payload(s.request, i)).collect();
            // A batch of this one request.
            if s.bulk {
                return match submit_many(producer, std::slice::from_ref(s)).await {
                    Outcome::Many(mut each) if each.len() == 1 => each.remove(0),
                    other => other,
                };
            }
            match build() {
                Ok(b) => b
                    .delay(Duration::from_millis(u64::from(*delay_ms)))
                    .submit(parts)
                    .await
                    .map(|_| u64::from(*parts_len(&s.shape))),
                Err(e) => Err(e),
            }
        }
        Shape::Streamed { adds, finalize, window, discard } => {
            let windowed = build().map(|b| b.discard_results(*discard)).and_then(|b| {
                if *window > 0 {
                    b.window(u64::from(*window))
                } else {
                    Ok(b)
                }
            });
            let mut open = match windowed {
                Ok(b) => match b.open().await {
                    Ok(o) => o,
                    Err(e) => return Outcome::from_submit(Err(e)),
                },
                Err(e) => return Outcome::from_submit(Err(e)),
            };
            let mut next = 0u64;
            for n in adds {
                let parts: Vec<u64> = (next..next + u64::from(*n)).map(|i| payload(s.request, i)).collect();
                if let Err(e) = open.add(parts).await {
                    return Outcome::Streamed {
                        added: next,
                        ambiguous: u64::from(*n),
                        error: Some(e.to_string()),
                    };
                }
                next += u64::from(*n);
            }
            if *finalize {
                if let Err(e) = open.finalize().await {
                    return Outcome::Streamed { added: next, ambiguous: 0, error: Some(e.to_string()) };
                }
            }
            return Outcome::Streamed { added: next, ambiguous: 0, error: None };
        }
    };
    Outcome::from_submit(result)
}

fn parts_len(shape: &Shape) -> &u8 {
    match shape {
        Shape::Whole { parts, .. } => parts,
        Shape::Streamed { .. } => &0,
    }
}
