//! Closing a component's connections when it ends, cleanly or not.
//!
//! A fred client's connection is driven by a task of fred's own, which outlives every handle to
//! the client: dropping a worker (an aborted task, a `select!` that chose another branch, a worker
//! built and never run) would leave its connections open, its slots' blocked pops still taking
//! what they wait for, and its subscription to the `up` channels listening; dropping a producer,
//! an admin or a listener would leave theirs. So each keeps the connections it made here: a clean
//! stop closes them ([`Hangup::close`]), and a drop closes them in a task of its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fred::clients::{Client, SubscriberClient};
use fred::interfaces::ClientInterface;
use fred::prelude::ClientLike;

/// How long the closing task of a dropped component waits for Redis before it gives up (its
/// connections then end with the process).
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The closing tasks of dropped components that have not ended, and their end's signal.
static CLOSING: AtomicUsize = AtomicUsize::new(0);
static CLOSED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Waits until the connections of every component dropped so far are closed.
///
/// A producer, admin, listener or worker that is dropped rather than stopped closes its
/// connections in a task of its own (at most 5 s: then they end with the process). A runtime
/// shut down while such a task runs (a `main` returning right after the drop) cuts it short, and
/// fred warns that it could not send `QUIT`. A program about to end can await this first: the
/// `sluicegate` command line does. A worker whose stop found Redis not answering is not waited
/// for: it gives up on its connections, so that a program ending after that stop ends at once.
///
/// ```no_run
/// # async fn demo() -> sluicegate::Result<()> {
/// let producer = sluicegate::Producer::connect(&sluicegate::Config::from_env()).await?;
/// drop(producer);
/// sluicegate::dropped_connections_closed().await;
/// # Ok(()) }
/// ```
pub async fn dropped_connections_closed() {
    loop {
        let closed = CLOSED.notified();
        tokio::pin!(closed);
        // Registered before the count is read: an end between the two still wakes it.
        closed.as_mut().enable();
        if CLOSING.load(Ordering::Acquire) == 0 {
            return;
        }
        closed.await;
    }
}

/// Counts a closing task from its spawn to its end, or to its drop with a runtime shut down.
struct Closing;

impl Closing {
    fn start() -> Self {
        CLOSING.fetch_add(1, Ordering::AcqRel);
        Self
    }
}

impl Drop for Closing {
    fn drop(&mut self) {
        CLOSING.fetch_sub(1, Ordering::AcqRel);
        CLOSED.notify_waiters();
    }
}

/// A close that a component's own task makes once the component ends (a producer's flush task
/// closes its connection after its last flush): counted by [`dropped_connections_closed`] from
/// [`begin`](Self::begin), at the component's drop, until the task's copy is dropped too.
#[derive(Clone, Default)]
pub(crate) struct LaterClose(std::sync::Arc<std::sync::Mutex<Option<Closing>>>);

impl LaterClose {
    pub(crate) fn begin(&self) {
        if let Ok(mut closing) = self.0.lock() {
            closing.get_or_insert_with(Closing::start);
        }
    }
}

/// A component's connections, closed once.
pub(crate) struct Hangup {
    /// The pipelined connection: closed last, after the others' calls.
    main: Option<Client>,
    /// Blocking connections (a worker's slots', a listener's reader).
    blocking: Vec<Client>,
    /// A pub/sub connection (a worker's `higher::listen`, a producer's doorbell).
    subscriber: Option<SubscriberClient>,
    /// The runtime the connections' tasks run on, for a drop outside it.
    runtime: Option<tokio::runtime::Handle>,
}

impl Hangup {
    /// Nothing to close yet.
    pub(crate) fn none() -> Self {
        Self {
            main: None,
            blocking: Vec::new(),
            subscriber: None,
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// The component's pipelined connection (`Store::client`), when the store is its own.
    pub(crate) fn new(main: Client) -> Self {
        Self {
            main: Some(main),
            blocking: Vec::new(),
            subscriber: None,
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }

    pub(crate) fn blocking(&mut self, client: Client) {
        self.blocking.push(client);
    }

    pub(crate) fn subscriber(&mut self, client: SubscriberClient) {
        self.subscriber = Some(client);
    }

    /// Closes every connection: a blocking one is unblocked first (a pop waits for its timeout
    /// before a `QUIT` sent behind it). Cancelled part-way (a stop's bound ran out), it leaves
    /// them to its drop, or to [`abandon`](Self::abandon).
    pub(crate) async fn close(&mut self) {
        close(&self.blocking, self.subscriber.as_ref(), self.main.as_ref()).await;
        (self.blocking, self.subscriber, self.main) = (Vec::new(), None, None);
    }

    /// Gives up on Redis, which did not answer a stop's last calls: the connections still left
    /// are closed in a task of their own as at a drop, but one that
    /// [`dropped_connections_closed`] does not wait for. A program ending after such a stop (the
    /// command line's worker) would otherwise wait up to 5 s more for a Redis that is not there.
    pub(crate) fn abandon(mut self) {
        self.spawn_close(false);
    }

    /// Closes what is left in a task of its own (at most [`CLOSE_WAIT`]), counted by
    /// [`dropped_connections_closed`] or not.
    fn spawn_close(&mut self, counted: bool) {
        let (blocking, subscriber, main) =
            (std::mem::take(&mut self.blocking), self.subscriber.take(), self.main.take());
        if blocking.is_empty() && subscriber.is_none() && main.is_none() {
            return;
        }
        // (A runtime shut down drops the task: the connections' tasks are gone with it.)
        if let Some(runtime) = tokio::runtime::Handle::try_current().ok().or_else(|| self.runtime.take()) {
            let counted = counted.then(Closing::start);
            runtime.spawn(async move {
                let _counted = counted;
                let closing = close(&blocking, subscriber.as_ref(), main.as_ref());
                let _ = tokio::time::timeout(CLOSE_WAIT, closing).await;
            });
        }
    }
}

impl Drop for Hangup {
    fn drop(&mut self) {
        self.spawn_close(true);
    }
}

async fn close(blocking: &[Client], subscriber: Option<&SubscriberClient>, main: Option<&Client>) {
    let blocking = blocking.iter().map(|client| async move {
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
