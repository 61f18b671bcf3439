//! Submitting requests (docs/protocol.md §5, "Submitting"): at once (`submit_open`, `load_parts`,
//! `submit_commit`, or `submit_small` for a request that fits in one chunk; `submit_abort` to give
//! up), or streamed (`stream_open`, `stream_append`, `stream_finalize`). All on a request's keys.

use std::time::Duration;

use fred::types::Value;

use super::{ms, Code, Finished, Func, Refusal};
use crate::error::{Error, Result};
use crate::reply;
use crate::request::RequestId;
use crate::request::{Concurrency, Priority};
use crate::store::Store;

/// What a new request is created with (`submit_open`'s `ARGV[1..9]` and `ARGV[11..14]`; `stream_open`,
/// `submit_small` and `lane_submit` take the same).
#[derive(Clone, Copy, Debug)]
pub(crate) struct NewRequest<'a> {
    /// The id as the producer gave it.
    pub(crate) id: &'a RequestId,
    /// Its key id (`id.key_id()`): its keys follow from it.
    pub(crate) key_id: &'a str,
    /// Its priority.
    pub(crate) priority: Priority,
    /// Its concurrency limit.
    pub(crate) concurrency: Concurrency,
    /// Runs per sub-request at most.
    pub(crate) max_attempts: u32,
    /// Per-attempt timeout, if any.
    pub(crate) timeout: Option<Duration>,
    /// Retry backoff base.
    pub(crate) backoff_base: Duration,
    /// Retry backoff cap.
    pub(crate) backoff_max: Duration,
    /// This submit's random nonce: a re-sent call is recognised, and only this producer may load,
    /// commit, abort or append.
    pub(crate) nonce: &'a str,
    /// Whether the first dead letter ends the request as failed.
    pub(crate) fail_fast: bool,
    /// The token shards it is submitted with.
    pub(crate) shards: u32,
    /// Redis time (ms) by which it must be created (its registration's deadline).
    pub(crate) deadline: i64,
    /// Its tags (at most `MAX_TAGS`, each checked by `RequestBuilder::tag`).
    pub(crate) tags: &'a [String],
    /// Whether it is entered in the listing index (`RequestBuilder::unlisted`).
    pub(crate) listed: bool,
    /// A streamed request's window: at most this many parts unsettled (0 = none; `stream_open`'s
    /// `ARGV[15]`).
    pub(crate) window: u64,
    /// A request whose `ok` results are never stored (`RequestBuilder::discard_results`; in the
    /// flags, `flags`, and for a streamed one `stream_open`'s `ARGV[16]` too).
    pub(crate) discard: bool,
    /// Its trace context, stored as `trace` for the workers' spans (`otel`; empty: none).
    pub(crate) trace: &'a str,
    /// Its deadline, as the time left from the producer's now (`RequestBuilder::deadline`): the
    /// creating call stores Redis's now plus this as `dl`. `None`: no deadline.
    pub(crate) finish_within: Option<Duration>,
    /// Its rate limit: at most this many parts started per interval (`RequestBuilder::rate`).
    pub(crate) rate: Option<(u32, Duration)>,
    /// The key ids of its upstreams (`RequestBuilder::after`; empty: none), and whether it runs
    /// when one of them fails (`OnUpstreamFailure::Run`) instead of failing.
    pub(crate) upstreams: &'a [String],
    pub(crate) run_after_failure: bool,
    /// Its tenant group (`RequestBuilder::group`), if any.
    pub(crate) group: Option<&'a str>,
}

impl NewRequest<'_> {
    /// `submit_open`'s arguments up to `ARGV[13]`, with `delay_or_expiry` as `ARGV[10]` (a delay;
    /// for `stream_open`, the open expiry) and `flags` as `ARGV[11]` (`flags`, or for
    /// `stream_open` `fail_fast_arg`).
    fn args(&self, store: &Store, delay_or_expiry: Duration, flags: &'static str) -> Vec<Value> {
        vec![
            self.id.as_str().into(),
            i64::from(self.priority.get()).into(),
            i64::from(self.concurrency.get()).into(),
            ms(store.config.loading_ttl),
            i64::from(self.max_attempts).into(),
            ms(self.timeout.unwrap_or(Duration::ZERO)),
            ms(self.backoff_base),
            ms(self.backoff_max),
            self.nonce.into(),
            ms(delay_or_expiry),
            flags.into(),
            i64::from(self.shards).into(),
            self.deadline.into(),
        ]
    }

    /// Its flags as `submit_open` and the lane submits take them (prelude.lua, `sg_flags`): `1`
    /// for fail fast (`0` for not), then `d` when its results are discarded.
    pub(crate) fn flags(&self) -> &'static str {
        match (self.fail_fast, self.discard) {
            (false, false) => "0",
            (true, false) => "1",
            (false, true) => "0d",
            (true, true) => "1d",
        }
    }

    /// Fail fast alone, `1` or `0`: `stream_open`'s argument, which has discarding apart.
    fn fail_fast_arg(&self) -> &'static str {
        if self.fail_fast {
            "1"
        } else {
            "0"
        }
    }

    /// The deadline and rate arguments the creating calls take after the trace context (ms,
    /// 0: none; `<R>/<interval ms>`, '': none).
    fn limits(&self) -> [Value; 2] {
        let rate = self.rate.map_or(String::new(), |(n, per)| format!("{n}/{}", crate::config::millis(per)));
        [ms(self.finish_within.unwrap_or(Duration::ZERO)), rate.into()]
    }
}

