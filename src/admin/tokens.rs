//! Where each of a request's tokens is (`Admin::tokens`), and the token audit of the unfinished
//! requests (`Admin::token_audit`): read from the token states a request's record keeps (`t<k>`,
//! docs/protocol.md §4), so that an operator sees who holds a request's tokens and whether every
//! token it owns is accounted for.

use std::collections::HashMap;

use fred::prelude::*;
use serde::Serialize;

use super::Admin;
use crate::error::{Error, Result};
use crate::keys::lane_of;
use crate::request::{Priority, RequestId, RequestState};
use crate::shards::Placement;

/// Requests one [`Admin::token_audit`] reads at most.
pub const MAX_TOKEN_AUDIT: u32 = 1_000;

/// Where one token of a request is, as its record says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "lowercase")]
#[non_exhaustive]
pub enum TokenState {
    /// Waiting in its priority list (an element `<kid>|<k>|<epoch>` should be there).
    Queued {
        /// The token's number, 0 to `expected - 1`.
        k: u64,
        /// The token shard its list is on.
        shard: u32,
        /// Its epoch.
        epoch: u64,
        /// When it was queued (ms since the Unix epoch, Redis's clock).
        since_ms: u64,
    },
    /// Held by a worker slot, running a batch of the request's parts.
    Held {
        /// The token's number.
        k: u64,
        /// The token shard it was taken from.
        shard: u32,
        /// Its epoch.
        epoch: u64,
        /// The slot holding it: `<worker id>/<slot>`. The hold lasts while that worker's
        /// registration is renewed ([`WorkerInfo::registration_expires_ms`](crate::WorkerInfo)).
        holder: String,
        /// The worker id part of `holder`.
        worker: String,
        /// When the slot took it.
        since_ms: u64,
        /// Parts in the batch the slot was handed.
        batch: u64,
        /// When the hold lapses unless its worker beats again (ms since the Unix epoch, Redis's
        /// clock): the worker's registration expiry. `None`: the worker is not registered (dead,
        /// being reaped: recovery reclaims the token), or this was read by the token audit.
        #[serde(skip_serializing_if = "Option::is_none")]
        lease_expires_ms: Option<u64>,
    },
    /// Parked: its request had nothing to hand out; recovery or new work wakes it.
    Parked {
        /// The token's number.
        k: u64,
        /// The token shard it goes back to when woken.
        shard: u32,
        /// Its epoch.
        epoch: u64,
    },
}

impl TokenState {
    /// Reads token `k`'s state field (`q|…`, `h|…`, `p|…`); `None` for anything else.
    fn parse(k: u64, shard: u32, field: &str) -> Option<Self> {
        let mut parts = field.split('|');
        let kind = parts.next()?;
        let epoch: u64 = parts.next()?.parse().ok()?;
        match kind {
            "q" => {
                let since_ms = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                Some(Self::Queued { k, shard, epoch, since_ms })
            }
            "h" => {
                let holder = parts.next()?.to_owned();
                let since_ms = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                let batch = parts.next().map_or(0, |b| b.split(',').filter(|e| !e.is_empty()).count() as u64);
                let worker = holder.split('/').next().unwrap_or_default().to_owned();
                Some(Self::Held { k, shard, epoch, holder, worker, since_ms, batch, lease_expires_ms: None })
            }
            "p" => Some(Self::Parked { k, shard, epoch }),
            _ => None,
        }
    }
}

/// One request's tokens: how many it owns and where each one is.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct RequestTokens {
    /// The request (or a lane: `~<shard>.<priority>`, whose small requests share its tokens).
    pub id: String,
    /// Whether it is a lane rather than a request.
    pub lane: bool,
    /// Its state.
    pub state: Option<RequestState>,
    /// Its priority.
    pub priority: u8,
    /// Tokens it owns (`ntok`: `min(limit, parts)`, a streamed request's limit; 0 once finished).
    pub expected: u64,
    /// Of those, queued in a priority list.
    pub queued: u64,
    /// Held by worker slots.
    pub held: u64,
    /// Parked.
    pub parked: u64,
    /// Token shards its tokens are spread over.
    pub shards: u32,
    /// Each token, by number (at most [`MAX_TOKEN_AUDIT`] listed).
    pub tokens: Vec<TokenState>,
}

