//! A bulk loader: many requests submitted with at most a window of their parts unfinished.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::events::Listener;
use crate::producer::{Producer, RequestBuilder, RequestHandle};
use crate::request::RequestId;

/// Submits many requests while at most `window` of their parts are unfinished in Redis, so that
/// a loader of a billion small tasks holds Redis's memory to the window's, whatever it loads.
///
/// [`submit`](Self::submit) waits until the request's parts fit in the window; a request's parts
/// leave it when the request ends (its completion event: completed, failed or cancelled). A
/// request larger than the window waits until nothing else of the loader's is unfinished, then
/// goes alone (for one request larger than Redis should hold, use a windowed streamed request,
/// [`RequestBuilder::window`]). Finished requests' results stay in Redis for their retention
/// ([`Config::retention`](crate::Config::retention)) unless read, as any request's do.
///
/// ```no_run
/// # async fn demo() -> sluicegate::Result<()> {
/// use sluicegate::{Config, Loader, Producer};
/// let producer = Producer::connect(&Config::from_env()).await?;
/// let loader = Loader::connect(&producer, 100_000).await?;
/// for file in 0..1_000_000u64 {
///     loader.submit(producer.request().concurrency(2)?, vec![file * 10, file * 10 + 1]).await?;
/// }
/// loader.drain().await?; // every request loaded has ended
/// # Ok(()) }
/// ```
pub struct Loader {
    window: u32,
    room: Arc<Semaphore>,
    /// Requests loaded and not ended yet, with the room each holds.
    unfinished: Arc<Mutex<HashMap<RequestId, OwnedSemaphorePermit>>>,
    /// Why the completion listener stopped, if it did (the loader then refuses to load).
    failed: Arc<Mutex<Option<String>>>,
    listening: tokio::task::JoinHandle<()>,
}

impl Loader {
    /// A loader through `producer` that keeps at most `window` parts unfinished (1 to 2^32 - 1).
    /// It listens to the namespace's completion events from now on.
    pub async fn connect(producer: &Producer, window: u64) -> Result<Self> {
        let window = u32::try_from(window).ok().filter(|w| *w > 0).ok_or_else(|| {
            Error::InvalidRequest(format!(
                "a loader's window of {window} parts is out of range: use 1 to {}",
                u32::MAX
            ))
        })?;
        let mut listener = Listener::connect(producer.config()).await?;
        let room = Arc::new(Semaphore::new(window as usize));
        let unfinished: Arc<Mutex<HashMap<RequestId, OwnedSemaphorePermit>>> = Arc::default();
        let failed: Arc<Mutex<Option<String>>> = Arc::default();
        let listening = {
            let (room, unfinished, failed) = (room.clone(), unfinished.clone(), failed.clone());
            tokio::spawn(async move {
                loop {
                    match listener.next().await {
                        // Dropping the permit gives its room back.
                        Ok(event) => drop(lock(&unfinished).remove(&event.id)),
                        Err(e) => {
                            tracing::error!(error = %e, "the loader stopped listening to completions");
                            *lock(&failed) = Some(e.to_string());
                            room.close();
                            return;
                        }
                    }
                }
            })
        };
        Ok(Self { window, room, unfinished, failed, listening })
    }

    /// Submits a request described by `spec` (from [`Producer::request`]) once its parts fit in
    /// the window. An id chosen in `spec` is kept; otherwise one is generated.
    pub async fn submit<I, T>(&self, spec: RequestBuilder<'_>, parts: I) -> Result<RequestHandle>
    where
        I: IntoIterator<Item = T>,
        T: Serialize,
    {
        let parts: Vec<T> = parts.into_iter().collect();
        let size = u32::try_from(parts.len()).unwrap_or(u32::MAX).clamp(1, self.window);
        let permit = self.room.clone().acquire_many_owned(size).await.map_err(|_| self.stopped())?;
        let (spec, id) = spec.with_id();
        // Known before the submit, so that a completion arriving before it returns is not missed.
        lock(&self.unfinished).insert(id.clone(), permit);
        let submitted = spec.submit(parts).await;
        if submitted.is_err() {
            lock(&self.unfinished).remove(&id);
        }
        submitted
    }

    /// Parts of the requests loaded that have not ended yet (at most the window, or one request's
    /// size when it is larger).
    pub fn unfinished(&self) -> u64 {
        u64::from(self.window).saturating_sub(self.room.available_permits() as u64)
    }

    /// Waits until every request loaded so far has ended.
    pub async fn drain(&self) -> Result<()> {
        let all = self.room.acquire_many(self.window).await.map_err(|_| self.stopped())?;
        drop(all);
        Ok(())
    }

    fn stopped(&self) -> Error {
        let why = lock(&self.failed).clone().unwrap_or_else(|| "the loader was dropped".into());
        Error::Protocol(format!("the loader no longer hears completions ({why}); nothing more is loaded"))
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.listening.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
