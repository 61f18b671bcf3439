//! One slot: take a token, run sub-requests of its request for one quantum, give the token back.
//!
//! Round trips per sub-request in steady state: one (the ack, which also hands out the next
//! sub-request). Per token take: a BRPOP, an acquire, and a push when the quantum ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::*;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::handler::{Context, Handler};
use super::leases::{LeaseKey, Leases};
use super::Quantum;
use crate::codec;
use crate::config::millis;
use crate::error::{Error, Result};
use crate::keys::{RequestId, RequestKeys};
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
    pub(crate) idle_poll: Duration,
    pub(crate) leases: Leases,
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
    list: String,
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
    Run(Entry),
    Requeue(String),
    Park,
    Finished { state: String, sweep: Vec<Value> },
    Drop,
    Stale,
    Fenced,
}

pub(crate) async fn run<H: Handler>(shared: Arc<Shared<H>>, n: usize, blocking: Client) {
    let holder = format!("{}/{n}", shared.worker_id);
    let mut backoff = Duration::from_millis(50);
    while !shared.stopping.is_cancelled() {
        match take_and_serve(&shared, n, &holder, &blocking).await {
            Ok(()) => backoff = Duration::from_millis(50),
            Err(e) => {
                tracing::warn!(slot = n, error = %e, "slot error; retrying after {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
    let _ = blocking.quit().await;
}

/// One token take: BRPOP, acquire, then serve the request until the quantum ends.
async fn take_and_serve<H: Handler>(
    shared: &Shared<H>,
    n: usize,
    holder: &str,
    blocking: &Client,
) -> Result<()> {
    let store = &shared.store;
    // The BRPOP is never abandoned mid-flight (that would pop a token into a reply nobody reads):
    // it runs to its server-side timeout, which bounds how long an idle slot takes to stop.
    let popped: Option<(String, String)> = match blocking
        .brpop(
            store.keys.token_lists().to_vec(),
            shared.idle_poll.as_secs_f64(),
        )
        .await
    {
        Ok(v) => v,
        Err(e) if *e.kind() == fred::error::ErrorKind::Timeout => None,
        Err(e) => return Err(e.into()),
    };
    let Some((list, element)) = popped else {
        return Ok(());
    };
    let Some(token) = parse_token(store, &list, &element) else {
        tracing::warn!(list, element, "dropping a malformed token element");
        return Ok(());
    };
    let span = tracing::info_span!("token", request_id = %token.request_id, token = %token.number, priority = token.priority.get());
    serve(shared, n, holder, token).instrument(span).await
}

fn parse_token(store: &Store, list: &str, element: &str) -> Option<Token> {
    let priority = store.keys.priority_of_list(list)?;
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

async fn serve<H: Handler>(shared: &Shared<H>, n: usize, holder: &str, token: Token) -> Result<()> {
    let store = &shared.store;
    let lease_ms = millis(store.config.lease) as i64;
    let reply = store
        .fcall(
            Func::Acquire,
            &[&token.keys.meta, &token.keys.stream],
            vec![
                token.key_id.as_str().into(),
                token.number.as_str().into(),
                token.epoch.as_str().into(),
                holder.into(),
                shared.worker_id.as_str().into(),
                lease_ms.into(),
            ],
        )
        .await?;
    let mut next = parse_next(reply)?;
    let started = Instant::now();
    let mut ran: u32 = 0;
    let lease = LeaseKey {
        meta_key: token.keys.meta.clone(),
        token: token.number.clone(),
        epoch: token.epoch.clone(),
        holder: holder.to_owned(),
    };
    let result = loop {
        let entry = match next {
            Next::Run(entry) => entry,
            other => break other,
        };
        // Not a child of `stopping`: a graceful stop lets running handlers finish.
        let cancel = CancellationToken::new();
        shared.leases.hold(n, lease.clone(), cancel.clone());
        let outcome = run_handler(shared, &token, &entry, cancel).await;
        ran += 1;
        let keep_going = ran < shared.quantum.parts
            && started.elapsed() < shared.quantum.time
            && !shared.stopping.is_cancelled();
        let acked = ack(shared, holder, &token, &entry, outcome, keep_going).await;
        shared.leases.release(n);
        // On error the ack's fate is unknown: the lease runs out and recovery hands the entry out
        // again (or the ack did land, and the entry is done).
        next = acked?;
    };
    match result {
        Next::Requeue(element) => {
            store
                .client
                .lpush::<i64, _, _>(token.list.as_str(), element)
                .await?;
        }
        Next::Finished { state, sweep } => {
            tracing::info!(state, "request finished");
            let mut args: Vec<Value> = vec![
                token.key_id.as_str().into(),
                state.as_str().into(),
                (millis(store.config.retention) as i64).into(),
            ];
            args.extend(sweep);
            let (active, events) = (store.keys.active(), store.keys.events());
            store
                .fcall(Func::FinishIndex, &[&active, &events, &token.list], args)
                .await?;
        }
        Next::Fenced => {
            tracing::warn!("fenced: this slot's claim moved on; its result was dropped")
        }
        Next::Park | Next::Drop | Next::Stale | Next::Run(_) => {}
    }
    Ok(())
}

/// Runs the handler in its own task, so that a panic is caught and recorded, not fatal.
async fn run_handler<H: Handler>(
    shared: &Shared<H>,
    token: &Token,
    entry: &Entry,
    cancel: CancellationToken,
) -> Result<Bytes, String> {
    let input: H::Input =
        codec::decode(&entry.payload).map_err(|e| format!("payload does not decode: {e}"))?;
    let ctx = Context {
        request_id: token.request_id.clone(),
        index: entry.index,
        attempt: entry.attempt,
        priority: token.priority,
        cancelled: cancel,
    };
    let handler = shared.handler.clone();
    let span = tracing::info_span!("handle", request_id = %token.request_id, index = entry.index, attempt = entry.attempt);
    let task = tokio::spawn(async move { handler.handle(ctx, input).await }.instrument(span));
    match task.await {
        Ok(Ok(output)) => codec::encode(&output)
            .map(Bytes::from)
            .map_err(|e| e.to_string()),
        Ok(Err(e)) => Err(e.message().to_owned()),
        Err(join) if join.is_panic() => {
            let panic = join.into_panic();
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(format!("handler panicked: {text}"))
        }
        Err(_) => Err("handler task was cancelled".into()),
    }
}

async fn ack<H: Handler>(
    shared: &Shared<H>,
    holder: &str,
    token: &Token,
    entry: &Entry,
    outcome: Result<Bytes, String>,
    keep_going: bool,
) -> Result<Next> {
    let store = &shared.store;
    let (kind, body): (&str, Value) = match outcome {
        Ok(bytes) => ("ok", Value::Bytes(bytes)),
        Err(msg) => {
            tracing::warn!(index = entry.index, error = %msg, "sub-request failed");
            ("err", msg.into())
        }
    };
    let reply = store
        .fcall(
            Func::Ack,
            &[
                &token.keys.meta,
                &token.keys.stream,
                &token.keys.results,
                &token.keys.errors,
            ],
            vec![
                token.key_id.as_str().into(),
                token.number.as_str().into(),
                token.epoch.as_str().into(),
                holder.into(),
                shared.worker_id.as_str().into(),
                (millis(store.config.lease) as i64).into(),
                entry.id.as_str().into(),
                kind.into(),
                body,
                (if keep_going { "1" } else { "0" }).into(),
                (millis(store.config.retention) as i64).into(),
                store.keys.done_channel().into(),
            ],
        )
        .instrument(tracing::debug_span!("ack", index = entry.index))
        .await?;
    parse_next(reply)
}

fn parse_next(reply: Value) -> Result<Next> {
    let mut items = reply::array(reply)?.into_iter();
    let tag = items
        .next()
        .map(|v| reply::text(&v))
        .transpose()?
        .unwrap_or_default();
    Ok(match tag.as_str() {
        "run" => {
            let (Some(id), Some(index), Some(payload), Some(attempt)) =
                (items.next(), items.next(), items.next(), items.next())
            else {
                return Err(Error::Protocol("short 'run' reply".into()));
            };
            Next::Run(Entry {
                id: reply::text(&id)?,
                index: reply::int(&index)? as u64,
                payload: reply::bytes(payload)?,
                attempt: reply::int(&attempt)? as u32,
            })
        }
        "requeue" => Next::Requeue(
            items
                .next()
                .map(|v| reply::text(&v))
                .transpose()?
                .unwrap_or_default(),
        ),
        "park" => Next::Park,
        "finished" => {
            let state = items
                .next()
                .map(|v| reply::text(&v))
                .transpose()?
                .unwrap_or_default();
            Next::Finished {
                state,
                sweep: items.collect(),
            }
        }
        "drop" => Next::Drop,
        "stale" => Next::Stale,
        "fenced" => Next::Fenced,
        other => return Err(Error::Protocol(format!("unexpected reply {other:?}"))),
    })
}
