//! The leases a worker holds, and the heartbeat that renews them.
//!
//! Each slot that holds a token registers it here; one heartbeat task renews all of them, one call
//! per request, all calls in flight at once (they pipeline on the shared connection). A lease the
//! server says is lost cancels the context of the handler running under it.

use std::collections::HashMap;
use std::sync::Mutex;

use fred::types::Value;
use futures::future::join_all;
use tokio_util::sync::CancellationToken;

use crate::config::millis;
use crate::reply;
use crate::scripts::Func;
use crate::store::Store;

/// A token held by one slot: what the heartbeat must present to renew it.
#[derive(Clone, Debug)]
pub(crate) struct LeaseKey {
    pub(crate) meta_key: String,
    pub(crate) token: String,
    pub(crate) epoch: String,
    pub(crate) holder: String,
}

#[derive(Default)]
pub(crate) struct Leases {
    /// slot number -> the lease it holds and the cancel signal of its handler.
    held: Mutex<HashMap<usize, (LeaseKey, CancellationToken)>>,
}

impl Leases {
    pub(crate) fn hold(&self, slot: usize, key: LeaseKey, cancel: CancellationToken) {
        self.lock().insert(slot, (key, cancel));
    }

    pub(crate) fn release(&self, slot: usize) {
        self.lock().remove(&slot);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, (LeaseKey, CancellationToken)>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Renews every held lease; cancels the handlers whose lease is gone.
    pub(crate) async fn renew_all(&self, store: &Store) {
        let snapshot: Vec<(LeaseKey, CancellationToken)> = self.lock().values().cloned().collect();
        let mut by_request: HashMap<String, Vec<(LeaseKey, CancellationToken)>> = HashMap::new();
        for (key, cancel) in snapshot {
            by_request.entry(key.meta_key.clone()).or_default().push((key, cancel));
        }
        let lease_ms = millis(store.config.lease) as i64;
        let calls = by_request.into_iter().map(|(meta, held)| async move {
            let mut args: Vec<Value> = vec![lease_ms.into()];
            for (key, _) in &held {
                args.push(key.token.as_str().into());
                args.push(key.epoch.as_str().into());
                args.push(key.holder.as_str().into());
            }
            match store.fcall(Func::Renew, &[&meta], args).await.and_then(reply::array) {
                Ok(lost) => {
                    for token in lost.iter().filter_map(|v| v.as_string()) {
                        for (key, cancel) in &held {
                            if key.token == token {
                                tracing::warn!(meta_key = %key.meta_key, token, "lease lost; cancelling its handler");
                                cancel.cancel();
                            }
                        }
                    }
                }
                // A failed renewal is retried at the next beat; the lease outlives several beats.
                Err(e) => tracing::warn!(error = %e, "lease renewal failed"),
            }
        });
        join_all(calls).await;
    }
}
