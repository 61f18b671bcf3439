//! Listing requests (`Admin::list`), tracking them, and purging finished ones (`Admin::purge`,
//! `Admin::purge_finished`), over the listing index each home shard keeps (docs/protocol.md,
//! "The listing index").

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use fred::prelude::*;
use serde::Serialize;

use super::Admin;
use crate::config::millis;
use crate::error::{Error, Result};
use crate::keys::home_shard;
use crate::protocol::lane::record_meta;
use crate::protocol::listing::{self, Kind, ListArgs, Listed, Position};
use crate::request::{Priority, RequestId, RequestState};

/// Rows a page holds at most.
pub const MAX_LIST_LIMIT: u32 = 1000;

/// Index entries one [`Admin::list`] call looks at, at most, before it returns what it found
/// with a cursor (a filter that few requests pass would otherwise read the whole index).
pub const MAX_LIST_LOOK: u64 = 10_000;

/// The state [`Admin::list`] filters on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ListState {
    /// Accepted and waiting for a worker.
    Queued,
    /// At least one sub-request has started.
    Running,
    /// Waiting for its scheduled time.
    Scheduled,
    /// Waiting for the requests it was submitted after.
    Waiting,
    /// Streamed and not finalized yet (queued or running).
    Open,
    /// Every sub-request succeeded.
    Completed,
    /// Ended with at least one dead letter.
    Failed,
    /// Cancelled.
    Cancelled,
}

impl ListState {
    /// The index set it lives in.
    fn set(self) -> &'static str {
        match self {
            Self::Queued | Self::Running | Self::Scheduled | Self::Waiting | Self::Open => "live",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// Whether a request in `state` (open or not) is in this state.
    fn holds(self, state: RequestState, open: bool) -> bool {
        match self {
            Self::Queued => state == RequestState::Queued,
            Self::Running => state == RequestState::Running,
            Self::Scheduled => state == RequestState::Scheduled,
            Self::Waiting => state == RequestState::Waiting,
            Self::Open => open && !state.is_terminal(),
            Self::Completed => state == RequestState::Completed,
            Self::Failed => state == RequestState::Failed,
            Self::Cancelled => state == RequestState::Cancelled,
        }
    }

    const NAMES: [(&'static str, ListState); 8] = [
        ("queued", Self::Queued),
        ("running", Self::Running),
        ("scheduled", Self::Scheduled),
        ("waiting", Self::Waiting),
        ("open", Self::Open),
        ("completed", Self::Completed),
        ("failed", Self::Failed),
        ("cancelled", Self::Cancelled),
    ];
}

impl FromStr for ListState {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::NAMES.iter().find(|(n, _)| *n == s).map(|(_, st)| *st).ok_or_else(|| {
            Error::InvalidRequest(format!(
                "unknown state {s:?}: one of queued, running, scheduled, waiting, open, completed, failed, cancelled"
            ))
        })
    }
}

impl fmt::Display for ListState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = Self::NAMES.iter().find(|(_, st)| st == self).map_or("?", |(n, _)| n);
        f.write_str(name)
    }
}

/// Which requests [`Admin::list`] returns; every filter is optional.
///
/// ```
/// use std::time::Duration;
/// use sluicegate::{ListQuery, ListState};
/// let q = ListQuery::new().state(ListState::Failed).tag("customer:42").older_than(Duration::from_secs(3600));
/// assert_eq!(q.limit, 100);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ListQuery {
    /// Only requests in this state.
    pub state: Option<ListState>,
    /// Only requests of this priority.
    pub priority: Option<Priority>,
    /// Only requests carrying this tag.
    pub tag: Option<String>,
    /// Only tracked requests ([`Admin::track`]).
    pub tracked: bool,
    /// Only requests submitted at least this long ago.
    pub older_than: Option<Duration>,
    /// Rows per page (1 to [`MAX_LIST_LIMIT`]; default 100).
    pub limit: u32,
    /// Where to go on: a previous page's [`ListPage::cursor`].
    pub cursor: Option<String>,
}

impl Default for ListQuery {
    fn default() -> Self {
        Self {
            state: None,
            priority: None,
            tag: None,
            tracked: false,
            older_than: None,
            limit: 100,
            cursor: None,
        }
    }
}

