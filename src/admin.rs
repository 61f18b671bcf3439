//! Operating sluicegate: a request's status, cancel, requeue of dead letters, priority, namespace
//! stats.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use fred::prelude::*;
use fred::types::scan::Scanner;
use futures::StreamExt;
use serde::Serialize;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::hangup::Hangup;
use crate::keys::home_shard;
use crate::protocol::operators::{self, Reprioritize};
use crate::request::RequestId;
use crate::request::{reason_shown, Cancelled, OnUpstreamFailure, PartError, Priority, RequestState};
use crate::store::Store;
use crate::worker::registry;
pub use crate::worker::{SlotWork, WorkerInfo};

mod groups;
mod listing;
#[cfg(feature = "schedules")]
mod schedules;
mod tally;
mod tokens;
pub use groups::{GroupStatus, DEFAULT_GROUP_LIMIT, MAX_GROUPS_LISTED, MAX_GROUP_LIMIT};
pub use listing::{ListPage, ListQuery, ListState, ListedRequest, MAX_LIST_LIMIT, MAX_LIST_LOOK};
pub use tally::{Tally, MAX_TALLY};
pub use tokens::{RequestTokens, TokenAudit, TokenState, MAX_TOKEN_AUDIT};

use crate::config::MAX_TOKEN_SHARDS;

/// At most this many errors are listed in a [`RequestStatus`].
pub const STATUS_ERRORS: usize = 100;

/// What an operator needs: status, cancel, requeue, reprioritize, stats. Cheap to clone.
///
/// ```no_run
/// # async fn demo() -> sluicegate::Result<()> {
/// use sluicegate::{Admin, Config, RequestId};
/// let admin = Admin::connect(&Config::from_env()).await?;
/// let status = admin.status(&RequestId::new("invoice-42")?).await?;
/// println!("{}: {}/{} done, {} failed", status.state, status.done, status.total, status.failed);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Admin {
    store: Store,
    /// Its connection, closed when its last clone is dropped (none on a store of another's).
    _hangup: Option<Arc<Hangup>>,
}

/// A request's state and counters.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct RequestStatus {
    /// The request.
    pub id: String,
    /// Where it is in its lifecycle.
    pub state: RequestState,
    /// 0 to 99.
    pub priority: u8,
    /// Its concurrency limit.
    pub concurrency: u32,
    /// Sub-requests in all.
    pub total: u64,
    /// Sub-requests that ended: succeeded or dead-lettered.
    pub done: u64,
    /// Sub-requests dead-lettered.
    pub failed: u64,
    /// Tokens held by worker slots right now (each runs one sub-request at a time).
    pub running: u64,
    /// Sub-requests waiting for a retry or re-delivery.
    pub retrying: u64,
    /// A streamed request still open for parts.
    pub open: bool,
    /// A streamed request's window (`RequestBuilder::window`):
    /// at most this many of its parts unsettled at once.
    pub window: Option<u64>,
    /// Its results are discarded
    /// (`RequestBuilder::discard_results`).
    pub discard_results: bool,
    /// Results handed to its reader by
    /// `RequestHandle::results_from` (the index of the
    /// next one to take).
    pub results_taken: u64,
    /// Sub-requests that succeeded after more than one attempt.
    pub succeeded_after_retry: u64,
    /// Most attempts any sub-request has had so far (failed, retrying or succeeded).
    pub max_attempts_seen: u32,
    /// When it was submitted (ms since the Unix epoch, Redis's clock).
    pub created_ms: u64,
    /// When its first sub-request started.
    pub started_ms: Option<u64>,
    /// When it turned terminal.
    pub finished_ms: Option<u64>,
    /// Its deadline (ms since the Unix epoch, Redis's clock; `RequestBuilder::deadline`), if any.
    pub deadline_ms: Option<u64>,
    /// Why a `failed` request ended, when not by its dead letters: `"deadline"`, or
    /// `"upstream:<id>"` (an upstream that did not complete; `RequestBuilder::after`).
    pub reason: Option<String>,
    /// Its rate limit (`RequestBuilder::rate`), if any.
    pub rate: Option<RateLimit>,
    /// Not terminal, and its priority or the whole namespace is paused ([`Admin::pause`]): no
    /// slot takes its tokens until a resume.
    pub paused: bool,
    /// Its tags (empty when it has none, or when it is no longer listed).
    pub tags: Vec<String>,
    /// Tracked ([`Admin::track`]).
    pub tracked: bool,
    /// The last error of up to [`STATUS_ERRORS`] sub-requests (dead letters and pending retries),
    /// by index.
    pub errors: Vec<IndexedError>,
    /// The requests it was submitted after (`RequestBuilder::after`), in the order given, each
    /// as far as this request has heard of it.
    pub upstreams: Vec<Upstream>,
    /// What it does when an upstream does not complete (`RequestBuilder::on_upstream_failure`);
    /// `None` for a request without upstreams.
    pub on_upstream_failure: Option<OnUpstreamFailure>,
    /// Requests submitted after it: at most [`STATUS_DOWNSTREAMS`] of them, in no order.
    pub downstreams: Vec<String>,
    /// Its tenant group (`RequestBuilder::group`), if any.
    pub group: Option<String>,
}

