//! Submitting requests and waiting for their results.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fred::prelude::*;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{broadcast, OnceCell};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::codec;
use crate::config::Config;
use crate::error::{retry_transient, Error, Result};
use crate::hangup::{Hangup, LaterClose};
use crate::otel;
use crate::protocol::lane;
use crate::protocol::listing::{Kind, Row};
use crate::protocol::submit::{self, NewRequest};
use crate::request::{
    reason_shown, Concurrency, OnUpstreamFailure, PartError, Priority, RequestId, RequestState,
};
use crate::shards::{Look, Placement};
use crate::stats::{Counter, Recorder};
use crate::store::Store;

/// Parts sent per call while a request loads (and at most this many bytes, unless one part is
/// larger): bounds producer memory, amortises round trips.
const LOAD_CHUNK: usize = 2_000;
const LOAD_CHUNK_BYTES: usize = 4 << 20;

/// The most requests one `lane_submit_many` call of [`Producer::submit_many`] creates.
const BULK_REQUESTS: usize = 256;

/// The calls of one [`Producer::submit_many`] in flight at once.
const BULK_CALLS: usize = 8;

/// One `lane_submit_many` call of [`Producer::submit_many`]: its home shard and priority, the
/// requests it carries (their places among the lane-bound ones, and each with its parts), and
/// their payload bytes.
type BulkCall<'a> = (u32, Priority, Vec<usize>, Vec<(&'a NewRequest<'a>, Vec<Value>)>, usize);

/// A request of [`Producer::submit_many`] that a lane takes, on its way to its call.
struct Small<'a> {
    /// Its place among the requests given.
    index: usize,
    count: u64,
    spec: RequestBuilder<'a>,
    id: RequestId,
    key_id: String,
    nonce: String,
    trace: String,
    send: otel::SendSpan,
    parts: Vec<Value>,
}

/// Submits requests and waits for their results.
///
/// ```no_run
/// # async fn demo() -> sluicegate::Result<()> {
/// use sluicegate::{Config, Producer};
/// let producer = Producer::connect(&Config::from_env()).await?;
/// let handle = producer.request().priority(7)?.concurrency(4)?.submit(vec!["a", "b"]).await?;
/// let done = handle.wait::<String>().await?;
/// println!("{:?}", done.results);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Producer {
    pub(crate) store: Store,
    doorbell: Arc<OnceCell<Doorbell>>,
    counting: Arc<Counting>,
}

impl Producer {
    /// Connects to Redis, checks its version and loads the functions library.
    pub async fn connect(config: &Config) -> Result<Self> {
        let store = crate::protocol::connect(config).await?;
        let counting = Arc::new(Counting::start(&store, Hangup::new(store.client.clone())));
        Ok(Self { store, doorbell: Arc::new(OnceCell::new()), counting })
    }

    /// A producer on a store of its owner's, counting for the stats by stage in `recorder`, which
    /// its owner flushes (no flush task of its own): a worker's recovery, which fires schedules
    /// (flushed with the worker's counts), and the checker's producers.
    #[cfg(any(test, feature = "schedules"))]
    pub(crate) fn from_store(store: Store, recorder: Arc<Recorder>) -> Self {
        let counting = Arc::new(Counting {
            recorder,
            stop: CancellationToken::new(),
            _hangup: None,
            closing: LaterClose::default(),
        });
        Self { store, doorbell: Arc::new(OnceCell::new()), counting }
    }

    /// Adds the requests this producer submitted since its last flush to the stats by stage now
    /// (`Admin::stats_since`). A producer does so by itself every `Config::stats_flush_interval`
    /// and when its last clone is dropped inside a running runtime; a short-lived program calls
    /// this before it exits.
    pub async fn flush_stats(&self) -> Result<()> {
        self.counting.recorder.flush(&self.store).await
    }

