//! Operating sluicegate: a request's status, cancel, requeue of dead letters, namespace stats.

use std::collections::{BTreeMap, HashMap};
use std::time::{SystemTime, UNIX_EPOCH};

use fred::prelude::*;
use serde::Serialize;

use crate::config::{millis, Config};
use crate::error::{Error, Result};
use crate::keys::RequestId;
use crate::producer::PartError;
use crate::reply;
use crate::request::{Priority, RequestState};
use crate::scripts::Func;
use crate::store::Store;

/// At most this many errors are listed in a [`RequestStatus`].
pub const STATUS_ERRORS: usize = 100;

/// What an operator needs: status, cancel, requeue, stats. Cheap to clone.
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
    /// The last error of up to [`STATUS_ERRORS`] sub-requests (dead letters and pending retries),
    /// by index.
    pub errors: Vec<IndexedError>,
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

/// What [`Admin::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum Cancelled {
    /// This call cancelled the request.
    Now,
    /// The request had ended before (or was still loading, and was discarded).
    AlreadyFinished(RequestState),
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
}

/// Token elements waiting at one priority.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct PriorityTokens {
    /// The priority.
    pub priority: u8,
    /// Elements in its list.
    pub tokens: u64,
}

/// A live worker, as it registered itself.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct WorkerInfo {
    /// Its id (its stream consumer name).
    pub id: String,
    /// Handlers it runs at once.
    pub slots: usize,
    /// Its process id.
    pub pid: u32,
    /// Its host name.
    pub host: String,
    /// When it started (ms since the Unix epoch).
    pub started_ms: u64,
}

impl Admin {
    /// Connects to Redis, checks its version and loads the functions library.
    pub async fn connect(config: &Config) -> Result<Self> {
        Ok(Self { store: Store::connect(config).await? })
    }

    pub(crate) fn from_store(store: Store) -> Self {
        Self { store }
    }

