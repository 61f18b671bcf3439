//! Workers: slots that take concurrency tokens, run the user's handler, and ack.

mod bound;
mod handler;
mod higher;
mod leases;
mod liveness;
pub(crate) mod recovery;
pub(crate) mod registry;
pub(crate) mod slot;
mod upstream;

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

pub(crate) use handler::panic_text;
pub use handler::{Context, Handler, HandlerError};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::request::Priority;
use leases::Leases;
pub use registry::{SlotWork, WorkerInfo};

/// How long a slot keeps a token while its request has work, before it gives the token back so
/// that higher priorities get through: whichever limit comes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quantum {
    /// Sub-requests run per token take.
    pub parts: u32,
    /// Time spent per token take.
    pub time: Duration,
}

impl Default for Quantum {
    fn default() -> Self {
        Self { parts: 32, time: Duration::from_millis(250) }
    }
}

/// Counters of what a worker did, for logs and tests. Read with [`Worker::metrics`].
#[derive(Debug)]
#[non_exhaustive]
pub struct WorkerMetrics {
    /// Sub-requests whose result was stored.
    pub succeeded: AtomicU64,
    /// Failed attempts scheduled for a retry.
    pub retried: AtomicU64,
    /// Sub-requests dead-lettered (out of attempts, or failed permanently).
    pub dead_lettered: AtomicU64,
    /// Acks, results or token returns refused because this slot no longer held the token as it
    /// was (this worker was declared dead, or the request was cancelled or finished): the late
    /// result was dropped (another attempt's result counts).
    pub fenced: AtomicU64,
    /// Tokens this worker's recovery put back in circulation (reclaimed from dead workers, lost
    /// elements restored, parked tokens woken).
    pub tokens_restored: AtomicU64,
    /// Tokens this worker's recovery reclaimed from dead workers' slots (their batches run again).
    pub holds_reclaimed: AtomicU64,
    /// Holds this worker's slots lost while their handlers ran, each counted once: the hold check
    /// of a beat found the token (or a lane entry's request) moved on (the request was cancelled
    /// or failed fast, or the token was reclaimed), or the worker learned it had been declared
    /// dead (every hold it had). The handlers were told to stop (`Context::cancelled`).
    pub leases_lost: AtomicU64,
    /// Calls to Redis that failed (unreachable, timed out, or answered with an error other than
    /// one of the library's refusals), by any of the worker's connections.
    pub redis_errors: Arc<AtomicU64>,
    /// Slots running a handler right now.
    pub busy_slots: AtomicU64,
    /// How long each handler run took (every attempt), [`TimeHistogram::RUN_BUCKETS`].
    pub run_time: TimeHistogram,
    /// How long each request this worker started had waited since it was submitted (its
    /// commit, or its delay's end) until its first part was handed out here,
    /// [`TimeHistogram::WAIT_BUCKETS`].
    pub queue_wait: TimeHistogram,
    /// Schedule ticks this worker's recovery submitted (each tick's request is created once,
    /// whichever worker's submit created it: this counts those that did here).
    pub schedule_submits: AtomicU64,
    /// Schedule ticks whose submit here found the tick's request there already (another worker,
    /// or a re-sent submit, created it first): refused, as meant.
    pub schedule_duplicates: AtomicU64,
    /// Schedule firings refused because the schedule changed after this worker read it (another
    /// worker fired those ticks first, or an operator paused, resumed or replaced it).
    pub schedule_conflicts: AtomicU64,
    /// Tokens handed to this worker's waiting slots (a reserved slot, or the standby slot of an
    /// idle worker) by a small request's submit or another request's push: run without a take of
    /// their own.
    pub handed_off: AtomicU64,
    /// Sub-requests its slots reported unrun (`skip`) in their acks: the rest of a first batch
    /// that ran past its budget (its size was a guess from the slot's last hold), the rest of a
    /// batch when the worker stopped, runs stopped because their hold ended (counted even when
    /// the ack is then fenced), and parts a request's deadline stopped (that ack ends the
    /// request). The others are handed out again first, with no attempt spent.
    pub handed_back: AtomicU64,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self {
            succeeded: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            fenced: AtomicU64::new(0),
            tokens_restored: AtomicU64::new(0),
            holds_reclaimed: AtomicU64::new(0),
            leases_lost: AtomicU64::new(0),
            redis_errors: Arc::default(),
            busy_slots: AtomicU64::new(0),
            run_time: TimeHistogram::new(&TimeHistogram::RUN_BUCKETS),
            queue_wait: TimeHistogram::new(&TimeHistogram::WAIT_BUCKETS),
            schedule_submits: AtomicU64::new(0),
            schedule_duplicates: AtomicU64::new(0),
            schedule_conflicts: AtomicU64::new(0),
            handed_off: AtomicU64::new(0),
            handed_back: AtomicU64::new(0),
        }
    }
}

