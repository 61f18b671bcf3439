//! The tokens a worker's slots hold right now, and the check that they still do.
//!
//! Each slot that holds a token registers it here while its handler runs. Holding does not need
//! renewing (a worker holds its tokens while it is registered alive, see `registry`), but a hold
//! can end without the slot knowing: the request was cancelled or finished, or the worker was
//! declared dead and its tokens moved on. The worker's liveness thread asks, for every hold older
//! than a heartbeat, whether it still stands (`holds`, one read-only call per request) and cancels
//! the context of the handler running under one that does not.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::protocol::tokens::{self, Hold};
use crate::store::Store;

/// A token held by one slot: what the check must present.
#[derive(Clone, Debug)]
pub(crate) struct LeaseKey {
    pub(crate) meta_key: String,
    pub(crate) token: String,
    pub(crate) epoch: String,
    pub(crate) holder: String,
    /// For a lane token: the record of the request whose entry runs, and its lifecycle then (the
    /// hold ends for that handler when the request is no longer live: cancelled, failed fast).
    pub(crate) record: Option<(String, String)>,
}

#[derive(Default)]
pub(crate) struct Leases {
    /// slot number -> the hold, when it began, and the cancel signal of its handler.
    held: Mutex<HashMap<usize, (LeaseKey, Instant, CancellationToken)>>,
}

impl Leases {
    pub(crate) fn hold(&self, slot: usize, key: LeaseKey, cancel: CancellationToken) {
        self.lock().insert(slot, (key, Instant::now(), cancel));
    }

    pub(crate) fn release(&self, slot: usize) {
        self.lock().remove(&slot);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, (LeaseKey, Instant, CancellationToken)>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The holds that stand now (for a clean stop's report of what could not be handed back).
    pub(crate) fn snapshot(&self) -> Vec<LeaseKey> {
        self.lock().values().map(|(k, _, _)| k.clone()).collect()
    }

    /// Cancels every running handler: this worker was declared dead, its tokens moved on.
    /// Returns how many holds were lost (not counting those cancelled before).
    pub(crate) fn cancel_all(&self) -> u64 {
        self.lock().values().map(|(_, _, cancel)| u64::from(lost(cancel))).sum()
    }

    /// Asks whether every hold older than `age` still stands; cancels the handlers of those that
    /// do not, and counts each such hold once in `leases_lost`.
    pub(crate) async fn check(&self, store: &Store, age: Duration, leases_lost: &AtomicU64) {
        let snapshot: Vec<(LeaseKey, CancellationToken)> = self
            .lock()
            .values()
            .filter(|(_, since, _)| since.elapsed() >= age)
            .map(|(k, _, c)| (k.clone(), c.clone()))
            .collect();
        let records = snapshot.iter().filter_map(|(key, cancel)| Some((key.record.clone()?, cancel.clone())));
        let lane_checks = records.map(|((record, lifecycle), cancel)| async move {
            match lane_request_live(store, &record, &lifecycle).await {
                Ok(false) => {
                    if lost(&cancel) {
                        tracing::warn!(record, "lane request no longer live; cancelling its handler");
                        leases_lost.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(true) => {}
                Err(e) => tracing::debug!(error = %e, "hold check failed"),
            }
        });
        futures::stream::iter(lane_checks.collect::<Vec<_>>())
            .buffer_unordered(store.concurrency(usize::MAX))
            .collect::<Vec<()>>()
            .await;
        let mut by_request: HashMap<String, Vec<(LeaseKey, CancellationToken)>> = HashMap::new();
        for (key, cancel) in snapshot {
            by_request.entry(key.meta_key.clone()).or_default().push((key, cancel));
        }
        let calls = by_request.into_iter().map(|(meta, held)| async move {
            let holds: Vec<Hold<'_>> = held
                .iter()
                .map(|(key, _)| Hold { k: &key.token, epoch: &key.epoch, holder: &key.holder })
                .collect();
            match tokens::holds(store, &meta, &holds).await {
                Ok(gone) => {
                    for token in gone {
                        for (key, cancel) in &held {
                            if key.token == token && lost(cancel) {
                                tracing::warn!(meta_key = %key.meta_key, token, "token no longer held; cancelling its handler");
                                leases_lost.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
                // Checked again at the next beat.
                Err(e) => tracing::debug!(error = %e, "hold check failed"),
            }
        });
        futures::stream::iter(calls)
            .buffer_unordered(store.concurrency(usize::MAX))
            .collect::<Vec<()>>()
            .await;
    }
}

/// Cancels a lost hold's handler; whether it was not cancelled before (a handler that ignores
/// its cancellation is found lost again at each check, and counted once).
fn lost(cancel: &CancellationToken) -> bool {
    let first = !cancel.is_cancelled();
    cancel.cancel();
    first
}

/// Whether a lane request's record is live (queued or running) at `lifecycle`, as the lane
/// functions decide it (prelude.lua, `sg_lane_live`).
async fn lane_request_live(store: &Store, record: &str, lifecycle: &str) -> crate::error::Result<bool> {
    use fred::interfaces::HashesInterface;
    let (state, now): (Option<String>, Option<String>) =
        store.client.hmget(record, vec!["state", "lc"]).await?;
    let live = matches!(state.as_deref(), Some("queued" | "running"));
    Ok(live && now.as_deref() == Some(lifecycle))
}