/// The most downstreams [`RequestStatus::downstreams`] lists.
pub const STATUS_DOWNSTREAMS: usize = 100;

/// An upstream of a request ([`RequestStatus::upstreams`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Upstream {
    /// The upstream request.
    pub id: String,
    /// How it ended, as its downstream heard: `None` while the downstream waits for it;
    /// `"completed"`, `"failed"`, `"cancelled"`, or `"gone"` (nothing of it was left).
    pub ended: Option<String>,
}

/// A request's rate limit: at most `n` parts start per `per_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RateLimit {
    /// Parts per interval.
    pub n: u32,
    /// The interval, in ms.
    pub per_ms: u64,
}

/// One sub-request's error record.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct IndexedError {
    /// The sub-request's index.
    pub index: u64,
    /// Its last error.
    pub error: PartError,
}

/// A dead-lettered sub-request ([`Admin::dead`]): its error and the payload it was submitted with.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The sub-request's index.
    pub index: u64,
    /// Its last error and attempts.
    pub error: PartError,
    /// Its payload as stored (MessagePack, as the producer encoded it).
    pub payload: Vec<u8>,
}

/// A namespace at a glance.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// Token elements waiting per priority, highest first (priorities with none left out).
    pub tokens_waiting: Vec<PriorityTokens>,
    /// Requests not yet terminal.
    pub active_requests: u64,
    /// Workers whose registration is fresh.
    pub workers: Vec<WorkerInfo>,
    /// What an operator paused.
    pub paused: Paused,
    /// Tokens held by worker slots now (their take records).
    pub tokens_held: u64,
    /// Requests by state.
    pub requests: RequestCounts,
    /// Token capacity, parked tokens and dead letters, added up from the requests' records.
    pub tally: Tally,
    /// Memory Redis uses (`used_memory`), summed over a cluster's primaries.
    pub redis_memory_bytes: u64,
}

/// What an operator paused in a namespace ([`Admin::pause`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Paused {
    /// The whole namespace.
    pub all: bool,
    /// Priorities paused one by one, highest first.
    pub priorities: Vec<u8>,
}

impl Paused {
    /// Nothing is paused.
    pub fn is_empty(&self) -> bool {
        !self.all && self.priorities.is_empty()
    }

    /// Whether slots take no tokens of `priority`.
    pub fn covers(&self, priority: u8) -> bool {
        self.all || self.priorities.contains(&priority)
    }
}

/// Token elements waiting at one priority.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct PriorityTokens {
    /// The priority.
    pub priority: u8,
    /// Requests' tokens waiting at it: elements in its lists, and in tenant groups' queues (the
    /// groups' own tokens, which wait in the lists in their place, not counted).
    pub tokens: u64,
    /// How long the element next in line has waited, in ms: since its token was last queued
    /// (an element's epoch is the Redis time it was queued at).
    pub oldest_waiting_ms: u64,
}

/// Requests of a namespace by state, from the listing index: finished ones until their retention
/// ends.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RequestCounts {
    /// Not finished yet: queued, scheduled or running (and submits not yet created).
    pub unfinished: u64,
    /// Completed.
    pub completed: u64,
    /// Failed.
    pub failed: u64,
    /// Cancelled.
    pub cancelled: u64,
}

/// What [`Admin::reprioritize`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Reprioritized {
    /// The priority the request had.
    pub from: u8,
    /// The priority it has now.
    pub to: u8,
    /// Tokens that were waiting in the old priority's lists and wait in the new one's now.
    pub moved: u64,
    /// Tokens queued but not found waiting in the old lists (being taken or pushed at that
    /// moment, or deeper than 1,000 elements from either end of a long list): each is taken once
    /// more at the old priority and goes to the new one's list when handed back. Tokens held by
    /// slots, or parked, are counted in neither: they go there at their next hand-back.
    pub left: u64,
}

impl Admin {
    /// Connects to Redis, checks its version and loads the functions library.
    pub async fn connect(config: &Config) -> Result<Self> {
        let store = crate::protocol::connect(config).await?;
        let hangup = Arc::new(Hangup::new(store.client.clone()));
        Ok(Self { store, _hangup: Some(hangup) })
    }

    /// An admin on the randomized checker's store.
    #[cfg(test)]
    pub(crate) fn from_store(store: Store) -> Self {
        Self { store, _hangup: None }
    }

    /// The request's state and counters.
    pub async fn status(&self, id: &RequestId) -> Result<RequestStatus> {
        let mut status = self.unpaused_status(id).await?;
        status.paused = !status.state.is_terminal() && self.paused().await?.covers(status.priority);
        if let Some((tags, tracked)) = self.listing_of(&id.key_id()).await? {
            (status.tags, status.tracked) = (tags, tracked);
        }
        Ok(status)
    }