    /// Starts describing a request; finish with [`RequestBuilder::submit`].
    pub fn request(&self) -> RequestBuilder<'_> {
        RequestBuilder {
            producer: self,
            id: None,
            priority: Priority::DEFAULT,
            concurrency: Concurrency::default(),
            retry: RetryPolicy::default(),
            delay: Duration::ZERO,
            open_expiry: None,
            fail_fast: false,
            own_stream: false,
            listed: true,
            window: 0,
            discard: false,
            tags: Vec::new(),
            deadline: None,
            rate: None,
            after: Vec::new(),
            on_upstream_failure: OnUpstreamFailure::Fail,
            group: None,
        }
    }

    /// The configuration this producer connected with.
    pub(crate) fn config(&self) -> &Config {
        &self.store.config
    }

    /// A handle on a request submitted earlier (by this or another process).
    pub fn handle(&self, id: RequestId) -> RequestHandle {
        RequestHandle { id, producer: self.clone(), lane: false }
    }

    async fn submit<I, T>(&self, spec: RequestBuilder<'_>, parts: I) -> Result<RequestHandle>
    where
        I: IntoIterator<Item = T>,
        T: codec::Part,
    {
        let id = spec.id.clone().unwrap_or_else(RequestId::generate);
        let span = tracing::info_span!("submit", request_id = %id, priority = spec.priority.get());
        let send = otel::SendSpan::request(self.store.config.namespace_str(), &id, spec.priority);
        let trace = send.carried();
        let submitted = async {
            check_duration("delay", spec.delay)?;
            spec.check_listing()?;
            spec.check_upstreams(&id)?;
            let finish_within = spec.finish_within()?;
            if spec.window > 0 {
                // A whole request is bounded by what the producer hands over at once; the window
                // paces a streamed producer (and keeps windowed requests off the lanes).
                return Err(Error::InvalidRequest(
                    "window is for streamed requests: use open() and add(), not submit()".into(),
                ));
            }
            let key_id = id.key_id();
            let nonce = uuid::Uuid::new_v4().simple().to_string();
            let place = Placement {
                priority: spec.priority,
                shards: self.store.keys.shards(),
                group: spec.group.clone(),
            };
            // The first chunk decides: a request that fits in it is submitted in one call.
            let mut parts = parts.into_iter();
            let first = encode_chunk(&mut parts, self.load_chunk())?;
            if first.is_empty() {
                return Err(Error::InvalidRequest("a request needs at least one part".into()));
            }
            let mut parts = parts.peekable();
            let lane = self.takes_lane(&spec, &first) && parts.peek().is_none();
            if !spec.listed && !lane {
                return Err(Error::InvalidRequest(UNLISTED_LANE_ONLY.into()));
            }
            if lane {
                // A generated id is unique, so its record needs no nonce to know a re-sent submit.
                let nonce = if spec.id.is_some() { nonce.as_str() } else { "" };
                let req = spec.new_request(&id, &key_id, nonce, place.shards, 0, &trace, None, &[]);
                send.count(first.len() as u64);
                lane::submit(&self.store, &req, first).await?;
                self.counting.recorder.count(spec.priority, Counter::Submitted, 1);
                tracing::debug!("request durable and queued in its lane");
                return Ok(RequestHandle { id: id.clone(), producer: self.clone(), lane: true });
            }
            // Registered with recovery before it exists: a producer that dies after creating it but
            // before pushing its tokens leaves a request recovery finds and completes. Never taken
            // back (it may be the winner's, when two producers submit one id).
            let row = spec.row(Kind::Own);
            let registration = crate::shards::register(&self.store, &key_id, place.clone(), &row).await?;
            let deadline = registration.deadline(&self.store);
            let upstreams: Vec<String> = spec.after.iter().map(RequestId::key_id).collect();
            let req = spec.new_request(
                &id,
                &key_id,
                &nonce,
                place.shards,
                deadline,
                &trace,
                finish_within,
                &upstreams,
            );
            let (committed, total) = self.write(&req, spec.delay, first, parts, &spec.after).await?;
            send.count(total);
            let elements = match committed {
                submit::Committed::Elements(elements) => elements,
                submit::Committed::Failed(finished) => {
                    // An upstream had failed already: it ended at once, and is announced now.
                    crate::shards::finish(&self.store, &key_id, place.clone(), finished).await?;
                    self.counting.recorder.count(spec.priority, Counter::Submitted, 1);
                    return Ok(RequestHandle { id: id.clone(), producer: self.clone(), lane: false });
                }
            };
            // A delayed request is first looked at (and promoted) when its time comes; one with a
            // deadline no later than that.
            let next = if spec.delay.is_zero() { self.store.config.census_interval } else { spec.delay };
            let next = finish_within.map_or(next, |d| d.min(next));
            crate::shards::push(&self.store, &key_id, place, Look::First(registration), next, elements)
                .await?;
            self.counting.recorder.count(spec.priority, Counter::Submitted, 1);
            tracing::debug!("request durable and queued");
            Ok(RequestHandle { id: id.clone(), producer: self.clone(), lane: false })
        }
        .instrument(span)
        .await;
        send.end(&submitted);
        submitted
    }

    /// Submits many requests at once, as BullMQ's `addBulk` or Sidekiq's `push_bulk` do: each
    /// `(request, parts)` pair as [`RequestBuilder::submit`] submits it, with one answer per
    /// request, in the order given. The requests a lane takes (given whole, at most 64 parts and
    /// 64 KB of payloads, with no delay, deadline, rate limit, group or upstream; docs/protocol.md
    /// §5, "Lanes") go in one call per up to 256 of one priority and home shard, which costs Redis
    /// far less than a call each (docs/benchmarks.md); the others are submitted one by one. A
    /// request refused (its id in use, a setting out of range), or lost with its call, leaves the
    /// others as they are: each answer is its own.
    ///
    /// ```no_run
    /// # async fn demo() -> sluicegate::Result<()> {
    /// use sluicegate::{Config, Producer};
    /// let producer = Producer::connect(&Config::from_env()).await?;
    /// let thumbnails = ["a.png", "b.png", "c.png"].map(|file| (producer.request(), vec![file]));
    /// for answer in producer.submit_many(thumbnails).await {
    ///     let handle = answer?;
    ///     println!("submitted {}", handle.id());
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn submit_many<'a, R, P, T>(&'a self, requests: R) -> Vec<Result<RequestHandle>>
    where
        R: IntoIterator<Item = (RequestBuilder<'a>, P)>,
        P: IntoIterator<Item = T>,
        T: Serialize,
    {
        let mut answers: Vec<Option<Result<RequestHandle>>> = Vec::new();
        let mut smalls: Vec<Small<'a>> = Vec::new();
        let mut others = Vec::new();
        for (index, (spec, parts)) in requests.into_iter().enumerate() {
            answers.push(None);
            let mut parts = parts.into_iter();
            // One part more than a lane takes at most: enough to tell whether this one fits.
            let first: Result<Vec<Vec<u8>>> =
                parts.by_ref().take(lane::MAX_PARTS + 1).map(|p| codec::Part::into_part(p)).collect();
            let first = match first {
                Ok(first) => first,
                Err(e) => {
                    answers[index] = Some(Err(e));
                    continue;
                }
            };
            let bytes = first.iter().map(Vec::len).sum();
            let small = !first.is_empty()
                && spec.window == 0
                && spec.check_listing().is_ok()
                && self.fits_lane(&spec, first.len(), bytes);
            if !small {
                // `submit` gives it its own stream, or the error that names what is wrong with it.
                let parts =
                    first.into_iter().map(codec::Pending::Done).chain(parts.map(codec::Pending::Todo));
                others.push((index, spec, parts));
                continue;
            }
            let id = spec.id.clone().unwrap_or_else(RequestId::generate);
            let send = otel::SendSpan::request(self.store.config.namespace_str(), &id, spec.priority);
            // A generated id is unique, so its record needs no nonce to know a re-sent submit.
            let nonce =
                if spec.id.is_some() { uuid::Uuid::new_v4().simple().to_string() } else { String::new() };
            smalls.push(Small {
                index,
                count: first.len() as u64,
                key_id: id.key_id(),
                trace: send.carried(),
                id,
                nonce,
                send,
                spec,
                parts: first.into_iter().map(|b| Value::Bytes(b.into())).collect(),
            });
        }
        let shards = self.store.keys.shards();
        let parts_of: Vec<Vec<Value>> = smalls.iter_mut().map(|s| std::mem::take(&mut s.parts)).collect();
        let news: Vec<NewRequest<'_>> = smalls
            .iter()
            .map(|s| s.spec.new_request(&s.id, &s.key_id, &s.nonce, shards, 0, &s.trace, None, &[]))
            .collect();
        // Calls of one priority and home shard each, in submission order, within BULK_REQUESTS
        // requests and LOAD_CHUNK_BYTES bytes of payloads.
        let mut calls: Vec<BulkCall<'_>> = Vec::new();
        let mut open: HashMap<(u32, Priority), usize> = HashMap::new();
        for (j, (small, parts)) in smalls.iter().zip(parts_of).enumerate() {
            let place = (crate::keys::home_shard(&small.key_id, shards), small.spec.priority);
            let bytes: usize = parts.iter().map(|v| v.as_bytes().map_or(0, <[u8]>::len)).sum();
            let at = match open.get(&place) {
                Some(&at) if calls[at].2.len() < BULK_REQUESTS && calls[at].4 + bytes <= LOAD_CHUNK_BYTES => {
                    at
                }
                _ => {
                    calls.push((place.0, place.1, Vec::new(), Vec::new(), 0));
                    open.insert(place, calls.len() - 1);
                    calls.len() - 1
                }
            };
            calls[at].2.push(j);
            calls[at].3.push((&news[j], parts));
            calls[at].4 += bytes;
        }
        // (Futures built in loops rather than by closures over borrowed batches, so that the whole
        // stays `Send` for callers that spawn it.)
        let mut sends = Vec::with_capacity(calls.len());
        for (shard, priority, members, batch, _) in calls {
            sends
                .push(async move { (members, lane::submit_many(&self.store, shard, priority, batch).await) });
        }
        // (Under the checker one at a time: its scheduler follows one call per actor.)
        let in_flight = if self.store.deterministic() { 1 } else { BULK_CALLS };
        let sent = at_most(in_flight, sends).await;
        let mut created: Vec<Option<Result<()>>> = smalls.iter().map(|_| None).collect();
        for (members, result) in sent {
            match result {
                Ok(each) => {
                    for (j, one) in members.into_iter().zip(each) {
                        created[j] = Some(one.map(drop));
                    }
                }
                Err(e) => {
                    for j in members {
                        created[j] = Some(Err(e.again()));
                    }
                }
            }
        }
        for (small, one) in smalls.into_iter().zip(created) {
            let one =
                one.unwrap_or_else(|| Err(Error::Protocol("a request of submit_many was not sent".into())));
            let handle = one.map(|()| {
                small.send.count(small.count);
                self.counting.recorder.count(small.spec.priority, Counter::Submitted, 1);
                RequestHandle { id: small.id.clone(), producer: self.clone(), lane: true }
            });
            small.send.end(&handle);
            answers[small.index] = Some(handle);
        }
        let mut submits = Vec::with_capacity(others.len());
        for (index, spec, parts) in others {
            submits.push(async move { (index, self.submit(spec, parts).await) });
        }
        for (index, answer) in at_most(in_flight, submits).await {
            answers[index] = Some(answer);
        }
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| Err(Error::Protocol("a request of submit_many got no answer".into())))
            })
            .collect()
    }

    /// Creates the request with its parts, `first` (already encoded) and then the rest: in one
    /// call if there is no rest and no upstream, else opened, linked to its `upstreams` (after the
    /// open, so that a release from then on reaches it, and before the commit, so that each
    /// upstream exists before it is committed and no cycle can form), loaded chunk by chunk and
    /// committed. Returns what
    /// the commit made of it, and how many parts it has.
    async fn write<I, T>(
        &self,
        req: &NewRequest<'_>,
        delay: Duration,
        first: Vec<Value>,
        rest: I,
        upstreams: &[RequestId],
    ) -> Result<(submit::Committed, u64)>
    where
        I: Iterator<Item = T>,
        T: codec::Part,
    {
        let mut rest = rest.peekable();
        if rest.peek().is_none() && upstreams.is_empty() && req.group.is_none() {
            let total = first.len() as u64;
            let elements = submit::submit_small(&self.store, req, delay, first).await?;
            return Ok((submit::Committed::Elements(elements), total));
        }
        submit::submit_open(&self.store, req, delay).await?;
        let loaded = async {
            // Links first: an upstream that cannot be waited for is refused before any part is sent.
            let links = crate::shards::dag::link_all(&self.store, req.key_id, req.shards, upstreams).await?;
            let total = self.load(req.key_id, req.nonce, first, rest).await?;
            Ok::<_, Error>((total, links))
        };
        let (total, links) = match loaded.await {
            Ok(loaded) => loaded,
            Err(e) => {
                // Nothing of a half-written request is visible to workers; remove it now so the id
                // can be used again (it would expire after the loading ttl anyway). Its entries in
                // upstreams' sets of downstreams name no request, and are passed over.
                let _ = submit::submit_abort(&self.store, req.key_id, req.nonce).await;
                return Err(e);
            }
        };
        // From here on the request may be committed: never delete it on error.
        Ok((submit::submit_commit(&self.store, req.key_id, total, req.nonce, &links).await?, total))
    }

    /// Writes the parts in chunks, `first` (already encoded) and then the rest. Returns how many.
    async fn load<I, T>(&self, key_id: &str, nonce: &str, first: Vec<Value>, mut rest: I) -> Result<u64>
    where
        I: Iterator<Item = T>,
        T: codec::Part,
    {
        let mut total: u64 = 0;
        let mut chunk = first;
        // Chunks go one after another, each awaited: producer memory stays bounded by one chunk,
        // and a slow Redis slows the producer down.
        while !chunk.is_empty() {
            let n = chunk.len() as u64;
            submit::load_parts(&self.store, key_id, nonce, total, chunk).await?;
            total += n;
            chunk = encode_chunk(&mut rest, self.load_chunk())?;
        }
        Ok(total)
    }

    /// Whether a request takes its priority's lane (docs/architecture.md, "Lanes"): lanes are on,
    /// it runs at once, and its parts, all in `first`, are few and small.
    fn takes_lane(&self, spec: &RequestBuilder<'_>, first: &[Value]) -> bool {
        let bytes: usize = first.iter().map(|v| v.as_bytes().map_or(0, <[u8]>::len)).sum();
        self.fits_lane(spec, first.len(), bytes)
    }

    /// Whether a request of `parts` parts, `bytes` bytes of payloads in all, given whole, is run in
    /// its priority's lane (docs/protocol.md §5, "Lanes").
    fn fits_lane(&self, spec: &RequestBuilder<'_>, parts: usize, bytes: usize) -> bool {
        self.store.config.lane_tokens > 0
            && !spec.own_stream
            && spec.delay.is_zero()
            && spec.deadline.is_none()
            && spec.rate.is_none()
            && spec.after.is_empty()
            && spec.group.is_none()
            && parts <= lane::MAX_PARTS
            && bytes <= lane::MAX_BYTES
    }

    /// Reads a request's terminal record and results, or `None` while it is not terminal.
    async fn try_completion<O: DeserializeOwned>(&self, id: &RequestId) -> Result<Option<Completion<O>>> {
        let key_id = id.key_id();
        let keys = self.store.keys.request(&key_id);
        let meta: Vec<Option<String>> = self
            .store
            .client
            .hmget(keys.meta.as_str(), vec!["state", "total", "taken", "discard", "failed", "why"])
            .await?;
        let num = |i: usize| meta.get(i).cloned().flatten().and_then(|v| v.parse::<u64>().ok());
        let (state, total, taken, failed) = (meta.first().cloned().flatten(), num(1), num(2), num(4));
        let discard = meta.get(3).cloned().flatten();
        let reason = meta.get(5).cloned().flatten().map(|why| reason_shown(&why));
        let Some(state) = state else {
            return self.try_lane_completion(id).await;
        };
        let state: RequestState = state.parse()?;
        if !state.is_terminal() {
            return Ok(None);
        }
        let total = total.unwrap_or(0);
        let discard = discard.as_deref() == Some("1");
        if discard {
            return Ok(Some(Completion::counts_only(id, state, total, failed.unwrap_or(0), reason)));
        }
        let oks: HashMap<u64, Vec<u8>> = self.store.client.hgetall(keys.results.as_str()).await?;
        let errs: HashMap<u64, Vec<u8>> = self.store.client.hgetall(keys.errors.as_str()).await?;
        // Results taken with results_from are not returned again (nor, once deleted, could be).
        let first = taken.unwrap_or(0).min(total);
        let mut done = completion_from(id, state, first, total, &oks, &errs, reason.as_deref())?;
        done.failed = failed.unwrap_or(done.failed);
        Ok(Some(done))
    }

    /// `try_completion` of a lane request, from its record (results `o<i>`, errors `e<i>`).
    async fn try_lane_completion<O: DeserializeOwned>(
        &self,
        id: &RequestId,
    ) -> Result<Option<Completion<O>>> {
        let key_id = id.key_id();
        let own = crate::shards::lane_home(&self.store, &key_id);
        let mut fields: HashMap<String, Vec<u8>> =
            self.store.client.hgetall(self.store.keys.record(own, &key_id).as_str()).await?;
        if fields.is_empty() {
            // Submitted with another shard count than this producer's (a handle of another
            // producer's request, while a change of `token_shards` rolls out).
            let home = crate::shards::lane_home_found(&self.store, &key_id).await?;
            if home != own {
                fields = self.store.client.hgetall(self.store.keys.record(home, &key_id).as_str()).await?;
            }
        }
        let meta = lane::record_meta(&fields);
        let Some(state) = meta.get("state") else {
            return Err(Error::UnknownRequest(id.clone()));
        };
        let state: RequestState = state.parse()?;
        if !state.is_terminal() {
            return Ok(None);
        }
        let total = meta.get("total").and_then(|t| t.parse().ok()).unwrap_or(0);
        if meta.get("discard").is_some_and(|d| d == "1") {
            let failed = meta.get("failed").and_then(|f| f.parse().ok()).unwrap_or(0);
            return Ok(Some(Completion::counts_only(id, state, total, failed, None)));
        }
        let (mut oks, mut errs) = (HashMap::new(), HashMap::new());
        for (field, value) in fields {
            let (kind, index) = field.split_at(1.min(field.len()));
            let Ok(index) = index.parse::<u64>() else { continue };
            match kind {
                "o" => oks.insert(index, value),
                "e" => errs.insert(index, value),
                _ => None,
            };
        }
        Ok(Some(completion(id, state, total, &oks, &errs)?))
    }

    /// Parts per load call: [`LOAD_CHUNK`], or the checker's smaller chunk.
    fn load_chunk(&self) -> usize {
        #[cfg(test)]
        if let Some(gate) = &self.store.gate {
            return gate.load_chunk;
        }
        LOAD_CHUNK
    }

    async fn doorbell(&self) -> Result<&Doorbell> {
        self.doorbell.get_or_try_init(|| Doorbell::start(&self.store)).await
    }
}

