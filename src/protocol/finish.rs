//! The steps after a request turns terminal (docs/protocol.md §5, "Finishing", and §6.3):
//! `finish_index` and `sweep` on the token side, `seal` on the request's keys, then `unindex`.
//! Also what the finishing functions (`ack`, `cancel`, `stream_finalize`) report of a finish.

use fred::types::Value;

use super::{ms, Func};
use crate::error::Result;
use crate::reply;
use crate::store::Store;

/// A request that has just turned terminal, as a finishing function reports it
/// (`{'finished', state, lifecycle, sweep...}`, the part after the tag).
#[derive(Debug)]
pub(crate) struct Finished {
    /// The terminal state.
    pub(crate) state: String,
    /// The lifecycle that finished: `created * 1000 + gen` (gen counts reopenings by requeue).
    pub(crate) lifecycle: i64,
    /// Stale token elements to sweep from the lists.
    pub(crate) sweep: Vec<Value>,
    /// The request's token shards, when the reply says (`acquire`'s finish at a deadline, whose
    /// slot has no policy of the request yet).
    pub(crate) shards: Option<u32>,
}

impl Finished {
    /// Reads the reply items that follow the `finished` tag.
    pub(crate) fn from_reply(mut items: impl Iterator<Item = Value>) -> Result<Finished> {
        let state = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
        let lifecycle = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
        let mut sweep: Vec<Value> = items.collect();
        let shards = match sweep.last() {
            Some(Value::Array(last)) if last.first().and_then(Value::as_str).as_deref() == Some("shards") => {
                let s = last.get(1).map(reply::int).transpose()?.unwrap_or(1);
                sweep.pop();
                Some(s.clamp(1, 1024) as u32)
            }
            _ => None,
        };
        Ok(Finished { state, lifecycle, sweep, shards })
    }
}

/// `sweep`: removes a finished request's stale `elements` from `list`, on `shard` (not its home).
pub(crate) async fn sweep(store: &Store, shard: u32, list: &str, elements: Vec<Value>) -> Result<()> {
    let bell = store.keys.bell(shard);
    // Returns 1: nothing to read.
    store.fcall(Func::Sweep, &[list, &bell], elements).await?;
    Ok(())
}

/// What `finish_index` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Indexed {
    /// This call recorded the event.
    Recorded,
    /// This call recorded the event, and the request has downstreams: their release is owed (in
    /// the shard's outbox), for the caller to run.
    ReleaseOwed,
    /// The event had been recorded (or the request has left the index).
    Before,
}

/// `finish_index`: records the one event of lifecycle `lifecycle` of request `key_id` on its home
/// shard `home`, and sweeps `sweep` from its priority list there.
pub(crate) async fn finish_index(
    store: &Store,
    key_id: &str,
    home: u32,
    list: &str,
    state: &str,
    lifecycle: i64,
    sweep: Vec<Value>,
) -> Result<Indexed> {
    let mut args: Vec<Value> =
        vec![key_id.into(), state.into(), ms(store.config.retention), lifecycle.into()];
    args.extend(sweep);
    let (active, events, marks, bell) = (
        store.keys.active(home),
        store.keys.events(home),
        store.keys.finish_marks(home, key_id),
        store.keys.bell(home),
    );
    let recorded = store.fcall(Func::FinishIndex, &[&active, &events, list, &marks, &bell], args).await?;
    Ok(match reply::int(&recorded)? {
        1 => Indexed::Recorded,
        2 => Indexed::ReleaseOwed,
        _ => Indexed::Before,
    })
}

/// `seal`: starts the retention of request `key_id`'s finished lifecycle `lifecycle`. Returns
/// whether the request is that lifecycle, now sealed (false: reopened since, or gone).
pub(crate) async fn seal(store: &Store, key_id: &str, lifecycle: i64) -> Result<bool> {
    let keys = store.keys.request(key_id);
    let args: Vec<Value> = vec![lifecycle.into(), ms(store.config.retention)];
    Ok(reply::int(&store.fcall(Func::Seal, &keys.all(), args).await?)? == 1)
}

/// What `unindex` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unindexed {
    /// The request left the index, or was not in it.
    Done,
    /// The entry stays for this newer lifecycle, which a requeue marked (`reopen`).
    StaysFor(i64),
}

/// `unindex`: takes request `key_id`, whose lifecycle `lifecycle` finished, out of its home shard
/// `home`'s index, unless a requeue has reopened it since.
/// `state`: its terminal state, for a listing row a refused duplicate submit left live.
pub(crate) async fn unindex(
    store: &Store,
    key_id: &str,
    home: u32,
    lifecycle: i64,
    state: &str,
) -> Result<Unindexed> {
    let (active, marks, reg, armed) = (
        store.keys.active(home),
        store.keys.finish_marks(home, key_id),
        store.keys.registrations(home),
        store.keys.armed(home),
    );
    let args: Vec<Value> = vec![key_id.into(), lifecycle.into(), ms(store.config.retention), state.into()];
    let left = reply::int(&store.fcall(Func::Unindex, &[&active, &marks, &reg, &armed], args).await?)?;
    // 1 (left) and 0 (not there) are below any lifecycle (`created * 1000 + gen`).
    Ok(if left > lifecycle { Unindexed::StaysFor(left) } else { Unindexed::Done })
}