/// `submit_small`: the whole request in one call, `delay` before it runs. Returns the token
/// elements to push.
pub(crate) async fn submit_small(
    store: &Store,
    req: &NewRequest<'_>,
    delay: Duration,
    parts: Vec<Value>,
) -> Result<Vec<Value>> {
    let keys = store.keys.request(req.key_id);
    let mut args = req.args(store, delay, req.flags());
    args.extend([req.key_id.into(), req.trace.into()]);
    args.extend(req.limits());
    args.extend(parts);
    reply::array(store.fcall(Func::SubmitSmall, &keys.all(), args).await.map_err(|e| created(req.id, e))?)
}

/// `submit_open`: creates the request in state `loading`, `delay` before it runs once committed.
pub(crate) async fn submit_open(store: &Store, req: &NewRequest<'_>, delay: Duration) -> Result<()> {
    let keys = store.keys.request(req.key_id);
    let mut args = req.args(store, delay, req.flags());
    args.push(req.trace.into());
    args.extend(req.limits());
    if !req.upstreams.is_empty() || req.group.is_some() {
        args.push((if req.run_after_failure { "run" } else { "fail" }).into());
        args.push(req.upstreams.join(",").into());
    }
    if let Some(group) = req.group {
        args.push(group.into());
    }
    // Returns 1: nothing to read.
    store.fcall(Func::SubmitOpen, &keys.all(), args).await.map_err(|e| created(req.id, e))?;
    Ok(())
}

/// `load_parts`: adds `parts`, the first of them part number `first`, to loading request
/// `key_id`. Returns how many parts its stream holds.
pub(crate) async fn load_parts(
    store: &Store,
    key_id: &str,
    nonce: &str,
    first: u64,
    parts: Vec<Value>,
) -> Result<i64> {
    let keys = store.keys.request(key_id);
    let mut args: Vec<Value> = Vec::with_capacity(parts.len() + 2);
    args.push(nonce.into());
    args.push((first as i64).into());
    args.extend(parts);
    match store.fcall(Func::LoadParts, &keys.all(), args).await {
        Ok(reply) => reply::int(&reply),
        Err(e) => Err(refused(&id_of(key_id)?, e, Error::Expired, None)),
    }
}

/// One upstream of a downstream being committed, as its link found it: key id, lifecycle, and
/// its end (`None`: not ended).
pub(crate) type Linked = (String, i64, Option<String>);

/// What `submit_commit` made of the request.
#[derive(Debug)]
pub(crate) enum Committed {
    /// Runnable (or delayed, or a downstream left waiting): the token elements to push.
    Elements(Vec<Value>),
    /// A downstream whose upstream failed: it ended at once, failed; the steps after its finish
    /// follow.
    Failed(Finished),
}

/// `submit_commit`: makes loading request `key_id`, of `total` parts, runnable; a downstream with
/// `links`, what its links (`dag_link`) found of each of its upstreams.
pub(crate) async fn submit_commit(
    store: &Store,
    key_id: &str,
    total: u64,
    nonce: &str,
    links: &[Linked],
) -> Result<Committed> {
    let keys = store.keys.request(key_id);
    let mut args: Vec<Value> = vec![key_id.into(), (total as i64).into(), nonce.into()];
    if !links.is_empty() {
        args.extend([ms(store.config.retention), store.keys.done_channel().into()]);
        for (ukid, lifecycle, end) in links {
            let (status, state) = match end.as_deref() {
                None => ("w", ""),
                Some("completed") => ("c", "completed"),
                Some(other) => ("f", other),
            };
            args.extend([ukid.as_str().into(), (*lifecycle).into(), status.into(), state.into()]);
        }
    }
    let mut items = match store.fcall(Func::SubmitCommit, &keys.all(), args).await {
        Ok(reply) => reply::array(reply)?,
        Err(e) => return Err(created(&id_of(key_id)?, e)),
    };
    if items.first().and_then(Value::as_str).as_deref() == Some("finished") {
        items.remove(0);
        return Ok(Committed::Failed(Finished::from_reply(items.into_iter())?));
    }
    Ok(Committed::Elements(items))
}