/// A histogram of durations with fixed buckets (seconds), recorded with atomics: cheap enough
/// for every run.
#[derive(Debug)]
pub struct TimeHistogram {
    /// The buckets' upper bounds in seconds (a last one, `+Inf`, is implied).
    bounds: &'static [f64],
    /// Samples per bucket: above the previous bucket's bound, at most this one's.
    counts: Box<[AtomicU64]>,
    sum_us: AtomicU64,
}

impl TimeHistogram {
    /// The buckets of handler run times (seconds).
    pub const RUN_BUCKETS: [f64; 12] =
        [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0];

    /// The buckets of queue waits (seconds): from a few ms for an idle system to an hour's backlog.
    pub const WAIT_BUCKETS: [f64; 14] =
        [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 300.0, 3600.0];

    /// An empty histogram with these upper bounds (seconds, ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Self { bounds, counts, sum_us: AtomicU64::new(0) }
    }

    /// The buckets' upper bounds in seconds (`+Inf` implied).
    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    pub(crate) fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let bucket = self.bounds.iter().position(|b| secs <= *b).unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.sum_us.fetch_add(us, std::sync::atomic::Ordering::Relaxed);
    }

    /// The sum of the samples in seconds, their number, and per bucket its upper bound and the
    /// samples that fell in it (not cumulative: above the previous bound), the last bucket's
    /// bound being `f64::MAX` (`+Inf`), as the `prometheus-client` crate takes a histogram.
    pub fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let buckets: Vec<(f64, u64)> = self
            .counts
            .iter()
            .enumerate()
            .map(|(i, n)| {
                (
                    self.bounds.get(i).copied().unwrap_or(f64::MAX),
                    n.load(std::sync::atomic::Ordering::Relaxed),
                )
            })
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.sum_us.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6;
        (sum, count, buckets)
    }
}

/// Configures a [`Worker`].
#[must_use = "a worker builder does nothing until build()"]
pub struct WorkerBuilder<H> {
    config: Config,
    handler: H,
    slots: usize,
    quantum: Quantum,
    max_batch: u32,
    idle_poll: Duration,
    shard_poll: Duration,
    shutdown_grace: Duration,
    stage_stats: bool,
    label: Option<String>,
    reserve: Option<(usize, u8)>,
    urgent: Option<u8>,
}

impl<H: Handler> WorkerBuilder<H> {
    /// Whether this worker counts the stats by stage (`Admin::stats_since`; default on, unless
    /// `Config::stats_retention` is zero). They cost no Redis call on the hot path: counts are
    /// kept in memory and added with one call per `Config::stats_flush_interval`.
    /// [`Worker::metrics`] counts either way.
    pub fn stage_stats(mut self, on: bool) -> Self {
        self.stage_stats = on;
        self
    }

    /// The most sub-requests a slot is handed at once (default 32). A slot asks for as many as
    /// fit in about 2 ms at its handlers' recent speed, so batches only form when handlers are
    /// fast; they run one after another under the slot's one token.
    pub fn max_batch(mut self, n: u32) -> Self {
        self.max_batch = n;
        self
    }