impl ListQuery {
    /// Every request, newest first, 100 a page.
    pub fn new() -> Self {
        Self::default()
    }
    /// Only requests in `state`.
    pub fn state(mut self, state: ListState) -> Self {
        self.state = Some(state);
        self
    }
    /// Only requests of `priority`.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }
    /// Only requests carrying `tag`.
    pub fn tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = Some(tag.into());
        self
    }
    /// Only tracked requests.
    pub fn tracked(mut self) -> Self {
        self.tracked = true;
        self
    }
    /// Only requests submitted at least `age` ago.
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }
    /// Rows per page.
    pub fn limit(mut self, n: u32) -> Self {
        self.limit = n;
        self
    }
    /// Goes on from a previous page.
    pub fn cursor(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = Some(cursor.into());
        self
    }
}

/// One request in a [`ListPage`].
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct ListedRequest {
    /// Its id.
    pub id: String,
    /// Its state, read from the request itself.
    pub state: RequestState,
    /// Streamed and not finalized.
    pub open: bool,
    /// Its priority.
    pub priority: u8,
    /// Its concurrency limit.
    pub concurrency: u32,
    /// Sub-requests in all (so far, for an open one).
    pub total: u64,
    /// Sub-requests ended (done or dead).
    pub done: u64,
    /// Sub-requests dead-lettered.
    pub failed: u64,
    /// When it was submitted (Redis time, ms since the epoch).
    pub submitted_ms: i64,
    /// Its tags.
    pub tags: Vec<String>,
    /// Tracked ([`Admin::track`]).
    pub tracked: bool,
}

/// A page of [`Admin::list`].
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct ListPage {
    /// The requests, newest first.
    pub requests: Vec<ListedRequest>,
    /// Pass it as [`ListQuery::cursor`] for the next page; `None` when there is no more.
    pub cursor: Option<String>,
    /// Index entries looked at to fill the page.
    pub looked_at: u64,
}

/// One shard's place in a walk: where to resume, or done.
#[derive(Clone, Debug, PartialEq)]
enum ShardCursor {
    Start,
    At(Position),
    Done,
}

fn encode_cursor(shards: &[ShardCursor]) -> Option<String> {
    if shards.iter().all(|c| *c == ShardCursor::Done) {
        return None;
    }
    let parts: Vec<String> = shards
        .iter()
        .map(|c| match c {
            ShardCursor::Start => "+".to_owned(),
            ShardCursor::At(p) => format!("{}.{}", p.score as i64, p.passed),
            ShardCursor::Done => "-".to_owned(),
        })
        .collect();
    Some(format!("l1:{}", parts.join(",")))
}

fn decode_cursor(cursor: &str, shards: u32) -> Result<Vec<ShardCursor>> {
    let bad = || {
        Error::InvalidCursor(format!(
            "{cursor:?} is not a list cursor of this namespace's {shards} shard(s): pass a cursor a page gave"
        ))
    };
    let parts: Vec<&str> = cursor.strip_prefix("l1:").ok_or_else(bad)?.split(',').collect();
    if parts.len() != shards as usize {
        return Err(bad());
    }
    parts
        .into_iter()
        .map(|p| match p {
            "+" => Ok(ShardCursor::Start),
            "-" => Ok(ShardCursor::Done),
            _ => {
                let (score, passed) = p.split_once('.').ok_or_else(bad)?;
                let score: i64 = score.parse().map_err(|_| bad())?;
                let passed: u64 = passed.parse().map_err(|_| bad())?;
                Ok(ShardCursor::At(Position { score: score as f64, passed }))
            }
        })
        .collect()
}

