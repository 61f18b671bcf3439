//! One slot: take a token, run sub-requests of its request for one quantum, give the token back.
//!
//! Round trips per sub-request in steady state: one (the ack, which also hands out the next
//! sub-request). Per token take: a BRPOP, an acquire, and a push when the quantum ends.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::*;
use rand::Rng;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::handler::{Context, Handler};
use super::leases::{LeaseKey, Leases};
use super::{Quantum, WorkerMetrics};
use crate::codec;
use crate::config::millis;
use crate::error::{Error, Result};
use crate::keys::{RequestId, RequestKeys};
use crate::producer::PartError;
use crate::reply;
use crate::request::Priority;
use crate::scripts::Func;
use crate::store::Store;

/// What all slots of a worker share.
pub(crate) struct Shared<H> {
    pub(crate) store: Store,
    pub(crate) handler: Arc<H>,
    pub(crate) worker_id: String,
    pub(crate) quantum: Quantum,
    pub(crate) max_batch: u32,
    pub(crate) idle_poll: Duration,
    /// With more than one token shard: how long a BRPOP waits on one shard before the slot
    /// moves on to the next.
    pub(crate) shard_poll: Duration,
    pub(crate) shutdown_grace: Duration,
    pub(crate) leases: Leases,
    pub(crate) metrics: Arc<WorkerMetrics>,
    /// Set when the worker stops: slots finish what runs and take no new token.
    pub(crate) stopping: CancellationToken,
}

/// A token this slot holds.
struct Token {
    key_id: String,
    request_id: RequestId,
    keys: RequestKeys,
    number: String,
    epoch: String,
    priority: Priority,
    /// The list it was popped from (on its shard): where it goes back.
    list: String,
}

/// The request's retry policy, as acquire reports it.
#[derive(Clone, Copy)]
struct Policy {
    max_attempts: u32,
    timeout: Option<Duration>,
    backoff_base: Duration,
    backoff_max: Duration,
    /// The token shards the request was submitted with.
    shards: u32,
}

impl Policy {
    /// Exponential backoff with "equal jitter": half fixed, half random, capped.
    fn backoff(&self, attempt: u32) -> Duration {
        let exp = self.backoff_base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let delay = exp.min(self.backoff_max);
        let half = delay / 2;
        half + half.mul_f64(rand::thread_rng().gen::<f64>())
    }
}

/// One sub-request handed to this slot.
struct Entry {
    id: String,
    index: u64,
    payload: Bytes,
    attempt: u32,
}

/// What the server answered to acquire or ack.
enum Next {
    Run(Vec<Entry>, Option<Policy>),
    Requeue(String),
    Park,
    Finished(crate::shards::Finished),
    Drop,
    Stale,
    Fenced,
}

/// How one run of the handler ended.
enum Outcome {
    Done(Bytes),
    Failed {
        message: String,
        permanent: bool,
    },
    /// Not run (shutdown), or abandoned when shutdown's grace ran out: handed out again first.
    Skipped,
}

