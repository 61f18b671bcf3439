//! Dependencies between requests across slots (docs/architecture.md, "Dependencies between
//! requests"): a downstream's links to its upstreams at its submit, and the release of an
//! upstream's finish to its downstreams.
//!
//! Each step is a one-slot call, and the chain of them obeys the rule of cross-slot steps: a
//! durable anchor before the first call whose follow-up could be lost, every call repeatable, the
//! anchor gone only after the last call answered. The anchor of a release is the upstream's
//! entry in its home shard's outbox (`rel`), written in the same step as its finish; the finisher
//! runs the release at once, and recovery runs it again for every entry that stays past its due
//! time (`claim_due`). A gate a settle opens has its tokens' elements handed out again by a re-run
//! (while no part of the downstream has started), so a caller that dies before pushing them
//! leaves them to the release's re-run.

use fred::prelude::*;
use futures::future::{try_join_all, BoxFuture};

use super::{armed, finish_at, placement, push, requeue, Look, Placement};
use crate::error::{Error, Result};
use crate::keys::home_shard;
pub(crate) use crate::protocol::dag::Ended;
use crate::protocol::dag::{self as calls, Link, Settled};
use crate::protocol::submit::Linked;
use crate::request::{Priority, RequestId};
use crate::store::Store;

/// How deep a cascade of finishes (a downstream failed by its upstream, then its own downstreams,
/// ...) the finisher follows itself; deeper hops are left to recovery's next claim of the outbox.
pub(crate) const INLINE_DEPTH: usize = 16;

/// Downstreams told at once, per page of the upstream's set.
const CONCURRENT: usize = 16;

/// Links downstream `dkid` (submitted with `shards` token shards) to each of `upstreams`, on their
/// home shards, between its `submit_open` and its `submit_commit`. Returns what each link found,
/// for the commit; an upstream that is unknown, or still being submitted, is refused.
pub(crate) async fn link_all(
    store: &Store,
    dkid: &str,
    shards: u32,
    upstreams: &[RequestId],
) -> Result<Vec<Linked>> {
    let entry = format!("{dkid}|{shards}");
    let mut links = Vec::with_capacity(upstreams.len());
    for some in upstreams.chunks(store.concurrency(CONCURRENT)) {
        links.extend(try_join_all(some.iter().map(|u| link_one(store, &entry, u))).await?);
    }
    Ok(links)
}

async fn link_one(store: &Store, entry: &str, upstream: &RequestId) -> Result<Linked> {
    let ukid = upstream.key_id();
    let meta = store.keys.request(&ukid).meta;
    let (state, created, gen, shards): (Option<String>, Option<i64>, Option<i64>, Option<u32>) = store
        .call("hmget", &meta, || async {
            Ok(store.client.hmget(meta.as_str(), vec!["state", "created", "gen", "shards"]).await?)
        })
        .await?;
    let unknown = |why| Error::UnknownUpstream { id: upstream.clone(), why };
    // A request of its own stream is homed by the shard count in its meta; a lane request's record
    // is on the home of the count it was submitted with, which may not be this producer's.
    let (home, lifecycle) = match state.as_deref() {
        Some("loading") => {
            return Err(unknown("is still being submitted: submit after it once its submit returned"))
        }
        Some(_) => (
            home_shard(&ukid, shards.unwrap_or(1).max(1)),
            Some(created.unwrap_or(0) * 1000 + gen.unwrap_or(0)),
        ),
        None => (super::lane_home_found(store, &ukid).await?, None),
    };
    match calls::link(store, home, &ukid, entry, lifecycle).await? {
        Link::Live { lifecycle: Some(lc) } => Ok((ukid, lc, None)),
        Link::Live { lifecycle: None } => match lifecycle {
            Some(lc) => Ok((ukid, lc, None)),
            None => Err(unknown("is unknown (never submitted, or its retention ran out)")),
        },
        Link::Ended(Ended { lifecycle, state }) => Ok((ukid, lifecycle, Some(state))),
        Link::Unknown => Err(unknown("is unknown (never submitted, or its retention ran out)")),
    }
}