impl Admin {
    /// Requests newest first, filtered by state, priority, tag, tracking and age, a page at a
    /// time, from the listing index of each home shard: a page of 100 of a million requests is
    /// one call per shard (O(log n + 100)) and one pipelined read of the rows' counters. Finished
    /// requests stay listed for their retention. A filter few requests pass looks at up to
    /// [`MAX_LIST_LOOK`] entries and returns what it found with a cursor to go on.
    ///
    /// Queued, running, scheduled, waiting and open requests share the index's `live` set and are told
    /// apart by the request's own state, so those filters look at the live requests in turn.
    pub async fn list(&self, query: &ListQuery) -> Result<ListPage> {
        if query.limit == 0 || query.limit > MAX_LIST_LIMIT {
            return Err(Error::InvalidRequest(format!("a page holds 1 to {MAX_LIST_LIMIT} requests")));
        }
        if let Some(tag) = &query.tag {
            crate::request::check_tag(tag)?;
        }
        let shards = self.store.keys.shards();
        let mut cursors = match &query.cursor {
            Some(c) => decode_cursor(c, shards)?,
            None => vec![ShardCursor::Start; shards as usize],
        };
        let states: Vec<&'static str> = match query.state {
            Some(s) => vec![s.set()],
            None => Vec::new(),
        };
        let walk: Vec<String> = if let Some(tag) = &query.tag {
            vec![format!("t:{tag}")]
        } else if query.tracked {
            vec!["tracked".into()]
        } else if states.is_empty() {
            ["live", "completed", "failed", "cancelled"].iter().map(|s| (*s).to_owned()).collect()
        } else {
            states.iter().map(|s| (*s).to_owned()).collect()
        };
        // A live state is told apart after reading the request: look further for each page.
        let post_filter = query.state.filter(|s| s.set() == "live");
        let budget = if post_filter.is_some() || query.priority.is_some() || query.tag.is_some() {
            (query.limit * 4).clamp(1000, 5000)
        } else {
            query.limit
        };
        let mut page: Vec<ListedRequest> = Vec::new();
        let mut looked = 0u64;
        while (page.len() as u32) < query.limit && looked < MAX_LIST_LOOK {
            let need = query.limit - page.len() as u32;
            let mut found: Vec<(u32, Listed)> = Vec::new();
            let mut ends: Vec<Option<Option<Position>>> = vec![None; shards as usize];
            for shard in 0..shards {
                let from = match &cursors[shard as usize] {
                    ShardCursor::Done => continue,
                    ShardCursor::Start => None,
                    ShardCursor::At(p) => Some(p),
                };
                let args = ListArgs {
                    walk: walk.clone(),
                    states: states.clone(),
                    from,
                    older_than_ms: query.older_than.map(millis),
                    limit: need,
                    budget: budget.max(need),
                    priority: query.priority,
                    // A tag is walked (its own set), never filtered for.
                    tag: None,
                    tracked: query.tracked,
                };
                let reply = listing::list(&self.store, shard, &args).await?;
                looked += reply.looked;
                ends[shard as usize] = Some(reply.next);
                found.extend(reply.rows.into_iter().map(|r| (shard, r)));
            }
            if ends.iter().all(Option::is_none) {
                break;
            }
            // Newest first over the shards; take what the page needs, and each shard resumes
            // right after the last row taken from it (or where its walk stopped, if all were).
            found.sort_by(|(_, a), (_, b)| {
                b.submitted_ms.cmp(&a.submitted_ms).then_with(|| b.key_id.cmp(&a.key_id))
            });
            let taken: Vec<(u32, Listed)> = found.iter().take(need as usize).cloned().collect();
            for shard in 0..shards {
                let Some(end) = ends[shard as usize].clone() else { continue };
                let returned = found.iter().filter(|(s, _)| *s == shard).count();
                let mine: Vec<&Listed> = taken.iter().filter(|(s, _)| *s == shard).map(|(_, r)| r).collect();
                cursors[shard as usize] = if mine.len() < returned {
                    match mine.last() {
                        Some(last) => ShardCursor::At(last.after.clone()),
                        None => cursors[shard as usize].clone(),
                    }
                } else {
                    end.map_or(ShardCursor::Done, ShardCursor::At)
                };
            }
            let rows = self.read_rows(taken.into_iter().map(|(_, r)| r).collect()).await?;
            page.extend(rows.into_iter().filter(|r| post_filter.map_or(true, |s| s.holds(r.state, r.open))));
            if cursors.iter().all(|c| *c == ShardCursor::Done) {
                break;
            }
        }
        Ok(ListPage { requests: page, cursor: encode_cursor(&cursors), looked_at: looked })
    }

    /// The counters of listed rows, read from each request's own keys in one pipeline. A row
    /// whose request is gone (expired, purged, or never created) is left out.
    async fn read_rows(&self, rows: Vec<Listed>) -> Result<Vec<ListedRequest>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let client = &self.store.client;
        let pipe = client.pipeline();
        for r in &rows {
            match r.row.kind {
                Kind::Own => {
                    let meta = self.store.keys.request(&r.key_id).meta;
                    pipe.hmget::<(), _, _>(meta, vec!["state", "total", "left", "failed", "open", "why"])
                        .await?;
                }
                Kind::Lane => {
                    // Where it was listed, not where this admin's shard count would put it: the
                    // two differ while a change of `token_shards` rolls out.
                    let record = self.store.keys.record(r.shard, &r.key_id);
                    pipe.hmget::<(), _, _>(record, vec!["state", "left", "failed", "pol", "lc"]).await?;
                }
            }
        }
        let replies: Vec<Value> = pipe.all().await?;
        let mut read = Vec::with_capacity(rows.len());
        for (r, reply) in rows.into_iter().zip(replies) {
            let values: Vec<Option<String>> = reply.convert()?;
            let names: &[&str] = match r.row.kind {
                Kind::Own => &["state", "total", "left", "failed", "open", "why"],
                Kind::Lane => &["state", "left", "failed", "pol", "lc"],
            };
            let mut fields: HashMap<String, Vec<u8>> = HashMap::new();
            for (name, v) in names.iter().zip(values) {
                if let Some(v) = v {
                    fields.insert((*name).to_owned(), v.into_bytes());
                }
            }
            if !fields.contains_key("state") {
                continue;
            }
            let meta: HashMap<String, String> = match r.row.kind {
                Kind::Own => {
                    fields.into_iter().map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned())).collect()
                }
                Kind::Lane => record_meta(&fields),
            };
            read.push((r, meta));
        }
        // A lane request handed out without its record reads running from its lane's mark.
        let lanes: Vec<(u32, &str, &HashMap<String, String>)> = read
            .iter()
            .filter(|(r, _)| r.row.kind == Kind::Lane)
            .map(|(r, meta)| (r.shard, r.key_id.as_str(), meta))
            .collect();
        let mut marks = crate::protocol::lane::running_marks(&self.store, &lanes).await?.into_iter();
        let mut out = Vec::with_capacity(read.len());
        for (r, mut meta) in read {
            if r.row.kind == Kind::Lane {
                crate::protocol::lane::mark_running(&mut meta, marks.next().flatten());
            }
            let Ok(state) = meta["state"].parse::<RequestState>() else { continue };
            if state == RequestState::Loading {
                continue;
            }
            let num = |k: &str| meta.get(k).and_then(|v| v.parse::<u64>().ok());
            let total = num("total").unwrap_or(0);
            let left = num("left").unwrap_or(total);
            // As `status` counts it: a request ended at its deadline, or by an upstream, leaves
            // parts that never ran, which are not done.
            let ended_early = meta.contains_key("why");
            let done = if state == RequestState::Completed || (state == RequestState::Failed && !ended_early)
            {
                total
            } else {
                total.saturating_sub(left)
            };
            let id = RequestId::from_key_id(&r.key_id).map(|id| id.to_string()).unwrap_or(r.key_id.clone());
            out.push(ListedRequest {
                id,
                state,
                open: meta.get("open").map(String::as_str) == Some("1"),
                priority: r.row.priority,
                concurrency: r.row.limit,
                total,
                done,
                failed: num("failed").unwrap_or(0),
                submitted_ms: r.submitted_ms,
                tags: r.row.tags,
                tracked: r.tracked,
            });
        }
        Ok(out)
    }

    /// Marks a request as tracked (`list --tracked` shows it), or unmarks it. Unknown requests,
    /// and finished ones past their retention, are an error.
    pub async fn track(&self, id: &RequestId, on: bool) -> Result<()> {
        let key_id = id.key_id();
        let home = self.home(&key_id).await?;
        if listing::track(&self.store, home, &key_id, on).await? {
            Ok(())
        } else {
            Err(Error::UnknownRequest(id.clone()))
        }
    }

    /// The tags and tracking of a listed request (`None` when it is not listed).
    pub(crate) async fn listing_of(&self, key_id: &str) -> Result<Option<(Vec<String>, bool)>> {
        let home = self.home(key_id).await?;
        let Some(row) = listing::row_of(&self.store, home, key_id).await? else { return Ok(None) };
        let tags = listing::Row::parse(&row)?.tags;
        let tracked: Option<f64> =
            self.store.client.zscore(self.store.keys.index_set(home, "tracked").as_str(), key_id).await?;
        Ok(Some((tags, tracked.is_some())))
    }

    /// The home shard of a request: its own meta says how many shards it was submitted with; a
    /// lane request (or an unknown one) is homed by this configuration's.
    async fn home(&self, key_id: &str) -> Result<u32> {
        let meta = self.store.keys.request(key_id).meta;
        Ok(match crate::shards::placement(&self.store, &meta).await? {
            Some(place) => home_shard(key_id, place.shards),
            None => crate::shards::lane_home_found(&self.store, key_id).await?,
        })
    }

    /// Deletes a finished request's keys now rather than at the end of its retention, and takes
    /// it out of the listing index. Returns false when there was nothing to delete (unknown, or
    /// already expired). A request that has not finished is refused ([`Error::Refused`]):
    /// cancel it first.
    pub async fn purge(&self, id: &RequestId) -> Result<bool> {
        let key_id = id.key_id();
        let keys = self.store.keys.request(&key_id);
        let unfinished = || {
            Error::Refused(format!(
                "request \"{id}\" has not finished (or its finish is still being recorded): cancel it first"
            ))
        };
        // A refusal by `purge` itself (its state not terminal) says the same, with the id.
        let say_unfinished = |e: Error| match e {
            Error::Refused(_) => unfinished(),
            e => e,
        };
        let purged = match crate::shards::placement(&self.store, &keys.meta).await? {
            Some(place) => {
                let home = home_shard(&key_id, place.shards);
                let active_key = self.store.keys.active(home);
                let active: Option<f64> = self
                    .store
                    .call("zscore", &active_key, || async {
                        Ok(self.store.client.zscore(active_key.as_str(), key_id.as_str()).await?)
                    })
                    .await?;
                // Out of the index, its finish is recorded: a release it owes is in the outbox
                // already, and nothing adds one now that it has finished (until a requeue, which
                // `purge` refuses to race: the request is not finished then).
                let releases = self.store.keys.releases(home);
                let owed: Option<f64> = self
                    .store
                    .call("zscore", &releases, || async {
                        Ok(self.store.client.zscore(releases.as_str(), key_id.as_str()).await?)
                    })
                    .await?;
                if active.is_some() || owed.is_some() {
                    return Err(unfinished());
                }
                let purged = listing::purge(&self.store, &keys.all()).await.map_err(say_unfinished)?;
                unlist(&self.store, home, &key_id, purged).await.map_err(say_unfinished)?
            }
            None => {
                let home = crate::shards::lane_home_found(&self.store, &key_id).await?;
                let purged = listing::purge_lane(&self.store, home, &key_id).await.map_err(say_unfinished)?;
                unlist(&self.store, home, &key_id, purged).await.map_err(say_unfinished)?
            }
        };
        Ok(purged)
    }

    /// Purges every finished request in `state` (completed, failed or cancelled) submitted at
    /// least `older_than` ago; returns how many were purged. Requests whose finish is still being
    /// recorded are left for a later run.
    pub async fn purge_finished(&self, state: ListState, older_than: Duration) -> Result<u64> {
        if state.set() == "live" {
            return Err(Error::InvalidRequest(format!(
                "only finished requests are purged (completed, failed or cancelled), not {state}"
            )));
        }
        let mut purged = 0u64;
        let mut refused: HashSet<String> = HashSet::new();
        loop {
            // From the newest each time: what was purged has left the index.
            let query = ListQuery::new().state(state).older_than(older_than).limit(MAX_LIST_LIMIT);
            let page = self.list(&query).await?;
            let ids: Vec<String> =
                page.requests.into_iter().map(|r| r.id).filter(|id| !refused.contains(id)).collect();
            if ids.is_empty() {
                return Ok(purged);
            }
            for id in ids {
                match self.purge(&RequestId::new(id.as_str())?).await {
                    Ok(true) => purged += 1,
                    Ok(false) => {}
                    Err(Error::Refused(_)) => {
                        refused.insert(id);
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
}

/// The index's half of a purge, after `purge` answered `purged`. Refused when the id is in use
/// again: by a request that was live all along (nothing was purged), or by a new request
/// submitted once the keys were gone, which lists itself in the purged one's place (then the
/// purge is done).
async fn unlist(store: &crate::store::Store, home: u32, key_id: &str, purged: bool) -> Result<bool> {
    match listing::unlist(store, home, key_id).await {
        Ok(_) => Ok(purged),
        Err(Error::Refused(_)) if purged => Ok(true),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_read_back_and_bad_ones_are_named() {
        let c = vec![
            ShardCursor::At(Position { score: 1_700_000_000_123.0, passed: 3 }),
            ShardCursor::Done,
            ShardCursor::Start,
        ];
        let text = encode_cursor(&c).unwrap();
        assert_eq!(text, "l1:1700000000123.3,-,+");
        assert_eq!(decode_cursor(&text, 3).unwrap(), c);
        assert!(decode_cursor(&text, 2).is_err());
        assert!(decode_cursor("nonsense", 1).unwrap_err().to_string().contains("not a list cursor"));
        assert_eq!(encode_cursor(&[ShardCursor::Done]), None);
    }

    #[test]
    fn states_parse_by_name() {
        assert_eq!("failed".parse::<ListState>().unwrap(), ListState::Failed);
        assert!("done".parse::<ListState>().unwrap_err().to_string().contains("one of queued"));
        assert_eq!(ListState::Open.to_string(), "open");
    }
}