impl RequestTokens {
    /// `expected - (queued + held + parked)`: zero when every token is accounted for. Other
    /// values are what recovery's census repairs (or a moment between two steps of a change).
    pub fn drift(&self) -> i64 {
        self.expected as i64 - (self.queued + self.held + self.parked) as i64
    }
}

/// The token audit of the unfinished requests ([`Admin::token_audit`]).
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct TokenAudit {
    /// The first unfinished requests of each shard's recovery index, with their tokens counted
    /// (each one's `tokens` list left empty: [`Admin::tokens`] has it).
    pub requests: Vec<RequestTokens>,
    /// Unfinished requests in the index in all (those listed and those beyond the page).
    pub unfinished: u64,
}

impl Admin {
    /// Where each token of request `id` is: queued (since when, on which shard), held (by which
    /// worker slot, since when, running how many parts) or parked. A finished request owns no
    /// tokens any more: its list is empty. Unknown requests are an error; a small request sharing
    /// a lane has no tokens of its own ([`token_audit`](Self::token_audit) lists its lane).
    ///
    /// ```no_run
    /// # async fn demo(admin: sluicegate::Admin) -> sluicegate::Result<()> {
    /// let tokens = admin.tokens(&sluicegate::RequestId::new("invoice-42")?).await?;
    /// println!("{} held, drift {}", tokens.held, tokens.drift());
    /// # Ok(()) }
    /// ```
    pub async fn tokens(&self, id: &RequestId) -> Result<RequestTokens> {
        let key_id = id.key_id();
        let meta: HashMap<String, String> =
            self.store.client.hgetall(self.store.keys.request(&key_id).meta).await?;
        if meta.is_empty() {
            // A lane request (its record is elsewhere) or none at all: status tells them apart.
            self.status(id).await?;
            return Err(Error::Refused(format!(
                "request \"{id}\" is a small request sharing its priority's lane: it owns no tokens of its own (the token audit lists the lane's)"
            )));
        }
        let mut tokens = request_tokens(&key_id, &meta, true);
        self.lease_expiries(&mut tokens.tokens).await?;
        Ok(tokens)
    }

    /// Fills in each held token's lease expiry: its worker's registration expiry, one `ZMSCORE`.
    async fn lease_expiries(&self, tokens: &mut [TokenState]) -> Result<()> {
        let workers: Vec<String> = tokens
            .iter()
            .filter_map(|t| match t {
                TokenState::Held { worker, .. } => Some(worker.clone()),
                _ => None,
            })
            .collect();
        if workers.is_empty() {
            return Ok(());
        }
        let args: Vec<String> = std::iter::once(self.store.keys.workers()).chain(workers).collect();
        let scores: Vec<Option<f64>> = self.store.client.custom(fred::cmd!("ZMSCORE"), args).await?;
        let mut scores = scores.into_iter();
        for token in tokens {
            if let TokenState::Held { lease_expires_ms, .. } = token {
                *lease_expires_ms = scores.next().flatten().map(|s| s as u64);
            }
        }
        Ok(())
    }

    /// Counts the tokens of up to `limit` (1 to [`MAX_TOKEN_AUDIT`]) unfinished requests and lanes,
    /// the oldest first in each token shard's recovery index: one pipelined `HGETALL` of each
    /// one's record, so its cost is bounded by `limit`, not by the backlog.
    pub async fn token_audit(&self, limit: u32) -> Result<TokenAudit> {
        if limit == 0 || limit > MAX_TOKEN_AUDIT {
            return Err(Error::InvalidRequest(format!(
                "a token audit reads 1 to {MAX_TOKEN_AUDIT} requests"
            )));
        }
        let keys = &self.store.keys;
        let client = &self.store.client;
        let mut ids = Vec::new();
        let mut unfinished = 0;
        for shard in 0..keys.shards() {
            let active = keys.active(shard);
            unfinished += client.zcard::<u64, _>(active.as_str()).await?;
            let room = i64::from(limit) - ids.len() as i64;
            if room > 0 {
                let page: Vec<String> =
                    client.zrange(active.as_str(), 0, room - 1, None, false, None, false).await?;
                ids.extend(page);
            }
        }
        let mut requests = Vec::with_capacity(ids.len());
        if !ids.is_empty() {
            let pipe = client.pipeline();
            for id in &ids {
                pipe.hgetall::<(), _>(keys.request(id).meta).await?;
            }
            let metas: Vec<HashMap<String, String>> = pipe.all().await?;
            for (id, meta) in ids.iter().zip(metas) {
                // Finished (or dropped) between the two reads: no longer unfinished.
                if !meta.is_empty() {
                    requests.push(request_tokens(id, &meta, false));
                }
            }
        }
        Ok(TokenAudit { requests, unfinished })
    }
}