    async fn unpaused_status(&self, id: &RequestId) -> Result<RequestStatus> {
        let keys = self.store.keys.request(&id.key_id());
        let meta: HashMap<String, String> = self.store.client.hgetall(keys.meta.as_str()).await?;
        if meta.is_empty() {
            return self.lane_status(id).await;
        }
        let state: RequestState = meta.get("state").map(String::as_str).unwrap_or("").parse()?;
        let running = meta.iter().filter(|(k, v)| k.starts_with('t') && v.starts_with("h|")).count() as u64;
        let retrying: u64 = if state.is_terminal() {
            0
        } else {
            let waiting: u64 =
                self.store.client.zcount(keys.retry.as_str(), f64::NEG_INFINITY, f64::MAX).await?;
            let orphans: u64 = self.store.client.llen(keys.orphans.as_str()).await?;
            waiting + orphans
        };
        let records: HashMap<u64, Vec<u8>> = self.store.client.hgetall(keys.errors.as_str()).await?;
        let errors = records
            .iter()
            .map(|(&index, record)| IndexedError { index, error: PartError::from_record(record) })
            .collect();
        let mut status = status_from(id, &meta, errors, running, retrying)?;
        let shards = meta.get("shards").and_then(|s| s.parse().ok()).unwrap_or(1u32).max(1);
        status.downstreams = self.downstreams_of(&id.key_id(), home_shard(&id.key_id(), shards)).await?;
        Ok(status)
    }

    /// Up to [`STATUS_DOWNSTREAMS`] downstreams of request `key_id`, homed on `home`.
    async fn downstreams_of(&self, key_id: &str, home: u32) -> Result<Vec<String>> {
        let (_, entries) = crate::protocol::dag::downstreams_page(&self.store, home, key_id, "0").await?;
        Ok(entries
            .iter()
            .filter_map(|e| RequestId::from_key_id(e.rsplit_once('|')?.0).ok())
            .take(STATUS_DOWNSTREAMS)
            .map(|id| id.to_string())
            .collect())
    }

    /// `status` of a lane request, from its record: `running` is not counted (its parts in the
    /// lane are not told apart from those running), `retrying` counts parts whose last attempt
    /// failed and that are not dead.
    async fn lane_status(&self, id: &RequestId) -> Result<RequestStatus> {
        let key_id = id.key_id();
        let home = crate::shards::lane_home_found(&self.store, &key_id).await?;
        let record = self.store.keys.record(home, &key_id);
        let fields: HashMap<String, Vec<u8>> = self.store.client.hgetall(record.as_str()).await?;
        if fields.is_empty() {
            return Err(Error::UnknownRequest(id.clone()));
        }
        let mut meta = crate::protocol::lane::record_meta(&fields);
        let marks = crate::protocol::lane::running_marks(&self.store, &[(home, &key_id, &meta)]).await?;
        crate::protocol::lane::mark_running(&mut meta, marks.into_iter().next().flatten());
        let state: RequestState = meta.get("state").map(String::as_str).unwrap_or("").parse()?;
        let errors: Vec<IndexedError> = fields
            .iter()
            .filter_map(|(k, v)| {
                Some(IndexedError {
                    index: k.strip_prefix('e')?.parse().ok()?,
                    error: PartError::from_record(v),
                })
            })
            .collect();
        let dead = fields.keys().filter(|k| k.starts_with('x')).count() as u64;
        let retrying = if state.is_terminal() { 0 } else { (errors.len() as u64).saturating_sub(dead) };
        let mut status = status_from(id, &meta, errors, 0, retrying)?;
        if fields.contains_key("dn") {
            status.downstreams = self.downstreams_of(&key_id, home).await?;
        }
        Ok(status)
    }

    /// Cancels a request: no sub-request of it starts afterwards, running handlers see their
    /// context cancelled at their next heartbeat and their results are dropped, and it gets one
    /// `cancelled` terminal record and event.
    pub async fn cancel(&self, id: &RequestId) -> Result<Cancelled> {
        crate::shards::cancel(&self.store, id).await
    }

    /// Finalizes a streamed request whose producer is gone: no more parts will come, and it
    /// completes once the parts it has are done.
    pub async fn finalize(&self, id: &RequestId) -> Result<()> {
        crate::shards::finalize(&self.store, &id.key_id(), "").await
    }

    /// Hands a request's dead letters out again, each with a fresh set of attempts; a failed
    /// request reopens and will end with a new terminal record. Returns how many were requeued.
    pub async fn requeue_dead(&self, id: &RequestId) -> Result<u64> {
        let key_id = id.key_id();
        let keys = self.store.keys.request(&key_id);
        let Some(place) = crate::shards::placement(&self.store, &keys.meta).await? else {
            // A lane request's record holds its dead letters.
            let home = crate::shards::lane_home_found(&self.store, &key_id).await?;
            let pol: Option<String> =
                self.store.client.hget(self.store.keys.record(home, &key_id), "pol").await?;
            let settings = pol.as_deref().map(crate::protocol::lane::Settings::parse).transpose()?;
            let prio = settings.and_then(|s| u8::try_from(s.values[0]).ok());
            let Some(priority) = prio.and_then(|p| Priority::new(p).ok()) else {
                return Err(Error::UnknownRequest(id.clone()));
            };
            return crate::protocol::lane::requeue(&self.store, home, priority, &key_id).await;
        };
        crate::shards::requeue(&self.store, &key_id, place).await
    }

