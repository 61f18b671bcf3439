//! Recovery's transitions (docs/protocol.md §5, "Recovery"): `claim_due` and `drop_gone` on a
//! home shard's index, `census`, `restore` and `reclaim` on a request's keys, `verify` on a
//! shard's token side.

use std::time::Duration;

use fred::types::Value;

use super::index::claim_arg;
use super::{ms, Func};
use crate::error::Result;
use crate::keys::group_of_queue;
use crate::reply;
use crate::request::Priority;
use crate::store::Store;

/// A request `claim_due` claimed, with the score its claim wrote (ms).
#[derive(Clone, Debug)]
pub(crate) struct Claimed {
    /// The request's key id.
    pub(crate) key_id: String,
    /// The claim's score, which recovery's re-arm compares.
    pub(crate) claim: i64,
}

/// What `claim_due` claimed.
#[derive(Clone, Debug, Default)]
pub(crate) struct Due {
    /// The requests whose look is due.
    pub(crate) requests: Vec<Claimed>,
    /// The upstreams whose release is due (docs/protocol.md §5, "Dependencies"): key ids.
    pub(crate) releases: Vec<String>,
    /// On shard 0, when asked for: the Redis time of the claim (ms) and the due schedules claimed.
    #[cfg_attr(not(feature = "schedules"), allow(dead_code))]
    pub(crate) schedules: Option<(i64, Vec<String>)>,
}

/// `claim_due` on `shard`: claims at most `limit` requests whose look is due, and as many releases
/// that are due, for `claim_for`; with `schedules` (shard 0 only), also the due schedules.
pub(crate) async fn claim_due(
    store: &Store,
    shard: u32,
    limit: i64,
    claim_for: Duration,
    schedules: bool,
) -> Result<Due> {
    let (active, armed) = (store.keys.active(shard), store.keys.armed(shard));
    let (releases, due) = (store.keys.releases(shard), store.keys.schedules_due());
    let mut keys: Vec<&str> = vec![&active, &armed, &releases];
    let schedules = schedules && shard == 0;
    if schedules {
        keys.push(&due);
    }
    let claimed = reply::array(store.fcall(Func::ClaimDue, &keys, vec![limit.into(), ms(claim_for)]).await?)?;
    // The requests' pairs, then '', the time, the releases (their count first) and the schedules.
    let split = claimed.iter().position(|v| v.as_str().is_some_and(|s| s.is_empty()));
    let (pairs, rest) = claimed.split_at(split.unwrap_or(claimed.len()));
    let requests = pairs
        .chunks(2)
        .filter_map(|p| match p {
            [kid, claim] => Some(Claimed { key_id: kid.as_string()?, claim: claim.as_i64()? }),
            _ => None,
        })
        .collect();
    let [_, now, count, rest @ ..] = rest else {
        return Ok(Due { requests, releases: Vec::new(), schedules: None });
    };
    let count = usize::try_from(reply::int(count)?).unwrap_or(0).min(rest.len());
    let (rels, names) = rest.split_at(count);
    let releases = rels.iter().map(reply::text).collect::<Result<Vec<String>>>()?;
    let schedules = if schedules {
        Some((reply::int(now)?, names.iter().map(reply::text).collect::<Result<Vec<String>>>()?))
    } else {
        None
    };
    Ok(Due { requests, releases, schedules })
}

/// `drop_gone`: drops request `key_id`'s entry from its home shard `home`'s index, once the
/// loading ttl has passed since it was registered (`claim`: the score recovery's claim wrote).
/// Returns whether it was dropped.
pub(crate) async fn drop_gone(store: &Store, key_id: &str, home: u32, claim: Option<i64>) -> Result<bool> {
    let (active, reg, marks, armed) = (
        store.keys.active(home),
        store.keys.registrations(home),
        store.keys.finish_marks(home, key_id),
        store.keys.armed(home),
    );
    let args: Vec<Value> =
        vec![key_id.into(), ms(store.config.loading_ttl), claim_arg(claim), ms(store.config.grace())];
    Ok(reply::int(&store.fcall(Func::DropGone, &[&active, &reg, &marks, &armed], args).await?)? == 1)
}

/// A request found terminal but still indexed (`{'finished', state, priority, shards, lifecycle,
/// sealed}` of `census` and `reclaim`): the steps after its finish are to be completed.
#[derive(Debug)]
pub(crate) struct Unfinished {
    /// The terminal state.
    pub(crate) state: String,
    /// Its priority.
    pub(crate) priority: Priority,
    /// The token shards it was submitted with.
    pub(crate) shards: u32,
    /// The lifecycle that finished.
    pub(crate) lifecycle: i64,
    /// Whether it is sealed already (only `unindex` is left).
    pub(crate) sealed: bool,
    /// Its tenant group, if any.
    pub(crate) group: Option<String>,
}

