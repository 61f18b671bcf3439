//! The totals `Admin::stats` reads from the requests' own records, which no namespace-wide key
//! keeps: the tokens unfinished requests own and how many of them are parked, and the dead letters
//! waiting to be requeued. Each is a field of every request's record (`ntok`, `npark`, `failed`,
//! docs/protocol.md §4), so the tally reads records, a bounded number of them per call, in
//! pipelines: the cost stays fixed however large the backlog, and a namespace with more than
//! [`MAX_TALLY`] records to read says so (`Tally::complete`).

use std::collections::HashSet;

use fred::prelude::*;
use serde::Serialize;

use super::Admin;
use crate::error::Result;
use crate::protocol::listing::{member_kids, Kind, Row};

/// Records one [`Admin::stats`] reads at most for its [`Tally`].
pub const MAX_TALLY: u64 = 10_000;

/// Records read per pipeline.
const TALLY_CHUNK: usize = 1_000;

/// Totals over the requests' records (at most [`MAX_TALLY`] of them).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Tally {
    /// Tokens the unfinished requests own, their concurrency capacity: each one's
    /// `min(limit, parts)`, and each lane's limit (a lane's small requests share its tokens).
    /// Each of them is waiting in a list, held by a slot or parked; the difference between this
    /// and the three is what recovery's census is repairing.
    pub token_capacity: u64,
    /// Of those, tokens parked: their request had nothing to hand out (its parts all running or
    /// waiting out a retry backoff, a streamed request waiting for parts, a scheduled one for its
    /// time), or they are a lane's with no small request waiting. Recovery or new work wakes
    /// them.
    pub tokens_parked: u64,
    /// Dead letters (parts that used up their attempts or failed permanently) that the failed
    /// requests still retained and the unfinished requests with keys of their own hold. A small
    /// (lane) request's dead letters count once it finishes.
    pub dead_letters: u64,
    /// Records read.
    pub records_read: u64,
    /// Whether every record was read (false: more than [`MAX_TALLY`], and the totals cover the
    /// first ones only).
    pub complete: bool,
}

impl Admin {
    /// Reads the tally: the unfinished requests of each shard first (recovery's index), then the
    /// failed ones (the listing index).
    pub(super) async fn tally(&self) -> Result<Tally> {
        let keys = &self.store.keys;
        let client = &self.store.client;
        let mut tally = Tally { complete: true, ..Tally::default() };
        let mut budget = MAX_TALLY;
        // A request that just finished is in both indexes for a moment: counted once.
        let mut unfinished = HashSet::new();
        for shard in 0..keys.shards() {
            let active = keys.active(shard);
            let total: u64 = client.zcard(active.as_str()).await?;
            let ids = first(client, &active, budget).await?;
            tally.complete &= total <= budget;
            budget -= ids.len() as u64;
            unfinished.extend(ids.iter().cloned());
            for chunk in ids.chunks(TALLY_CHUNK) {
                let pipe = client.pipeline();
                for id in chunk {
                    pipe.hmget::<(), _, _>(keys.request(id).meta, vec!["ntok", "npark", "failed"]).await?;
                }
                let replies: Vec<Vec<Option<u64>>> = pipe.all().await?;
                for fields in replies {
                    let field = |i: usize| fields.get(i).copied().flatten().unwrap_or(0);
                    tally.token_capacity += field(0);
                    tally.tokens_parked += field(1);
                    tally.dead_letters += field(2);
                }
                tally.records_read += chunk.len() as u64;
            }
        }
        for shard in 0..keys.shards() {
            let failed = keys.index_set(shard, "failed");
            let members: u64 = client.zcard(failed.as_str()).await?;
            // Its requests, not its members: a group member holds several (`ix:gn` counts the
            // rest; it may outlive a set that expired, so only while the set exists).
            let grouped: Option<u64> =
                if members > 0 { client.hget(keys.index_set(shard, "gn"), "failed").await? } else { None };
            let total = members + grouped.unwrap_or(0);
            let mut ids = first(client, &failed, budget).await?;
            ids.retain(|id| !unfinished.contains(id));
            tally.complete &= total <= budget;
            budget -= ids.len() as u64;
            for chunk in ids.chunks(TALLY_CHUNK) {
                let rows: Vec<Option<String>> = client.hmget(keys.index_rows(shard), chunk.to_vec()).await?;
                let pipe = client.pipeline();
                for (id, row) in chunk.iter().zip(&rows) {
                    // A lane request's record is on the shard that lists it; one with keys of its
                    // own keeps the count in its meta. A row not in the index's rows is kept in a
                    // lane record (docs/protocol.md §5).
                    let lane = row
                        .as_deref()
                        .map_or(Ok(Kind::Lane), |row| Row::parse(row).map(|r| r.kind))
                        .is_ok_and(|kind| kind == Kind::Lane);
                    let record = if lane { keys.record(shard, id) } else { keys.request(id).meta };
                    pipe.hget::<(), _, _>(record, "failed").await?;
                }
                let replies: Vec<Option<u64>> = pipe.all().await?;
                tally.dead_letters += replies.into_iter().flatten().sum::<u64>();
                tally.records_read += chunk.len() as u64;
            }
        }
        Ok(tally)
    }

    /// Memory Redis uses (`INFO memory`'s `used_memory`), summed over a cluster's primaries.
    pub(super) async fn redis_memory(&self) -> Result<u64> {
        let client = &self.store.client;
        let infos: Vec<String> = match client.cached_cluster_state() {
            Some(state) if client.is_clustered() => {
                let mut infos = Vec::new();
                for node in state.unique_primary_nodes() {
                    infos.push(
                        client.with_cluster_node(node).info(Some(fred::types::InfoKind::Memory)).await?,
                    );
                }
                infos
            }
            _ => vec![client.info(Some(fred::types::InfoKind::Memory)).await?],
        };
        Ok(infos.iter().filter_map(|info| used_memory(info)).sum())
    }
}

/// The first `n` members of sorted set `key` (none for `n` = 0).
async fn first(client: &Client, key: &str, n: u64) -> Result<Vec<String>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let members: Vec<String> = client.zrange(key, 0, n as i64 - 1, None, false, None, false).await?;
    // A group member of a terminal set names several.
    Ok(members.iter().flat_map(|m| member_kids(m)).take(n as usize).map(str::to_owned).collect())
}

/// `used_memory` of one `INFO memory` reply.
fn used_memory(info: &str) -> Option<u64> {
    info.lines().find_map(|line| line.strip_prefix("used_memory:")).and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::used_memory;

    #[test]
    fn used_memory_is_read_from_its_own_line() {
        let info = "# Memory\r\nused_memory:1065920\r\nused_memory_human:1.02M\r\nused_memory_rss:9\r\n";
        assert_eq!(used_memory(info), Some(1_065_920));
        assert_eq!(used_memory("# Memory\r\n"), None);
    }
}