    /// Changes the priority of a request that is queued or running (also a delayed one, or a
    /// streamed one still open): [`status`](Self::status) shows the new priority at once.
    ///
    /// Its tokens waiting in the old priority's lists move to the new one's now, each keeping
    /// its place in time (a token that has waited longer than those there is taken before them);
    /// a token held by a worker slot goes to the new priority's list when the slot hands it back
    /// (at the end of its quantum), a parked one when it is woken. No token is ever in two lists
    /// or in none: each moves in one atomic step on its shard. A token that was being taken or
    /// pushed at that moment (see [`Reprioritized::left`]) is taken once more at the old priority.
    ///
    /// Refused ([`Error::Refused`]) for a request that has finished or is still being submitted,
    /// and for a small request that took its priority's lane (its parts already wait in that
    /// lane's stream; submit with `RequestBuilder::own_stream` to be able to change a small
    /// request's priority). An unknown id is [`Error::UnknownRequest`].
    ///
    /// ```no_run
    /// # async fn demo() -> sluicegate::Result<()> {
    /// use sluicegate::{Admin, Config, Priority, RequestId};
    /// let admin = Admin::connect(&Config::from_env()).await?;
    /// let done = admin.reprioritize(&RequestId::new("invoice-42")?, Priority::new(90)?).await?;
    /// println!("priority {} -> {}: {} waiting tokens moved", done.from, done.to, done.moved);
    /// # Ok(()) }
    /// ```
    pub async fn reprioritize(&self, id: &RequestId, priority: Priority) -> Result<Reprioritized> {
        let key_id = id.key_id();
        let (from, shards, elements) = match operators::reprioritize(&self.store, &key_id, priority).await? {
            Reprioritize::Moved { from, shards, elements } => (from, shards, elements),
            Reprioritize::Refused(state) => return Err(not_reprioritized(id, &state)),
            Reprioritize::Unknown => return Err(self.lane_not_reprioritized(id).await),
        };
        let queued = if from == priority { 0 } else { elements.len() as u64 };
        let mut moved = 0;
        // The listing index shows (and filters by) the new priority.
        let home = crate::keys::home_shard(&key_id, shards);
        crate::protocol::listing::relabel(&self.store, home, &key_id, priority).await?;
        if from != priority {
            // Each shard's elements in its own calls (their lists share that shard's hash tag),
            // a bounded number per call: each call scans near the ends of the lists.
            for (shard, elements) in
                crate::shards::by_shard(&key_id, &crate::shards::Placement::new(from, shards), elements)
            {
                for chunk in elements.chunks(RELIST_CHUNK) {
                    moved += operators::relist(&self.store, shard, from, priority, chunk.to_vec()).await?;
                }
            }
        }
        Ok(Reprioritized { from: from.get(), to: priority.get(), moved, left: queued.saturating_sub(moved) })
    }

    /// Why a request without keys of its own cannot be reprioritized: it is a lane request (live
    /// or finished), or unknown.
    async fn lane_not_reprioritized(&self, id: &RequestId) -> Error {
        let key_id = id.key_id();
        let home = match crate::shards::lane_home_found(&self.store, &key_id).await {
            Ok(home) => home,
            Err(e) => return e,
        };
        let record = self.store.keys.record(home, &key_id);
        let fields: HashMap<String, Vec<u8>> = match self.store.client.hgetall(record.as_str()).await {
            Ok(fields) => fields,
            Err(e) => return e.into(),
        };
        if fields.is_empty() {
            return Error::UnknownRequest(id.clone());
        }
        let meta = crate::protocol::lane::record_meta(&fields);
        let state = meta.get("state").map_or("", String::as_str);
        if !matches!(state, "queued" | "running") {
            return not_reprioritized(id, state);
        }
        let prio = meta.get("prio").map_or("?", String::as_str);
        Error::Refused(format!(
            "request \"{id}\" is a small request that shares the lane of priority {prio} with others: its \
             sub-requests already wait in that lane, so its priority cannot be changed and it runs at priority \
             {prio}; submit small requests with their own stream (RequestBuilder::own_stream) to be able to \
             change their priority, or cancel this one and submit it again"
        ))
    }

    /// Tokens waiting per priority, active requests, live workers, requests by state, what is
    /// paused, the [`Tally`] of the requests' records and Redis's memory. Its cost is bounded: a
    /// few round trips per shard, and at most [`MAX_TALLY`] records read.
    pub async fn stats(&self) -> Result<Stats> {
        self.read_stats(true).await
    }

    /// [`stats`](Self::stats) without the tally (its `tally` is all zero, with `records_read` 0):
    /// the part of a reading whose cost does not grow with the backlog, for a display that reads
    /// the tally less often than the rest.
    pub async fn stats_without_tally(&self) -> Result<Stats> {
        self.read_stats(false).await
    }