    /// On shutdown, how long running handlers may go on before they are cancelled and their
    /// sub-requests handed back (default 30 s).
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.shutdown_grace = d;
        self
    }

    /// Describes what this worker runs, for operators: its registration carries it, and
    /// `sluicegate workers` and the dashboard show it (`sluicegate worker --exec` puts its command
    /// line here). At most 256 characters are kept.
    pub fn label(mut self, text: impl Into<String>) -> Self {
        let text: String = text.into();
        self.label = Some(text.chars().take(256).collect());
        self
    }

    /// Handlers run at once in this process (default 4). With one token shard, one idle
    /// unreserved slot at a time is the worker's standby: the submit of a small request (up to 64
    /// parts) is handed to it in the submit's own step, as to a reserved slot (docs/protocol.md,
    /// "Hand-offs"), so an idle worker starts it without a take after the bell.
    pub fn slots(mut self, slots: usize) -> Self {
        self.slots = slots;
        self
    }

    /// Keeps `slots` of this worker's slots for requests of priority `min_priority` (1 to 99) or
    /// higher: they take nothing lower, and wait for such work to be announced. A busy slot gives
    /// way to a higher priority only between batches, so with long handlers (minutes, say) an
    /// urgent request submitted while every slot is busy waits for the first handler to end; a
    /// reserved slot starts it at once. With one token shard, an idle reserved slot is handed a
    /// small request (up to 64 parts) of its priorities by that request's submit, in the same step
    /// (docs/protocol.md, "Hand-offs"). The reserved slots are counted in [`slots`](Self::slots)
    /// (at least one slot stays unreserved), and sit idle while no such request waits. A worker
    /// with reserved slots has no [`urgent`](Self::urgent) slot: they take its place.
    ///
    /// ```no_run
    /// # use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Worker};
    /// # struct Upper;
    /// # #[async_trait] impl Handler for Upper { type Input = String; type Output = String;
    /// #   async fn handle(&self, _: Context, s: String) -> Result<String, HandlerError> { Ok(s) } }
    /// # async fn demo() -> sluicegate::Result<()> {
    /// // Sixteen slots, two of them kept for requests of priority 90 and above.
    /// let worker = Worker::builder(&Config::from_env(), Upper).slots(16).reserve(2, 90).build().await?;
    /// # Ok(()) }
    /// ```
    pub fn reserve(mut self, slots: usize, min_priority: u8) -> Self {
        self.reserve = Some((slots, min_priority));
        self
    }

    /// The urgent slot: one slot beside the worker's [`slots`](Self::slots) for requests of
    /// priority `min_priority` (1 to 99) or higher (default `Some(90)`; `None`: no urgent slot).
    /// It takes nothing lower and waits idle, so an urgent request submitted while every slot is
    /// busy starts at once (with one token shard, a small one in its submit's own step:
    /// docs/protocol.md, "Hand-offs") instead of after a busy slot's batch ends and it gives way.
    ///
    /// `slots` still bounds what runs, but only from one batch to the next: while the urgent slot
    /// holds a token, the first other slot to end a batch gives its token back and takes again
    /// only once the worker's holds are fewer than `slots`. So the worker runs `slots + 1`
    /// handlers from the urgent start until that batch ends (with handlers of minutes, for
    /// minutes). Give `None` where `slots` must hold at every moment (a pool of `slots`
    /// connections, say), or [`reserve`](Self::reserve) slots within `slots` instead.
    ///
    /// ```no_run
    /// # use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Worker};
    /// # struct Upper;
    /// # #[async_trait] impl Handler for Upper { type Input = String; type Output = String;
    /// #   async fn handle(&self, _: Context, s: String) -> Result<String, HandlerError> { Ok(s) } }
    /// # async fn demo() -> sluicegate::Result<()> {
    /// // Eight slots, and an urgent one for priorities 95 and above.
    /// let worker = Worker::builder(&Config::from_env(), Upper).slots(8).urgent(Some(95)).build().await?;
    /// # Ok(()) }
    /// ```
    pub fn urgent(mut self, min_priority: Option<u8>) -> Self {
        self.urgent = min_priority;
        self
    }

    /// How much one token take may run before the token goes back (default 32 parts or 250 ms).
    /// When the parts run out first and no token waits on the shard, the slot runs on for another
    /// quantum of parts, within the same time.
    pub fn quantum(mut self, quantum: Quantum) -> Self {
        self.quantum = quantum;
        self
    }

    /// How long an idle slot's BRPOP blocks on the server before it is re-issued (default 1 s).
    /// A stopping worker wakes its blocked slots at once (`CLIENT UNBLOCK`); with a user whose ACL
    /// refuses that, shutdown may wait this long for them.
    pub fn idle_poll(mut self, d: Duration) -> Self {
        self.idle_poll = d;
        self
    }

    /// With more than one token shard (`Config::token_shards`): how long a slot's BRPOP waits on
    /// one shard's lists before it moves on to the next shard (default 100 ms). A token on another
    /// shard waits at most this long per shard for an idle slot (docs/architecture.md, "Shards").
    /// With one shard the slot blocks for `idle_poll` instead.
    pub fn shard_poll(mut self, d: Duration) -> Self {
        self.shard_poll = d;
        self
    }

    /// Connects: one shared pipelined connection, plus one blocking connection per slot.
    pub async fn build(self) -> Result<Worker<H>> {
        if self.slots == 0 {
            return Err(Error::Config("a worker needs at least one slot".into()));
        }
        if !(1..=256).contains(&self.max_batch) {
            return Err(Error::Config("max_batch must be from 1 to 256".into()));
        }
        if self.quantum.parts == 0 {
            return Err(Error::Config("quantum.parts must be at least 1".into()));
        }
        let reserved = match self.reserve {
            None | Some((0, _)) => None,
            Some((n, _)) if n >= self.slots => {
                return Err(Error::Config(format!(
                    "reserve({n}, ..) keeps {n} of the worker's {} slots: at least one must take every priority",
                    self.slots
                )))
            }
            Some((_, 0)) => {
                return Err(Error::Config(
                    "reserve(.., 0) keeps slots for every priority, which reserves nothing: give a priority from 1 to 99"
                        .into(),
                ))
            }
            Some((n, p)) => Some((
                n,
                Priority::new(p).map_err(|_| {
                    Error::Config(format!("reserve(.., {p}): a priority is from 1 to 99 here, not {p}"))
                })?,
            )),
        };
        // The urgent slot, unless reserved slots take its place: the last slot, beside `slots`.
        let urgent = match self.urgent {
            None => None,
            Some(p) if !(1..=99).contains(&p) => {
                return Err(Error::Config(format!(
                    "urgent(Some({p})): a priority is from 1 to 99 here (or None for no urgent slot), not {p}"
                )))
            }
            Some(_) if reserved.is_some() => None,
            Some(p) => Some(Priority::new(p).map_err(|e| Error::Config(e.to_string()))?),
        };
        let reserved = reserved.or(urgent.map(|p| (1, p)));
        if self.idle_poll + Duration::from_millis(500) > self.config.unresponsive {
            return Err(Error::Config(format!(
                "idle_poll ({:?}) must be at least 500 ms shorter than the unresponsive timeout ({:?}), \
                 or idle BRPOPs would be taken for dead connections",
                self.idle_poll, self.config.unresponsive
            )));
        }
        if self.idle_poll < Duration::from_millis(10) {
            return Err(Error::Config("idle_poll must be at least 10 ms".into()));
        }
        if self.shard_poll < Duration::from_millis(10)
            || self.shard_poll + Duration::from_millis(500) > self.config.unresponsive
        {
            return Err(Error::Config(format!(
                "shard_poll ({:?}) must be at least 10 ms and at least 500 ms shorter than the unresponsive timeout",
                self.shard_poll
            )));
        }
        let store = crate::protocol::connect(&self.config).await?;
        let shards = store.keys.shards();
        let metrics =
            Arc::new(WorkerMetrics { redis_errors: store.failed_calls.clone(), ..Default::default() });
        let stats = match self.stage_stats {
            true => crate::stats::Recorder::new(self.config.stats_keep()),
            false => crate::stats::Recorder::off(),
        };
        // From here on, a failed build or a worker dropped unrun closes what it connected.
        let mut hangup = crate::hangup::Hangup::new(store.client.clone());
        let running = self.slots + usize::from(urgent.is_some());
        let mut blocking = Vec::with_capacity(running);
        for _ in 0..running {
            let client = store.blocking_client().await?;
            hangup.blocking(client.clone());
            blocking.push(client);
        }
        let (wake_tx, wakes) = tokio::sync::mpsc::unbounded_channel();
        Ok(Worker {
            shared: Arc::new(slot::Shared {
                store,
                handler: Arc::new(self.handler),
                worker_id: std::sync::Mutex::new(slot::new_worker_id()),
                quantum: self.quantum,
                max_batch: self.max_batch,
                idle_poll: self.idle_poll,
                shard_poll: self.shard_poll,
                shutdown_grace: self.shutdown_grace,
                metrics,
                stats: Arc::new(stats),
                leases: Leases::default(),
                stopping: CancellationToken::new(),
                wakes: Some(wake_tx),
                higher: Arc::new(higher::Higher::new(shards, reserved.map(|(_, p)| p))),
                standby: Default::default(),
                bound: urgent.map(|_| bound::Bound::new(self.slots)),
                releasing: Default::default(),
            }),
            reserved,
            blocking,
            hangup,
            wakes,
            label: self.label,
        })
    }
}