/// `submit_abort`: deletes loading request `key_id` if it is this producer's (`nonce`). Returns
/// whether its keys were deleted.
pub(crate) async fn submit_abort(store: &Store, key_id: &str, nonce: &str) -> Result<bool> {
    let keys = store.keys.request(key_id);
    Ok(reply::int(&store.fcall(Func::SubmitAbort, &keys.all(), vec![nonce.into()]).await?)? == 1)
}

/// `stream_open`: starts a streamed request, cancelled by recovery if still open `expiry` after
/// (never, if `None`). Its tokens start parked: the elements it returns are none, and not read.
pub(crate) async fn stream_open(store: &Store, req: &NewRequest<'_>, expiry: Option<Duration>) -> Result<()> {
    let keys = store.keys.request(req.key_id);
    let mut args: Vec<Value> = vec![req.key_id.into()];
    // Its fail-fast argument (ARGV 12) stays `1`/`0`, without the flags' `d`: discarding is ARGV
    // 16's, which a library from before whole requests could discard reads too (that one would
    // store `1d` as `failfast`, and not fail fast).
    args.extend(req.args(store, expiry.unwrap_or(Duration::ZERO), req.fail_fast_arg()));
    args.push((req.window as i64).into());
    args.push((if req.discard { "1" } else { "0" }).into());
    args.push(req.trace.into());
    args.extend(req.limits());
    args.push(req.group.unwrap_or_default().into());
    store.fcall(Func::StreamOpen, &keys.all(), args).await.map_err(|e| created(req.id, e))?;
    Ok(())
}

/// What `stream_append` answers.
#[derive(Debug)]
pub(crate) struct Appended {
    /// The request's priority now, whose lists the elements go to (an operator may have changed
    /// it since the request was opened); `None` from an older library.
    pub(crate) priority: Option<Priority>,
    /// For a windowed request: its parts not settled yet, after this call.
    pub(crate) outstanding: Option<u64>,
    /// The token elements to push.
    pub(crate) elements: Vec<Value>,
}

/// `stream_append`: adds `parts`, the first of them part number `first`, to open request
/// `key_id`; `deadline` is the one of the producer's arm. The reply starts with the request's
/// priority, then, when `windowed` (the request was opened with a window), its outstanding parts.
pub(crate) async fn stream_append(
    store: &Store,
    key_id: &str,
    nonce: &str,
    first: u64,
    deadline: i64,
    windowed: bool,
    parts: Vec<Value>,
) -> Result<Appended> {
    let keys = store.keys.request(key_id);
    let mut args: Vec<Value> = Vec::with_capacity(parts.len() + 4);
    args.extend([key_id.into(), nonce.into(), (first as i64).into(), deadline.into()]);
    args.extend(parts);
    let mut elements = match store.fcall(Func::StreamAppend, &keys.all(), args).await {
        Ok(reply) => reply::array(reply)?,
        Err(e) => return Err(refused(&id_of(key_id)?, e, Error::NotOpen, None)),
    };
    let first_item = |elements: &mut Vec<Value>| (!elements.is_empty()).then(|| elements.remove(0));
    let priority = super::priority_item(first_item(&mut elements))?;
    let outstanding = match first_item(&mut elements) {
        Some(n) if windowed => Some(reply::int(&n)?.max(0) as u64),
        Some(element) => {
            elements.insert(0, element);
            None
        }
        None => None,
    };
    Ok(Appended { priority, outstanding, elements })
}

/// `outstanding`: the parts of open request `key_id` not settled yet, or `None` when it is not
/// open for parts any more (finalized, cancelled, finished, expired or unknown).
pub(crate) async fn outstanding(store: &Store, key_id: &str) -> Result<Option<u64>> {
    let keys = store.keys.request(key_id);
    let n = reply::int(&store.fcall(Func::Outstanding, &[keys.meta.as_str()], Vec::new()).await?)?;
    Ok(u64::try_from(n).ok())
}

/// One part's outcome in a `results_from` page, as stored.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// `ok`: the result bytes (MessagePack).
    Ok(bytes::Bytes),
    /// `err`: the error record of a dead letter (or a terminal request's last failure).
    Err(bytes::Bytes),
    /// `none`: a part of a terminal request that never ended.
    None,
}

/// What `results_from` answers.
#[derive(Debug)]
pub(crate) struct Page {
    /// The request's state.
    pub(crate) state: String,
    /// Its number of parts once no more can be added.
    pub(crate) total: Option<u64>,
    /// The index of the first outcome.
    pub(crate) first: u64,
    /// The outcomes, in part order.
    pub(crate) outcomes: Vec<Outcome>,
}