    /// Turns the elements counted on `shard`'s lists into requests' tokens waiting: a tenant
    /// group's queued tokens wait there in place of its requests' tokens, which wait in its queues
    /// (docs/protocol.md §5, "Tenant groups"). Three pipelines, whatever the number of groups.
    async fn count_group_tokens(&self, shard: u32, waiting: &mut BTreeMap<u8, (u64, u64)>) -> Result<()> {
        let keys = &self.store.keys;
        let client = &self.store.client;
        let groups: Vec<String> = client.smembers(keys.groups(shard)).await?;
        if groups.is_empty() {
            return Ok(());
        }
        let pipe = client.pipeline();
        for g in &groups {
            pipe.hgetall::<(), _>(keys.group(shard, g)).await?;
            pipe.zrange::<(), _, _, _>(keys.group_work(shard, g), 0, -1, None, false, None, false).await?;
        }
        let replies: Vec<Value> = pipe.all().await?;
        let pipe = client.pipeline();
        let mut queues = Vec::new();
        for (g, pair) in groups.iter().zip(replies.chunks(2)) {
            let meta: HashMap<String, String> = pair[0].clone().convert().unwrap_or_default();
            for (field, value) in &meta {
                let mut f = value.split('|');
                if field.starts_with('t') && f.next() == Some("q") {
                    if let Some(p) = f.nth(2).and_then(|p| p.parse::<u8>().ok()) {
                        let entry = waiting.entry(p).or_default();
                        entry.0 = entry.0.saturating_sub(1);
                    }
                }
            }
            let prios: Vec<String> = pair[1].clone().convert().unwrap_or_default();
            for p in prios.iter().filter_map(|p| Priority::new(p.parse().ok()?).ok()) {
                pipe.llen::<(), _>(keys.group_queue(shard, g, p)).await?;
                queues.push(p.get());
            }
        }
        if queues.is_empty() {
            return Ok(());
        }
        let lens: Vec<u64> = pipe.all().await?;
        for (p, n) in queues.into_iter().zip(lens) {
            if n > 0 {
                waiting.entry(p).or_default().0 += n;
            }
        }
        Ok(())
    }

    async fn read_stats(&self, tally: bool) -> Result<Stats> {
        let keys = &self.store.keys;
        // Summed over the configured shards (each shard's lists share a slot: one pipeline each).
        let mut waiting: BTreeMap<u8, (u64, u64)> = BTreeMap::new();
        let mut active_requests: u64 = 0;
        let (mut tokens_held, mut requests) = (0u64, RequestCounts::default());
        let now_ms: u64 = {
            let time =
                fred::types::CustomCommand::new_static("TIME", fred::types::ClusterHash::Random, false);
            let (s, us): (u64, u64) = self.store.client.custom(time, Vec::<Value>::new()).await?;
            s * 1000 + us / 1000
        };
        for shard in 0..keys.shards() {
            let lists = keys.token_lists(shard);
            let pipe = self.store.client.pipeline();
            for list in &lists {
                pipe.llen::<(), _>(list.as_str()).await?;
            }
            // The tail is next in line (lists are pushed at the head).
            for list in &lists {
                pipe.lindex::<(), _>(list.as_str(), -1).await?;
            }
            let replies: Vec<Value> = pipe.all().await?;
            let (lens, tails) = replies.split_at(lists.len());
            for ((list, n), tail) in lists.iter().zip(lens).zip(tails) {
                let n = n.as_u64().unwrap_or(0);
                if let (Some((_, p)), true) = (keys.priority_of_list(list), n > 0) {
                    let queued = tail
                        .as_string()
                        .and_then(|e| crate::protocol::TokenElement::parse(&e))
                        .map(|t| t.epoch);
                    let age = queued.map_or(0, |at| now_ms.saturating_sub(at));
                    let entry = waiting.entry(p.get()).or_default();
                    entry.0 += n;
                    entry.1 = entry.1.max(age);
                }
            }
            self.count_group_tokens(shard, &mut waiting).await?;
            let pipe = self.store.client.pipeline();
            pipe.zcard::<(), _>(keys.active(shard)).await?;
            pipe.hlen::<(), _>(keys.held(shard)).await?;
            for set in ["live", "completed", "failed", "cancelled"] {
                pipe.zcard::<(), _>(keys.index_set(shard, set)).await?;
            }
            // Queued lane requests are counted apart until they are listed as live (`lq`).
            pipe.get::<(), _>(keys.index_set(shard, "lq")).await?;
            // A terminal set's groups hold more requests than members (`gn`, per state).
            pipe.hmget::<(), _, _>(keys.index_set(shard, "gn"), vec!["completed", "failed", "cancelled"])
                .await?;
            let mut replies: Vec<Value> = pipe.all().await?;
            let grouped: Vec<Option<u64>> = replies.pop().unwrap_or(Value::Null).convert()?;
            let counts: Vec<u64> = replies
                .into_iter()
                .map(|v| v.convert::<Option<u64>>().map(Option::unwrap_or_default))
                .collect::<std::result::Result<_, _>>()?;
            // Groups left behind by a set that expired on its own are not counted.
            let terminal = |i: usize| match counts[3 + i] {
                0 => 0,
                n => n.saturating_add_signed(grouped.get(i).copied().flatten().unwrap_or(0) as i64),
            };
            active_requests += counts[0];
            tokens_held += counts[1];
            requests.unfinished += counts[2] + counts[6];
            requests.completed += terminal(0);
            requests.failed += terminal(1);
            requests.cancelled += terminal(2);
        }
        let tokens_waiting = waiting
            .into_iter()
            .rev()
            .map(|(priority, (tokens, oldest_waiting_ms))| PriorityTokens {
                priority,
                tokens,
                oldest_waiting_ms,
            })
            .collect();
        let workers = registry::live(&self.store).await?;
        Ok(Stats {
            tokens_waiting,
            active_requests,
            workers,
            paused: self.paused().await?,
            tokens_held,
            requests,
            tally: if tally { self.tally().await? } else { Tally::default() },
            redis_memory_bytes: self.redis_memory().await?,
        })
    }