/// A terminal request's completion from its results and error records, by index.
fn completion<O: DeserializeOwned>(
    id: &RequestId,
    state: RequestState,
    total: u64,
    oks: &HashMap<u64, Vec<u8>>,
    errs: &HashMap<u64, Vec<u8>>,
) -> Result<Completion<O>> {
    completion_from(id, state, 0, total, oks, errs, None)
}

/// [`completion`] of the parts from `first` on (those before were taken with `results_from`):
/// never a slot for a part taken, however many there were.
fn completion_from<O: DeserializeOwned>(
    id: &RequestId,
    state: RequestState,
    first: u64,
    total: u64,
    oks: &HashMap<u64, Vec<u8>>,
    errs: &HashMap<u64, Vec<u8>>,
    reason: Option<&str>,
) -> Result<Completion<O>> {
    let mut results = Vec::with_capacity(total.saturating_sub(first) as usize);
    for i in first..total {
        results.push(match (oks.get(&i), errs.get(&i)) {
            (Some(bytes), _) => Ok(codec::decode::<O>(bytes)?),
            (None, Some(record)) => Err(PartError::from_record(record)),
            (None, None) if reason == Some("deadline") => Err(PartError {
                message: "not run: the request's deadline passed first".into(),
                attempts: 0,
                permanent: true,
            }),
            (None, None) if reason.is_some_and(|r| r.starts_with("upstream:")) => Err(PartError {
                message: format!(
                    "not run: its upstream {} did not complete",
                    reason.and_then(|r| r.strip_prefix("upstream:")).unwrap_or_default()
                ),
                attempts: 0,
                permanent: true,
            }),
            (None, None) => Err(PartError {
                message: format!("no result recorded (request {state})"),
                attempts: 0,
                permanent: false,
            }),
        });
    }
    let failed = errs.keys().filter(|i| **i < total && !oks.contains_key(i)).count() as u64;
    Ok(Completion { id: id.clone(), state, first, total, failed, results, reason: reason.map(str::to_owned) })
}