/// Why `results_from` refused.
#[derive(Debug)]
pub(crate) enum PageRefused {
    /// `SGSTATE`: unknown request, or `first` below records deleted already (the reason).
    State(String),
    /// `SGINVALID`: not a streamed request, or its results are discarded (the reason).
    Invalid(String),
    /// `SGGAP`: `first` is past the results taken so far (the reason).
    Gap(String),
}

/// `results_from`: up to `count` outcomes of request `key_id` from part `first`, deleting those
/// below `first` (the reader holds them).
pub(crate) async fn results_from(
    store: &Store,
    key_id: &str,
    first: u64,
    count: usize,
) -> Result<std::result::Result<Page, PageRefused>> {
    let keys = store.keys.request(key_id);
    let args: Vec<Value> = vec![(first as i64).into(), (count.max(1) as i64).into()];
    let reply = match store.fcall(Func::ResultsFrom, &keys.all(), args).await {
        Ok(reply) => reply,
        Err(e) => {
            let Some(r) = Refusal::of(&e) else { return Err(e) };
            return Ok(Err(match r.code {
                Code::State => PageRefused::State(r.why),
                Code::Gap => PageRefused::Gap(r.why),
                Code::Invalid => PageRefused::Invalid(r.why),
                _ => return Err(e),
            }));
        }
    };
    let mut items = reply::array(reply)?.into_iter();
    let mut next = || items.next().ok_or_else(|| Error::Protocol("results_from: short reply".into()));
    let state = reply::text(&next()?)?;
    let total = u64::try_from(reply::int(&next()?)?).ok();
    let first = reply::int(&next()?)?.max(0) as u64;
    let mut outcomes = Vec::new();
    while let Ok(tag) = next() {
        let body = reply::bytes(next()?)?;
        outcomes.push(match reply::text(&tag)?.as_str() {
            "ok" => Outcome::Ok(body),
            "err" => Outcome::Err(body),
            _ => Outcome::None,
        });
    }
    Ok(Ok(Page { state, total, first, outcomes }))
}

/// What `stream_finalize` answers.
#[derive(Debug)]
pub(crate) enum Finalized {
    /// `{'open'}`: parts are still to run (or any reply but a finish).
    Open,
    /// `{'finished', ...}`: every part was done; the request just turned terminal.
    Finished(Finished),
}

/// `stream_finalize`: no more parts for request `key_id` (`nonce` empty: an operator's finalize).
pub(crate) async fn stream_finalize(store: &Store, key_id: &str, nonce: &str) -> Result<Finalized> {
    let keys = store.keys.request(key_id);
    let args: Vec<Value> =
        vec![key_id.into(), ms(store.config.retention), store.keys.done_channel().into(), nonce.into()];
    let reply = match store.fcall(Func::StreamFinalize, &keys.all(), args).await {
        Ok(reply) => reply,
        Err(e) => return Err(refused(&id_of(key_id)?, e, Error::NotOpen, None)),
    };
    let mut items = reply::array(reply)?.into_iter();
    if items.next().and_then(|v| v.as_string()).as_deref() == Some("finished") {
        return Ok(Finalized::Finished(Finished::from_reply(items)?));
    }
    Ok(Finalized::Open)
}

/// The error a refused submit call means to its producer. The library's refusals mean the same
/// for every submit call (an argument out of range; parts missing that the producer sent, a write
/// lost between producer and Redis; the id in use), except `SGSTATE` (`state`: a request no longer
/// loading has expired, a streamed one that is not open takes no parts) and `SGLATE` (`late`: a
/// request not created in time has expired; a streamed step past its arm's deadline is left to
/// its caller, which arms again). Any other error is returned as it is.
fn refused(
    id: &RequestId,
    e: Error,
    state: fn(RequestId) -> Error,
    late: Option<fn(RequestId) -> Error>,
) -> Error {
    let Some(r) = Refusal::of(&e) else { return e };
    match r.code {
        Code::Duplicate => Error::DuplicateRequestId(id.clone()),
        Code::Invalid => Error::InvalidRequest(r.why),
        Code::Gap | Code::Incomplete => Error::Protocol(format!(
            "request \"{id}\": Redis does not hold every part this producer sent ({}); submit it again",
            r.why
        )),
        Code::State => state(id.clone()),
        Code::Late => late.map_or(e, |late| late(id.clone())),
    }
}

/// [`refused`] for a call that creates a request (or commits it): refused as not loading, or too
/// late, it has expired.
pub(super) fn created(id: &RequestId, e: Error) -> Error {
    refused(id, e, Error::Expired, Some(Error::Expired))
}

/// The request id behind `key_id`, for an error about it.
fn id_of(key_id: &str) -> Result<RequestId> {
    Ok(RequestId::from_key_id(key_id)?)
}
