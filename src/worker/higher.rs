//! Giving way to a higher priority: a busy slot keeps its token for a quantum (32 parts or 250 ms
//! by default), so without a signal a request of a higher priority submitted while every slot is
//! busy waits for the first quantum to run out. A push onto an empty priority list is announced on
//! its shard's `up` channel (`sg_push`); each worker listens, and the first of its slots that ends
//! a batch while holding a lower priority gives its token back and takes again, which takes the
//! higher one (`take` pops the highest priority first).

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::Arc;

use fred::prelude::*;

use crate::request::Priority;
use crate::store::Store;

/// Per shard, the highest priority announced waiting there that no slot of this worker has
/// answered yet, as priority + 1 (0: none).
#[derive(Debug, Default)]
pub(crate) struct Higher(Vec<AtomicU8>);

impl Higher {
    pub(crate) fn new(shards: u32) -> Self {
        Self((0..shards).map(|_| AtomicU8::new(0)).collect())
    }

    fn announce(&self, shard: usize, priority: u8) {
        if let Some(cell) = self.0.get(shard) {
            cell.fetch_max(priority.saturating_add(1), Relaxed);
        }
    }

    /// For a slot holding `priority` on `shard` at the end of a batch: whether a higher priority
    /// waits there, claimed for this slot (no other slot of this worker gives way for it).
    pub(crate) fn claim_above(&self, shard: u32, priority: Priority) -> bool {
        let Some(cell) = self.0.get(shard as usize) else { return false };
        let waiting = cell.load(Relaxed);
        waiting > priority.get() + 1 && cell.compare_exchange(waiting, 0, Relaxed, Relaxed).is_ok()
    }

    /// A take of `priority` on `shard` answers an announcement of that priority or below.
    pub(crate) fn answered(&self, shard: u32, priority: Priority) {
        let Some(cell) = self.0.get(shard as usize) else { return };
        let waiting = cell.load(Relaxed);
        if waiting != 0 && waiting <= priority.get() + 1 {
            let _ = cell.compare_exchange(waiting, 0, Relaxed, Relaxed);
        }
    }
}

/// Subscribes to the `up` channel of every shard this worker serves and records what it hears in
/// `higher`, until the returned task is aborted. Without it (no subscription could be made) slots
/// still give way, at the end of their quantum.
pub(crate) async fn listen(store: &Store, higher: Arc<Higher>) -> Option<tokio::task::JoinHandle<()>> {
    let channels: Vec<String> = (0..store.keys.shards()).map(|s| store.keys.up_channel(s)).collect();
    let subscribed = async {
        let sub = store.subscriber().await?;
        let messages = sub.message_rx();
        sub.subscribe(channels.clone()).await?;
        Ok::<_, crate::error::Error>((sub, messages))
    };
    let (sub, mut messages) = match subscribed.await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for higher priorities; busy slots give way at the end of their quantum");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        // Owns the subscriber: it lives exactly as long as this task.
        let _sub = sub;
        loop {
            match messages.recv().await {
                Ok(msg) => {
                    let shard = channels.iter().position(|c| msg.channel.as_bytes() == c.as_bytes());
                    let priority = msg.value.as_string().and_then(|p| p.parse::<u8>().ok());
                    if let (Some(shard), Some(priority)) = (shard, priority) {
                        higher.announce(shard, priority);
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
            }
        }
    }))
}