/// The refusal of `unlisted` for a request that does not take a lane.
const UNLISTED_LANE_ONLY: &str =
    "only a request that takes its priority's lane can be unlisted: at most 64 parts and 64 KB given whole, \
     not delayed, not own_stream, not opened for streaming, with no deadline or rate limit";

/// Describes a request before it is submitted.
#[must_use = "a request is only sent by submit()"]
pub struct RequestBuilder<'a> {
    producer: &'a Producer,
    id: Option<RequestId>,
    priority: Priority,
    concurrency: Concurrency,
    retry: RetryPolicy,
    delay: Duration,
    open_expiry: Option<Duration>,
    fail_fast: bool,
    own_stream: bool,
    listed: bool,
    window: u64,
    discard: bool,
    tags: Vec<String>,
    deadline: Option<Deadline>,
    rate: Option<(u32, Duration)>,
    after: Vec<RequestId>,
    on_upstream_failure: OnUpstreamFailure,
    group: Option<String>,
}

/// The most upstreams a request can be submitted after.
pub const MAX_UPSTREAMS: usize = 1000;

/// A request's deadline as the producer was given it.
#[derive(Clone, Copy, Debug)]
enum Deadline {
    /// At this time, by this process's clock.
    At(SystemTime),
    /// This long after the submit reaches Redis.
    In(Duration),
}

