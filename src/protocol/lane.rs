//! Lanes (docs/protocol.md §5, "Lanes"): a small request given whole goes, in one call, into the
//! lane of its priority on its home shard, a long-lived stream shared by many small requests, with
//! one record hash per request. `lane_submit`, `lane_cancel` and `lane_requeue` here; a lane
//! token is taken like any (`take`) and run with `lane_acquire` and `lane_ack` (`tokens`).

use fred::types::Value;

use super::submit::NewRequest;
use super::{ms, Code, Func, Refusal};
use crate::error::{Error, Result};
use crate::keys::{home_shard, lane_key_id};
use crate::reply;
use crate::request::{Priority, RequestId};
use crate::store::Store;

/// The most parts a lane request has; a larger request takes its own stream.
pub(crate) const MAX_PARTS: usize = 64;

/// The most payload bytes a lane request has.
pub(crate) const MAX_BYTES: usize = 64 << 10;

/// The keys of the lane of `priority` on `shard`, as `lane_submit` and `lane_requeue` take them:
/// its six request keys, the record of `key_id`, its priority list and the shard's bell.
fn lane_keys(store: &Store, shard: u32, priority: Priority, key_id: &str) -> (String, Vec<String>) {
    let lane = lane_key_id(shard, priority);
    let mut keys: Vec<String> = store.keys.request(&lane).all().iter().map(|k| (*k).to_owned()).collect();
    keys.push(store.keys.record(shard, key_id));
    keys.push(store.keys.token_list(shard, priority));
    keys.push(store.keys.bell(shard));
    (lane, keys)
}

/// `lane_submit`: the whole request `req` (its `shards` decide its home shard) with its encoded
/// `parts`, in one call. Returns its lifecycle.
pub(crate) async fn submit(store: &Store, req: &NewRequest<'_>, parts: Vec<Value>) -> Result<String> {
    let shard = home_shard(req.key_id, req.shards);
    let (lane, mut keys) = lane_keys(store, shard, req.priority, req.key_id);
    keys.extend([
        store.keys.active(shard),
        store.keys.registrations(shard),
        store.keys.finish_marks(shard, req.key_id),
    ]);
    let mut args: Vec<Value> = vec![
        lane.into(),
        req.key_id.into(),
        req.id.as_str().into(),
        req.nonce.into(),
        i64::from(req.priority.get()).into(),
        i64::from(req.concurrency.get()).into(),
        i64::from(req.max_attempts).into(),
        ms(req.timeout.unwrap_or_default()),
        ms(req.backoff_base),
        ms(req.backoff_max),
        (if req.fail_fast { "1" } else { "0" }).into(),
        i64::from(store.config.lane_tokens).into(),
        ms(store.config.census_interval),
    ];
    args.extend(parts);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let reply =
        store.fcall(Func::LaneSubmit, &keys, args).await.map_err(|e| super::submit::created(req.id, e))?;
    let reply = reply::array(reply)?;
    Ok(reply.first().map(reply::text).transpose()?.unwrap_or_default())
}

/// What `lane_cancel` answered.
#[derive(Debug)]
pub(crate) enum LaneCancelled {
    /// It is cancelled now.
    Now,
    /// It was terminal before, in this state.
    Already(String),
    /// No such lane request.
    Unknown,
}

/// `lane_cancel` of lane request `key_id`, homed on `shard`.
pub(crate) async fn cancel(store: &Store, shard: u32, key_id: &str) -> Result<LaneCancelled> {
    let keys = [store.keys.record(shard, key_id), store.keys.events(shard)];
    let args: Vec<Value> = vec![key_id.into(), ms(store.config.retention), store.keys.done_channel().into()];
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut items = reply::array(store.fcall(Func::LaneCancel, &keys, args).await?)?.into_iter();
    let tag = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    Ok(match tag.as_str() {
        "finished" => LaneCancelled::Now,
        "already" => {
            LaneCancelled::Already(items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default())
        }
        _ => LaneCancelled::Unknown,
    })
}

/// `lane_requeue` of lane request `key_id`, homed on `shard`, of `priority`. Returns how many dead
/// letters were requeued.
pub(crate) async fn requeue(store: &Store, shard: u32, priority: Priority, key_id: &str) -> Result<u64> {
    let (lane, mut keys) = lane_keys(store, shard, priority, key_id);
    keys.push(store.keys.active(shard));
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let args: Vec<Value> = vec![
        lane.into(),
        key_id.into(),
        i64::from(store.config.lane_tokens.max(1)).into(),
        ms(store.config.census_interval),
    ];
    let reply = match store.fcall(Func::LaneRequeue, &keys, args).await {
        Ok(reply) => reply::array(reply)?,
        Err(e) if Refusal::is(&e, Code::State).is_some() => {
            return Err(Error::NoDeadLetters(RequestId::from_key_id(key_id)?))
        }
        Err(e) => return Err(e),
    };
    Ok(reply.first().map(reply::int).transpose()?.unwrap_or(0).max(0) as u64)
}