    /// The stats by stage of the last `since` (from the start of the minute it began in; at
    /// most 31 days, and what `Config::stats_retention` kept): per priority, requests submitted,
    /// started, completed and failed, sub-request attempts succeeded, retried and dead-lettered,
    /// acks fenced, and histograms of the queue wait, run time and request duration. Counts reach
    /// Redis once per flush interval of each producer and worker (`Config::stats_flush_interval`),
    /// so the last few seconds may be missing.
    ///
    /// ```no_run
    /// # async fn demo(admin: sluicegate::Admin) -> sluicegate::Result<()> {
    /// let stats = admin.stats_since(std::time::Duration::from_secs(3600)).await?;
    /// for p in &stats.priorities {
    ///     println!("priority {}: {} completed, p99 wait {:?}", p.priority, p.completed, p.queue_wait.quantile(0.99));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn stats_since(&self, since: std::time::Duration) -> Result<crate::stats::StageStats> {
        crate::stats::read(&self.store, since).await
    }

    /// The request's dead letters, by index: each one's error and payload (what
    /// [`requeue_dead`](Self::requeue_dead) would run again). Empty for a request without any;
    /// unknown requests are an error.
    pub async fn dead(&self, id: &RequestId) -> Result<Vec<DeadLetter>> {
        let keys = self.store.keys.request(&id.key_id());
        let client = &self.store.client;
        let exists: i64 = client.exists(keys.meta.as_str()).await?;
        if exists == 0 {
            return self.lane_dead(id).await;
        }
        // Dead letters wait in the retry set with an infinite score; their payloads stay pending in
        // the stream (entry `0-<index + 1>`), their errors in the errors hash.
        let ids: Vec<String> = client.zrangebyscore(keys.retry.as_str(), "+inf", "+inf", false, None).await?;
        let mut dead = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(1_000) {
            let pipe = client.pipeline();
            for entry in chunk {
                pipe.xrange::<(), _, _, _>(keys.stream.as_str(), entry.as_str(), entry.as_str(), None)
                    .await?;
                let index = entry_index(entry)?;
                pipe.hget::<(), _, _>(keys.errors.as_str(), index).await?;
            }
            let replies: Vec<Value> = pipe.all().await?;
            for (entry, pair) in chunk.iter().zip(replies.chunks(2)) {
                // Gone meanwhile (requeued and run, say): not a dead letter any more.
                let Some(payload) = first_entry_field(&pair[0]) else { continue };
                let record = pair[1].as_bytes().map(<[u8]>::to_vec).unwrap_or_default();
                dead.push(DeadLetter {
                    index: entry_index(entry)?,
                    error: PartError::from_record(&record),
                    payload,
                });
            }
        }
        dead.sort_by_key(|d| d.index);
        Ok(dead)
    }

    /// `dead` of a lane request: its record keeps a dead part's payload (`x<index>`) and error
    /// record (`e<index>`).
    async fn lane_dead(&self, id: &RequestId) -> Result<Vec<DeadLetter>> {
        let key_id = id.key_id();
        let record =
            self.store.keys.record(crate::shards::lane_home_found(&self.store, &key_id).await?, &key_id);
        let fields: HashMap<String, Vec<u8>> = self.store.client.hgetall(record.as_str()).await?;
        if fields.is_empty() {
            return Err(Error::UnknownRequest(id.clone()));
        }
        let mut dead: Vec<DeadLetter> = fields
            .iter()
            .filter_map(|(k, payload)| {
                let index: u64 = k.strip_prefix('x')?.parse().ok()?;
                let record = fields.get(&format!("e{index}")).map(Vec::as_slice).unwrap_or_default();
                Some(DeadLetter { index, error: PartError::from_record(record), payload: payload.clone() })
            })
            .collect();
        dead.sort_by_key(|d| d.index);
        Ok(dead)
    }

    /// Deletes every key of the namespace (requests queued, running and finished, results,
    /// events, pauses, the registry), found with `SCAN` on every master. Refused while workers are
    /// registered in it, unless `force` (they would go on in an empty namespace: stop them first).
    /// Returns how many keys were deleted. Producers and listeners of the namespace see their
    /// requests vanish; a request submitted meanwhile may survive in part, so quiesce first.
    pub async fn purge_namespace(&self, force: bool) -> Result<u64> {
        let ns = self.store.config.namespace_str().to_owned();
        let workers = self.workers().await?;
        if !workers.is_empty() && !force {
            let ids: Vec<&str> = workers.iter().map(|w| w.id.as_str()).collect();
            return Err(Error::Refused(format!(
                "{} worker(s) are registered in namespace \"{ns}\" ({}): stop them first, or force the purge",
                workers.len(),
                ids.join(", ")
            )));
        }
        let pattern = format!("{}:*", escape_glob(&ns));
        let mut deleted = 0;
        // Again while a pass finds keys: one written during a scan may be missed by it.
        for _ in 0..5 {
            let found = self.unlink_matching(&pattern).await?;
            deleted += found;
            if found == 0 {
                break;
            }
        }
        tracing::warn!(namespace = %ns, deleted, force, "purged the namespace");
        Ok(deleted)
    }

    /// One SCAN pass over every master, unlinking what matches `pattern`.
    async fn unlink_matching(&self, pattern: &str) -> Result<u64> {
        let client = &self.store.client;
        let mut deleted = 0;
        if client.is_clustered() {
            let mut pages = client.scan_cluster(pattern, Some(1_000), None);
            while let Some(page) = pages.next().await {
                if let Some(keys) = page?.take_results() {
                    deleted += unlink_each(client, keys).await?;
                }
            }
        } else {
            let mut pages = client.scan(pattern, Some(1_000), None);
            while let Some(page) = pages.next().await {
                if let Some(keys) = page?.take_results() {
                    deleted += unlink_each(client, keys).await?;
                }
            }
        }
        Ok(deleted)
    }

    /// The workers whose registration is fresh (as in [`stats`](Self::stats), without the rest).
    /// Also says what each worker's busy slots hold ([`WorkerInfo::busy`]): one `HGETALL` of each
    /// token shard's take records, so its cost grows with the slots busy now, not the backlog.
    pub async fn workers(&self) -> Result<Vec<WorkerInfo>> {
        let mut workers = registry::live(&self.store).await?;
        if workers.is_empty() {
            return Ok(workers);
        }
        let keys = &self.store.keys;
        let pipe = self.store.client.pipeline();
        for shard in 0..keys.shards() {
            pipe.hgetall::<(), _>(keys.held(shard)).await?;
        }
        let held: Vec<HashMap<String, String>> = pipe.all().await?;
        let mut by_worker: HashMap<&str, Vec<SlotWork>> = HashMap::new();
        for (shard, records) in held.iter().enumerate() {
            for (holder, record) in records {
                if let Some(work) = SlotWork::from_record(shard as u32, holder, record) {
                    let worker = holder.split('/').next().unwrap_or_default();
                    by_worker.entry(worker).or_default().push(work);
                }
            }
        }
        for worker in &mut workers {
            if let Some(mut busy) = by_worker.remove(worker.id.as_str()) {
                busy.sort_by(|a, b| a.slot.cmp(&b.slot));
                worker.busy = busy;
            }
        }
        Ok(workers)
    }

    /// Pauses the namespace (`None`) or one priority: from their next take, worker slots take no
    /// token of it (within one idle poll for an idle slot); a slot holding one finishes its
    /// quantum first, and running handlers finish. Submits still work. Kept in Redis, so it holds
    /// across worker restarts until [`resume`](Self::resume). Repeating it changes nothing.
    pub async fn pause(&self, priority: Option<Priority>) -> Result<()> {
        let field = priority.map_or_else(|| "all".to_owned(), |p| p.get().to_string());
        // On every shard a worker may use, not only on this admin's: workers and producers may be
        // configured with more token shards than the operator's tool.
        let pipe = self.store.client.pipeline();
        for shard in 0..MAX_TOKEN_SHARDS {
            pipe.hset::<(), _, _>(self.store.keys.paused(shard), (field.as_str(), 1)).await?;
        }
        pipe.all::<Vec<Value>>().await?;
        Ok(())
    }

    /// Undoes pauses: `None` resumes everything (the namespace and every priority paused one by
    /// one); `Some(p)` resumes priority `p` only (a pause of the whole namespace stays). Slots
    /// take again at their next take, an idle one within one idle poll.
    pub async fn resume(&self, priority: Option<Priority>) -> Result<()> {
        let pipe = self.store.client.pipeline();
        for shard in 0..MAX_TOKEN_SHARDS {
            let key = self.store.keys.paused(shard);
            match priority {
                None => pipe.del::<(), _>(key).await?,
                Some(p) => pipe.hdel::<(), _, _>(key, p.get().to_string()).await?,
            };
        }
        pipe.all::<Vec<Value>>().await?;
        Ok(())
    }

    /// What is paused (as the first token shard holds it; every shard holds the same, but for a
    /// moment during a pause or resume).
    pub async fn paused(&self) -> Result<Paused> {
        let fields: HashMap<String, String> = self.store.client.hgetall(self.store.keys.paused(0)).await?;
        let mut paused = Paused::default();
        for field in fields.into_keys() {
            match field.parse::<u8>() {
                Ok(p) => paused.priorities.push(p),
                Err(_) => paused.all |= field == "all",
            }
        }
        paused.priorities.sort_unstable_by(|a, b| b.cmp(a));
        Ok(paused)
    }
}