/// A worker process's runtime: K slots serving every request of one namespace.
///
/// ```no_run
/// # use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Worker};
/// # struct Upper;
/// # #[async_trait] impl Handler for Upper { type Input = String; type Output = String;
/// #   async fn handle(&self, _: Context, s: String) -> Result<String, HandlerError> { Ok(s) } }
/// # async fn demo() -> sluicegate::Result<()> {
/// let worker = Worker::builder(&Config::from_env(), Upper).slots(8).build().await?;
/// worker.run().await // until ctrl-c or SIGTERM
/// # }
/// ```
pub struct Worker<H> {
    shared: Arc<slot::Shared<H>>,
    blocking: Vec<fred::clients::Client>,
    /// Its connections, closed when it ends (a drop included).
    hangup: crate::hangup::Hangup,
    wakes: tokio::sync::mpsc::UnboundedReceiver<slot::Wake>,
    label: Option<String>,
    /// How many of the slots are reserved, and for which priorities (the last ones; the urgent
    /// slot is one, beside `slots`).
    reserved: Option<(usize, Priority)>,
}

impl<H: Handler> Worker<H> {
    /// Starts configuring a worker for `handler`.
    pub fn builder(config: &Config, handler: H) -> WorkerBuilder<H> {
        WorkerBuilder {
            config: config.clone(),
            handler,
            slots: 4,
            quantum: Quantum::default(),
            max_batch: 32,
            idle_poll: Duration::from_secs(1),
            shard_poll: Duration::from_millis(100),
            shutdown_grace: Duration::from_secs(30),
            stage_stats: true,
            label: None,
            reserve: None,
            urgent: Some(90),
        }
    }