impl RequestBuilder<'_> {
    /// Runs the request only after the requests `ids` (its upstreams): it is stored at once, in
    /// state `waiting`, and gets its tokens when every one of them has completed. One that fails
    /// or is cancelled fails this request too, unless
    /// [`on_upstream_failure`](Self::on_upstream_failure) says otherwise. Its handlers can read
    /// the upstreams' results with `Context::upstream`. A request may
    /// have up to [`MAX_UPSTREAMS`] upstreams and any number of downstreams, on any shards and
    /// cluster slots.
    ///
    /// Each upstream must exist when this request is submitted (its submit has returned), so no
    /// cycle can form; an unknown one is refused with [`Error::UnknownUpstream`], and nothing of
    /// this request is kept. An id given twice counts once; calls add up. A request submitted
    /// after others takes its own stream, never a lane, and cannot be delayed or
    /// [`open`](Self::open)ed for streaming.
    ///
    /// ```no_run
    /// # async fn demo(producer: sluicegate::Producer) -> sluicegate::Result<()> {
    /// let split = producer.request().submit(["a.csv", "b.csv"]).await?;
    /// let merge = producer.request().after([split.id().clone()]).submit(["merge"]).await?;
    /// merge.wait::<String>().await?;
    /// # Ok(()) }
    /// ```
    pub fn after(mut self, ids: impl IntoIterator<Item = RequestId>) -> Self {
        for id in ids {
            if !self.after.contains(&id) {
                self.after.push(id);
            }
        }
        self
    }

    /// What the request does when an upstream (see [`after`](Self::after)) ends without
    /// completing; default [`OnUpstreamFailure::Fail`].
    pub fn on_upstream_failure(mut self, policy: OnUpstreamFailure) -> Self {
        self.on_upstream_failure = policy;
        self
    }

    /// Refuses upstreams this request cannot wait for as built: itself, too many, with a delay.
    fn check_upstreams(&self, id: &RequestId) -> Result<()> {
        if self.after.is_empty() {
            return Ok(());
        }
        if self.after.contains(id) {
            return Err(Error::InvalidRequest(format!("request \"{id}\" cannot be submitted after itself")));
        }
        if self.after.len() > MAX_UPSTREAMS {
            return Err(Error::InvalidRequest(format!(
                "a request can be submitted after at most {MAX_UPSTREAMS} others, not {}",
                self.after.len()
            )));
        }
        if !self.delay.is_zero() {
            return Err(Error::InvalidRequest(
                "a request submitted after others cannot be delayed as well".into(),
            ));
        }
        Ok(())
    }

    /// Gives the request a deadline: past `at`, none of its parts starts, the handlers still
    /// running see `Context::cancelled` (and are stopped at their next
    /// await, as at an attempt timeout: their parts get no result), and the request ends `failed`
    /// with [`Completion::reason`] `"deadline"`. Its parts already done keep their results. A
    /// request that completes before `at` completes. The time is taken against this process's
    /// clock once, at the submit, and kept in Redis as Redis's now plus what was left, so later
    /// clock differences between machines do not move it. A request with a deadline takes its own
    /// stream, never a lane. `at` in the past is refused at the submit.
    pub fn deadline(mut self, at: SystemTime) -> Self {
        self.deadline = Some(Deadline::At(at));
        self
    }

    /// [`deadline`](Self::deadline) `d` after the submit: Redis's now when it creates the
    /// request, plus `d`.
    pub fn deadline_in(mut self, d: Duration) -> Self {
        self.deadline = Some(Deadline::In(d));
        self
    }

    /// Puts the request in tenant group `name` (docs/architecture.md, "Tenant groups"): at most
    /// the group's limit of sub-requests of all its requests run at once, on top of the request's
    /// own concurrency, and within a priority the groups with work take turns, so that a tenant
    /// with a thousand requests queued cannot crowd out one with a single request. The limit is
    /// set with `Admin::set_group` (default: `DEFAULT_GROUP_LIMIT`, 10). A request in a group takes its own
    /// stream, never a lane, and keeps its priority (no `Admin::reprioritize`). `name` is 1 to 64
    /// ASCII letters, digits, `.`, `_` or `-`, else [`Error::InvalidRequest`].
    pub fn group(mut self, name: &str) -> Result<Self> {
        crate::request::check_group(name).map_err(Error::InvalidRequest)?;
        self.group = Some(name.to_owned());
        Ok(self)
    }

    /// Limits the request's rate: at most `n` of its parts start per `per`, across all workers,
    /// with bursts of up to `n` (a part started is any hand-out: a first attempt, a retry, a part
    /// run again after its worker died). Over any window W, at most `n * W / per + n` start. The
    /// limit is kept in Redis as one timestamp refilled by time (GCRA): when it is reached, the
    /// request's tokens leave the slots (which serve other requests meanwhile) and are woken as
    /// room comes back, so nothing polls. It is on top of the concurrency limit, which bounds the
    /// rate already for handlers of steady duration. A rate-limited request takes its own stream,
    /// never a lane. `n` from 1 to 1,000,000 and `per` from 1 ms to a day, else
    /// [`Error::InvalidRequest`].
    pub fn rate(mut self, n: u32, per: Duration) -> Result<Self> {
        if !(1..=1_000_000).contains(&n)
            || per < Duration::from_millis(1)
            || per > Duration::from_secs(86_400)
        {
            return Err(Error::InvalidRequest(format!(
                "a rate is 1 to 1000000 parts per 1 ms to a day, not {n} per {per:?}"
            )));
        }
        self.rate = Some((n, per));
        Ok(self)
    }

    /// What the deadline leaves from now (at least 1 ms), or the refusal of one that has passed or
    /// is too far.
    fn finish_within(&self) -> Result<Option<Duration>> {
        let left = match self.deadline {
            None => return Ok(None),
            Some(Deadline::In(d)) => d,
            Some(Deadline::At(at)) => at.duration_since(SystemTime::now()).map_err(|_| {
                Error::InvalidRequest(format!(
                    "the deadline has passed ({:?} ago): give a time in the future",
                    SystemTime::now().duration_since(at).unwrap_or_default()
                ))
            })?,
        };
        check_duration("deadline", left)?;
        Ok(Some(left.max(Duration::from_millis(1))))
    }

    /// For [`open`](Self::open): keeps Redis's memory bounded whatever the request's size (10
    /// million parts, a billion): [`OpenRequest::add`] waits while more than `w` of the parts
    /// added are not settled yet (neither done nor dead-lettered), polling every
    /// [`Config::window_poll`], and the acks trim the request's stream as they go. Its results
    /// stay in Redis until they are taken: read them while adding, from another task, with
    /// [`RequestHandle::results_from`], or give up on them with
    /// [`discard_results`](Self::discard_results); [`RequestHandle::wait`] returns only the
    /// results not taken. `w = 0` is refused; [`submit`](Self::submit) refuses a window.
    ///
    /// ```no_run
    /// # async fn demo(producer: sluicegate::Producer) -> sluicegate::Result<()> {
    /// let mut open = producer.request().window(100_000)?.discard_results(true).open().await?;
    /// for chunk in 0..10_000u64 {
    ///     open.add((chunk * 1_000..(chunk + 1) * 1_000).collect::<Vec<u64>>()).await?;
    /// }
    /// let done = open.finalize().await?.wait::<u64>().await?;
    /// println!("{} parts, {} failed", done.total, done.failed);
    /// # Ok(()) }
    /// ```
    pub fn window(mut self, w: u64) -> Result<Self> {
        if w == 0 {
            return Err(Error::InvalidRequest(
                "a window must allow at least 1 part in Redis (window(0) would never let a part in)".into(),
            ));
        }
        self.window = w;
        Ok(self)
    }

    /// Successful parts' results are never stored (errors are): the request's completion then
    /// carries no results, only its counts ([`Completion::total`], [`Completion::failed`]), and
    /// [`RequestHandle::results_from`] is refused. For work whose effect is elsewhere (writes,
    /// uploads, notifications), as BullMQ's `removeOnComplete` or a Sidekiq job: the request
    /// still finishes, announces its completion and keeps its status and errors for the
    /// retention, but Redis neither stores its results nor hands them back, which saves memory and
    /// some Redis CPU per part (docs/benchmarks.md, "Results discarded"). For
    /// [`submit`](Self::submit), [`Producer::submit_many`] and [`open`](Self::open) alike.
    pub fn discard_results(mut self, on: bool) -> Self {
        self.discard = on;
        self
    }

    /// Ends the request as `failed` at its first dead letter; its parts not yet run never will.
    /// Default: the other parts still run, and the results show which failed.
    pub fn fail_fast(mut self, on: bool) -> Self {
        self.fail_fast = on;
        self
    }

    /// Gives the request a stream of its own even when it is small enough for its priority's
    /// lane (see [`Config::lane_tokens`]): its status then counts its running parts, and a large
    /// lane limit cannot let its parts crowd its own. Default: a small request takes the lane.
    pub fn own_stream(mut self, on: bool) -> Self {
        self.own_stream = on;
        self
    }

    /// Leaves the request out of the listing index: `Admin::list`, `sluicegate list` and the
    /// dashboard's lists do not show it, and `Admin::stats`' request counts leave it out.
    /// Everything done by id works as for any request: status, `wait`, events, cancel, requeue,
    /// results. For many tiny requests that nobody lists: it
    /// saves the index's Redis work at the finish (a single-part request's drain costs about 20
    /// µs of Redis CPU unlisted against 23-24 listed, docs/benchmarks.md, "Running lane requests
    /// listed from their lanes") and about 170 bytes per finished request during the retention
    /// (a queued or running one without tags costs about the same either way: `list` finds it in
    /// its lane until it finishes). Only for a
    /// request that takes its priority's lane (a small one given whole: see
    /// [`Config::lane_tokens`]; not delayed, not [`own_stream`](Self::own_stream), not
    /// [`open`](Self::open)ed), which is created and entered in one step: a request of its own
    /// stream is registered before it is created, and the index cannot then tell a duplicate id
    /// held by an unlisted request. Not with tags (they name sets of the index). Default: listed.
    pub fn unlisted(mut self) -> Self {
        self.listed = false;
        self
    }

    /// Makes the request eligible only `delay` after it is accepted: until then no worker sees it;
    /// then it runs under the normal priority rules, promoted by any worker's recovery pass
    /// (so it starts up to one recovery interval after its time).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// For [`open`](Self::open): a request still open this long after it was opened (its
    /// producer died, say) is cancelled by recovery. Default: it stays open until an operator
    /// finalizes or cancels it.
    pub fn expire_open_after(mut self, d: Duration) -> Self {
        self.open_expiry = Some(d);
        self
    }

    /// Each sub-request runs at most `n` times (default 1): a retryable failure before the last
    /// attempt is retried after a backoff; after it, or on a permanent failure, the sub-request is
    /// dead-lettered and the request will end `failed`.
    pub fn max_attempts(mut self, n: u32) -> Result<Self> {
        if !(1..=1000).contains(&n) {
            return Err(Error::InvalidRequest(format!("max_attempts {n} is out of range: use 1 to 1000")));
        }
        self.retry.max_attempts = n;
        Ok(self)
    }

    /// Retry delays: `base` doubling per attempt up to `max`, each with random jitter.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Result<Self> {
        if base > max {
            return Err(Error::InvalidRequest(format!("backoff base {base:?} exceeds its cap {max:?}")));
        }
        self.retry.backoff_base = base;
        self.retry.backoff_max = max;
        Ok(self)
    }

    /// Abandons an attempt that runs longer than `limit` (a retryable failure).
    pub fn timeout(mut self, limit: Duration) -> Result<Self> {
        if limit.is_zero() {
            return Err(Error::InvalidRequest("a timeout must be longer than zero".into()));
        }
        self.retry.timeout = Some(limit);
        Ok(self)
    }

    /// Chooses the request's id (default: a generated, time-ordered id, [`RequestId::generate`]). An id in use is refused at submit.
    pub fn id(mut self, id: impl Into<String>) -> Result<Self> {
        self.id = Some(RequestId::new(id)?);
        Ok(self)
    }

    /// Adds a tag (at most [`MAX_TAGS`](crate::MAX_TAGS) per request; rules in
    /// [`check_tag`](crate::check_tag)): `Admin::list` and `sluicegate list --tag` filter by it.
    /// A tag given twice counts once.
    pub fn tag(mut self, tag: impl Into<String>) -> Result<Self> {
        let tag = tag.into();
        crate::request::check_tag(&tag)?;
        if !self.tags.contains(&tag) {
            if self.tags.len() == crate::request::MAX_TAGS {
                return Err(Error::InvalidRequest(format!(
                    "a request carries at most {} tags",
                    crate::request::MAX_TAGS
                )));
            }
            self.tags.push(tag);
        }
        Ok(self)
    }

    /// 0 (lowest) to 99 (highest); default 50.
    pub fn priority(mut self, p: u8) -> Result<Self> {
        self.priority = Priority::new(p)?;
        Ok(self)
    }

    /// At most `n` sub-requests of this request run at once, across all workers; default 1.
    pub fn concurrency(mut self, n: u32) -> Result<Self> {
        self.concurrency = Concurrency::new(n)?;
        Ok(self)
    }

    /// Sends the request, its parts encoded as MessagePack. Returns once the whole request is
    /// durable in Redis and its tokens are queued; until then no worker can see any of it.
    pub async fn submit<I, T>(self, parts: I) -> Result<RequestHandle>
    where
        I: IntoIterator<Item = T>,
        T: Serialize,
    {
        let producer = self.producer;
        producer.submit(self, parts).await
    }

    /// [`submit`](Self::submit) of parts encoded already (a schedule's).
    #[cfg(feature = "schedules")]
    pub(crate) async fn submit_encoded(self, parts: Vec<codec::Encoded>) -> Result<RequestHandle> {
        let producer = self.producer;
        producer.submit(self, parts).await
    }

    /// The request's id, generated now if none was chosen, so that it is known before the submit.
    pub(crate) fn with_id(mut self) -> (Self, RequestId) {
        let id = self.id.get_or_insert_with(RequestId::generate).clone();
        (self, id)
    }

    /// What the request is created with, as the submit functions take it (`trace`: the context
    /// of its send span, `otel`).
    /// Refuses tags on an unlisted request: they would name sets it is not in.
    fn check_listing(&self) -> Result<()> {
        if !self.listed && !self.tags.is_empty() {
            return Err(Error::InvalidRequest(
                "an unlisted request cannot carry tags: tags name sets of the listing index".into(),
            ));
        }
        Ok(())
    }

    /// Its row in the listing index ('' when unlisted: the functions then leave it out).
    fn row(&self, kind: Kind) -> String {
        if self.listed {
            Row::encode(kind, self.priority, self.concurrency, &self.tags)
        } else {
            String::new()
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn new_request<'a>(
        &'a self,
        id: &'a RequestId,
        key_id: &'a str,
        nonce: &'a str,
        shards: u32,
        deadline: i64,
        trace: &'a str,
        finish_within: Option<Duration>,
        upstreams: &'a [String],
    ) -> NewRequest<'a> {
        NewRequest {
            id,
            key_id,
            priority: self.priority,
            concurrency: self.concurrency,
            max_attempts: self.retry.max_attempts,
            timeout: self.retry.timeout,
            backoff_base: self.retry.backoff_base,
            backoff_max: self.retry.backoff_max,
            nonce,
            fail_fast: self.fail_fast,
            shards,
            deadline,
            window: self.window,
            discard: self.discard,
            tags: &self.tags,
            listed: self.listed,
            trace,
            finish_within,
            rate: self.rate,
            upstreams,
            run_after_failure: self.on_upstream_failure == OnUpstreamFailure::Run,
            group: self.group.as_deref(),
        }
    }

    /// Opens a streamed request: workers start on its parts as soon as they are added, and it
    /// completes only after [`OpenRequest::finalize`] and every part done. Not with `delay`.
    pub async fn open(self) -> Result<OpenRequest> {
        if !self.delay.is_zero() {
            return Err(Error::InvalidRequest("a streamed request cannot be delayed".into()));
        }
        if !self.after.is_empty() {
            return Err(Error::InvalidRequest(
                "a streamed request cannot be submitted after others: submit() it whole".into(),
            ));
        }
        if let Some(expiry) = self.open_expiry {
            check_duration("open expiry", expiry)?;
        }
        let finish_within = self.finish_within()?;
        let producer = self.producer.clone();
        let id = self.id.clone().unwrap_or_else(RequestId::generate);
        let send = otel::SendSpan::request(producer.store.config.namespace_str(), &id, self.priority);
        let trace = send.carried();
        let opened = async {
            self.check_listing()?;
            if !self.listed {
                return Err(Error::InvalidRequest(UNLISTED_LANE_ONLY.into()));
            }
            let key_id = id.key_id();
            let nonce = uuid::Uuid::new_v4().simple().to_string();
            let cfg = &producer.store.config;
            let place = Placement {
                priority: self.priority,
                shards: producer.store.keys.shards(),
                group: self.group.clone(),
            };
            let row = self.row(Kind::Own);
            let registration = crate::shards::register(&producer.store, &key_id, place.clone(), &row).await?;
            let deadline = registration.deadline(&producer.store);
            let req =
                self.new_request(&id, &key_id, &nonce, place.shards, deadline, &trace, finish_within, &[]);
            submit::stream_open(&producer.store, &req, self.open_expiry).await?;
            // Its first look: when it expires unfinalized or reaches its deadline, or the census
            // interval.
            let next = self.open_expiry.map_or(cfg.census_interval, |e| e.min(cfg.census_interval));
            let next = finish_within.map_or(next, |d| d.min(next));
            crate::shards::push(
                &producer.store,
                &key_id,
                place.clone(),
                Look::First(registration),
                next,
                Vec::new(),
            )
            .await?;
            producer.counting.recorder.count(self.priority, Counter::Submitted, 1);
            Ok(OpenRequest {
                handle: RequestHandle { id: id.clone(), producer: producer.clone(), lane: false },
                key_id,
                nonce,
                place,
                added: 0,
                window: self.window,
                outstanding: 0,
                sent: send.link(),
            })
        }
        .await;
        send.end(&opened);
        opened
    }
}

