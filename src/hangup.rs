//! Closing a component's connections when it ends, cleanly or not.
//!
//! A fred client's connection is driven by a task of fred's own, which outlives every handle to
//! the client: dropping a worker (an aborted task, a `select!` that chose another branch, a worker
//! built and never run) would leave its connections open, its slots' blocked pops still taking
//! what they wait for, and its subscription to the `up` channels listening; dropping a producer,
//! an admin or a listener would leave theirs. So each keeps the connections it made here: a clean
//! stop closes them ([`Hangup::close`]), and a drop closes them in a task of its own.

use std::time::Duration;

use fred::clients::{Client, SubscriberClient};
use fred::interfaces::ClientInterface;
use fred::prelude::ClientLike;

/// How long the closing task of a dropped component waits for Redis before it gives up (its
/// connections then end with the process).
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// A component's connections, closed once.
pub(crate) struct Hangup {
    /// The pipelined connection: closed last, after the others' calls.
    main: Option<Client>,
    /// Blocking connections (a worker's slots', a listener's reader).
    blocking: Vec<Client>,
    /// A pub/sub connection (a worker's `higher::listen`, a producer's doorbell).
    subscriber: Option<SubscriberClient>,
}

impl Hangup {
    /// Nothing to close yet.
    pub(crate) fn none() -> Self {
        Self { main: None, blocking: Vec::new(), subscriber: None }
    }

    /// The component's pipelined connection (`Store::client`), when the store is its own.
    pub(crate) fn new(main: Client) -> Self {
        Self { main: Some(main), blocking: Vec::new(), subscriber: None }
    }

    pub(crate) fn blocking(&mut self, client: Client) {
        self.blocking.push(client);
    }

    pub(crate) fn subscriber(&mut self, client: SubscriberClient) {
        self.subscriber = Some(client);
    }

    /// Closes every connection: a blocking one is unblocked first (a pop waits for its timeout
    /// before a `QUIT` sent behind it).
    pub(crate) async fn close(mut self) {
        close(std::mem::take(&mut self.blocking), self.subscriber.take(), self.main.take()).await
    }
}

impl Drop for Hangup {
    fn drop(&mut self) {
        let (blocking, subscriber, main) =
            (std::mem::take(&mut self.blocking), self.subscriber.take(), self.main.take());
        if blocking.is_empty() && subscriber.is_none() && main.is_none() {
            return;
        }
        // Dropped outside a runtime, the connections' own tasks are gone already.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(CLOSE_WAIT, close(blocking, subscriber, main)).await;
            });
        }
    }
}

async fn close(blocking: Vec<Client>, subscriber: Option<SubscriberClient>, main: Option<Client>) {
    let blocking = blocking.into_iter().map(|client| async move {
        // (An error: it was not blocked.)
        let _ = client.unblock_self(None).await;
        let _ = client.quit().await;
    });
    futures::future::join_all(blocking).await;
    if let Some(subscriber) = subscriber {
        let _ = subscriber.quit().await;
    }
    if let Some(main) = main {
        let _ = main.quit().await;
    }
}
