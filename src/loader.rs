//! A bulk loader: many requests submitted with at most a window of their parts unfinished.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::admin::Admin;
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
/// A completion the loader never hears (its event trimmed or lost in a failover, the namespace
/// purged, a submit that failed without saying whether it happened) does not hold its room for
/// ever: every few seconds the loader asks for the status of requests it has waited on for a
/// while, and frees the room of those that ended or do not exist.
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
    /// What `submit_many` submits through.
    producer: Producer,
    window: u32,
    room: Arc<Semaphore>,
    unfinished: Unfinished,
    /// Why the completion listener stopped, if it did (the loader then refuses to load).
    failed: Arc<Mutex<Option<String>>>,
    listening: tokio::task::JoinHandle<()>,
    checking: tokio::task::JoinHandle<()>,
}

/// Requests loaded and not ended yet.
type Unfinished = Arc<Mutex<HashMap<RequestId, Loaded>>>;

/// A request loaded: the room it holds, since when it was last looked at, and whether its submit
/// is still under way (then no status says anything yet).
struct Loaded {
    _room: OwnedSemaphorePermit,
    since: Instant,
    submitting: bool,
}

/// How often, and after how long, the loader asks for the status of requests it has not heard
/// end; and how many it asks about each time.
const CHECK_EVERY: Duration = Duration::from_secs(5);
const CHECK_MAX: usize = 100;

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
        let admin = Admin::connect(producer.config()).await?;
        let room = Arc::new(Semaphore::new(window as usize));
        let unfinished: Unfinished = Arc::default();
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
        let checking = tokio::spawn(check(admin, unfinished.clone()));
        Ok(Self { producer: producer.clone(), window, room, unfinished, failed, listening, checking })
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
        let (spec, id) = spec.with_id();
        if lock(&self.unfinished).contains_key(&id) {
            return Err(Error::DuplicateRequestId(id));
        }
        let permit = self.room.clone().acquire_many_owned(size).await.map_err(|_| self.stopped())?;
        {
            let mut unfinished = lock(&self.unfinished);
            // Another of this loader's requests has that id (a retried submit): refused as Redis
            // would, without touching its room.
            if unfinished.contains_key(&id) {
                return Err(Error::DuplicateRequestId(id));
            }
            // Known before the submit, so that a completion arriving before it returns is not missed.
            unfinished.insert(id.clone(), Loaded { _room: permit, since: Instant::now(), submitting: true });
        }
        let submitting = Submitting { unfinished: &self.unfinished, id: &id };
        let submitted = spec.submit(parts).await;
        // A refusal that says nothing was created gives the room back now; after any other error
        // the request may exist, and the status checks settle it.
        if let Err(e) = &submitted {
            if refused_whole(e) {
                lock(&self.unfinished).remove(&id);
            }
        }
        drop(submitting);
        submitted
    }

    /// Submits many requests as [`Producer::submit_many`] does (hundreds of small ones per call,
    /// through the producer the loader was connected with), each once its parts fit in the window:
    /// the requests that fit go in one `submit_many`, then the loader waits for room for the next. One answer per request, in order; a request refused
    /// (its id in use, by Redis or by another of this loader's requests; a bad argument) is refused
    /// alone and holds no room.
    ///
    /// ```no_run
    /// # async fn demo(producer: &sluicegate::Producer, loader: &sluicegate::Loader) -> sluicegate::Result<()> {
    /// for chunk in (0..1_000_000u64).collect::<Vec<_>>().chunks(1_000) {
    ///     let batch = chunk.iter().map(|n| (producer.request(), vec![*n]));
    ///     for answer in loader.submit_many(batch).await {
    ///         answer?;
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn submit_many<'a, R, P, T>(&self, requests: R) -> Vec<Result<RequestHandle>>
    where
        R: IntoIterator<Item = (RequestBuilder<'a>, P)>,
        P: IntoIterator<Item = T>,
        T: Serialize,
    {
        let mut answers: Vec<Option<Result<RequestHandle>>> = Vec::new();
        let mut batch: Vec<Pending<'a, T>> = Vec::new();
        for (n, (spec, parts)) in requests.into_iter().enumerate() {
            answers.push(None);
            let parts: Vec<T> = parts.into_iter().collect();
            let size = u32::try_from(parts.len()).unwrap_or(u32::MAX).clamp(1, self.window);
            let (spec, id) = spec.with_id();
            if lock(&self.unfinished).contains_key(&id) {
                answers[n] = Some(Err(Error::DuplicateRequestId(id)));
                continue;
            }
            let permit = match self.room.clone().try_acquire_many_owned(size) {
                Ok(permit) => permit,
                // No room: what fits is sent first (its room comes back as it finishes).
                Err(tokio::sync::TryAcquireError::NoPermits) => {
                    self.send(&mut batch, &mut answers).await;
                    match self.room.clone().acquire_many_owned(size).await {
                        Ok(permit) => permit,
                        Err(_) => {
                            answers[n] = Some(Err(self.stopped()));
                            continue;
                        }
                    }
                }
                Err(tokio::sync::TryAcquireError::Closed) => {
                    answers[n] = Some(Err(self.stopped()));
                    continue;
                }
            };
            {
                let mut unfinished = lock(&self.unfinished);
                if unfinished.contains_key(&id) {
                    answers[n] = Some(Err(Error::DuplicateRequestId(id)));
                    continue;
                }
                unfinished
                    .insert(id.clone(), Loaded { _room: permit, since: Instant::now(), submitting: true });
            }
            batch.push(Pending { at: n, id, spec, parts });
        }
        self.send(&mut batch, &mut answers).await;
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| Err(Error::Protocol("a request of submit_many got no answer".into())))
            })
            .collect()
    }

    /// Submits the requests of `batch` (their room held) in one `submit_many`, and records their
    /// answers.
    async fn send<'a, T: Serialize>(
        &self,
        batch: &mut Vec<Pending<'a, T>>,
        answers: &mut [Option<Result<RequestHandle>>],
    ) {
        if batch.is_empty() {
            return;
        }
        let pending = std::mem::take(batch);
        let ids: Vec<(usize, RequestId)> = pending.iter().map(|p| (p.at, p.id.clone())).collect();
        let _submitting: Vec<Submitting<'_>> =
            ids.iter().map(|(_, id)| Submitting { unfinished: &self.unfinished, id }).collect();
        let submitted = self.producer.submit_many(pending.into_iter().map(|p| (p.spec, p.parts))).await;
        for ((at, id), answer) in ids.iter().zip(submitted) {
            // As in `submit`: a refusal that says nothing was created gives the room back now.
            if let Err(e) = &answer {
                if refused_whole(e) {
                    lock(&self.unfinished).remove(id);
                }
            }
            answers[*at] = Some(answer);
        }
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
        self.checking.abort();
    }
}