/// Unlinks keys one by one (on a cluster they live in many slots), in one pipeline.
async fn unlink_each(client: &Client, keys: Vec<Key>) -> Result<u64> {
    let pipe = client.pipeline();
    for key in keys {
        pipe.unlink::<(), _>(key).await?;
    }
    let counts: Vec<u64> = pipe.all().await?;
    Ok(counts.into_iter().sum())
}

/// `text` with the glob characters of `SCAN MATCH` escaped.
fn escape_glob(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// The index of stream entry `0-<index + 1>`.
fn entry_index(entry: &str) -> Result<u64> {
    entry
        .strip_prefix("0-")
        .and_then(|seq| seq.parse::<u64>().ok())
        .and_then(|seq| seq.checked_sub(1))
        .ok_or_else(|| Error::Protocol(format!("a dead letter's entry id {entry:?} is not 0-<index + 1>")))
}

/// The value of the first field of the first entry of an XRANGE reply (`[[id, [field, value]]]`).
fn first_entry_field(reply: &Value) -> Option<Vec<u8>> {
    let Value::Array(entries) = reply else { return None };
    let Value::Array(entry) = entries.first()? else { return None };
    let fields = match entry.get(1)? {
        Value::Array(fields) => fields.get(1)?.clone(),
        Value::Map(map) => map.clone().inner().into_values().next()?,
        _ => return None,
    };
    fields.as_bytes().map(<[u8]>::to_vec)
}

/// Elements per `relist` call.
const RELIST_CHUNK: usize = 100;

/// The refusal of a request in `state` (finished, or still loading) to change its priority.
fn not_reprioritized(id: &RequestId, state: &str) -> Error {
    if state == "loading" {
        return Error::Refused(format!(
            "request \"{id}\" is still being submitted: change its priority once its submit has returned"
        ));
    }
    Error::Refused(format!(
        "request \"{id}\" has already finished ({state}): its priority can no longer change"
    ))
}

/// A request's status from the scalar fields of its meta hash or lane record (both name them
/// alike), its error records, and what was counted beside them.
fn status_from(
    id: &RequestId,
    meta: &HashMap<String, String>,
    mut errors: Vec<IndexedError>,
    running: u64,
    retrying: u64,
) -> Result<RequestStatus> {
    let num = |k: &str| meta.get(k).and_then(|v| v.parse::<u64>().ok());
    let state: RequestState = meta.get("state").map(String::as_str).unwrap_or("").parse()?;
    let total = num("total").unwrap_or(0);
    let left = num("left").unwrap_or(total);
    errors.sort_by_key(|e| e.index);
    // `maxseen` is written only past one attempt: a part settled at its first makes it 1.
    let max_attempts_seen = errors
        .iter()
        .map(|e| e.error.attempts)
        .chain(num("maxseen").map(|m| m as u32))
        .max()
        .unwrap_or(0)
        .max(u32::from(left < total));
    errors.truncate(STATUS_ERRORS);
    let reason = meta.get("why").map(|why| reason_shown(why));
    // A request ended at its deadline leaves parts that never ran: they are not done.
    let done = if state == RequestState::Completed || (state == RequestState::Failed && reason.is_none()) {
        total
    } else {
        total.saturating_sub(left)
    };
    Ok(RequestStatus {
        id: id.to_string(),
        state,
        priority: num("prio").unwrap_or(0) as u8,
        concurrency: num("limit").unwrap_or(0) as u32,
        total,
        done,
        failed: num("failed").unwrap_or(0),
        running,
        retrying,
        max_attempts_seen,
        succeeded_after_retry: num("retried").unwrap_or(0),
        open: meta.get("open").map(String::as_str) == Some("1"),
        window: num("window").filter(|w| *w > 0),
        discard_results: meta.get("discard").map(String::as_str) == Some("1"),
        results_taken: num("taken").unwrap_or(0),
        created_ms: num("created").unwrap_or(0),
        started_ms: num("started"),
        finished_ms: num("finished"),
        deadline_ms: num("dl"),
        rate: meta
            .get("rate")
            .and_then(|r| r.split_once('/'))
            .and_then(|(n, per)| Some(RateLimit { n: n.parse().ok()?, per_ms: per.parse().ok()? })),
        reason,
        errors,
        paused: false,
        tags: Vec::new(),
        tracked: false,
        upstreams: upstreams_of(meta),
        on_upstream_failure: meta.get("ups").map(|_| match meta.get("onup").map(String::as_str) {
            Some("run") => OnUpstreamFailure::Run,
            _ => OnUpstreamFailure::Fail,
        }),
        downstreams: Vec::new(),
        group: meta.get("grp").cloned(),
    })
}

/// A downstream's upstreams, from its meta (`ups` and the fields `u:<key id>`).
fn upstreams_of(meta: &HashMap<String, String>) -> Vec<Upstream> {
    let Some(ups) = meta.get("ups") else { return Vec::new() };
    ups.split(',')
        .filter_map(|ukid| {
            let id = RequestId::from_key_id(ukid).ok()?.to_string();
            let field = meta.get(&format!("u:{ukid}"));
            let ended = match field.map(|f| f.split('|').collect::<Vec<_>>()).as_deref() {
                Some(["c", ..]) => Some("completed".to_owned()),
                Some(["f", _, state, ..]) => Some((*state).to_owned()),
                _ => None,
            };
            Some(Upstream { id, ended })
        })
        .collect()
}
