//! The worker registry's transitions (docs/protocol.md §5, "Worker registry"): `beat` and
//! `reaped`, on shard 0's registry keys.

use std::time::Duration;

use fred::types::Value;

use super::{ms, Func};
use crate::error::Result;
use crate::reply;
use crate::store::Store;

/// One beat of a worker (`lua/beat.lua`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BeatArgs<'a> {
    /// The beating worker's id.
    pub(crate) worker: &'a str,
    /// How long its registration lasts without another beat.
    pub(crate) lease: Duration,
    /// Its description (JSON), stored on its first beat.
    pub(crate) description: &'a str,
    /// Whether this is the worker's first beat.
    pub(crate) first: bool,
    /// Dead workers to claim at most.
    pub(crate) claim_at_most: i64,
    /// How long a claim on a dead worker lasts: a reaper that dies is replaced after it.
    pub(crate) claim: Duration,
}

/// What a beat found: `{alive, dead id, dead description, ...}`.
#[derive(Debug)]
pub(crate) struct BeatReply {
    /// False when this worker had been declared dead (it must take a new id).
    pub(crate) alive: bool,
    /// The dead workers this beat claimed for reaping: id and description (JSON, if readable).
    pub(crate) dead: Vec<(String, Option<String>)>,
}

/// `beat`: renews (or makes) a worker's registration and claims dead workers for reaping.
pub(crate) async fn beat(store: &Store, a: BeatArgs<'_>) -> Result<BeatReply> {
    let (workers, winfo, reaping) = (store.keys.workers(), store.keys.worker_info(), store.keys.reaping());
    let args: Vec<Value> = vec![
        a.worker.into(),
        ms(a.lease),
        a.description.into(),
        (if a.first { "1" } else { "0" }).into(),
        a.claim_at_most.into(),
        ms(a.claim),
    ];
    let mut items =
        reply::array(store.fcall(Func::Beat, &[&workers, &winfo, &reaping], args).await?)?.into_iter();
    let alive = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(1) == 1;
    let mut dead = Vec::new();
    while let (Some(id), Some(described)) = (items.next(), items.next()) {
        dead.push((reply::text(&id)?, reply::text(&described).ok()));
    }
    Ok(BeatReply { alive, dead })
}

/// `reaped`: takes a worker out of the registry.
pub(crate) async fn reaped(store: &Store, worker: &str) -> Result<()> {
    let (workers, winfo, reaping) = (store.keys.workers(), store.keys.worker_info(), store.keys.reaping());
    // Returns 1: nothing to read.
    store.fcall(Func::Reaped, &[&workers, &winfo, &reaping], vec![worker.into()]).await?;
    Ok(())
}
