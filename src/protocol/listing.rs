//! The listing index (docs/protocol.md §5, "Listing"): `list`, `track`, and purging one finished
//! request (`purge` on its keys, then `unlist` on its home shard). The index itself is kept by the
//! submit and finish functions (prelude.lua, "The listing index"); here is what reads and trims it
//! on an operator's behalf, and the row each request is entered with.

use fred::interfaces::HashesInterface;
use fred::types::Value;

use super::refusal::{Code, Refusal};
use super::Func;
use crate::error::{Error, Result};
use crate::reply;
use crate::request::{Concurrency, Priority};
use crate::store::Store;

/// How a request is stored, as its index row says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Its own keys (`Keys::request`).
    Own,
    /// A record in its home shard's lane (`Keys::record`).
    Lane,
}

/// A request's row in the listing index: what a page shows of it without reading its keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Row {
    pub(crate) kind: Kind,
    pub(crate) priority: u8,
    pub(crate) limit: u32,
    pub(crate) tags: Vec<String>,
}

impl Row {
    /// The row a new request is entered with: `<kind>|<priority>|<limit>|<tags>`.
    pub(crate) fn encode(kind: Kind, priority: Priority, limit: Concurrency, tags: &[String]) -> String {
        let kind = match kind {
            Kind::Own => 'r',
            Kind::Lane => 'l',
        };
        format!("{kind}|{}|{}|{}", priority.get(), limit.get(), tags.join(","))
    }

    /// A row as `encode` wrote it.
    pub(crate) fn parse(row: &str) -> Result<Row> {
        let bad = || Error::Protocol(format!("malformed listing row {row:?}"));
        let mut f = row.splitn(4, '|');
        let kind = match f.next() {
            Some("r") => Kind::Own,
            Some("l") => Kind::Lane,
            _ => return Err(bad()),
        };
        let priority = f.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let limit = f.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let tags = f.next().unwrap_or("").split(',').filter(|t| !t.is_empty()).map(str::to_owned).collect();
        Ok(Row { kind, priority, limit, tags })
    }
}

/// Where a walk of one shard's index stands: the score it reached and how many entries of exactly
/// that score it has passed (entries sharing a submit millisecond are told apart by key id).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Position {
    pub(crate) score: f64,
    pub(crate) passed: u64,
}

/// What `list` is asked for on one shard.
#[derive(Clone, Debug)]
pub(crate) struct ListArgs<'a> {
    /// The index sets walked and merged (`live`, `completed`, `failed`, `cancelled`, `t:<tag>`,
    /// `tracked`).
    pub(crate) walk: Vec<String>,
    /// The state sets a row must be in (empty: any).
    pub(crate) states: Vec<&'static str>,
    /// Where to resume (`None`: from the newest).
    pub(crate) from: Option<&'a Position>,
    /// Only requests submitted at least this long ago (ms).
    pub(crate) older_than_ms: Option<u64>,
    /// Most rows.
    pub(crate) limit: u32,
    /// Most entries looked at.
    pub(crate) budget: u32,
    pub(crate) priority: Option<Priority>,
    pub(crate) tag: Option<&'a str>,
    pub(crate) tracked: bool,
}

/// One row `list` returned.
#[derive(Clone, Debug)]
pub(crate) struct Listed {
    pub(crate) key_id: String,
    /// The shard whose index listed it: its home shard, where a lane request's record is.
    pub(crate) shard: u32,
    pub(crate) submitted_ms: i64,
    pub(crate) row: Row,
    pub(crate) tracked: bool,
    /// Resumes right after this row.
    pub(crate) after: Position,
}

/// What `list` answered for one shard.
#[derive(Clone, Debug)]
pub(crate) struct ListReply {
    pub(crate) rows: Vec<Listed>,
    /// Where the next page starts; `None` when the walk reached the end.
    pub(crate) next: Option<Position>,
    /// Entries looked at.
    pub(crate) looked: u64,
}

