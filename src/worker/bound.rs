//! The worker's urgent slot and the bound on its holds.
//!
//! A busy slot gives way to a higher priority only between batches, and the give-way costs the
//! urgent request a round trip in a queue the busy slots keep full: the slot's `ack` that hands its
//! token back, then its `take` of the urgent one. A reserved slot (`WorkerBuilder::reserve`) starts
//! urgent work at once, but keeps a slot from every other priority. The urgent slot
//! (`WorkerBuilder::urgent`, on by default for priorities 90 and up) is a reserved slot beside the
//! worker's `slots`, not one of them: it waits idle, and is handed an urgent request by its
//! submit, as a reserved slot is (docs/protocol.md, "Hand-offs").
//!
//! So that `slots` still bounds what the worker runs, the slots' holds are counted here. An
//! unreserved slot claims its hold before it takes ([`Bound::claim`]), and only while fewer than
//! `slots` run; otherwise it waits for one to end ([`Bound::room`]). The urgent slot's hold, and a
//! token handed to a waiting slot, are counted without a claim ([`Bound::hold`]): they may put the
//! worker one over `slots`, and then one slot (and only one: [`Counted::make_room`]) of those that
//! end a batch gives its token back, as it gives way to a higher priority.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How many of the worker's slots hold a token, against how many may.
#[derive(Debug)]
pub(crate) struct Bound {
    slots: usize,
    holding: AtomicUsize,
    /// Holds that have claimed a give-way to bring the count back to `slots`, and not ended yet.
    yielding: AtomicUsize,
    freed: Notify,
}

impl Bound {
    pub(crate) fn new(slots: usize) -> Arc<Self> {
        Arc::new(Self {
            slots,
            holding: AtomicUsize::new(0),
            yielding: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    /// Claims a hold for an unreserved slot about to take, if fewer than `slots` run.
    pub(crate) fn claim(self: &Arc<Self>) -> Option<Counted> {
        self.holding.fetch_update(Relaxed, Relaxed, |h| (h < self.slots).then_some(h + 1)).ok()?;
        Some(Counted { bound: self.clone(), yielded: false })
    }

    /// Counts a hold that came without a claim (the urgent slot's, a token handed to a waiting
    /// slot), whatever the count.
    pub(crate) fn hold(self: &Arc<Self>) -> Counted {
        self.holding.fetch_add(1, Relaxed);
        Counted { bound: self.clone(), yielded: false }
    }

    /// Waits until fewer holds than the worker's slots run, or the worker stops.
    pub(crate) async fn room(&self, stopping: &CancellationToken) {
        loop {
            let freed = self.freed.notified();
            if self.holding.load(Relaxed) < self.slots || stopping.is_cancelled() {
                return;
            }
            tokio::select! {
                _ = freed => {}
                _ = stopping.cancelled() => return,
            }
        }
    }
}

/// A hold counted in the bound while this lives.
#[derive(Debug)]
pub(crate) struct Counted {
    bound: Arc<Bound>,
    yielded: bool,
}

impl Counted {
    /// At a batch's end: whether this hold is to end so that the worker's holds come back to its
    /// slots. More holds run than slots, beside those already ending for it: this one claims the
    /// give-way, so that two slots ending batches at once do not both give their tokens back.
    pub(crate) fn make_room(&mut self) -> bool {
        if self.yielded {
            return true;
        }
        let bound = &self.bound;
        self.yielded = bound
            .yielding
            .fetch_update(Relaxed, Relaxed, |y| {
                (bound.holding.load(Relaxed).saturating_sub(y) > bound.slots).then_some(y + 1)
            })
            .is_ok();
        self.yielded
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // The count first: for a moment it looks one lower, never one higher.
        self.bound.holding.fetch_sub(1, Relaxed);
        if self.yielded {
            self.bound.yielding.fetch_sub(1, Relaxed);
        }
        self.bound.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_slot_waits_for_room_once_the_holds_fill_the_bound_and_goes_when_one_ends() {
        let bound = Bound::new(2);
        let stop = CancellationToken::new();
        let mut a = bound.claim().expect("room for two");
        let mut b = bound.claim().expect("room for two");
        assert!(bound.claim().is_none(), "no third claim");
        assert!(!a.make_room(), "at the bound, nobody makes room");
        let urgent = bound.hold();
        assert!(a.make_room(), "one over: the first slot to end a batch makes room");
        assert!(!b.make_room(), "and only that one");
        let waiting = bound.room(&stop);
        tokio::pin!(waiting);
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        drop(a);
        assert!(!b.make_room(), "back at the bound");
        assert!(futures::poll!(waiting.as_mut()).is_pending(), "still full");
        drop(urgent);
        tokio::time::timeout(std::time::Duration::from_secs(1), waiting)
            .await
            .expect("room once a hold ended");
        let c = bound.claim().expect("room again");
        assert!(bound.claim().is_none(), "one claim for the one hold that ended");
        let waiting = bound.room(&stop);
        stop.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(1), waiting).await.expect("a stop ends the wait");
        drop((b, c));
        assert_eq!(bound.holding.load(Relaxed), 0);
        assert_eq!(bound.yielding.load(Relaxed), 0);
    }
}