/// A streamed request, open for parts. Each [`add`](Self::add) call is one round trip that
/// waits for Redis, so a producer slows down with Redis instead of buffering without bound.
#[must_use = "an open request completes only after finalize()"]
pub struct OpenRequest {
    handle: RequestHandle,
    pub(crate) key_id: String,
    pub(crate) nonce: String,
    place: Placement,
    added: u64,
    /// The window (0 = none) and the outstanding parts the last append or poll reported.
    window: u64,
    outstanding: u64,
    /// The request's send span, which the send spans of its parts link to (`otel`).
    sent: otel::RequestSpan,
}

impl OpenRequest {
    /// The request's handle (it can be waited on from anywhere).
    pub fn handle(&self) -> &RequestHandle {
        &self.handle
    }

    /// Parts added so far.
    pub fn len(&self) -> u64 {
        self.added
    }

    /// Whether no part was added yet.
    pub fn is_empty(&self) -> bool {
        self.added == 0
    }

    /// Adds parts (one call per 1,000); workers may start on them at once. With a
    /// [`window`](RequestBuilder::window) of W, each call of up to `min(1,000, W)` parts first
    /// waits until it fits: until at most W minus its size of the parts added are unsettled.
    ///
    /// After an error (or when the future is dropped before it returns), the parts before
    /// [`len`](Self::len) are in; of the rest, some may be (a call whose reply was lost). Add
    /// them again, the same parts, from the request's part `len()` on: a part already in is
    /// recognised by its index and not added twice. Adding other parts instead would have as many
    /// of them taken for parts already in, and skipped.
    pub async fn add<I, T>(&mut self, parts: I) -> Result<()>
    where
        I: IntoIterator<Item = T>,
        T: Serialize,
    {
        let store = &self.handle.producer.store;
        let send = otel::SendSpan::parts(
            store.config.namespace_str(),
            &self.handle.id,
            self.place.priority,
            &self.sent,
        );
        let before = self.added;
        let added = self.append(parts).await;
        send.count(self.added - before);
        send.end(&added);
        added
    }

    /// [`add`](Self::add), without its span.
    async fn append<I, T>(&mut self, parts: I) -> Result<()>
    where
        I: IntoIterator<Item = T>,
        T: Serialize,
    {
        let mut parts = parts.into_iter().peekable();
        let producer = self.handle.producer.clone();
        let store = &producer.store;
        let mut per_call = self.handle.producer.load_chunk().min(1_000);
        if self.window > 0 {
            per_call = per_call.min(usize::try_from(self.window).unwrap_or(usize::MAX));
        }
        while parts.peek().is_some() {
            let mut chunk: Vec<Value> = Vec::new();
            for part in parts.by_ref().take(per_call) {
                chunk.push(Value::Bytes(codec::encode(&part)?.into()));
            }
            let n = chunk.len() as u64;
            if self.window > 0 {
                self.wait_for_room(n).await?;
            }
            // Recovery is asked to look after the parts go in: if this process dies between the
            // append and the push of the tokens it wakes, they are restored (verify).
            let (key_id, nonce, first) = (self.key_id.as_str(), self.nonce.as_str(), self.added);
            let windowed = self.window > 0;
            let appended = crate::shards::armed(store, key_id, self.place.shards, |deadline| {
                submit::stream_append(store, key_id, nonce, first, deadline, windowed, chunk.clone())
            })
            .await;
            let submit::Appended { priority, outstanding, elements } = appended?;
            // An operator may have changed the priority (`Admin::reprioritize`): the woken tokens
            // go to the lists of the priority the request has now.
            if let Some(priority) = priority {
                self.place.priority = priority;
            }
            self.added += n;
            // A re-sent append that added nothing reports no count: assume the chunk went in.
            self.outstanding = outstanding.unwrap_or(self.outstanding + n);
            if !elements.is_empty() {
                let next = store.config.census_interval;
                crate::shards::push(store, &self.key_id, self.place.clone(), Look::More, next, elements)
                    .await?;
            }
        }
        Ok(())
    }