/// The key ids a member of a terminal set names: itself, or each of a group's
/// ("|<kid>|<kid>|...": lane requests one call finished that were submitted in one millisecond;
/// docs/protocol.md §5, "Listing").
pub(crate) fn member_kids(member: &str) -> Vec<&str> {
    match member.strip_prefix('|') {
        Some(group) => group.split('|').collect(),
        None => vec![member],
    }
}

/// `list` on `shard` (FCALL_RO).
pub(crate) async fn list(store: &Store, shard: u32, a: &ListArgs<'_>) -> Result<ListReply> {
    let rows_key = store.keys.index_rows(shard);
    let (score, passed) = match a.from {
        Some(p) => (score_text(p.score), p.passed as i64),
        None => ("+inf".to_owned(), 0),
    };
    let args: Vec<Value> = vec![
        a.walk.join(",").into(),
        a.states.join(",").into(),
        score.into(),
        passed.into(),
        a.older_than_ms.map_or(String::new(), |ms| ms.to_string()).into(),
        i64::from(a.limit).into(),
        i64::from(a.budget).into(),
        a.priority.map_or(String::new(), |p| p.get().to_string()).into(),
        a.tag.unwrap_or("").into(),
        (if a.tracked { "1" } else { "" }).into(),
    ];
    // Refused (SGSTATE) when a lane holds too many entries of started requests to page past now.
    let items = reply::array(store.fcall(Func::List, &[rows_key.as_str()], args).await.map_err(refused)?)?;
    if items.len() < 3 || (items.len() - 3) % 7 != 0 {
        return Err(Error::Protocol(format!("list answered {} items", items.len())));
    }
    let next_score = reply::text(&items[0])?;
    let next = if next_score.is_empty() {
        None
    } else {
        Some(Position { score: parse_score(&next_score)?, passed: reply::int(&items[1])?.max(0) as u64 })
    };
    let looked = reply::int(&items[2])?.max(0) as u64;
    let rows = items[3..]
        .chunks(7)
        .map(|r| {
            Ok(Listed {
                key_id: reply::text(&r[0])?,
                shard,
                submitted_ms: reply::int(&r[1])?,
                row: Row::parse(&reply::text(&r[2])?)?,
                tracked: reply::int(&r[4])? == 1,
                after: Position {
                    score: parse_score(&reply::text(&r[5])?)?,
                    passed: reply::int(&r[6])?.max(0) as u64,
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ListReply { rows, next, looked })
}

fn score_text(score: f64) -> String {
    if score.is_infinite() {
        "+inf".to_owned()
    } else {
        format!("{}", score as i64)
    }
}

fn parse_score(s: &str) -> Result<f64> {
    s.parse::<f64>().map_err(|_| Error::Protocol(format!("list answered the score {s:?}")))
}

/// The listing row of `key_id` on `shard`: from the index's rows, or kept in its lane record (a
/// lane request without tags: field `ix`; docs/protocol.md §5). `None` when it is not listed.
pub(crate) async fn row_of(store: &Store, shard: u32, key_id: &str) -> Result<Option<String>> {
    let row: Option<String> = store.client.hget(store.keys.index_rows(shard).as_str(), key_id).await?;
    if row.is_some() {
        return Ok(row);
    }
    let (kept, pol): (Option<String>, Option<String>) =
        store.client.hmget(store.keys.record(shard, key_id).as_str(), vec!["ix", "pol"]).await?;
    Ok(kept.map(|k| kept_row(&k, pol.as_deref().unwrap_or(""))))
}

/// The row a lane record keeps (`ix`, and its settings `pol`): `ix` is empty, the row
/// `l|<priority>|<limit>|` from `pol` ("[f]<priority>,<limit>,..."); a record an earlier version
/// wrote keeps "<submitted ms>|<row>".
fn kept_row(ix: &str, pol: &str) -> String {
    if let Some((_, row)) = ix.split_once('|') {
        return row.to_owned();
    }
    let mut settings = pol.trim_start_matches('f').split(',');
    let priority = settings.next().unwrap_or("0");
    let limit = settings.next().unwrap_or("1");
    format!("l|{priority}|{limit}|")
}

/// `track` on `shard`: marks (or unmarks) `key_id` as tracked. False when it is not listed.
pub(crate) async fn track(store: &Store, shard: u32, key_id: &str, on: bool) -> Result<bool> {
    let rows_key = store.keys.index_rows(shard);
    let args: Vec<Value> = vec![key_id.into(), (if on { "1" } else { "0" }).into()];
    Ok(reply::int(&store.fcall(Func::Track, &[rows_key.as_str()], args).await?)? == 1)
}

/// `relabel` on `shard`: the listed row of `key_id` takes `priority`. False when it is not listed.
pub(crate) async fn relabel(store: &Store, shard: u32, key_id: &str, priority: Priority) -> Result<bool> {
    let rows_key = store.keys.index_rows(shard);
    let args: Vec<Value> = vec![key_id.into(), i64::from(priority.get()).into()];
    Ok(reply::int(&store.fcall(Func::Relabel, &[rows_key.as_str()], args).await?)? == 1)
}

/// `purge` on the request's slot: deletes `keys` (the first holds its `state`) if it finished.
/// False when there was nothing; `Error::Refused` when it has not finished.
pub(crate) async fn purge(store: &Store, keys: &[&str]) -> Result<bool> {
    let purged = store.fcall(Func::Purge, keys, Vec::new()).await.map_err(refused)?;
    Ok(reply::int(&purged)? == 1)
}

/// `purge` of lane request `key_id`, homed on `shard`: its record, unless its release to its
/// downstreams is owed (`Error::Refused` then, as while it runs).
pub(crate) async fn purge_lane(store: &Store, shard: u32, key_id: &str) -> Result<bool> {
    let (record, releases) = (store.keys.record(shard, key_id), store.keys.releases(shard));
    let keys = [record.as_str(), releases.as_str()];
    let purged = store.fcall(Func::Purge, &keys, vec![key_id.into()]).await.map_err(refused)?;
    Ok(reply::int(&purged)? == 1)
}

/// `unlist` on `shard`: the request leaves the index and its finish marks go. False when it was
/// not listed; `Error::Refused` while it is still in recovery's index.
pub(crate) async fn unlist(store: &Store, shard: u32, key_id: &str) -> Result<bool> {
    let (rows, active, marks) =
        (store.keys.index_rows(shard), store.keys.active(shard), store.keys.finish_marks(shard, key_id));
    let record = store.keys.record(shard, key_id);
    let keys = [rows.as_str(), active.as_str(), marks.as_str(), record.as_str()];
    let unlisted = store.fcall(Func::Unlist, &keys, vec![key_id.into()]).await.map_err(refused)?;
    Ok(reply::int(&unlisted)? == 1)
}

fn refused(e: Error) -> Error {
    match Refusal::is(&e, Code::State) {
        Some(r) => Error::Refused(r.why),
        None => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_records_row_comes_from_its_settings_or_from_an_earlier_versions_ix() {
        assert_eq!(kept_row("", "10,4,1"), "l|10|4|");
        assert_eq!(kept_row("", "f99,1,3,2"), "l|99|1|");
        assert_eq!(kept_row("1764453600000|l|7|2|", "7,2,1"), "l|7|2|");
        let row = Row::parse(&kept_row("", "f5,3,2")).unwrap();
        assert_eq!((row.kind, row.priority, row.limit, row.tags.len()), (Kind::Lane, 5, 3, 0));
    }

    #[test]
    fn rows_read_back_as_written() {
        let tags = vec!["customer:42".to_owned(), "env=prod".to_owned()];
        let text = Row::encode(Kind::Lane, Priority::new(7).unwrap(), Concurrency::new(3).unwrap(), &tags);
        assert_eq!(text, "l|7|3|customer:42,env=prod");
        let row = Row::parse(&text).unwrap();
        assert_eq!(row, Row { kind: Kind::Lane, priority: 7, limit: 3, tags });
        let bare = Row::parse("r|0|1|").unwrap();
        assert!(bare.tags.is_empty() && bare.kind == Kind::Own);
        assert!(Row::parse("x|1|1|").is_err());
    }
}
