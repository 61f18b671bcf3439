//! Lanes (docs/protocol.md §5, "Lanes"): a small request given whole goes, in one call, into the
//! lane of its priority on its home shard, a long-lived stream shared by many small requests, with
//! one record hash per request. `lane_submit`, `lane_cancel` and `lane_requeue` here; a lane
//! token is taken like any (`take`) and run with `lane_acquire` and `lane_ack` (`tokens`).

use std::collections::HashMap;

use fred::prelude::*;
use fred::types::Value;

use super::listing::{Kind, Row};
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
        store.keys.held(shard),
        store.keys.armed(shard),
        store.keys.offers(shard),
    ]);
    let mut args: Vec<Value> = vec![
        lane.into(),
        req.key_id.into(),
        req.id.as_str().into(),
        req.nonce.into(),
        i64::from(req.priority.get()).into(),
    ];
    args.extend(settings(req));
    args.extend([
        i64::from(store.config.lane_tokens).into(),
        ms(store.config.census_interval),
        row(req).into(),
        req.trace.into(),
    ]);
    args.extend(parts);
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let reply =
        store.fcall(Func::LaneSubmit, &keys, args).await.map_err(|e| super::submit::created(req.id, e))?;
    let reply = reply::array(reply)?;
    Ok(reply.first().map(reply::text).transpose()?.unwrap_or_default())
}

