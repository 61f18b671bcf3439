//! A worker's liveness thread: its heartbeat, and its share of recovery.
//!
//! It runs on an OS thread of its own, with its own tokio runtime and its own Redis connection, so
//! that nothing the handlers do (block, spin on every runtime thread, flood the shared connection)
//! can delay a beat: a live worker is never declared dead for being busy. Its beats run in a loop
//! of their own, beside its recovery chores, so that no recovery work delays them either. Every
//! `heartbeat` it beats (`registry::beat`), reaps the dead workers the beat claimed, and checks
//! that its slots' holds still stand; every `recovery_interval` it looks at the requests whose
//! look fell due (`recovery::pass`); every `census_interval` it runs the take records' backstop;
//! and it wakes parked tokens when their retries fall due.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::handler::Handler;
use super::registry::{self, WorkerInfo};
use super::slot::{Shared, Wake};
use crate::error::{Error, Result};
use crate::store::Store;

/// The running thread; stopped by [`Liveness::stop`], or when dropped (a worker whose task was
/// dropped stops beating, and so is declared dead, as after a crash).
pub(crate) struct Liveness {
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Closes when the thread's closure returns (its sender is dropped then), so that `stop` can
    /// wait for the thread without a blocking task: a blocking task still joining a stuck thread
    /// would hold up the drop of the caller's runtime, and so the process's exit.
    ended: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Liveness {
    /// Starts the thread. The worker's first beat has been made already (by `Worker::run_until`,
    /// before its slots took anything).
    pub(crate) fn start<H: Handler>(
        shared: Arc<Shared<H>>,
        info: WorkerInfo,
        wakes: mpsc::UnboundedReceiver<Wake>,
    ) -> Result<Liveness> {
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let config = shared.store.config.clone();
        let (ending, ended) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("sluicegate-liveness".into())
            .spawn(move || {
                let _ending = ending;
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start the liveness thread's runtime");
                        return;
                    }
                };
                runtime.block_on(async move {
                    // A connection of its own, driven by this thread's runtime; its failed calls
                    // count with the worker's.
                    let store = loop {
                        match crate::protocol::connect(&config).await {
                            Ok(mut store) => {
                                store.failed_calls = shared.store.failed_calls.clone();
                                break store;
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "liveness thread cannot connect; retrying");
                                tokio::select! {
                                    _ = stopped.cancelled() => return,
                                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                                }
                            }
                        }
                    };
                    tokio::select! {
                        _ = stopped.cancelled() => {}
                        _ = run(&shared, &store, info, wakes) => {}
                    }
                    // Bounded: with Redis unreachable, a QUIT waits on the reconnect policy.
                    let quit = fred::interfaces::ClientLike::quit(&store.client);
                    let _ = tokio::time::timeout(QUIT_WAIT, quit).await;
                });
            })
            .map_err(|e| Error::Config(format!("cannot start the worker's liveness thread: {e}")))?;
        Ok(Liveness { stop, thread: Some(thread), ended: Some(ended) })
    }

    /// Stops the thread and waits for it (at most `limit`). A thread that does not end in time is
    /// left behind, detached: it holds nothing a later worker needs, and the process may exit.
    pub(crate) async fn stop(mut self, limit: Duration) {
        self.stop.cancel();
        let (Some(thread), Some(ended)) = (self.thread.take(), self.ended.take()) else { return };
        // Ok or Closed alike: the sender is only ever dropped, when the thread's closure returns.
        if tokio::time::timeout(limit, ended).await.is_ok() {
            let _ = thread.join();
        } else {
            tracing::warn!("the liveness thread did not stop in time");
        }
    }
}

/// How long the liveness thread waits for its QUIT once stopped.
const QUIT_WAIT: Duration = Duration::from_secs(1);

async fn run<H: Handler>(
    shared: &Shared<H>,
    store: &Store,
    info: WorkerInfo,
    wakes: mpsc::UnboundedReceiver<Wake>,
) {
    // Two loops, so that no recovery work, however long, delays a beat: a late beat is how a live
    // worker gets declared dead.
    tokio::join!(beats(shared, store, info), chores(shared, store, wakes));
}

/// Beats the registry, reaps the dead workers a beat reports (in tasks of their own), and checks
/// that the slots' holds still stand.
async fn beats<H: Handler>(shared: &Shared<H>, store: &Store, mut info: WorkerInfo) {
    let cfg = &store.config;
    let metrics = shared.metrics.clone();
    let mut beat = tokio::time::interval(cfg.heartbeat);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut first = false;
    let mut reaps = tokio::task::JoinSet::new();
    loop {
        beat.tick().await;
        while reaps.try_join_next().is_some() {}
        match registry::beat(store, &info, first).await {
            Ok(found) => {
                first = false;
                if !found.alive {
                    // Cut off longer than the lease: its tokens were (or are being) reclaimed, so
                    // its handlers' results would be refused. It goes on as a new worker.
                    metrics
                        .leases_lost
                        .fetch_add(shared.leases.cancel_all(), std::sync::atomic::Ordering::Relaxed);
                    info.id = shared.renew_id();
                    first = true;
                    tracing::warn!(
                        worker = info.id,
                        "this worker had been declared dead; going on under a new id"
                    );
                }
                for (id, described) in found.dead {
                    let (store, metrics) = (store.clone(), metrics.clone());
                    reaps.spawn(async move {
                        if let Err(e) = super::recovery::reap(&store, &metrics, &id, described.as_ref()).await {
                            tracing::warn!(worker = id, error = %e, "reaping failed; another beat will claim it again");
                        }
                    });
                }
            }
            Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
        }
        shared.leases.check(store, cfg.heartbeat, &metrics.leases_lost).await;
    }
}

/// Recovery's polls of due requests, the take-record backstop, and the wake-ups slots asked for.
async fn chores<H: Handler>(shared: &Shared<H>, store: &Store, mut wakes: mpsc::UnboundedReceiver<Wake>) {
    let cfg = &store.config;
    let metrics = shared.metrics.clone();
    let mut poll = tokio::time::interval(cfg.recovery_interval);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut backstop = tokio::time::interval(cfg.census_interval);
    backstop.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut timers = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = poll.tick() => {
                if let Err(e) = super::recovery::pass(store, &metrics, &shared.stats).await {
                    tracing::warn!(error = %e, "recovery pass failed; retrying next interval");
                }
            }
            _ = backstop.tick() => {
                if let Err(e) = super::recovery::scan_held(store, &metrics).await {
                    tracing::warn!(error = %e, "take records check failed");
                }
            }
            Some(wake) = wakes.recv() => {
                let (store, metrics) = (store.clone(), metrics.clone());
                timers.spawn(async move {
                    tokio::time::sleep_until(wake.at).await;
                    if let Err(e) = super::recovery::look_at(&store, &metrics, &wake.key_id, wake.shards).await {
                        tracing::debug!(error = %e, "wake-up failed; recovery will look at the request");
                    }
                });
            }
            Some(_) = timers.join_next(), if !timers.is_empty() => {}
        }
    }
}