    /// Waits until `n` more parts fit in the window: until at most `window - n` parts are
    /// unsettled (the count the last append reported, then polled every `window_poll`).
    async fn wait_for_room(&mut self, n: u64) -> Result<()> {
        let store = &self.handle.producer.store;
        let room = self.window.saturating_sub(n);
        while self.outstanding > room {
            tokio::time::sleep(store.config.window_poll).await;
            let polled = retry_transient("outstanding", || submit::outstanding(store, &self.key_id)).await?;
            match polled {
                Some(outstanding) => self.outstanding = outstanding,
                None => return Err(Error::NotOpen(self.handle.id.clone())),
            }
        }
        Ok(())
    }

    /// No more parts: the request completes once every part is done. A call that reached Redis
    /// but whose reply was lost is sent again, and the copy answers as the first call did.
    /// [`Error::NotOpen`] when the request ended before it was finalized (cancelled, failed
    /// fast, past its deadline, or expired unfinalized).
    pub async fn finalize(self) -> Result<RequestHandle> {
        let producer = &self.handle.producer;
        crate::shards::finalize(&producer.store, &self.key_id, &self.nonce).await?;
        Ok(self.handle)
    }
}

/// The longest delay or open expiry accepted: ten years (the functions refuse longer ones too).
const MAX_DELAY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

fn check_duration(what: &str, d: Duration) -> Result<()> {
    if d > MAX_DELAY {
        return Err(Error::InvalidRequest(format!("{what} {d:?} is too long: at most ten years")));
    }
    Ok(())
}

/// Runs `futures`, at most `n` at once, and returns their outputs as they end.
async fn at_most<F: std::future::Future>(n: usize, futures: Vec<F>) -> Vec<F::Output> {
    let mut waiting = futures.into_iter();
    let mut running: futures::stream::FuturesUnordered<F> = waiting.by_ref().take(n).collect();
    let mut out = Vec::new();
    while let Some(output) = running.next().await {
        out.push(output);
        if let Some(next) = waiting.next() {
            running.push(next);
        }
    }
    out
}

/// Encodes the next chunk of parts: up to `max` parts or `LOAD_CHUNK_BYTES` bytes (at least
/// one part); empty when the parts are exhausted.
fn encode_chunk<I, T>(parts: &mut I, max: usize) -> Result<Vec<Value>>
where
    I: Iterator<Item = T>,
    T: codec::Part,
{
    let mut chunk = Vec::new();
    let mut bytes = 0;
    while bytes < LOAD_CHUNK_BYTES && chunk.len() < max {
        let Some(part) = parts.next() else { break };
        let encoded = part.into_part()?;
        bytes += encoded.len();
        chunk.push(Value::Bytes(encoded.into()));
    }
    Ok(chunk)
}

/// A submitted request.
#[derive(Clone)]
pub struct RequestHandle {
    id: RequestId,
    producer: Producer,
    /// Submitted through this handle's producer as a lane request: its state and results are in
    /// its record alone, which a wait reads without first looking for a meta hash (a handle made
    /// from an id does not know, and looks at both, docs/protocol.md §6.7).
    lane: bool,
}

impl std::fmt::Debug for RequestHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHandle").field("id", &self.id).finish_non_exhaustive()
    }
}

impl RequestHandle {
    /// The request's id.
    pub fn id(&self) -> &RequestId {
        &self.id
    }

    /// Waits until the request is terminal and returns its results in sub-request order.
    ///
    /// One exception: the results of a streamed request taken with
    /// [`results_from`](Self::results_from) are not returned again, and a request opened with
    /// [`discard_results`](RequestBuilder::discard_results) returns none;
    /// [`Completion::first`] says where its results start.
    ///
    /// It subscribes before it reads the durable record, so a completion that happened before or
    /// during the call is never missed; it also re-reads the record every `wait_poll` in case a
    /// message was lost in a reconnect.
    pub async fn wait<O: DeserializeOwned>(&self) -> Result<Completion<O>> {
        let bell = self.producer.doorbell().await?;
        let ring = bell.listen(self.id.key_id());
        let mut reads = 0;
        loop {
            // A dropped connection is waited out (the clients reconnect by themselves); the
            // doorbell re-subscribes, and the durable record is read again below anyway.
            let read = retry_transient("wait", || self.try_completion::<O>()).await?;
            if let Some(done) = read {
                return Ok(done);
            }
            // A lane request's first read comes about when a worker takes it; a second one, a
            // round trip later, finds a short handler's part acked without the doorbell's hops
            // (its message, then this read). Measured with no-op handlers: without it, the
            // round trip from submit to results was half as long again (docs/benchmarks.md).
            reads += 1;
            if self.lane && reads == 1 {
                continue;
            }
            // A message that came since the listening began left a permit: this returns at once.
            tokio::select! {
                _ = ring.notify.notified() => {}
                _ = tokio::time::sleep(self.producer.store.config.wait_poll) => {}
            }
        }
    }

    /// Up to `count` outcomes of a streamed request from part `first`, in part order, while it
    /// runs: the page ends before the first part not settled yet (so it may be empty; poll again
    /// later). Read it from 0 on, each call from the previous page's
    /// [`next_index`](ResultsPage::next_index), until [`is_last`](ResultsPage::is_last): asking
    /// from `first` says that you hold every outcome below it, which is then deleted from Redis,
    /// so a reader that keeps up bounds the results a [windowed](RequestBuilder::window) request
    /// keeps. After an error, call again with the same `first`: the page is still there. Results
    /// taken this way are not returned again by [`wait`](Self::wait).
    ///
    /// Refused for a request that was not opened with [`RequestBuilder::open`] (a lane or whole
    /// submit), or whose results are discarded.
    ///
    /// ```no_run
    /// # async fn demo(handle: sluicegate::RequestHandle) -> sluicegate::Result<()> {
    /// let mut next = 0;
    /// loop {
    ///     let page = handle.results_from::<u64>(next, 1_000).await?;
    ///     for (i, r) in page.results.iter().enumerate() {
    ///         println!("part {}: {r:?}", page.first + i as u64);
    ///     }
    ///     next = page.next_index();
    ///     if page.is_last() { break }
    ///     if page.results.is_empty() { tokio::time::sleep(std::time::Duration::from_millis(50)).await }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn results_from<O: DeserializeOwned>(
        &self,
        first: u64,
        count: usize,
    ) -> Result<ResultsPage<O>> {
        let store = &self.producer.store;
        let key_id = self.id.key_id();
        let page = match submit::results_from(store, &key_id, first, count).await? {
            Ok(page) => page,
            Err(submit::PageRefused::State(why)) if why.contains("unknown") => {
                let record = store.keys.record(crate::shards::lane_home(store, &key_id), &key_id);
                let lane: bool = store.client.exists(record.as_str()).await?;
                if lane {
                    return Err(Error::InvalidRequest(format!(
                        "request \"{}\": results_from is for streamed requests (opened with open()); wait() \
                         returns the results of a submitted one",
                        self.id
                    )));
                }
                return Err(Error::UnknownRequest(self.id.clone()));
            }
            Err(
                submit::PageRefused::State(why)
                | submit::PageRefused::Invalid(why)
                | submit::PageRefused::Gap(why),
            ) => return Err(Error::InvalidRequest(format!("request \"{}\": {why}", self.id))),
        };
        let state: RequestState = page.state.parse()?;
        let mut results = Vec::with_capacity(page.outcomes.len());
        for outcome in page.outcomes {
            results.push(match outcome {
                submit::Outcome::Ok(bytes) => Ok(codec::decode::<O>(&bytes)?),
                submit::Outcome::Err(record) => Err(PartError::from_record(&record)),
                submit::Outcome::None => Err(PartError {
                    message: format!("no result recorded (request {state})"),
                    attempts: 0,
                    permanent: false,
                }),
            });
        }
        Ok(ResultsPage { first: page.first, results, state, total: page.total })
    }

    /// The results if the request is terminal, `None` while it runs; does not wait.
    pub async fn try_completion<O: DeserializeOwned>(&self) -> Result<Option<Completion<O>>> {
        if self.lane {
            return self.producer.try_lane_completion(&self.id).await;
        }
        self.producer.try_completion(&self.id).await
    }

    /// Cancels the request (see `Admin::cancel`).
    pub async fn cancel(&self) -> Result<crate::Cancelled> {
        crate::shards::cancel(&self.producer.store, &self.id).await
    }

    /// [`wait`](Self::wait) with a time limit.
    pub async fn wait_timeout<O: DeserializeOwned>(&self, limit: Duration) -> Result<Completion<O>> {
        tokio::time::timeout(limit, self.wait()).await.map_err(|_| Error::Timeout(self.id.clone()))?
    }
}

