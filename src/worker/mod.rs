//! Workers: slots that take concurrency tokens, run the user's handler, and ack.

mod handler;
mod leases;
mod slot;

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use fred::interfaces::ClientLike;
use tokio_util::sync::CancellationToken;

pub use handler::{Context, Handler, HandlerError};

use crate::admin::{register_worker, unregister_worker};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::store::Store;
use crate::WorkerInfo;
use leases::Leases;

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
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct WorkerMetrics {
    /// Sub-requests whose result was stored.
    pub succeeded: AtomicU64,
    /// Failed attempts scheduled for a retry.
    pub retried: AtomicU64,
    /// Sub-requests dead-lettered (out of attempts, or failed permanently).
    pub dead_lettered: AtomicU64,
    /// Acks, results or token returns refused because this worker's lease had moved on: the
    /// late result was dropped (another attempt's result counts).
    pub fenced: AtomicU64,
    /// Tokens recovery put back in circulation (expired leases, lost elements, unparked).
    pub tokens_restored: AtomicU64,
    /// Leases recovery found expired (their entries were handed out again).
    pub leases_expired: AtomicU64,
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
}

impl<H: Handler> WorkerBuilder<H> {
    /// The most sub-requests a slot is handed at once (default 16). A slot asks for as many as
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

    /// Handlers run at once in this process (default 4).
    pub fn slots(mut self, slots: usize) -> Self {
        self.slots = slots;
        self
    }

    /// How much one token take may run before the token goes back (default 32 parts or 250 ms).
    pub fn quantum(mut self, quantum: Quantum) -> Self {
        self.quantum = quantum;
        self
    }

    /// How long an idle slot's BRPOP blocks on the server before it is re-issued (default 1 s);
    /// also how long shutdown may wait for idle slots.
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
        let store = Store::connect(&self.config).await?;
        let worker_id = format!("w-{}", uuid::Uuid::new_v4().simple());
        let mut blocking = Vec::with_capacity(self.slots);
        for _ in 0..self.slots {
            blocking.push(store.blocking_client().await?);
        }
        Ok(Worker {
            shared: Arc::new(slot::Shared {
                store,
                handler: Arc::new(self.handler),
                worker_id,
                quantum: self.quantum,
                max_batch: self.max_batch,
                idle_poll: self.idle_poll,
                shard_poll: self.shard_poll,
                shutdown_grace: self.shutdown_grace,
                metrics: Arc::new(WorkerMetrics::default()),
                leases: Leases::default(),
                stopping: CancellationToken::new(),
            }),
            blocking,
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
}

impl<H: Handler> Worker<H> {
    /// Starts configuring a worker for `handler`.
    pub fn builder(config: &Config, handler: H) -> WorkerBuilder<H> {
        WorkerBuilder {
            config: config.clone(),
            handler,
            slots: 4,
            quantum: Quantum::default(),
            max_batch: 16,
            idle_poll: Duration::from_secs(1),
            shard_poll: Duration::from_millis(100),
            shutdown_grace: Duration::from_secs(30),
        }
    }

    /// What this worker did so far (shared: keep the `Arc` to read it after `run`).
    pub fn metrics(&self) -> Arc<WorkerMetrics> {
        self.shared.metrics.clone()
    }

    /// This worker's id (its stream consumer name, and the prefix of its lease holders).
    pub fn id(&self) -> &str {
        &self.shared.worker_id
    }

    /// Runs until ctrl-c or SIGTERM, then stops gracefully.
    pub async fn run(self) -> Result<()> {
        self.run_until(shutdown_signal()).await
    }

    /// Runs until `shutdown` completes. Then every slot stops taking tokens, lets its running
    /// handler finish (up to the shutdown grace), acks, and gives its token back: nothing waits
    /// for a lease to expire after a clean shutdown.
    ///
    /// Besides its slots, every worker renews its leases and takes its share of recovery
    /// (expired leases, lost tokens): there is no master process.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let shared = self.shared;
        let mut slots = tokio::task::JoinSet::new();
        for (n, client) in self.blocking.into_iter().enumerate() {
            slots.spawn(slot::run(shared.clone(), n, client));
        }
        let info = WorkerInfo {
            id: shared.worker_id.clone(),
            slots: slots.len(),
            pid: std::process::id(),
            host: hostname(),
            started_ms: crate::admin::now_ms(),
        };
        let heartbeat = tokio::spawn(heartbeat(shared.clone(), info));
        let recovery = tokio::spawn(crate::recovery::run(shared.store.clone(), shared.metrics.clone()));
        tokio::select! {
            _ = shutdown => {}
            _ = shared.stopping.cancelled() => {}
        }
        tracing::info!(worker = %shared.worker_id, "shutting down: finishing running handlers");
        shared.stopping.cancel();
        while let Some(joined) = slots.join_next().await {
            if let Err(e) = joined {
                tracing::error!(error = %e, "a slot task ended abnormally");
            }
        }
        heartbeat.abort();
        recovery.abort();
        if let Err(e) = unregister_worker(&shared.store, &shared.worker_id).await {
            tracing::warn!(error = %e, "could not remove the worker's registration");
        }
        let _ = shared.store.client.quit().await;
        Ok(())
    }
}

async fn heartbeat<H: Handler>(shared: Arc<slot::Shared<H>>, info: WorkerInfo) {
    let mut tick = tokio::time::interval(shared.store.config.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (_, registered) =
            tokio::join!(shared.leases.renew_all(&shared.store), register_worker(&shared.store, &info));
        if let Err(e) = registered {
            tracing::warn!(error = %e, "worker registration failed");
        }
    }
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