    /// The request's state and counters.
    pub async fn status(&self, id: &RequestId) -> Result<RequestStatus> {
        let keys = self.store.keys.request(&id.key_id());
        let meta: HashMap<String, String> = self.store.client.hgetall(keys.meta.as_str()).await?;
        if meta.is_empty() {
            return Err(Error::UnknownRequest(id.clone()));
        }
        let num = |k: &str| meta.get(k).and_then(|v| v.parse::<u64>().ok());
        let state: RequestState = meta.get("state").map(String::as_str).unwrap_or("").parse()?;
        let total = num("total").unwrap_or(0);
        let failed = num("failed").unwrap_or(0);
        let left = num("left").unwrap_or(total);
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
        let mut errors: Vec<IndexedError> = records
            .iter()
            .map(|(&index, record)| IndexedError { index, error: PartError::from_record(record) })
            .collect();
        errors.sort_by_key(|e| e.index);
        let max_attempts_seen = errors
            .iter()
            .map(|e| e.error.attempts)
            .chain(num("maxseen").map(|m| m as u32))
            .max()
            .unwrap_or(0);
        errors.truncate(STATUS_ERRORS);
        let done = if state == RequestState::Completed || state == RequestState::Failed {
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
            failed,
            running,
            retrying,
            max_attempts_seen,
            succeeded_after_retry: num("retried").unwrap_or(0),
            open: meta.get("open").map(String::as_str) == Some("1"),
            created_ms: num("created").unwrap_or(0),
            started_ms: num("started"),
            finished_ms: num("finished"),
            errors,
        })
    }

    /// Cancels a request: no sub-request of it starts afterwards, running handlers see their
    /// context cancelled at their next heartbeat and their results are dropped, and it gets one
    /// `cancelled` terminal record and event.
    pub async fn cancel(&self, id: &RequestId) -> Result<Cancelled> {
        let key_id = id.key_id();
        let keys = self.store.keys.request(&key_id);
        let cfg = &self.store.config;
        let args: Vec<Value> = vec![
            key_id.as_str().into(),
            (millis(cfg.retention) as i64).into(),
            self.store.keys.done_channel().into(),
        ];
        let placement = crate::shards::placement(&self.store, &keys.meta).await?;
        let mut reply = reply::array(self.store.fcall(Func::Cancel, &keys.all(), args).await?)?.into_iter();
        let tag = reply.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
        match tag.as_str() {
            "unknown" => Err(Error::UnknownRequest(id.clone())),
            "already" => {
                let state = reply.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
                Ok(Cancelled::AlreadyFinished(state.parse()?))
            }
            "finished" => {
                let finished = crate::shards::Finished::from_reply(reply)?;
                let (priority, shards) = placement.unwrap_or((Priority::default(), 1));
                crate::shards::finish(&self.store, &key_id, shards, priority, finished).await?;
                Ok(Cancelled::Now)
            }
            other => Err(Error::Protocol(format!("unexpected cancel reply {other:?}"))),
        }
    }

    /// Finalizes a streamed request whose producer is gone: no more parts will come, and it
    /// completes once the parts it has are done.
    pub async fn finalize(&self, id: &RequestId) -> Result<()> {
        let key_id = id.key_id();
        let keys = self.store.keys.request(&key_id);
        crate::producer::finalize(&self.store, &key_id, &keys, "").await
    }

    /// Hands a request's dead letters out again, each with a fresh set of attempts; a failed
    /// request reopens and will end with a new terminal record. Returns how many were requeued.
    pub async fn requeue_dead(&self, id: &RequestId) -> Result<u64> {
        let key_id = id.key_id();
        let keys = self.store.keys.request(&key_id);
        let Some((priority, shards)) = crate::shards::placement(&self.store, &keys.meta).await? else {
            return Err(Error::UnknownRequest(id.clone()));
        };
        let lease = millis(self.store.config.lease) as i64;
        // Registered first, as at submit: if this process dies after the requeue, recovery finds
        // the reopened request and pushes its tokens. Taken back only when the request cannot be
        // requeued at all (completed or cancelled): after any other outcome (nothing requeued,
        // an error whose requeue may have run anyway) a concurrent requeue may have reopened it,
        // and recovery drops an entry that is not needed.
        let registered = crate::shards::register(&self.store, &key_id, shards, priority).await?;
        let mut attempts = 0;
        let mut items = loop {
            attempts += 1;
            let reply = self.store.fcall(Func::RequeueDead, &keys.all(), vec![key_id.as_str().into()]).await;
            let items = match reply {
                Ok(v) => reply::array(v)?,
                Err(Error::Redis(r)) if r.details().contains("SGSTATE") => {
                    if registered {
                        crate::shards::unregister(&self.store, &key_id, shards).await;
                    }
                    return Err(Error::InvalidRequest(format!(
                        "request \"{id}\" has no dead letters that can be requeued (only a failed or running request has)"
                    )));
                }
                Err(e) => return Err(e),
            };
            let unsealed = items.first().map(reply::int).transpose()? == Some(-1);
            if !unsealed {
                break items.into_iter();
            }
            if attempts > 3 {
                return Err(Error::Protocol(format!(
                    "request \"{id}\": its failure is still not sealed after completing its finish; try again"
                )));
            }
            // A failure whose steps after the finish are not done (its worker died, and recovery
            // has not come by yet): announce it first, so that its lifecycle keeps its one event.
            let gen = items.get(1).map(reply::int).transpose()?.unwrap_or(0);
            let finished = crate::shards::Finished { state: "failed".into(), gen, sweep: Vec::new() };
            crate::shards::finish(&self.store, &key_id, shards, priority, finished).await?;
        };
        let n = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0).max(0) as u64;
        let reopened = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
        if reopened > 0 {
            // The finished lifecycle's own last step (unindex) may still be on its way: the mark
            // makes it leave the reopened request in `active`.
            crate::shards::reopen(&self.store, &key_id, shards, priority, reopened).await?;
        }
        let elements: Vec<Value> = items.collect();
        if !elements.is_empty() {
            crate::shards::ring_push(&self.store, &key_id, shards, priority, lease, elements).await?;
        }
        Ok(n)
    }

    /// Tokens waiting per priority, active requests, live workers.
    pub async fn stats(&self) -> Result<Stats> {
        let keys = &self.store.keys;
        // Summed over the configured shards (each shard's lists share a slot: one pipeline each).
        let mut waiting: BTreeMap<u8, u64> = BTreeMap::new();
        let mut active_requests: u64 = 0;
        for shard in 0..keys.shards() {
            let pipe = self.store.client.pipeline();
            for list in keys.token_lists(shard) {
                pipe.llen::<(), _>(list.as_str()).await?;
            }
            let lens: Vec<u64> = pipe.all().await?;
            for (list, n) in keys.token_lists(shard).iter().zip(lens) {
                if let (Some((_, p)), true) = (keys.priority_of_list(list), n > 0) {
                    *waiting.entry(p.get()).or_default() += n;
                }
            }
            active_requests += self.store.client.zcard::<u64, _>(keys.active(shard)).await?;
        }
        let tokens_waiting =
            waiting.into_iter().rev().map(|(priority, tokens)| PriorityTokens { priority, tokens }).collect();
        let now = now_ms() as f64;
        let expired: Vec<String> =
            self.store.client.zrangebyscore(keys.workers(), f64::NEG_INFINITY, now, false, None).await?;
        if !expired.is_empty() {
            let _: i64 = self.store.client.zrem(keys.workers(), expired.clone()).await?;
            let _: i64 = self.store.client.hdel(keys.worker_info(), expired).await?;
        }
        let live: Vec<String> =
            self.store.client.zrangebyscore(keys.workers(), now, f64::INFINITY, false, None).await?;
        let mut workers = Vec::new();
        if !live.is_empty() {
            let infos: Vec<Option<String>> = self.store.client.hmget(keys.worker_info(), live).await?;
            workers = infos.into_iter().flatten().filter_map(|j| serde_json::from_str(&j).ok()).collect();
        }
        Ok(Stats { tokens_waiting, active_requests, workers })
    }
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A worker's registration, renewed with its heartbeat.
pub(crate) async fn register_worker(store: &Store, info: &WorkerInfo) -> Result<()> {
    let ttl = 3 * millis(store.config.heartbeat);
    let json = serde_json::to_string(info).map_err(|e| Error::Codec(e.to_string()))?;
    let (workers, infos) = (store.keys.workers(), store.keys.worker_info());
    let now = now_ms();
    // Workers that died without unregistering are pruned by the live ones; and both keys expire
    // when no worker is left to refresh them, so a namespace whose workers were all killed
    // leaks nothing.
    let dead: Vec<String> =
        store.client.zrangebyscore(workers.as_str(), f64::NEG_INFINITY, now as f64, false, None).await?;
    if !dead.is_empty() {
        let _: i64 = store.client.zrem(workers.as_str(), dead.clone()).await?;
        let _: i64 = store.client.hdel(infos.as_str(), dead).await?;
    }
    let _: i64 = store.client.hset(infos.as_str(), (info.id.as_str(), json)).await?;
    let _: i64 = store
        .client
        .zadd(workers.as_str(), None, None, false, false, ((now + ttl) as f64, info.id.as_str()))
        .await?;
    let _: bool = store.client.pexpire(workers.as_str(), ttl as i64, None).await?;
    let _: bool = store.client.pexpire(infos.as_str(), ttl as i64, None).await?;
    Ok(())
}

/// Removes a worker's registration at a clean shutdown.
pub(crate) async fn unregister_worker(store: &Store, id: &str) -> Result<()> {
    let _: i64 = store.client.zrem(store.keys.workers(), id).await?;
    let _: i64 = store.client.hdel(store.keys.worker_info(), id).await?;
    Ok(())
}