pub(crate) async fn run<H: Handler>(shared: Arc<Shared<H>>, n: usize, blocking: Client) {
    let holder = format!("{}/{n}", shared.worker_id);
    let mut backoff = Duration::from_millis(50);
    // Slots serve the shards in turn, one BRPOP each, starting at different shards.
    let shards = shared.store.keys.shards();
    let mut shard = (n as u32) % shards;
    while !shared.stopping.is_cancelled() {
        let took = take_and_serve(&shared, n, &holder, &blocking, shard).await;
        shard = (shard + 1) % shards;
        match took {
            Ok(()) => backoff = Duration::from_millis(50),
            // A BRPOP refused because the shard's slot is moving (a redirection, which our
            // clients hand back with the slot map refreshed): the new owner is known, go now.
            Err(e) if e.is_not_executed() => {
                tracing::debug!(slot = n, error = %e, "token lists moving; taking again");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => {
                tracing::warn!(slot = n, error = %e, "slot error; retrying after {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
    let _ = blocking.quit().await;
}

/// One token take on one shard: BRPOP, acquire, then serve the request until the quantum ends.
async fn take_and_serve<H: Handler>(
    shared: &Shared<H>,
    n: usize,
    holder: &str,
    blocking: &Client,
    shard: u32,
) -> Result<()> {
    let store = &shared.store;
    let wait = if store.keys.shards() == 1 { shared.idle_poll } else { shared.shard_poll };
    // The BRPOP is never abandoned mid-flight (that would pop a token into a reply nobody reads):
    // it runs to its server-side timeout, which bounds how long an idle slot takes to stop. If
    // the connection drops with a token in the reply anyway, recovery restores it.
    let popped: Option<(String, String)> =
        match blocking.brpop(store.keys.token_lists(shard).to_vec(), wait.as_secs_f64()).await {
            Ok(v) => v,
            Err(e) if *e.kind() == fred::error::ErrorKind::Timeout => None,
            Err(e) => return Err(e.into()),
        };
    let Some((list, element)) = popped else { return Ok(()) };
    let Some(token) = parse_token(store, &list, &element) else {
        tracing::warn!(list, element, "dropping a malformed token element");
        return Ok(());
    };
    let span = tracing::info_span!("token", request_id = %token.request_id, token = %token.number, priority = token.priority.get());
    serve(shared, n, holder, token).instrument(span).await
}

fn parse_token(store: &Store, list: &str, element: &str) -> Option<Token> {
    let (_, priority) = store.keys.priority_of_list(list)?;
    let mut parts = element.split('|');
    let (key_id, number, epoch) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || number.parse::<u32>().is_err() || epoch.parse::<u64>().is_err() {
        return None;
    }
    Some(Token {
        request_id: RequestId::from_key_id(key_id).ok()?,
        keys: store.keys.request(key_id),
        key_id: key_id.to_owned(),
        number: number.to_owned(),
        epoch: epoch.to_owned(),
        priority,
        list: list.to_owned(),
    })
}

/// How long a batch of fast handlers should take: entries handed out together wait for each other,
/// so batches only grow while handlers are quick.
const BATCH_TARGET: Duration = Duration::from_millis(2);

/// Picks how many entries to ask for next, from how long handlers have been taking.
struct Batching {
    max: u32,
    /// Exponentially weighted mean handler time (µs); None until one has run.
    mean_us: Option<f64>,
}

impl Batching {
    fn observe(&mut self, took: Duration) {
        let us = took.as_secs_f64() * 1e6;
        self.mean_us = Some(self.mean_us.map_or(us, |m| 0.8 * m + 0.2 * us));
    }

    fn want(&self, quantum_left: u32) -> u32 {
        let fits = match self.mean_us {
            None => 1.0,
            Some(m) => BATCH_TARGET.as_secs_f64() * 1e6 / m.max(1.0),
        };
        (fits as u32).clamp(1, self.max).min(quantum_left.max(1))
    }
}

async fn serve<H: Handler>(shared: &Shared<H>, n: usize, holder: &str, token: Token) -> Result<()> {
    let store = &shared.store;
    let lease_ms = millis(store.config.lease) as i64;
    let mut batching = Batching { max: shared.max_batch, mean_us: None };
    let reply = store
        .fcall(
            Func::Acquire,
            &token.keys.all(),
            vec![
                token.key_id.as_str().into(),
                token.number.as_str().into(),
                token.epoch.as_str().into(),
                holder.into(),
                shared.worker_id.as_str().into(),
                lease_ms.into(),
                i64::from(batching.want(shared.quantum.parts)).into(),
            ],
        )
        .await?;
    let mut next = parse_next(reply, true)?;
    let mut policy = None;
    let started = Instant::now();
    let mut ran: u32 = 0;
    let lease = LeaseKey {
        meta_key: token.keys.meta.clone(),
        token: token.number.clone(),
        epoch: token.epoch.clone(),
        holder: holder.to_owned(),
    };
    let result = loop {
        let entries = match next {
            Next::Run(entries, p) => {
                policy = p.or(policy);
                entries
            }
            other => break other,
        };
        let Some(policy) = policy else {
            return Err(Error::Protocol("acquire did not report the request's policy".into()));
        };
        // Not a child of `stopping`: a graceful stop lets the running handler finish.
        let cancel = CancellationToken::new();
        shared.leases.hold(n, lease.clone(), cancel.clone());
        let mut outcomes = Vec::with_capacity(entries.len());
        for entry in &entries {
            // Once stopping (or once the grace ran out), the rest of the batch is handed back.
            if shared.stopping.is_cancelled() || matches!(outcomes.last(), Some(Outcome::Skipped)) {
                outcomes.push(Outcome::Skipped);
                continue;
            }
            let began = Instant::now();
            let outcome = run_handler(shared, &token, entry, policy, cancel.clone()).await;
            batching.observe(began.elapsed());
            ran += 1;
            outcomes.push(outcome);
        }
        let keep_going = ran < shared.quantum.parts
            && started.elapsed() < shared.quantum.time
            && !shared.stopping.is_cancelled();
        let want = batching.want(shared.quantum.parts.saturating_sub(ran));
        let acked = ack(shared, holder, &token, &entries, policy, outcomes, keep_going, want).await;
        shared.leases.release(n);
        // On error the ack's fate is unknown: either it landed, or the lease runs out and
        // recovery hands the entries out again.
        next = acked?;
    };
    match result {
        Next::Requeue(element) => {
            // Re-sent while the list's slot is moving, rather than left to recovery (a lease).
            let limit = store.config.unresponsive;
            crate::error::retry_not_executed("token push-back", limit, || async {
                Ok(store.client.lpush::<i64, _, _>(token.list.as_str(), element.as_str()).await?)
            })
            .await?;
        }
        Next::Finished(finished) => {
            tracing::info!(state = finished.state, "request finished");
            let shards = policy.map_or(1, |p| p.shards);
            crate::shards::finish(store, &token.key_id, shards, token.priority, finished).await?;
        }
        Next::Fenced => {
            shared.metrics.fenced.fetch_add(1, Relaxed);
            tracing::warn!("fenced: this slot's lease ran out and the work moved on; its result was dropped");
        }
        Next::Park | Next::Drop | Next::Stale | Next::Run(..) => {}
    }
    Ok(())
}

/// Runs the handler in its own task, so that a panic is caught and recorded, not fatal; applies
/// the request's per-attempt timeout and the worker's shutdown grace.
async fn run_handler<H: Handler>(
    shared: &Shared<H>,
    token: &Token,
    entry: &Entry,
    policy: Policy,
    cancel: CancellationToken,
) -> Outcome {
    let input: H::Input = match codec::decode(&entry.payload) {
        Ok(input) => input,
        Err(e) => {
            return Outcome::Failed { message: format!("payload does not decode: {e}"), permanent: true }
        }
    };
    let ctx = Context {
        request_id: token.request_id.clone(),
        index: entry.index,
        attempt: entry.attempt,
        priority: token.priority,
        cancelled: cancel.clone(),
    };
    let handler = shared.handler.clone();
    let span = tracing::info_span!("handle", request_id = %token.request_id, index = entry.index, attempt = entry.attempt);
    let mut task = tokio::spawn(async move { handler.handle(ctx, input).await }.instrument(span));
    let timeout = async {
        match policy.timeout {
            Some(limit) => tokio::time::sleep(limit).await,
            None => std::future::pending().await,
        }
    };
    let grace_over = async {
        shared.stopping.cancelled().await;
        tokio::time::sleep(shared.shutdown_grace).await;
    };
    let joined = tokio::select! {
        joined = &mut task => joined,
        _ = timeout => {
            cancel.cancel();
            task.abort();
            let limit = policy.timeout.unwrap_or_default();
            return Outcome::Failed { message: format!("attempt timed out after {limit:?}"), permanent: false };
        }
        _ = grace_over => {
            cancel.cancel();
            task.abort();
            tracing::warn!(index = entry.index, "shutdown grace ran out; handing the sub-request back");
            return Outcome::Skipped;
        }
    };
    match joined {
        Ok(Ok(output)) => match codec::encode(&output) {
            Ok(bytes) => Outcome::Done(bytes.into()),
            Err(e) => Outcome::Failed { message: e.to_string(), permanent: true },
        },
        Ok(Err(e)) => Outcome::Failed { message: e.message().to_owned(), permanent: e.is_permanent() },
        Err(join) if join.is_panic() => {
            let panic = join.into_panic();
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Outcome::Failed { message: format!("handler panicked: {text}"), permanent: false }
        }
        Err(_) => Outcome::Failed { message: "handler task was cancelled".into(), permanent: false },
    }
}

#[allow(clippy::too_many_arguments)]
async fn ack<H: Handler>(
    shared: &Shared<H>,
    holder: &str,
    token: &Token,
    entries: &[Entry],
    policy: Policy,
    outcomes: Vec<Outcome>,
    keep_going: bool,
    want: u32,
) -> Result<Next> {
    let store = &shared.store;
    let m = &shared.metrics;
    let mut args: Vec<Value> = vec![
        token.key_id.as_str().into(),
        token.number.as_str().into(),
        token.epoch.as_str().into(),
        holder.into(),
        shared.worker_id.as_str().into(),
        (millis(store.config.lease) as i64).into(),
        (if keep_going { "1" } else { "0" }).into(),
        (millis(store.config.retention) as i64).into(),
        store.keys.done_channel().into(),
        i64::from(want).into(),
    ];
    for (entry, outcome) in entries.iter().zip(outcomes) {
        let (kind, body, delay): (&str, Value, Duration) = match outcome {
            Outcome::Done(bytes) => {
                m.succeeded.fetch_add(1, Relaxed);
                ("ok", Value::Bytes(bytes), Duration::ZERO)
            }
            Outcome::Skipped => ("skip", "".into(), Duration::ZERO),
            Outcome::Failed { message, permanent } => {
                let last = permanent || entry.attempt >= policy.max_attempts;
                let record = PartError { message, attempts: entry.attempt, permanent };
                let body = Value::Bytes(
                    serde_json::to_vec(&record).map_err(|e| Error::Codec(e.to_string()))?.into(),
                );
                if last {
                    m.dead_lettered.fetch_add(1, Relaxed);
                    tracing::warn!(index = entry.index, attempt = entry.attempt, error = %record.message, "sub-request dead-lettered");
                    ("dead", body, Duration::ZERO)
                } else {
                    m.retried.fetch_add(1, Relaxed);
                    let delay = policy.backoff(entry.attempt);
                    tracing::info!(index = entry.index, attempt = entry.attempt, ?delay, error = %record.message, "sub-request will be retried");
                    ("retry", body, delay)
                }
            }
        };
        args.extend([
            entry.id.as_str().into(),
            kind.into(),
            body,
            (millis(delay) as i64).into(),
            i64::from(entry.attempt).into(),
        ]);
    }
    let reply = store
        .fcall(Func::Ack, &token.keys.all(), args)
        .instrument(tracing::debug_span!("ack", entries = entries.len()))
        .await?;
    parse_next(reply, false)
}

/// Reads an acquire (`with_policy`) or ack reply.
fn parse_next(reply: Value, with_policy: bool) -> Result<Next> {
    let mut items = reply::array(reply)?.into_iter();
    let tag = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    Ok(match tag.as_str() {
        "run" => {
            let policy = if with_policy {
                let p: Vec<i64> = reply::array(items.next().unwrap_or(Value::Null))?
                    .iter()
                    .map(reply::int)
                    .collect::<Result<_>>()?;
                let [max_attempts, timeout, base, cap, ref rest @ ..] = p[..] else {
                    return Err(Error::Protocol("acquire's policy has fewer than four fields".into()));
                };
                Some(Policy {
                    max_attempts: max_attempts.max(1) as u32,
                    timeout: (timeout > 0).then(|| Duration::from_millis(timeout as u64)),
                    backoff_base: Duration::from_millis(base.max(0) as u64),
                    backoff_max: Duration::from_millis(cap.max(0) as u64),
                    shards: rest.first().map_or(1, |s| (*s).clamp(1, 1024) as u32),
                })
            } else {
                None
            };
            let mut entries = Vec::new();
            for item in items {
                let mut f = reply::array(item)?.into_iter();
                let (Some(id), Some(index), Some(payload), Some(attempt)) =
                    (f.next(), f.next(), f.next(), f.next())
                else {
                    return Err(Error::Protocol("short entry in a 'run' reply".into()));
                };
                entries.push(Entry {
                    id: reply::text(&id)?,
                    index: reply::int(&index)? as u64,
                    payload: reply::bytes(payload)?,
                    attempt: reply::int(&attempt)? as u32,
                });
            }
            if entries.is_empty() {
                return Err(Error::Protocol("a 'run' reply without entries".into()));
            }
            Next::Run(entries, policy)
        }
        "requeue" => Next::Requeue(items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default()),
        "park" => Next::Park,
        "finished" => Next::Finished(crate::shards::Finished::from_reply(items)?),
        "drop" => Next::Drop,
        "stale" => Next::Stale,
        "fenced" => Next::Fenced,
        other => return Err(Error::Protocol(format!("unexpected reply {other:?}"))),
    })
}