    /// What this worker did so far (shared: keep the `Arc` to read it after `run`).
    pub fn metrics(&self) -> Arc<WorkerMetrics> {
        self.shared.metrics.clone()
    }

    /// This worker's id (its stream consumer name, and the prefix of its slots' holder names). A
    /// worker that was cut off from Redis longer than the lease goes on under a new id.
    pub fn id(&self) -> String {
        self.shared.id()
    }

    /// Runs until ctrl-c or SIGTERM, then stops gracefully.
    pub async fn run(self) -> Result<()> {
        self.run_until(shutdown_signal()).await
    }

    /// Runs until `shutdown` completes. Then every slot stops taking tokens, lets its running
    /// handler finish (up to the shutdown grace), acks, and gives its token back: nothing waits
    /// for recovery after a clean shutdown. If that cannot be done (Redis unreachable), the worker
    /// still stops, at most 5 s after the grace, and logs which tokens it could not hand
    /// back: other workers reclaim them once its registration expires, as after a crash.
    ///
    /// Besides its slots, every worker beats, reaps dead workers and takes its share of recovery,
    /// on a thread of its own: there is no master process.
    ///
    /// Dropping the returned future instead (an abort, a `select!` that chose another branch) is a
    /// crash, not a stop: every task of the worker ends with it, whatever it held is reclaimed by
    /// the other workers once its lease has passed, and its stats by stage not yet flushed are lost.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let shared = self.shared;
        // What ends the tasks of a dropped run: the slots' JoinSet (a slot's running handler is
        // aborted with it, `slot::supervise`), the handles of the flusher, the
        // listener and the unblocker (they abort on drop), the liveness thread's guard, this one
        // for the releases, and `hangup` for the connections.
        let _gone = shared.releasing.gone.clone().drop_guard();
        let mut hangup = self.hangup;
        let info = WorkerInfo {
            id: shared.id(),
            slots: self.blocking.len(),
            pid: std::process::id(),
            host: hostname(),
            started_ms: now_ms(),
            shards: shared.store.keys.shards(),
            registration_expires_ms: None,
            version: Some(env!("CARGO_PKG_VERSION").to_owned()),
            label: self.label.clone(),
            busy: Vec::new(),
        };
        // Registered before any slot takes a token: a take record of a worker the registry does not
        // know would be reclaimed by recovery's backstop.
        registry::beat(&shared.store, &info, true).await?;
        let liveness = liveness::Liveness::start(shared.clone(), info, self.wakes)?;
        // The stats by stage reach Redis once per flush interval, and once more after the slots
        // stopped (below).
        let flushing = CancellationToken::new();
        let flusher = shared.stats.is_on().then(|| {
            let (shared, stop) = (shared.clone(), flushing.clone());
            AbortOnDropHandle::new(tokio::spawn(async move {
                crate::stats::flush_until(&shared.stats, &shared.store, stop).await
            }))
        });
        let listening = higher::listen(&shared.store, shared.higher.clone(), &mut hangup)
            .await
            .map(AbortOnDropHandle::new);
        let mut slots = tokio::task::JoinSet::new();
        let shards = shared.store.keys.shards();
        let general = self.blocking.len() - self.reserved.map_or(0, |(n, _)| n);
        let blocking = self.blocking.clone();
        for (n, client) in self.blocking.into_iter().enumerate() {
            let slot = match self.reserved {
                Some((_, floor)) if n >= general => slot::Slot::reserved(n, shards, floor, &shared.higher),
                _ => slot::Slot::new(n, shards),
            };
            slots.spawn(slot::run(shared.clone(), slot, client));
        }
        tokio::select! {
            _ = shutdown => {}
            _ = shared.stopping.cancelled() => {}
        }
        tracing::info!(worker = %shared.id(), "shutting down: finishing running handlers");
        shared.stopping.cancel();
        let unblocking = AbortOnDropHandle::new(tokio::spawn(unblock_idle(blocking)));
        // One bound for the whole stop: the grace, then STOP_WAIT for the slots' hand-backs and
        // the last calls together.
        let deadline = tokio::time::Instant::now() + shared.shutdown_grace + STOP_WAIT;
        let drained = tokio::time::timeout_at(deadline, async {
            while let Some(joined) = slots.join_next().await {
                if let Err(e) = joined {
                    tracing::error!(error = %e, "a slot task ended abnormally");
                }
            }
        })
        .await;
        if drained.is_err() {
            let stuck = shared.leases.snapshot();
            slots.abort_all();
            tracing::error!(
                worker = %shared.id(),
                tokens = stuck.len(),
                held = ?stuck.iter().map(|l| format!("{} token {}", l.meta_key, l.token)).collect::<Vec<_>>(),
                "stopping without handing back what the slots hold (Redis unreachable?): other workers reclaim it \
                 once this worker's registration expires, as after a crash"
            );
        }
        unblocking.abort();
        // The releases still running in tasks of their own (a release left undone stays in the
        // outbox, for recovery).
        let _ = tokio::time::timeout_at(deadline, shared.releasing.drained()).await;
        if let Some(listening) = listening {
            listening.abort();
        }
        // The last calls share the stop's bound: with Redis unreachable, the worker still stops.
        // After a drain that used it all (Redis unreachable), they get a moment, not another wait.
        let last_until = deadline.max(tokio::time::Instant::now() + LAST_CALLS_MIN);
        let last = async {
            flushing.cancel();
            if let Some(flusher) = flusher {
                let _ = flusher.await;
            }
            liveness.stop(STOP_WAIT).await;
            let id = shared.id();
            match registry::leave(&shared.store, &id).await {
                Ok(()) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not remove the worker's registration; it expires")
                }
            }
            hangup.close().await;
        };
        if tokio::time::timeout_at(last_until, last).await.is_err() {
            tracing::warn!(
                "Redis did not answer the worker's last calls; its registration expires by itself"
            );
            // Not another wait for the connections' close: a program that ends now (the command
            // line's worker) ends within the stop's bound.
            hangup.abandon();
        }
        Ok(())
    }
}