/// The release of upstream `ukid` (homed on `home`) that its finish just put in the outbox, run
/// by its finisher at once. An error (or a cascade deeper than [`INLINE_DEPTH`]) leaves it to
/// recovery, which claims the outbox's entry when it falls due.
/// `ended`: the lifecycle that finished, as the finisher knows it (else it is read);
/// `downstreams`: the whole set of downstreams, when the finishing call named it (else it is read).
pub(crate) async fn release_owed(
    store: &Store,
    home: u32,
    ukid: &str,
    ended: Option<Ended>,
    downstreams: Option<Vec<String>>,
    depth: usize,
) {
    #[cfg(feature = "test-clock")]
    if store.config.test_no_inline_release {
        return;
    }
    if depth >= INLINE_DEPTH {
        return;
    }
    if let Err(e) = release_from(store, home, ukid, ended, downstreams, depth).await {
        tracing::warn!(upstream = ukid, error = %e, "releasing the downstreams failed; recovery will");
    }
}

/// Runs the release of upstream `ukid`, homed on `home`, that its finish owes (in the outbox):
/// tells every downstream in its set that its latest lifecycle ended, and does what each answer
/// asks (push an opened gate's tokens, finish a downstream failed by it, reopen one it failed
/// before); then takes it out of the outbox. Repeatable. `depth`: how many finishes this one
/// follows in a cascade.
pub(crate) fn release<'a>(
    store: &'a Store,
    home: u32,
    ukid: &'a str,
    depth: usize,
) -> BoxFuture<'a, Result<()>> {
    release_from(store, home, ukid, None, None, depth)
}

/// [`release`] of lifecycle `known` when the caller knows which ended (its finisher), else of the
/// one its home shard says ended last; to the downstreams `named` when the caller knows the whole
/// set (its finishing call named them), else to those the set holds.
fn release_from<'a>(
    store: &'a Store,
    home: u32,
    ukid: &'a str,
    known: Option<Ended>,
    named: Option<Vec<String>>,
    depth: usize,
) -> BoxFuture<'a, Result<()>> {
    Box::pin(async move {
        let ended = match known {
            Some(ended) => ended,
            None => match calls::ended(store, home, ukid).await? {
                Link::Ended(ended) => ended,
                // Running again (requeued after its finish): its next finish owes the next release.
                Link::Live { .. } => {
                    calls::rel_done(store, home, ukid, None).await?;
                    return Ok(());
                }
                // Its marks are gone with its retention: whoever still waits learns it is gone.
                Link::Unknown => Ended { lifecycle: 0, state: "gone".into() },
            },
        };
        let mut cursor = "0".to_owned();
        let mut named = named;
        loop {
            let (next, entries) = match named.take() {
                Some(all) => ("0".to_owned(), all),
                None => calls::downstreams_page(store, home, ukid, &cursor).await?,
            };
            for some in entries.chunks(store.concurrency(CONCURRENT)) {
                try_join_all(some.iter().map(|entry| settle_one(store, entry, ukid, &ended, depth))).await?;
            }
            if next == "0" {
                break;
            }
            cursor = next;
        }
        calls::rel_done(store, home, ukid, Some(ended.lifecycle)).await?;
        Ok(())
    })
}

/// Tells downstream `entry` (`<dkid>|<its token shards>`) that upstream `ukid`'s lifecycle `ended`
/// has ended, and does what its answer asks.
async fn settle_one(store: &Store, entry: &str, ukid: &str, ended: &Ended, depth: usize) -> Result<()> {
    let Some((dkid, shards)) = entry.rsplit_once('|') else { return Ok(()) };
    let shards: u32 = shards.parse().unwrap_or(1).clamp(1, crate::config::MAX_TOKEN_SHARDS);
    settle(store, dkid, shards, ukid, ended, depth, Anchor::Outbox).await
}