/// `lane_submit_many`: whole small requests of one `priority` and one home `shard` (each
/// request's `shards` give it), each with its encoded parts, in one call. Returns, per request in
/// order, its lifecycle or why it was refused (its id in use); `Err` when the call failed, or
/// refused them all (an argument out of range).
pub(crate) async fn submit_many(
    store: &Store,
    shard: u32,
    priority: Priority,
    requests: Vec<(&NewRequest<'_>, Vec<Value>)>,
) -> Result<Vec<Result<String>>> {
    let lane = lane_key_id(shard, priority);
    let mut keys: Vec<String> = store.keys.request(&lane).all().iter().map(|k| (*k).to_owned()).collect();
    keys.extend([
        store.keys.token_list(shard, priority),
        store.keys.bell(shard),
        store.keys.active(shard),
        store.keys.registrations(shard),
    ]);
    let mut args: Vec<Value> = vec![
        lane.into(),
        i64::from(priority.get()).into(),
        i64::from(store.config.lane_tokens).into(),
        ms(store.config.census_interval),
    ];
    let ids: Vec<RequestId> = requests.iter().map(|(req, _)| req.id.clone()).collect();
    for (req, parts) in requests {
        debug_assert_eq!((home_shard(req.key_id, req.shards), req.priority), (shard, priority));
        keys.push(store.keys.record(shard, req.key_id));
        keys.push(store.keys.finish_marks(shard, req.key_id));
        args.extend([req.key_id.into(), req.id.as_str().into(), req.nonce.into()]);
        args.extend(settings(req));
        args.extend([row(req).into(), req.trace.into(), (parts.len() as i64).into()]);
        args.extend(parts);
    }
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let reply = store.fcall(Func::LaneSubmitMany, &keys, args).await.map_err(|e| match ids.first() {
        // Refused as a whole: an argument out of range (the same words for every request).
        Some(id) => super::submit::created(id, e),
        None => e,
    })?;
    let items = reply::array(reply)?;
    if items.len() != ids.len() {
        return Err(Error::Protocol(format!(
            "lane_submit_many answered {} items for {} requests",
            items.len(),
            ids.len()
        )));
    }
    items
        .iter()
        .zip(ids)
        .map(|(item, id)| {
            let text = reply::text(item)?;
            Ok(match Refusal::parse(&text) {
                Some(r) if r.code == Code::Duplicate => Err(Error::DuplicateRequestId(id)),
                Some(_) => Err(Error::Protocol(format!("lane_submit_many refused request \"{id}\": {text}"))),
                None => Ok(text),
            })
        })
        .collect()
}

/// A request's settings as both lane submit functions take them, in this order: limit, max
/// attempts, timeout ms, backoff base ms, backoff cap ms, flags (fail fast, results discarded:
/// `NewRequest::flags`).
fn settings(req: &NewRequest<'_>) -> [Value; 6] {
    [
        i64::from(req.concurrency.get()).into(),
        i64::from(req.max_attempts).into(),
        ms(req.timeout.unwrap_or_default()),
        ms(req.backoff_base),
        ms(req.backoff_max),
        req.flags().into(),
    ]
}

/// A request's row in the listing index as the lane functions take it ('' when unlisted).
fn row(req: &NewRequest<'_>) -> String {
    if req.listed {
        Row::encode(Kind::Lane, req.priority, req.concurrency, req.tags)
    } else {
        String::new()
    }
}

/// What `lane_cancel` answered.
#[derive(Debug)]
pub(crate) enum LaneCancelled {
    /// It is cancelled now; `release_owed`: it has downstreams, whose release is the caller's to run.
    Now { release_owed: bool },
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
        "finished" => {
            let release_owed = items.nth(2).is_some_and(|v| v.as_str().as_deref() == Some("rel"));
            LaneCancelled::Now { release_owed }
        }
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

/// A lane request's settings as its record stores them (`pol`, prelude.lua "Lanes"):
/// "[f]<priority>,<limit>,<parts>,<max attempts>,<timeout ms>,<backoff base ms>,<backoff cap ms>",
/// "f" for fail fast, trailing fields at their defaults (1, 0, 1000, 60000) left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Settings {
    /// Priority, limit, parts, max attempts, timeout ms, backoff base ms, backoff cap ms.
    pub(crate) values: [u64; 7],
    pub(crate) fail_fast: bool,
}

impl Settings {
    const NAMES: [&'static str; 7] = ["prio", "limit", "total", "maxatt", "timeout", "bbase", "bmax"];
    const DEFAULTS: [u64; 4] = [1, 0, 1000, 60_000];

    pub(crate) fn parse(pol: &str) -> Result<Self> {
        let bad = || Error::Protocol(format!("a lane request's settings are malformed: {pol:?}"));
        let (fail_fast, rest) = match pol.strip_prefix('f') {
            Some(rest) => (true, rest),
            None => (false, pol),
        };
        let given: Vec<u64> = rest.split(',').map(str::parse).collect::<Result<_, _>>().map_err(|_| bad())?;
        if !(3..=7).contains(&given.len()) {
            return Err(bad());
        }
        let mut values = [0; 7];
        for (i, v) in values.iter_mut().enumerate() {
            *v = given.get(i).copied().unwrap_or_else(|| Self::DEFAULTS[i - 3]);
        }
        Ok(Self { values, fail_fast })
    }
}

/// The scalar fields of a lane request's record (prelude.lua, "Lanes") under the names a request's
/// meta hash gives them (`state`, `prio`, `limit`, `total`, `left`, `failed`, `created`, `gen`,
/// `started`, `finished`, `retried`, `maxseen`, ...), so that status and the checker read both
/// alike. The record packs its settings into `pol` and its creation time into `lc`;
/// its per-part fields (`o<i>`, `e<i>`, `x<i>`, `w<i>`) are left out.
pub(crate) fn record_meta(record: &HashMap<String, Vec<u8>>) -> HashMap<String, String> {
    let per_part = |k: &str| {
        k.len() > 1 && matches!(&k[..1], "o" | "e" | "x" | "w") && k[1..].bytes().all(|b| b.is_ascii_digit())
    };
    let mut meta: HashMap<String, String> = record
        .iter()
        .filter(|(k, _)| !per_part(k))
        .map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned()))
        .collect();
    if let Some(settings) = meta.remove("pol").and_then(|pol| Settings::parse(&pol).ok()) {
        for (name, value) in Settings::NAMES.iter().zip(settings.values) {
            meta.insert((*name).to_owned(), value.to_string());
        }
        meta.insert("failfast".into(), u8::from(settings.fail_fast).to_string());
    }
    // A discarding record counts its discarded results in `discard`, as a meta hash does in
    // `discarded` beside its flag.
    if let Some(n) = meta.remove("discard") {
        meta.insert("discard".into(), "1".into());
        meta.insert("discarded".into(), n);
    }
    // Its lifecycle is its created ms * 1000 plus less than 1000; how many requeues reopened it is
    // its own field `gen` (prelude.lua, sg_lane_clock).
    if let Some(lc) = meta.get("lc").and_then(|v| v.parse::<u64>().ok()) {
        meta.insert("created".into(), (lc / 1000).to_string());
    }
    meta.entry("gen".into()).or_insert_with(|| "0".into());
    meta.entry("failed".into()).or_insert_with(|| "0".into());
    meta
}

