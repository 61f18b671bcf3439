//! Dependencies between requests (docs/protocol.md §5, "Dependencies"): `dag_link` on an
//! upstream's home shard while a downstream is being submitted, `dag_settle` on a downstream when
//! an upstream's lifecycle has ended, `rel_done` once an upstream's release reached every
//! downstream; and the plain reads a release makes on the upstream's home shard.

use fred::prelude::*;

use super::{ms, Finished, Func};
use crate::error::Result;
use crate::reply;
use crate::request::Priority;
use crate::store::Store;

/// Where an upstream stands, as `dag_link` (or a read of its home shard) finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Link {
    /// It has not ended: its finish will release the downstream. `lifecycle`: a lane request's
    /// (the record's); `None` for a request of its own stream (its meta says).
    Live { lifecycle: Option<i64> },
    /// Its latest lifecycle ended, in `state`.
    Ended(Ended),
    /// No such request (never created, or gone with its retention).
    Unknown,
}

/// An upstream's lifecycle that ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ended {
    /// Its lifecycle (created ms * 1000 + gen).
    pub(crate) lifecycle: i64,
    /// Its terminal state: completed, failed or cancelled (or `gone`, for one that vanished).
    pub(crate) state: String,
}

/// `dag_link`: downstream `entry` (`<dkid>|<its token shards>`) joins upstream `ukid`'s
/// downstreams, on the upstream's home shard `home`. `lifecycle`: the upstream's as its meta hash
/// said just before (a request of its own stream), so that marks an earlier request of the id left
/// are not taken for its end.
pub(crate) async fn link(
    store: &Store,
    home: u32,
    ukid: &str,
    entry: &str,
    lifecycle: Option<i64>,
) -> Result<Link> {
    let keys = [
        store.keys.downstreams(home, ukid),
        store.keys.finish_marks(home, ukid),
        store.keys.record(home, ukid),
        store.keys.active(home),
        store.keys.releases(home),
    ];
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let args: Vec<Value> = vec![
        ukid.into(),
        entry.into(),
        ms(store.config.retention),
        lifecycle.map_or_else(String::new, |lc| lc.to_string()).into(),
    ];
    let mut items = reply::array(store.fcall(Func::DagLink, &keys, args).await?)?.into_iter();
    let tag = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    let lifecycle = items.next().and_then(|v| reply::int(&v).ok());
    Ok(match (tag.as_str(), lifecycle) {
        ("live", lifecycle) => Link::Live { lifecycle },
        ("done", Some(lifecycle)) => {
            let state = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
            Link::Ended(Ended { lifecycle, state })
        }
        _ => Link::Unknown,
    })
}

/// What `dag_settle` asks of its caller.
#[derive(Debug)]
pub(crate) enum Settled {
    /// The downstream's gate opened: push these elements of its woken tokens.
    Open { priority: Priority, shards: u32, group: Option<String>, elements: Vec<Value> },
    /// It failed because of an upstream (now, or before with its finish steps maybe undone):
    /// complete the steps after its finish.
    Finished(Finished),
    /// It failed because of an upstream and its gate is open again: requeue it (it reopens).
    Reopen,
    /// Nothing to do.
    Recorded,
    /// It is no downstream of this upstream.
    NotLinked,
}

/// `dag_settle`: tells downstream `dkid` that lifecycle `ended` of upstream `ukid` has ended.
/// `deadline`: the caller's arm's (see `shards::armed`).
pub(crate) async fn settle(
    store: &Store,
    dkid: &str,
    ukid: &str,
    ended: &Ended,
    deadline: i64,
) -> Result<Settled> {
    let keys = store.keys.request(dkid);
    let args: Vec<Value> = vec![
        dkid.into(),
        ukid.into(),
        ended.lifecycle.into(),
        ended.state.as_str().into(),
        ms(store.config.retention),
        store.keys.done_channel().into(),
        deadline.into(),
    ];
    let mut items = reply::array(store.fcall(Func::DagSettle, &keys.all(), args).await?)?.into_iter();
    let tag = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    Ok(match tag.as_str() {
        "open" => {
            let priority = super::priority_item(items.next())?.unwrap_or_default();
            let shards =
                items.next().and_then(|v| reply::int(&v).ok()).map_or(1, |s| s.clamp(1, 1024) as u32);
            let group = super::recovery::group_of(items.next())?;
            Settled::Open { priority, shards, group, elements: items.collect() }
        }
        "finished" => Settled::Finished(Finished::from_reply(items)?),
        "reopen" => Settled::Reopen,
        "none" => Settled::NotLinked,
        _ => Settled::Recorded,
    })
}

