//! Giving way to a higher priority: a busy slot keeps its token for a quantum (32 parts or 250 ms
//! by default), so without a signal a request of a higher priority submitted while every slot is
//! busy waits for the first quantum to run out. A push onto an empty priority list is announced on
//! its shard's `up` channel (`sg_push`); each worker listens, and the first of its slots that ends
//! a batch while holding a lower priority gives its token back and takes again, which takes the
//! higher one (`take` pops the highest priority first).
//!
//! A busy slot gives way only between batches, so with long handlers an urgent request still waits
//! for the first of them to end. A worker's reserved slots (`WorkerBuilder::reserve`) take only
//! priorities at or above their floor, and wait for work on these same announcements (and an idle
//! poll) rather than on the bell, which every push of any priority rings: an announcement they
//! cover wakes an idle one, which takes at once, and no busy slot gives way for it.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use fred::prelude::*;
use tokio::sync::watch;

use crate::request::Priority;
use crate::store::Store;

/// Per shard, the highest priority announced waiting there that no slot of this worker has
/// answered yet, as priority + 1 (0: none); and for the worker's reserved slots
/// (`WorkerBuilder::reserve`), the announcements at or above their floor.
#[derive(Debug)]
pub(crate) struct Higher {
    waiting: Vec<AtomicU8>,
    /// The floor of this worker's reserved slots, if it has any.
    reserved: Option<Priority>,
    /// How many reserved slots wait for work right now: an announcement they cover wakes them
    /// and does not make a busy slot give way.
    idle_reserved: AtomicUsize,
    /// The last announcement at or above the reserved slots' floor: shard and priority.
    heard: watch::Sender<Option<(u32, Priority)>>,
}

impl Default for Higher {
    fn default() -> Self {
        Self::new(1, None)
    }
}

impl Higher {
    pub(crate) fn new(shards: u32, reserved: Option<Priority>) -> Self {
        Self {
            waiting: (0..shards).map(|_| AtomicU8::new(0)).collect(),
            reserved,
            idle_reserved: AtomicUsize::new(0),
            heard: watch::Sender::new(None),
        }
    }

    pub(crate) fn announce(&self, shard: usize, priority: Priority) {
        let reserved = self.reserved.is_some_and(|floor| priority >= floor);
        if reserved {
            self.heard.send_replace(Some((shard as u32, priority)));
        }
        // An idle reserved slot takes it: busy slots go on.
        if reserved && self.idle_reserved.load(Relaxed) > 0 {
            return;
        }
        if let Some(cell) = self.waiting.get(shard) {
            cell.fetch_max(priority.get().saturating_add(1), Relaxed);
        }
    }

    /// For a slot holding `priority` on `shard` at the end of a batch: whether a higher priority
    /// waits there, claimed for this slot (no other slot of this worker gives way for it).
    pub(crate) fn claim_above(&self, shard: u32, priority: Priority) -> bool {
        let Some(cell) = self.waiting.get(shard as usize) else { return false };
        let waiting = cell.load(Relaxed);
        waiting > priority.get() + 1 && cell.compare_exchange(waiting, 0, Relaxed, Relaxed).is_ok()
    }

    /// A take of `priority` on `shard` answers an announcement of that priority or below.
    pub(crate) fn answered(&self, shard: u32, priority: Priority) {
        let Some(cell) = self.waiting.get(shard as usize) else { return };
        let waiting = cell.load(Relaxed);
        if waiting != 0 && waiting <= priority.get() + 1 {
            let _ = cell.compare_exchange(waiting, 0, Relaxed, Relaxed);
        }
    }

    /// What a reserved slot waits on: the announcements at or above its floor.
    pub(crate) fn hear(&self) -> watch::Receiver<Option<(u32, Priority)>> {
        self.heard.subscribe()
    }

    /// A reserved slot waits for work (until the guard drops).
    pub(crate) fn idle_reserved(&self) -> IdleReserved<'_> {
        self.idle_reserved.fetch_add(1, Relaxed);
        IdleReserved(&self.idle_reserved)
    }
}

/// A reserved slot counted as waiting for work while this lives.
pub(crate) struct IdleReserved<'a>(&'a AtomicUsize);

impl Drop for IdleReserved<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Subscribes to the `up` channel of every shard this worker serves and records what it hears in
/// `higher`, until the returned task is aborted; the subscriber's connection goes to the worker's
/// `hangup`. Without it (no subscription could be made) slots still give way, at the end of their
/// quantum.
pub(crate) async fn listen(
    store: &Store,
    higher: Arc<Higher>,
    hangup: &mut crate::hangup::Hangup,
) -> Option<tokio::task::JoinHandle<()>> {
    let channels: Vec<String> = (0..store.keys.shards()).map(|s| store.keys.up_channel(s)).collect();
    let subscribed = async {
        let sub = store.subscriber().await?;
        // The worker's to close from here on, whatever happens next.
        hangup.subscriber(sub.clone());
        let messages = sub.message_rx();
        sub.subscribe(channels.clone()).await?;
        Ok::<_, crate::error::Error>((sub, messages))
    };
    let (_, mut messages) = match subscribed.await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for higher priorities; busy slots give way at the end of their quantum");
            return None;
        }
    };
    let task = tokio::spawn(async move {
        loop {
            match messages.recv().await {
                Ok(msg) => {
                    let shard = channels.iter().position(|c| msg.channel.as_bytes() == c.as_bytes());
                    let priority = msg.value.as_string().and_then(|p| p.parse::<u8>().ok());
                    let priority = priority.and_then(|p| Priority::new(p).ok());
                    if let (Some(shard), Some(priority)) = (shard, priority) {
                        higher.announce(shard, priority);
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
            }
        }
    });
    Some(task)
}