/// A finished request: its terminal state and one result per sub-request, in order.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Completion<O> {
    /// The request.
    pub id: RequestId,
    /// Completed, failed or cancelled.
    pub state: RequestState,
    /// The index of the sub-request of `results[0]`: 0, unless earlier results were taken with
    /// [`RequestHandle::results_from`] (or discarded, see
    /// [`RequestBuilder::discard_results`]: then it is `total`).
    pub first: u64,
    /// The request's number of sub-requests.
    pub total: u64,
    /// How many sub-requests were dead-lettered.
    pub failed: u64,
    /// One entry per sub-request from `first`, in sub-request order.
    pub results: Vec<Result<O, PartError>>,
    /// Why a `failed` request ended, when not by its dead letters: `"deadline"` (see
    /// [`RequestBuilder::deadline`]), or `"upstream:<id>"`, the upstream that did not complete
    /// (see [`RequestBuilder::after`]). `None` otherwise.
    pub reason: Option<String>,
}

/// A page of a streamed request's outcomes ([`RequestHandle::results_from`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ResultsPage<O> {
    /// The index of the sub-request of `results[0]`.
    pub first: u64,
    /// Consecutive outcomes from `first`, in sub-request order (possibly none yet).
    pub results: Vec<Result<O, PartError>>,
    /// The request's state when the page was read.
    pub state: RequestState,
    /// The request's number of sub-requests, once no more can be added (finalized or terminal).
    pub total: Option<u64>,
}

impl<O> ResultsPage<O> {
    /// Where the next page starts.
    pub fn next_index(&self) -> u64 {
        self.first + self.results.len() as u64
    }

    /// Whether this page reaches the request's last sub-request: no more outcomes will come.
    pub fn is_last(&self) -> bool {
        self.total.is_some_and(|t| self.next_index() >= t)
    }
}

impl<O> Completion<O> {
    /// The completion of a request that discards its results: they were never stored, so only
    /// its counts are left, and its results start at `total`.
    fn counts_only(
        id: &RequestId,
        state: RequestState,
        total: u64,
        failed: u64,
        reason: Option<String>,
    ) -> Self {
        Completion { id: id.clone(), state, first: total, total, failed, results: Vec::new(), reason }
    }

    /// The outputs, or the first failure.
    pub fn into_outputs(self) -> Result<Vec<O>, PartError> {
        self.results.into_iter().collect()
    }
}

/// What happens when a sub-request's handler fails, as the request's builder set it
/// ([`RequestBuilder::max_attempts`], [`backoff`](RequestBuilder::backoff),
/// [`timeout`](RequestBuilder::timeout)); stored in the request's meta hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RetryPolicy {
    /// Runs at most this many times (default 1: no retry).
    max_attempts: u32,
    /// Delay before the first retry; doubles each attempt, with jitter (default 1 s).
    backoff_base: Duration,
    /// The longest delay between attempts (default 60 s).
    backoff_max: Duration,
    /// Each attempt is abandoned (and counts as a retryable failure) after this long (default none).
    timeout: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 1,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            timeout: None,
        }
    }
}

/// A producer's count of the requests it submitted, for the stats by stage: added to Redis every
/// flush interval by a task of its own, which the last clone of the producer stops (the task then
/// flushes once more, if the runtime still runs, and closes the producer's connection).
struct Counting {
    recorder: Arc<Recorder>,
    stop: CancellationToken,
    /// The producer's connection when its store is its own and no flush task closes it: closed
    /// when the last clone is dropped.
    _hangup: Option<Hangup>,
    /// The flush task's close, counted from the last clone's drop until the task ends.
    closing: LaterClose,
}

impl Counting {
    fn start(store: &Store, mut hangup: Hangup) -> Self {
        let recorder = Arc::new(Recorder::new(store.config.stats_keep()));
        let stop = CancellationToken::new();
        let closing = LaterClose::default();
        if recorder.is_on() {
            let (flushed, store, stopped, counted) =
                (recorder.clone(), store.clone(), stop.clone(), closing.clone());
            tokio::spawn(async move {
                let _counted = counted;
                crate::stats::flush_until(&flushed, &store, stopped).await;
                hangup.close().await
            });
            return Self { recorder, stop, _hangup: None, closing };
        }
        Self { recorder, stop, _hangup: Some(hangup), closing }
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        self.closing.begin();
        self.stop.cancel();
    }
}

/// The handles waiting, by request key id: one `Notify` per waiting call.
type Listening = Arc<std::sync::Mutex<HashMap<String, Vec<Arc<tokio::sync::Notify>>>>>;

/// One subscription to the completion channel per producer, rung through to the handles waiting
/// for the requests each message names (and only those: a producer waiting for many requests
/// pays per message for its own waiters, not for all of them).
struct Doorbell {
    listening: Listening,
    task: tokio::task::JoinHandle<()>,
    /// Its subscriber's connection, closed when it is dropped (after `task` is aborted).
    _hangup: Hangup,
}

/// One waiting call's place at the doorbell, left when dropped.
struct Ring {
    listening: Listening,
    key_id: String,
    notify: Arc<tokio::sync::Notify>,
}

impl Drop for Ring {
    fn drop(&mut self) {
        let mut listening = self.listening.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(waiting) = listening.get_mut(&self.key_id) {
            waiting.retain(|n| !Arc::ptr_eq(n, &self.notify));
            if waiting.is_empty() {
                listening.remove(&self.key_id);
            }
        }
    }
}

impl Doorbell {
    async fn start(store: &Store) -> Result<Self> {
        let sub = store.subscriber().await?;
        // Closed when dropped from here on: a failed subscribe, or a wait cancelled meanwhile.
        let mut hangup = Hangup::none();
        hangup.subscriber(sub.clone());
        let mut messages = sub.message_rx();
        sub.subscribe(store.keys.done_channel()).await?;
        let listening = Listening::default();
        let rings = listening.clone();
        let task = tokio::spawn(async move {
            loop {
                match messages.recv().await {
                    Ok(msg) => {
                        let Some(text) = msg.value.as_string() else { continue };
                        let rings = rings.lock().unwrap_or_else(|e| e.into_inner());
                        for rid in crate::protocol::doorbell_key_ids(&text) {
                            // A permit each: a call between its read and its wait returns at once.
                            for notify in rings.get(rid).into_iter().flatten() {
                                notify.notify_one();
                            }
                        }
                    }
                    // Messages were dropped, ours among them maybe: every waiting call reads its
                    // record again now rather than at its next poll.
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let rings = rings.lock().unwrap_or_else(|e| e.into_inner());
                        rings.values().flatten().for_each(|notify| notify.notify_one());
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                }
            }
        });
        Ok(Self { listening, task, _hangup: hangup })
    }

    /// Listens for request `key_id`'s completion from now on.
    fn listen(&self, key_id: String) -> Ring {
        let notify = Arc::new(tokio::sync::Notify::new());
        let mut listening = self.listening.lock().unwrap_or_else(|e| e.into_inner());
        listening.entry(key_id.clone()).or_default().push(notify.clone());
        Ring { listening: self.listening.clone(), key_id, notify }
    }
}

impl Drop for Doorbell {
    fn drop(&mut self) {
        self.task.abort();
    }
}