/// A request's tokens from its record's fields; each token listed when `list`.
fn request_tokens(key_id: &str, meta: &HashMap<String, String>, list: bool) -> RequestTokens {
    let num = |k: &str| meta.get(k).and_then(|v| v.parse::<u64>().ok());
    let lane = lane_of(key_id);
    let shards = num("shards").unwrap_or(1).max(1) as u32;
    let place = Placement { priority: Priority::default(), shards, group: meta.get("grp").cloned() };
    let state: Option<RequestState> = meta.get("state").and_then(|s| s.parse().ok());
    // A finished request's record keeps its `ntok`, but it owns no token any more.
    let expected = if state.is_some_and(RequestState::is_terminal) { 0 } else { num("ntok").unwrap_or(0) };
    let mut tokens = Vec::new();
    let (mut queued, mut held, mut parked) = (0, 0, 0);
    let mut numbered: Vec<(u64, &String)> =
        meta.iter().filter_map(|(f, v)| Some((f.strip_prefix('t')?.parse::<u64>().ok()?, v))).collect();
    numbered.sort_unstable_by_key(|(k, _)| *k);
    for (k, field) in numbered {
        let Some(token) = TokenState::parse(k, place.token_shard(key_id, k), field) else { continue };
        match token {
            TokenState::Queued { .. } => queued += 1,
            TokenState::Held { .. } => held += 1,
            TokenState::Parked { .. } => parked += 1,
        }
        if list && tokens.len() < MAX_TOKEN_AUDIT as usize {
            tokens.push(token);
        }
    }
    let id = match (&lane, meta.get("id")) {
        (None, Some(raw)) => raw.clone(),
        _ => RequestId::from_key_id(key_id).map_or_else(|_| key_id.to_owned(), |id| id.to_string()),
    };
    RequestTokens {
        id,
        lane: lane.is_some(),
        state,
        priority: lane.map_or_else(|| num("prio").unwrap_or(0) as u8, |(_, p)| p.get()),
        expected,
        queued,
        held,
        parked,
        shards: if lane.is_some() { 1 } else { shards },
        tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_token_state_is_read_from_its_field() {
        assert_eq!(
            TokenState::parse(0, 1, "q|17|1000"),
            Some(TokenState::Queued { k: 0, shard: 1, epoch: 17, since_ms: 1000 })
        );
        assert_eq!(
            TokenState::parse(2, 0, "h|18|w1/3|2000|0-1,0-2"),
            Some(TokenState::Held {
                k: 2,
                shard: 0,
                epoch: 18,
                holder: "w1/3".into(),
                worker: "w1".into(),
                since_ms: 2000,
                batch: 2,
                lease_expires_ms: None
            })
        );
        assert_eq!(TokenState::parse(1, 0, "p|19"), Some(TokenState::Parked { k: 1, shard: 0, epoch: 19 }));
        assert_eq!(TokenState::parse(1, 0, "x|19"), None);
    }

    #[test]
    fn drift_is_what_the_token_states_do_not_account_for() {
        let meta: HashMap<String, String> = [
            ("id", "a"),
            ("state", "running"),
            ("prio", "7"),
            ("ntok", "3"),
            ("t0", "q|1|5"),
            ("t1", "h|1|w/0|5|0-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let tokens = request_tokens("a", &meta, true);
        assert_eq!((tokens.expected, tokens.queued, tokens.held, tokens.parked), (3, 1, 1, 0));
        assert_eq!(tokens.drift(), 1);
        assert_eq!(tokens.tokens.len(), 2);
        assert_eq!(tokens.state, Some(RequestState::Running));
    }
}
