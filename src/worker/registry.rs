//! The worker registry (shard 0): which workers are alive, by Redis's clock.
//!
//! A worker registers on its first beat and beats every `heartbeat` from a thread of its own
//! (`worker::liveness`); a registration not renewed within the lease has expired, and the next beat
//! of any worker claims the dead worker for reaping (`beat.lua`), after which recovery reclaims
//! the tokens its slots held (`recovery::reap`). A worker that finds its own registration gone
//! (it was cut off longer than the lease) takes a new id.

use std::time::Duration;

use fred::prelude::*;
use serde::{Deserialize, Serialize};

use crate::config::millis;
use crate::error::{Error, Result};
use crate::protocol::registry::{self as calls, BeatArgs};
use crate::store::Store;

/// A live worker, as it registered itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[non_exhaustive]
pub struct WorkerInfo {
    /// Its id (its stream consumer name).
    pub id: String,
    /// Its slots, the urgent one included (`WorkerBuilder::slots`, plus one with
    /// `WorkerBuilder::urgent`): their holder names are `<id>/0` to `<id>/<slots - 1>`, which a
    /// reaper looks at.
    pub slots: usize,
    /// Its process id.
    pub pid: u32,
    /// Its host name.
    pub host: String,
    /// When it started (ms since the Unix epoch).
    pub started_ms: u64,
    /// The token shards it serves (its slots' take records may be on any of them).
    #[serde(default = "one")]
    pub shards: u32,
    /// When its registration lapses unless it beats again (ms since the Unix epoch, Redis's
    /// clock): its last heartbeat plus its lease. Read from the registry by `Admin::workers` and
    /// `Admin::stats`; never written by a worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registration_expires_ms: Option<u64>,
    /// The sluicegate version it runs (absent for a worker that did not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// What it runs, as its owner described it ([`WorkerBuilder::label`](crate::WorkerBuilder::label)):
    /// `sluicegate worker --exec` puts its command line here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Its slots that hold a token now, from the shards' take records: read by `Admin::workers`
    /// only (empty elsewhere); never written by a worker.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub busy: Vec<SlotWork>,
}

/// What one worker slot holds now: a token of a request (or of a priority's lane), from its take
/// record (docs/protocol.md §3, `held`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SlotWork {
    /// The slot: `<worker id>/<slot>`.
    pub slot: String,
    /// The request whose token it holds; `None` for a lane's token (`lane` says which).
    pub request: Option<String>,
    /// For a lane's token, the lane's priority (the slot runs small requests of that priority).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<u8>,
    /// The token's number.
    pub token: u64,
    /// The token shard it was taken from.
    pub shard: u32,
}

impl SlotWork {
    /// Reads a take record: field `<holder>`, value `<kid>|<k>|<epoch>|<take id>|<list>`. `None` for
    /// a record a slot no longer knows about (`<holder>/lost/<take id>`) or a malformed one.
    pub(crate) fn from_record(shard: u32, holder: &str, record: &str) -> Option<Self> {
        if holder.contains("/lost/") {
            return None;
        }
        let mut fields = record.split('|');
        let key_id = fields.next()?;
        let token = fields.next()?.parse().ok()?;
        let (request, lane) = match crate::keys::lane_of(key_id) {
            Some((_, priority)) => (None, Some(priority.get())),
            None => (Some(crate::request::RequestId::from_key_id(key_id).ok()?.to_string()), None),
        };
        Some(Self { slot: holder.to_owned(), request, lane, token, shard })
    }
}

fn one() -> u32 {
    1
}

/// What a beat found.
pub(crate) struct Beat {
    /// False when this worker had been declared dead: it must take a new id.
    pub(crate) alive: bool,
    /// Dead workers this beat claimed for reaping, with what they registered.
    pub(crate) dead: Vec<(String, Option<WorkerInfo>)>,
}

/// Dead workers one beat claims at most.
const REAP_BATCH: i64 = 16;