/// `rel_done`: the release of upstream `ukid`'s lifecycle `lifecycle` reached every downstream
/// (`None`: the release found it running again, nothing to release); returns whether it left the
/// outbox of its home shard `home` (false: a later finish owes another).
pub(crate) async fn rel_done(store: &Store, home: u32, ukid: &str, lifecycle: Option<i64>) -> Result<bool> {
    let keys = [
        store.keys.releases(home),
        store.keys.finish_marks(home, ukid),
        store.keys.record(home, ukid),
        store.keys.downstreams(home, ukid),
    ];
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let lifecycle: Value = lifecycle.map_or_else(|| "".into(), Value::from);
    let args: Vec<Value> = vec![ukid.into(), lifecycle, ms(store.config.retention)];
    Ok(reply::int(&store.fcall(Func::RelDone, &keys, args).await?)? == 1)
}

/// Where upstream `ukid`, homed on `home`, stands, read from its home shard: its lane record, or
/// its finish marks and index entry (a read of what `dag_link` reads, writing nothing).
pub(crate) async fn ended(store: &Store, home: u32, ukid: &str) -> Result<Link> {
    let record = store.keys.record(home, ukid);
    let lane: (Option<String>, Option<i64>) = store
        .call("hmget", &record, || async {
            Ok(store.client.hmget(record.as_str(), vec!["state", "lc"]).await?)
        })
        .await?;
    if let (Some(state), Some(lifecycle)) = lane {
        return Ok(if matches!(state.as_str(), "queued" | "running") {
            Link::Live { lifecycle: Some(lifecycle) }
        } else {
            Link::Ended(Ended { lifecycle, state })
        });
    }
    let marks = store.keys.finish_marks(home, ukid);
    let (e, s, o): (Option<i64>, Option<String>, Option<i64>) = store
        .call("hmget", &marks, || async {
            Ok(store.client.hmget(marks.as_str(), vec!["e", "s", "o"]).await?)
        })
        .await?;
    if let Some(lifecycle) = e.filter(|e| o.map_or(true, |o| o <= *e)) {
        return Ok(Link::Ended(Ended { lifecycle, state: s.unwrap_or_else(|| "completed".into()) }));
    }
    let active = store.keys.active(home);
    let indexed: Option<f64> = store
        .call("zscore", &active, || async { Ok(store.client.zscore(active.as_str(), ukid).await?) })
        .await?;
    Ok(if indexed.is_some() { Link::Live { lifecycle: None } } else { Link::Unknown })
}

/// A page of upstream `ukid`'s downstreams (`SSCAN` of its set on its home shard `home`, from
/// `cursor`): the next cursor ("0" after the last page) and the entries `<dkid>|<shards>`.
pub(crate) async fn downstreams_page(
    store: &Store,
    home: u32,
    ukid: &str,
    cursor: &str,
) -> Result<(String, Vec<String>)> {
    let set = store.keys.downstreams(home, ukid);
    store
        .call("sscan", &set, || async {
            let args: Vec<Value> = vec![set.as_str().into(), cursor.into(), "COUNT".into(), 100.into()];
            let cmd =
                fred::types::CustomCommand::new_static("SSCAN", fred::types::ClusterHash::FirstKey, false);
            let (next, entries): (String, Vec<String>) = store.client.custom(cmd, args).await?;
            Ok((next, entries))
        })
        .await
}