/// At a stop, wakes the slots blocked on Redis for work (an idle slot's `BRPOP` of the bell, a
/// standby's or reserved slot's `BLPOP` of its hand list), so that they see the stop at once rather
/// than at the end of their poll: `CLIENT UNBLOCK`, as if the pop timed out, sent on a connection
/// of fred's own. Again every 50 ms until the slots are done (a slot may block once more between
/// its check of the stop and its pop). A user whose ACL refuses `CLIENT ID` or `CLIENT UNBLOCK`
/// waits the poll out, as before.
async fn unblock_idle(clients: Vec<fred::clients::Client>) {
    use fred::interfaces::ClientInterface;
    use fred::types::ClientUnblockFlag;
    loop {
        for client in &clients {
            // (An error: the connection is not blocked, or the unblock was refused.)
            let _ = client.unblock_self(Some(ClientUnblockFlag::Timeout)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long a stopping worker waits, beyond its shutdown grace, for its slots to hand their tokens
/// back and for its last calls (the stats' flush, leaving the registry), before it stops anyway.
pub(crate) const STOP_WAIT: Duration = Duration::from_secs(5);

/// The least a stopping worker gives its last calls when the slots used up its stop's bound.
const LAST_CALLS_MIN: Duration = Duration::from_millis(200);

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

/// Completes on ctrl-c, or SIGTERM on Unix.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}