/// One beat of worker `info.id`: renews (or, `first`, makes) its registration and claims dead
/// workers for reaping.
pub(crate) async fn beat(store: &Store, info: &WorkerInfo, first: bool) -> Result<Beat> {
    let json = serde_json::to_string(info).map_err(|e| Error::Codec(e.to_string()))?;
    let lease = store.config.lease;
    // A reaper that dies leaves its claim; another claims the worker again after a few leases.
    let claim = Duration::from_millis(millis(lease).saturating_mul(5));
    let args =
        BeatArgs { worker: &info.id, lease, description: &json, first, claim_at_most: REAP_BATCH, claim };
    let reply = calls::beat(store, args).await?;
    let dead = reply
        .dead
        .into_iter()
        .map(|(id, described)| (id, described.and_then(|j| serde_json::from_str(&j).ok())))
        .collect();
    Ok(Beat { alive: reply.alive, dead })
}

/// Takes a worker out of the registry: at its clean stop, or once recovery reaped it.
pub(crate) async fn leave(store: &Store, id: &str) -> Result<()> {
    calls::reaped(store, id).await
}

/// For each worker id, whether it is gone: neither registered (alive, or dead and waiting to be
/// claimed) nor being reaped. Recovery reclaims only a gone worker's tokens itself; the others' are
/// the reaper's (or their own).
pub(crate) async fn gone(store: &Store, ids: &[String]) -> Result<Vec<bool>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let (workers, reaping) = (store.keys.workers(), store.keys.reaping());
    let score = |key: String| {
        let ids = ids.to_vec();
        async move {
            let key2 = key.clone();
            store
                .call("zmscore", &key2, || {
                    let (key, ids) = (key.clone(), ids.clone());
                    async move {
                        let scores: Vec<Option<f64>> = store
                            .client
                            .custom(
                                fred::cmd!("ZMSCORE"),
                                std::iter::once(key).chain(ids).collect::<Vec<String>>(),
                            )
                            .await?;
                        Ok(scores)
                    }
                })
                .await
        }
    };
    let registered = score(workers).await?;
    let reaped = score(reaping).await?;
    Ok(registered.iter().zip(&reaped).map(|(r, p)| r.is_none() && p.is_none()).collect())
}

/// The registered workers whose registration has not expired, by Redis's clock.
pub(crate) async fn live(store: &Store) -> Result<Vec<WorkerInfo>> {
    let (workers, winfo) = (store.keys.workers(), store.keys.worker_info());
    // The registry's own master's clock, which wrote the expiries.
    let slot = fred::util::redis_keyslot(workers.as_bytes());
    let time = fred::cmd!("TIME", hash: fred::types::ClusterHash::Custom(slot));
    let (secs, micros): (u64, u64) = store.client.custom(time, Vec::<Value>::new()).await?;
    let now = (secs * 1000 + micros / 1000) as f64;
    let scored: Vec<(String, f64)> =
        store.client.zrangebyscore(workers.as_str(), now, f64::INFINITY, true, None).await?;
    if scored.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<&String> = scored.iter().map(|(id, _)| id).collect();
    let infos: Vec<Option<String>> = store.client.hmget(winfo.as_str(), ids).await?;
    // (Fields "<id>|lapsed" are not descriptions: never asked for here.)
    Ok(infos
        .into_iter()
        .zip(&scored)
        .filter_map(|(json, (_, expires))| {
            let mut info: WorkerInfo = serde_json::from_str(&json?).ok()?;
            info.registration_expires_ms = Some(*expires as u64);
            Some(info)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::SlotWork;

    #[test]
    fn a_take_record_says_what_a_slot_runs() {
        let work = SlotWork::from_record(1, "w-1/3", "import%2D7|2|17|t9|ns:{ns.q1}:p:50").unwrap();
        assert_eq!((work.slot.as_str(), work.token, work.shard, work.lane), ("w-1/3", 2, 1, None));
        assert!(work.request.is_some());
        let lane = SlotWork::from_record(0, "w-1/0", "~0.70|5|3|t1|ns:{ns.q0}:p:70").unwrap();
        assert_eq!((lane.request, lane.lane), (None, Some(70)));
        assert_eq!(SlotWork::from_record(0, "w-1/0/lost/t1", "~0.70|5|3|t1|x"), None);
        assert_eq!(SlotWork::from_record(0, "w-1/0", "garbage"), None);
    }
}
