//! Tenant groups (docs/operations.md, "Tenant groups"): set a group's limit, read one group or all.

use std::collections::{BTreeSet, HashMap};

use fred::prelude::*;
use serde::Serialize;

use super::Admin;
use crate::error::Result;
use crate::keys::group_shard;
use crate::protocol::groups;
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
        groups::set(&self.store, shard, name, limit).await?;
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
        let set: Option<u32> = self
            .store
            .call("hget", &limits, || async { Ok(self.store.client.hget(limits.as_str(), name).await?) })
            .await?;
        let limit = fields.get("limit").and_then(|l| l.parse().ok()).or(set).unwrap_or(DEFAULT_GROUP_LIMIT);
        let (mut held, mut queued, mut parked) = (0, 0, 0);
        for (field, value) in &fields {
            if !field.starts_with('t') || field[1..].parse::<u64>().is_err() {
                continue;
            }
            match value.split('|').next() {
                Some("h") => held += 1,
                Some("q") => queued += 1,
                Some("p") => parked += 1,
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
            names.extend(b);
        }
        let mut out = Vec::new();
        for name in names.into_iter().take(MAX_GROUPS_LISTED) {
            out.push(self.group(&name).await?);
        }
        Ok(out)
    }
}