impl Unfinished {
    fn from_reply(mut items: impl Iterator<Item = Value>) -> Result<Unfinished> {
        let state = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
        let prio = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
        let shards = shards_of(items.next());
        let lifecycle = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
        let sealed = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0) == 1;
        let group = group_of(items.next())?;
        Ok(Unfinished { state, priority: priority_of(prio), shards, lifecycle, sealed, group })
    }
}

/// The token shards a reply names (absent from requests of older builds: 1).
fn shards_of(v: Option<Value>) -> u32 {
    v.and_then(|v| reply::int(&v).ok()).map_or(1, |s| s.clamp(1, 1024) as u32)
}

/// The tenant group a reply names ('' or absent: none).
pub(crate) fn group_of(v: Option<Value>) -> Result<Option<String>> {
    Ok(v.map(|v| reply::text(&v)).transpose()?.filter(|g| !g.is_empty()))
}

fn priority_of(prio: i64) -> Priority {
    Priority::new(prio as u8).unwrap_or_default()
}

/// A held token, as `census` lists it: `{k, epoch, holder}`.
#[derive(Clone, Debug)]
pub(crate) struct HeldToken {
    /// The token number.
    pub(crate) k: i64,
    /// Its epoch.
    pub(crate) epoch: String,
    /// The slot holding it (`<worker>/<slot>`).
    pub(crate) holder: String,
}

/// One chunk of a census of a live request (`{'ok', priority, shards, next, look, push, check,
/// held, group}`).
#[derive(Debug)]
pub(crate) struct CensusChunk {
    /// The request's priority.
    pub(crate) priority: Priority,
    /// Its token shards.
    pub(crate) shards: u32,
    /// The first token of the next chunk; `None` after the last.
    pub(crate) next: Option<i64>,
    /// In how many ms the request wants its next look, counting the chunks so far.
    pub(crate) look: i64,
    /// Elements of woken tokens, to push now.
    pub(crate) push: Vec<Value>,
    /// Elements queued longer than the grace, whose presence in their list is to be verified.
    pub(crate) check: Vec<Value>,
    /// Every held token in this chunk, for a check that its holder's worker lives. Malformed
    /// items are skipped.
    pub(crate) held: Vec<HeldToken>,
    /// Its tenant group, if any.
    pub(crate) group: Option<String>,
}

/// What `census` found.
#[derive(Debug)]
pub(crate) enum Census {
    /// `{'gone'}`: no such request (`drop_gone`).
    Gone,
    /// `{'loading'}`: its producer is writing it (or died doing so).
    Loading,
    /// `{'waiting', shards, look, ukid...}`: a downstream waiting for its upstreams; look again in
    /// `look` ms, and check that the upstreams listed (not ended, by its fields) still exist.
    Waiting {
        /// Its token shards.
        shards: u32,
        /// In how many ms to look again.
        look: i64,
        /// The key ids of its upstreams that have not ended.
        upstreams: Vec<String>,
    },
    /// `{'finished', ...}`: terminal, still indexed.
    Finished(Unfinished),
    /// `{'ok', ...}`: one chunk of tokens looked at.
    Chunk(CensusChunk),
    /// A reply this build does not know, by its tag.
    Unexpected(String),
}

/// `census` of request `key_id`, tokens `from` on, at most `chunk` of them; `look_so_far` is the
/// next look (ms) when nothing in this chunk is due sooner.
pub(crate) async fn census(
    store: &Store,
    key_id: &str,
    from: i64,
    chunk: i64,
    look_so_far: i64,
) -> Result<Census> {
    let keys = store.keys.request(key_id);
    let cfg = &store.config;
    let args: Vec<Value> = vec![
        key_id.into(),
        ms(cfg.grace()),
        ms(cfg.retention),
        store.keys.done_channel().into(),
        from.into(),
        chunk.into(),
        look_so_far.into(),
    ];
    let mut reply = reply::array(store.fcall(Func::Census, &keys.all(), args).await?)?.into_iter();
    let tag = reply.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    match tag.as_str() {
        "gone" => return Ok(Census::Gone),
        "loading" => return Ok(Census::Loading),
        "waiting" => {
            let shards = shards_of(reply.next());
            let look = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(1);
            let upstreams = reply.map(|v| reply::text(&v)).collect::<Result<Vec<String>>>()?;
            return Ok(Census::Waiting { shards, look, upstreams });
        }
        "finished" => return Ok(Census::Finished(Unfinished::from_reply(reply)?)),
        "ok" => {}
        _ => return Ok(Census::Unexpected(tag)),
    }
    let prio = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
    let shards = shards_of(reply.next());
    let next = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(-1);
    let look = reply.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(1);
    let push = reply::array(reply.next().unwrap_or(Value::Null))?;
    let check = reply::array(reply.next().unwrap_or(Value::Null))?;
    let mut held = Vec::new();
    for h in reply::array(reply.next().unwrap_or(Value::Null))? {
        if let [k, epoch, holder] = &reply::array(h)?[..] {
            held.push(HeldToken {
                k: reply::int(k)?,
                epoch: reply::text(epoch)?,
                holder: reply::text(holder)?,
            });
        }
    }
    let group = group_of(reply.next())?;
    Ok(Census::Chunk(CensusChunk {
        priority: priority_of(prio),
        shards,
        next: (next >= 0).then_some(next),
        look,
        push,
        check,
        held,
        group,
    }))
}