/// The running marks of lane requests of one part handed out without their records (their
/// records say `queued` until their batch's ack; docs/protocol.md §5, "Lanes"): for each of
/// `records` (shard, key id, the record as [`record_meta`] reads it) whose state is `queued`, the
/// ms its part was handed out at, if a token of its lane names it and its lifecycle in its marks
/// (`m<k>` = `<ms>|<kid>|<lc>,<kid>|<lc>,...` in the lane's meta). A request so marked reads `running` since then:
/// [`mark_running`]. One read of each lane's meta.
pub(crate) async fn running_marks(
    store: &Store,
    records: &[(u32, &str, &HashMap<String, String>)],
) -> Result<Vec<Option<String>>> {
    let mut out = vec![None; records.len()];
    let mut lanes: HashMap<String, HashMap<String, String>> = HashMap::new();
    for (i, (shard, key_id, meta)) in records.iter().enumerate() {
        if meta.get("state").map(String::as_str) != Some("queued") {
            continue;
        }
        let prio = meta.get("prio").map_or("", String::as_str);
        let lane = format!("{}{prio}", store.keys.lane_prefix(*shard));
        if !lanes.contains_key(&lane) {
            let fields: HashMap<String, String> = store.client.hgetall(lane.as_str()).await?;
            lanes.insert(lane.clone(), marks_of(&fields));
        }
        let lc = meta.get("lc").map_or("", String::as_str);
        out[i] = lanes[&lane].get(&format!("{key_id}|{lc}")).cloned();
    }
    Ok(out)
}

/// The running marks a lane's meta holds (its fields `m<k>`), by `<kid>|<lc>`: the hand-out ms.
pub(crate) fn marks_of(lane_meta: &HashMap<String, String>) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for (field, value) in lane_meta {
        let is_mark =
            field.len() > 1 && field.starts_with('m') && field[1..].bytes().all(|b| b.is_ascii_digit());
        if let (true, Some((since, kids))) = (is_mark, value.split_once('|')) {
            for kid in kids.split(',').filter(|k| !k.is_empty()) {
                out.insert(kid.to_owned(), since.to_owned());
            }
        }
    }
    out
}

/// A lane record read by [`record_meta`] with its running mark ([`running_marks`]): `running`
/// since the mark's ms.
pub(crate) fn mark_running(meta: &mut HashMap<String, String>, since: Option<String>) {
    if let Some(since) = since {
        meta.insert("state".into(), "running".into());
        meta.insert("started".into(), since);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lean_record_reads_as_a_meta_hash() {
        let record: HashMap<String, Vec<u8>> = [
            ("state", "running"),
            ("lc", "1795571926989213"),
            ("gen", "2"),
            ("pol", "f50,4,10,3"),
            ("left", "7"),
            ("o0", "x"),
            ("w9", "y"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.as_bytes().to_vec()))
        .collect();
        let meta = record_meta(&record);
        let get = |k: &str| meta.get(k).map(String::as_str);
        assert_eq!(get("prio"), Some("50"));
        assert_eq!(get("limit"), Some("4"));
        assert_eq!(get("total"), Some("10"));
        assert_eq!(get("failfast"), Some("1"));
        assert_eq!(get("maxatt"), Some("3"));
        assert_eq!(get("bmax"), Some("60000"));
        assert_eq!(get("created"), Some("1795571926989"));
        assert_eq!(get("gen"), Some("2"));
        assert_eq!(get("failed"), Some("0"));
        assert_eq!(get("left"), Some("7"));
        assert_eq!(get("o0"), None);
        assert_eq!(get("w9"), None);
        assert_eq!((get("discard"), get("discarded")), (None, None));
    }

    #[test]
    fn a_discarding_record_reads_as_a_meta_hash_that_discards() {
        let record: HashMap<String, Vec<u8>> = [("state", "completed"), ("pol", "50,4,5"), ("discard", "4")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.as_bytes().to_vec()))
            .collect();
        let meta = record_meta(&record);
        let get = |k: &str| meta.get(k).map(String::as_str);
        assert_eq!((get("discard"), get("discarded"), get("total")), (Some("1"), Some("4"), Some("5")));
    }

    #[test]
    fn settings_fill_in_their_defaults_and_refuse_what_is_malformed() {
        let s = Settings::parse("50,1,1").unwrap();
        assert_eq!(s.values, [50, 1, 1, 1, 0, 1000, 60_000]);
        assert!(!s.fail_fast);
        let s = Settings::parse("f9,2,3,4,5,6,7").unwrap();
        assert_eq!(s.values, [9, 2, 3, 4, 5, 6, 7]);
        assert!(s.fail_fast);
        for bad in ["", "50,1", "50,x,1", "50,1,1,1,0,1000,60000,0", "g50,1,1"] {
            assert!(Settings::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