/// What makes sure the elements of a gate a settle opens are pushed if its caller dies first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Anchor {
    /// The release's entry in the outbox: it stays until the release is done, and a re-run of
    /// `dag_settle` hands out the elements of a downstream still `queued` again.
    Outbox,
    /// A look armed on the downstream's home shard a grace ahead (`shards::armed`): recovery's
    /// look at a waiting request, which no outbox entry covers.
    Armed,
}

/// `dag_settle` of downstream `dkid` for upstream `ukid`, and what its answer asks.
async fn settle(
    store: &Store,
    dkid: &str,
    shards: u32,
    ukid: &str,
    ended: &Ended,
    depth: usize,
    anchor: Anchor,
) -> Result<()> {
    let settled = match anchor {
        Anchor::Outbox => calls::settle(store, dkid, ukid, ended, 0).await?,
        Anchor::Armed => {
            armed(store, dkid, shards, |deadline| calls::settle(store, dkid, ukid, ended, deadline)).await?
        }
    };
    match settled {
        Settled::Open { priority, shards, group, elements } => {
            let place = Placement { priority, shards, group };
            push(store, dkid, place, Look::More, store.config.census_interval, elements).await?;
        }
        Settled::Finished(finished) => {
            let place = placement(store, &store.keys.request(dkid).meta)
                .await?
                .unwrap_or(Placement::new(Priority::default(), shards));
            finish_at(store, dkid, place, finished, depth + 1).await?;
        }
        Settled::Reopen => {
            if let Some(place) = placement(store, &store.keys.request(dkid).meta).await? {
                tracing::info!(
                    request = dkid,
                    upstream = ukid,
                    "reopening a request its upstream had failed"
                );
                requeue(store, dkid, place).await?;
            }
        }
        Settled::Recorded | Settled::NotLinked => {}
    }
    Ok(())
}

/// Recovery's look at waiting downstream `dkid` (homed by `shards`): each upstream listed (not
/// ended, by its fields) is read where it lives; one that has ended, or is gone, is settled here,
/// in case its release never reached this downstream (its marks expired, or Redis lost them).
pub(crate) async fn check_waiting(
    store: &Store,
    dkid: &str,
    shards: u32,
    upstreams: &[String],
) -> Result<()> {
    for ukid in upstreams {
        let ended = match upstream_now(store, ukid).await? {
            Some(ended) => ended,
            None => continue,
        };
        tracing::info!(
            request = dkid,
            upstream = ukid.as_str(),
            state = ended.state,
            "settling a waiting request's upstream"
        );
        settle(store, dkid, shards, ukid, &ended, 0, Anchor::Armed).await?;
    }
    Ok(())
}

/// Where upstream `ukid` stands, read from its own keys: `None` while it is live, its ended
/// lifecycle once terminal, or `gone` (lifecycle 0) when nothing of it is left.
async fn upstream_now(store: &Store, ukid: &str) -> Result<Option<Ended>> {
    let meta = store.keys.request(ukid).meta;
    let (state, created, gen): (Option<String>, Option<i64>, Option<i64>) = store
        .call("hmget", &meta, || async {
            Ok(store.client.hmget(meta.as_str(), vec!["state", "created", "gen"]).await?)
        })
        .await?;
    if let Some(state) = state {
        let terminal = matches!(state.as_str(), "completed" | "failed" | "cancelled");
        let lifecycle = created.unwrap_or(0) * 1000 + gen.unwrap_or(0);
        return Ok(terminal.then_some(Ended { lifecycle, state }));
    }
    let home = super::lane_home_found(store, ukid).await?;
    Ok(match calls::ended(store, home, ukid).await? {
        Link::Live { .. } => None,
        Link::Ended(ended) => Some(ended),
        Link::Unknown => Some(Ended { lifecycle: 0, state: "gone".into() }),
    })
}