/// The home shard's part of a `verify`: it sets the request's next look.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rearm {
    /// The next look, in ms from now.
    pub(crate) look: i64,
    /// The score recovery's claim wrote, if it claimed the request.
    pub(crate) claim: Option<i64>,
}

/// `verify` on `shard`, for request `key_id` whose elements wait in `list` there: pushes `push`,
/// and returns which of `check` are missing from the list; on the home shard (`rearm`) also sets
/// the next look.
pub(crate) async fn verify(
    store: &Store,
    key_id: &str,
    shard: u32,
    list: &str,
    push: Vec<Value>,
    check: Vec<Value>,
    rearm: Option<Rearm>,
) -> Result<Vec<Value>> {
    let next = rearm.map_or(0, |r| r.look);
    let mut args: Vec<Value> =
        vec![key_id.into(), next.into(), ms(store.config.grace()), (push.len() as i64).into()];
    args.extend(push);
    args.extend(check);
    if let Some(r) = rearm {
        args.push(claim_arg(r.claim));
    }
    let (bell, active, armed) = (store.keys.bell(shard), store.keys.active(shard), store.keys.armed(shard));
    let keys: Vec<&str> =
        if rearm.is_some() { vec![list, &bell, &active, &armed] } else { vec![list, &bell] };
    reply::array(store.fcall(Func::Verify, &keys, args).await?)
}

/// `restore`: re-queues request `key_id`'s tokens whose elements (`missing`) verify found
/// missing, if still queued as checked. Returns the new elements, to push.
pub(crate) async fn restore(store: &Store, key_id: &str, missing: Vec<Value>) -> Result<Vec<Value>> {
    let mut args: Vec<Value> = vec![key_id.into()];
    args.extend(missing);
    reply::array(store.fcall(Func::Restore, &store.keys.request(key_id).all(), args).await?)
}

/// What `reclaim` answered.
#[derive(Debug)]
pub(crate) enum Reclaimed {
    /// `{'push', element, priority}`: push the element (`give_back`, which also ends the record)
    /// onto the list of `priority`, the request's priority now (`None` from an older library: the
    /// list it was taken from).
    Push(Vec<Value>, Option<Priority>),
    /// `{'finished', ...}`: the request is terminal; the steps after its finish may be left.
    Finished(Unfinished),
    /// `{'wake', in}`: the token is parked; recovery is to look when its retry falls due.
    Wake(Duration),
    /// `{'none'}` (or a reply this build does not know): nothing to do.
    Nothing,
}

/// `reclaim` of token `k` of request `key_id`, taken at `epoch` by `holder` from `list`: puts it
/// back in circulation if that slot left it out. A slot's own reclaim passes the `deadline` of its
/// arm. The tenant group of `list` (none for a shard's list) tells the function whether the request
/// under that id now is the one the token was taken for: an id is free again after a purge, and a
/// request of another group (or of none) is left alone.
pub(crate) async fn reclaim(
    store: &Store,
    key_id: &str,
    k: i64,
    epoch: &str,
    holder: &str,
    list: &str,
    deadline: Option<i64>,
) -> Result<Reclaimed> {
    let keys = store.keys.request(key_id);
    let group = group_of_queue(list).unwrap_or_default();
    let args: Vec<Value> = vec![
        key_id.into(),
        k.into(),
        epoch.into(),
        holder.into(),
        deadline.unwrap_or(0).into(),
        group.into(),
    ];
    let mut items = reply::array(store.fcall(Func::Reclaim, &keys.all(), args).await?)?.into_iter();
    Ok(match items.next().map(|v| reply::text(&v)).transpose()?.as_deref() {
        Some("push") => {
            let element: Vec<Value> = items.next().into_iter().collect();
            Reclaimed::Push(element, super::priority_item(items.next())?)
        }
        Some("finished") => Reclaimed::Finished(Unfinished::from_reply(items)?),
        Some("wake") => {
            let wake = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(1);
            Reclaimed::Wake(Duration::from_millis(wake.max(0) as u64))
        }
        _ => Reclaimed::Nothing,
    })
}