/// A request of `submit_many` whose room is held, waiting for its batch's call.
struct Pending<'a, T> {
    at: usize,
    id: RequestId,
    spec: RequestBuilder<'a>,
    parts: Vec<T>,
}

/// Marks a submit as over when it returns or its caller drops it.
struct Submitting<'a> {
    unfinished: &'a Unfinished,
    id: &'a RequestId,
}

impl Drop for Submitting<'_> {
    fn drop(&mut self) {
        if let Some(loaded) = lock(self.unfinished).get_mut(self.id) {
            loaded.submitting = false;
            loaded.since = Instant::now();
        }
    }
}

/// Errors after which nothing of the request is in Redis.
fn refused_whole(e: &Error) -> bool {
    match e {
        Error::InvalidRequest(_)
        | Error::InvalidRequestId(_)
        | Error::DuplicateRequestId(_)
        | Error::Codec(_) => true,
        Error::Redis(redis) => redis.is_full(),
        _ => false,
    }
}

/// Every `CHECK_EVERY`: the status of up to `CHECK_MAX` requests not heard from for that long;
/// those that ended, or do not exist, give their room back.
async fn check(admin: Admin, unfinished: Unfinished) {
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        let mut due: Vec<(Instant, RequestId)> = lock(&unfinished)
            .iter()
            .filter(|(_, l)| !l.submitting && l.since.elapsed() >= CHECK_EVERY)
            .map(|(id, l)| (l.since, id.clone()))
            .collect();
        due.sort();
        for (_, id) in due.into_iter().take(CHECK_MAX) {
            let ended = match admin.status(&id).await {
                Ok(status) => status.state.is_terminal(),
                Err(Error::UnknownRequest(_)) => true,
                Err(e) => {
                    tracing::debug!(error = %e, "the loader could not look at a request; later");
                    false
                }
            };
            let mut unfinished = lock(&unfinished);
            if ended {
                unfinished.remove(&id);
            } else if let Some(loaded) = unfinished.get_mut(&id) {
                loaded.since = Instant::now();
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
