//! Tenant groups (docs/operations.md, "Tenant groups"): set a group's limit, read one group or all.

use std::collections::{BTreeSet, HashMap};

use fred::prelude::*;
use serde::Serialize;

use super::Admin;
use crate::error::Result;
use crate::keys::group_shard;
use crate::protocol::groups::{self, RateChange};
use crate::request::{check_group, Priority};

/// A group's limit until an operator sets one ([`Admin::set_group`]).
pub const DEFAULT_GROUP_LIMIT: u32 = 10;

/// The largest group limit.
pub const MAX_GROUP_LIMIT: u32 = 10_000;

/// The most groups [`Admin::groups`] reads.
pub const MAX_GROUPS_LISTED: usize = 1_000;

/// One tenant group as Redis has it now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GroupStatus {
    /// Its name.
    pub name: String,
    /// The token shard its tokens live on.
    pub shard: u32,
    /// At most this many of its sub-requests run at once.
    pub limit: u32,
    /// Whether an operator set the limit (else it is [`DEFAULT_GROUP_LIMIT`]).
    pub configured: bool,
    /// Its tokens held by worker slots: its requests' tokens running now.
    pub held: u32,
    /// Its tokens waiting on the shard's priority lists for a slot.
    pub queued: u32,
    /// Its tokens parked: it had no work for them.
    pub parked: u32,
    /// Its tokens waiting for its rate limit to refill.
    pub rate_waiting: u32,
    /// Its rate limit, if any.
    pub rate: Option<super::RateLimit>,
    /// Its requests' token elements waiting in its queues, by priority, highest first.
    pub waiting: Vec<(u8, u64)>,
}

impl Admin {
    /// Sets tenant group `name`'s limit: at most `limit` (1 to [`MAX_GROUP_LIMIT`]) sub-requests
    /// of all its requests run at once. Takes effect at once: a raised limit adds tokens, a lowered
    /// one retires tokens as they come back (running parts are never stopped).
    pub async fn set_group(&self, name: &str, limit: u32) -> Result<()> {
        check_group(name).map_err(crate::Error::InvalidRequest)?;
        if !(1..=MAX_GROUP_LIMIT).contains(&limit) {
            return Err(crate::Error::InvalidRequest(format!(
                "a group limit is from 1 to {MAX_GROUP_LIMIT}, not {limit}"
            )));
        }
        let shard = group_shard(name, self.store.keys.shards());
        groups::set(&self.store, shard, name, Some(limit), RateChange::Keep).await?;
        Ok(())
    }

    /// Sets tenant group `name`'s rate limit: at most `n` of its parts start per `per`, across all
    /// workers (a token bucket in Redis, refilled by time; a slot that finds it empty waits for
    /// the refill, no polling). `None` removes it. `n` from 1 to 1,000,000 and `per` from 1 ms to a
    /// day. Each part of a rate-limited group is started by a take of its own (one part per turn).
    pub async fn set_group_rate(&self, name: &str, rate: Option<(u32, std::time::Duration)>) -> Result<()> {
        check_group(name).map_err(crate::Error::InvalidRequest)?;
        let change = match rate {
            None => RateChange::Remove,
            Some((n, per)) => {
                let ms = per.as_millis();
                if !(1..=1_000_000).contains(&n) || !(1..=86_400_000).contains(&ms) {
                    return Err(crate::Error::InvalidRequest(format!(
                        "a rate is 1 to 1000000 parts per 1 ms to a day, not {n} per {per:?}"
                    )));
                }
                RateChange::Set(n, ms as u64)
            }
        };
        let shard = group_shard(name, self.store.keys.shards());
        groups::set(&self.store, shard, name, None, change).await?;
        Ok(())
    }

    /// Tenant group `name` now (a group nobody used nor configured reads as idle, with the
    /// default limit).
    pub async fn group(&self, name: &str) -> Result<GroupStatus> {
        check_group(name).map_err(crate::Error::InvalidRequest)?;
        let keys = &self.store.keys;
        let shard = group_shard(name, keys.shards());
        let meta = keys.group(shard, name);
        let fields: HashMap<String, String> = self
            .store
            .call("hgetall", &meta, || async { Ok(self.store.client.hgetall(meta.as_str()).await?) })
            .await?;
        let limits = keys.group_limits(shard);
        let rate_field = format!("{name}:rate");
        let (set, rate_set): (Option<u32>, Option<String>) = self
            .store
            .call("hmget", &limits, || async {
                Ok(self.store.client.hmget(limits.as_str(), vec![name, rate_field.as_str()]).await?)
            })
            .await?;
        let rate = fields.get("rate").cloned().or(rate_set).and_then(|r| {
            let (n, per) = r.split_once('/')?;
            Some(super::RateLimit { n: n.parse().ok()?, per_ms: per.parse().ok()? })
        });
        let limit = fields.get("limit").and_then(|l| l.parse().ok()).or(set).unwrap_or(DEFAULT_GROUP_LIMIT);
        let (mut held, mut queued, mut parked, mut rate_waiting) = (0, 0, 0, 0);
        for (field, value) in &fields {
            if !field.starts_with('t') || field[1..].parse::<u64>().is_err() {
                continue;
            }
            match value.split('|').next() {
                Some("h") => held += 1,
                Some("q") => queued += 1,
                Some("p") => parked += 1,
                Some("r") => rate_waiting += 1,
                _ => {}
            }
        }
        let work = keys.group_work(shard, name);
        let prios: Vec<String> = self
            .store
            .call("zrange", &work, || async {
                Ok(self.store.client.zrange(work.as_str(), 0, -1, None, true, None, false).await?)
            })
            .await?;
        let mut waiting = Vec::new();
        for p in prios.iter().filter_map(|p| p.parse::<u8>().ok()).filter_map(|p| Priority::new(p).ok()) {
            let queue = keys.group_queue(shard, name, p);
            let n: u64 = self
                .store
                .call("llen", &queue, || async { Ok(self.store.client.llen(queue.as_str()).await?) })
                .await?;
            if n > 0 {
                waiting.push((p.get(), n));
            }
        }
        Ok(GroupStatus {
            name: name.to_owned(),
            shard,
            limit,
            configured: set.is_some(),
            held,
            queued,
            parked,
            rate_waiting,
            rate,
            waiting,
        })
    }

    /// Every tenant group in use or configured, by name (at most [`MAX_GROUPS_LISTED`]).
    pub async fn groups(&self) -> Result<Vec<GroupStatus>> {
        let keys = &self.store.keys;
        let mut names = BTreeSet::new();
        for shard in 0..keys.shards() {
            let (used, limits) = (keys.groups(shard), keys.group_limits(shard));
            let a: Vec<String> = self
                .store
                .call("smembers", &used, || async { Ok(self.store.client.smembers(used.as_str()).await?) })
                .await?;
            let b: Vec<String> = self
                .store
                .call("hkeys", &limits, || async { Ok(self.store.client.hkeys(limits.as_str()).await?) })
                .await?;
            names.extend(a);
            // (`<name>:rate` fields hold rates: a group with only a rate set is listed too.)
            names.extend(b.into_iter().map(|n| n.split(':').next().unwrap_or_default().to_owned()));
        }
        let mut out = Vec::new();
        for name in names.into_iter().take(MAX_GROUPS_LISTED) {
            out.push(self.group(&name).await?);
        }
        Ok(out)
    }
}
