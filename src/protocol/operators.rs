//! Operators' transitions (docs/protocol.md §5, "Operators"): `cancel`, `requeue_dead` and
//! `reprioritize` on a request's keys, and `relist`, reprioritize's step on a shard's token side.

use fred::types::Value;

use super::{ms, Code, Finished, Func, Refusal};
use crate::error::{Error, Result};
use crate::reply;
use crate::request::{Priority, RequestId};
use crate::store::Store;

/// What `cancel` answers.
#[derive(Debug)]
pub(crate) enum Cancel {
    /// `{'finished', 'cancelled', lifecycle, sweep...}`: this call cancelled it.
    Finished(Finished),
    /// `{'already', state}`: it was terminal before (or loading, and was discarded).
    Already(String),
    /// `{'unknown'}`.
    Unknown,
}

/// `cancel`: ends request `key_id` now.
pub(crate) async fn cancel(store: &Store, key_id: &str) -> Result<Cancel> {
    let keys = store.keys.request(key_id);
    let args: Vec<Value> = vec![key_id.into(), ms(store.config.retention), store.keys.done_channel().into()];
    let mut reply = reply::array(store.fcall(Func::Cancel, &keys.all(), args).await?)?.into_iter();
    let tag = reply.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    match tag.as_str() {
        "unknown" => Ok(Cancel::Unknown),
        "already" => {
            Ok(Cancel::Already(reply.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default()))
        }
        "finished" => Ok(Cancel::Finished(Finished::from_reply(reply)?)),
        other => Err(Error::Protocol(format!("unexpected cancel reply {other:?}"))),
    }
}

/// What `requeue_dead` answers: `{n, reopened, elements...}`, or for a failed request the step
/// to take first.
#[derive(Debug)]
pub(crate) enum Requeued {
    /// `{-1, lifecycle}`: the failed lifecycle's finish is not sealed yet: complete the steps
    /// after it, then call again.
    FinishFirst(i64),
    /// `{-2, lifecycle}`: call `reopen` with this lifecycle, then call again with it.
    ReopenFirst(i64),
    /// Done: how many dead letters were requeued, and token elements to push. (The reply's second
    /// item, the lifecycle a failed request was reopened as, is not needed by any caller.)
    Done {
        /// Dead letters requeued.
        n: i64,
        /// Elements of re-created or woken tokens, to push.
        elements: Vec<Value>,
    },
}

/// `requeue_dead` on request `key_id`: `reopen_as` is the lifecycle a failed request reopens as
/// ('' until `reopen` marked one), `deadline` the one of the caller's arm (SGLATE past it),
/// `resume` recovery's completion of a requeue whose caller died after that mark.
pub(crate) async fn requeue_dead(
    store: &Store,
    key_id: &str,
    reopen_as: &str,
    deadline: i64,
    resume: bool,
) -> Result<Requeued> {
    let keys = store.keys.request(key_id);
    let mut args: Vec<Value> = vec![key_id.into(), reopen_as.into(), deadline.into()];
    if resume {
        args.push("resume".into());
    }
    let reply = match store.fcall(Func::RequeueDead, &keys.all(), args).await {
        Ok(reply) => reply,
        // Only a failed, running or queued request has dead letters to requeue.
        Err(e) => match Refusal::is(&e, Code::State) {
            Some(r) if r.why.contains("deadline") => {
                let id = RequestId::from_key_id(key_id)?;
                return Err(Error::Refused(format!(
                    "request \"{id}\" ended at its deadline, which has passed for good: submit it again instead"
                )));
            }
            Some(_) => return Err(Error::NoDeadLetters(RequestId::from_key_id(key_id)?)),
            None => return Err(e),
        },
    };
    let mut items = reply::array(reply)?.into_iter();
    let n = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
    let lifecycle = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
    Ok(match n {
        -1 => Requeued::FinishFirst(lifecycle),
        -2 => Requeued::ReopenFirst(lifecycle),
        n => Requeued::Done { n, elements: items.collect() },
    })
}

/// What `reprioritize` answers.
#[derive(Debug)]
pub(crate) enum Reprioritize {
    /// `{'moved', old priority, shards, element...}`: the request has the new priority; the
    /// elements of its tokens queued now are to be moved from `from`'s lists (`relist`).
    Moved {
        /// The priority before (the one before the last change, when the priority was the new
        /// one already: a repeat).
        from: Priority,
        /// The token shards the request was submitted with.
        shards: u32,
        /// Elements of its queued tokens.
        elements: Vec<Value>,
    },
    /// `{'refused', state}`: it is finished, or still loading.
    Refused(String),
    /// `{'unknown'}`: no request with its own keys has this id (a lane request may).
    Unknown,
}

/// `reprioritize`: gives request `key_id` priority `priority`.
pub(crate) async fn reprioritize(store: &Store, key_id: &str, priority: Priority) -> Result<Reprioritize> {
    let keys = store.keys.request(key_id);
    let args: Vec<Value> = vec![key_id.into(), i64::from(priority.get()).into()];
    let reply = match store.fcall(Func::Reprioritize, &keys.all(), args).await {
        // A request in a tenant group keeps its priority: refused, in the library's words.
        Err(e) => match super::refusal::Refusal::is(&e, super::refusal::Code::Invalid) {
            Some(r) => return Err(crate::error::Error::Refused(r.why)),
            None => return Err(e),
        },
        Ok(reply) => reply,
    };
    let mut items = reply::array(reply)?.into_iter();
    let tag = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    match tag.as_str() {
        "moved" => {
            let from = super::priority_item(items.next())?.unwrap_or(priority);
            let shards = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(1).clamp(1, 1024) as u32;
            Ok(Reprioritize::Moved { from, shards, elements: items.collect() })
        }
        "refused" => {
            Ok(Reprioritize::Refused(items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default()))
        }
        "unknown" => Ok(Reprioritize::Unknown),
        other => Err(Error::Protocol(format!("unexpected reprioritize reply {other:?}"))),
    }
}

/// `relist` on `shard`: moves `elements` from the list of priority `from` to the list of `to`,
/// each to its place by epoch; those not found near either end of the old list, or with no place
/// near the head of the new one, stay. Returns how many moved.
pub(crate) async fn relist(
    store: &Store,
    shard: u32,
    from: Priority,
    to: Priority,
    elements: Vec<Value>,
) -> Result<u64> {
    let (old, new) = (store.keys.token_list(shard, from), store.keys.token_list(shard, to));
    let moved = reply::int(&store.fcall(Func::Relist, &[&old, &new], elements).await?)?;
    Ok(moved.max(0) as u64)
}
