//! The reference model: what the checker knows happened (submits accepted, verdicts given,
//! requests cancelled), and the invariants of CONTRACT.md checked against Redis's state.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use fred::prelude::*;

use super::gate::{Fault, Verdict};
use super::ops::{Shape, Submit, REQUEST_IDS};
use super::world::{payload, request_id, Task, World};
use crate::request::RequestId;

/// How an actor's task ended (the details are for traces: `SLUICEGATE_CHECK_TRACE`).
#[derive(Clone, Debug)]
#[allow(dead_code)]
pub(crate) enum Outcome {
    Done,
    Error(String),
    /// `submit` returned Ok: the request is accepted with this many parts.
    Accepted(u64),
    /// `submit` was refused because the id is in use.
    Duplicate,
    /// A streamed request: `added` parts surely added, `ambiguous` more maybe (an `add` that
    /// failed after its call may have run); `error` if it did not get through.
    Streamed {
        added: u64,
        ambiguous: u64,
        error: Option<String>,
    },
    /// This call cancelled the request.
    Cancelled,
    Requeued(u64),
    /// A page of results read from part `first` (`Err` carries a failure's attempts), of a
    /// request that was terminal or not when it was read.
    Read {
        first: u64,
        terminal: bool,
        results: Vec<Result<u64, u32>>,
    },
}

impl Outcome {
    pub(crate) fn from_submit(r: crate::Result<u64>) -> Outcome {
        match r {
            Ok(parts) => Outcome::Accepted(parts),
            Err(crate::Error::DuplicateRequestId(_)) => Outcome::Duplicate,
            Err(e) => Outcome::Error(e.to_string()),
        }
    }
}

/// What the model knows of one request id.
#[derive(Default, Debug)]
pub(crate) struct Req {
    /// Submits that returned Ok (more than one while the first is retained is a bug).
    pub(crate) accepted: u32,
    /// The accepted submit, and its parts: at least, at most (streamed adds may be ambiguous).
    pub(crate) spec: Option<Submit>,
    pub(crate) parts: (u64, u64),
    /// A streamed request that was opened (accepted) but whose producer did not finalize it.
    pub(crate) unfinalized: bool,
    /// An operator's cancel took effect (or may have: it failed after its call ran).
    pub(crate) cancelled: bool,
    /// Parts a handler failed at least once.
    pub(crate) failed_parts: BTreeSet<u64>,
    /// What the reader took with `results_from`, by part (`Err`: a failure), and where its next
    /// page starts.
    pub(crate) read: BTreeMap<u64, Result<u64, u32>>,
    pub(crate) read_next: u64,
    /// An operator asked to requeue its dead letters (its outstanding parts may then pass its
    /// window).
    pub(crate) requeue_tried: bool,
}

#[derive(Default)]
pub(crate) struct Model {
    pub(crate) requests: BTreeMap<u8, Req>,
    /// Per live actor, the request key ids its current task has touched.
    touched: HashMap<u64, BTreeSet<String>>,
    /// Per live actor blocked in a handler: the run (request, index, attempt).
    pub(crate) running: HashMap<u64, (String, u64, u32)>,
    /// A broken promise found outside a step's checks (a page of results that is wrong).
    pub(crate) broken: Option<String>,
}

/// The key id in a request key `<ns>:r:{<kid>}…`.
fn kid_of(key: &str) -> Option<&str> {
    let rest = key.split_once(":r:{")?.1;
    rest.split_once('}').map(|(kid, _)| kid)
}

impl Model {
    pub(crate) fn submitting(&mut self, _s: &Submit) {}

    pub(crate) fn call(&mut self, actor: u64, _what: &str, key: &str, _fault: Fault) {
        if let Some(kid) = kid_of(key) {
            self.touched.entry(actor).or_default().insert(kid.to_owned());
        }
        self.running.remove(&actor);
    }

    pub(crate) fn handler_started(&mut self, actor: u64, request: &str, index: u64, attempt: u32) {
        self.running.insert(actor, (request.to_owned(), index, attempt));
    }

    pub(crate) fn verdict(&mut self, request: &str, index: u64, _attempt: u32, verdict: Verdict) {
        let running: Vec<u64> =
            self.running.iter().filter(|(_, r)| r.0 == request && r.1 == index).map(|(a, _)| *a).collect();
        for a in running {
            self.running.remove(&a);
        }
        if verdict != Verdict::Ok {
            if let Some(r) = index_of(request) {
                self.requests.entry(r).or_default().failed_parts.insert(index);
            }
        }
    }

    pub(crate) fn touched(&self, actor: u64, kid: &str) -> bool {
        self.touched.get(&actor).is_some_and(|t| t.contains(kid))
    }

    pub(crate) fn died(&mut self, actor: u64, what: &Task) {
        self.touched.remove(&actor);
        self.running.remove(&actor);
        // A cancel that died after its call may have taken effect.
        if let Task::Cancel(i) = what {
            self.requests.entry(*i).or_default().cancelled = true;
        }
    }

    pub(crate) fn ended(&mut self, what: &Task, outcome: Outcome) {
        match (what, outcome) {
            (Task::Submit(s), Outcome::Accepted(parts)) => {
                let r = self.requests.entry(s.request).or_default();
                r.accepted += 1;
                r.spec = Some(s.clone());
                r.parts = (parts, parts);
            }
            (Task::Submit(s), Outcome::Streamed { added, ambiguous, error }) => {
                let finalized = matches!(s.shape, Shape::Streamed { finalize: true, .. }) && error.is_none();
                // An open that failed (a duplicate, say) surfaces as an Error outcome instead.
                let r = self.requests.entry(s.request).or_default();
                r.accepted += 1;
                r.spec = Some(s.clone());
                r.parts = (added, added + ambiguous);
                r.unfinalized = !finalized;
            }
            (Task::Cancel(i), Outcome::Cancelled | Outcome::Error(_)) => {
                self.requests.entry(*i).or_default().cancelled = true
            }
            (Task::Read(i, asked), Outcome::Read { first, terminal, results }) => {
                let r = self.requests.entry(*i).or_default();
                let req = request_id(*i);
                if first != *asked {
                    self.broken = Some(format!("{req}: a page asked from {asked} starts at {first}"));
                    return;
                }
                let len = results.len() as u64;
                for (n, got) in results.into_iter().enumerate() {
                    let index = first + n as u64;
                    let want = payload(*i, index) * 3;
                    let wrong = match got {
                        Ok(v) => v != want,
                        // A failure is read only for a part that failed, or (attempts 0: nothing
                        // recorded) of a request that ended before the part did.
                        Err(0) => !terminal,
                        Err(_) => !r.failed_parts.contains(&index),
                    };
                    // A page read again (its reply was lost) answers as before.
                    let changed = r.read.get(&index).is_some_and(|before| *before != got);
                    if wrong || changed {
                        self.broken = Some(format!(
                            "{req}: part {index} read as {got:?} (before: {:?}; its result is {want})",
                            r.read.get(&index)
                        ));
                        return;
                    }
                    r.read.insert(index, got);
                }
                r.read_next = r.read_next.max(first + len);
            }
            _ => {}
        }
    }
}

fn index_of(request: &str) -> Option<u8> {
    request.strip_prefix('r')?.parse().ok()
}

/// One request's state in Redis.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    pub(crate) meta: HashMap<String, String>,
    pub(crate) events: u64,
    pub(crate) indexed: bool,
    /// How many parts have a result, and how many are dead letters (in the retry set at +inf).
    pub(crate) results: u64,
    pub(crate) dead: u64,
    /// Entries listed both as orphans and in the retry set (each must be in at most one: one
    /// listing is one hand-out).
    pub(crate) listed_twice: Vec<String>,
    /// A lane request (its `meta` is its record): its results and errors by index, and whether a
    /// token of its lane is held by a holder.
    pub(crate) lane: Option<LaneSeen>,
}

/// What a lane request's record holds beside its fields.
#[derive(Debug, Default)]
pub(crate) struct LaneSeen {
    pub(crate) results: HashMap<u64, u64>,
    pub(crate) errors: HashMap<u64, String>,
    /// Holders of its lane's held tokens.
    pub(crate) holders: Vec<String>,
}

impl Seen {
    fn num(&self, field: &str) -> u64 {
        self.meta.get(field).and_then(|v| v.parse().ok()).unwrap_or(0)
    }
    fn state(&self) -> &str {
        self.meta.get("state").map_or("", String::as_str)
    }
    pub(crate) fn terminal(&self) -> bool {
        matches!(self.state(), "completed" | "failed" | "cancelled")
    }
    /// Token fields `t<k>` = value.
    fn tokens(&self) -> impl Iterator<Item = (&str, &str)> {
        self.meta
            .iter()
            .filter(|(k, _)| k.starts_with('t') && k[1..].chars().all(|c| c.is_ascii_digit()) && k.len() > 1)
            .map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// The registered workers and when their registrations expire (the functions' clock).
pub(crate) async fn registry(world: &World) -> Result<HashMap<String, u64>, String> {
    let ns = world.config.namespace_str();
    let entries: Vec<(String, f64)> = world
        .reader
        .zrange(format!("{ns}:{{{ns}.q0}}:workers"), 0, -1, None, false, None, true)
        .await
        .map_err(|e| e.to_string())?;
    Ok(entries.into_iter().map(|(w, s)| (w, s as u64)).collect())
}

/// Reads every request of the pool, the active index and the events stream (one round trip).
pub(crate) async fn snapshot(world: &World) -> Result<(BTreeMap<u8, Seen>, u64), String> {
    let c = &world.reader;
    let e = |e: fred::error::Error| e.to_string();
    let ns = world.config.namespace_str();
    let pipe = c.pipeline();
    let _: () =
        pipe.zrange(format!("{ns}:{{{ns}.q0}}:active"), 0, -1, None, false, None, false).await.map_err(e)?;
    let _: () = pipe.xrange(format!("{ns}:{{{ns}.q0}}:events"), "-", "+", None).await.map_err(e)?;
    let _: () = pipe
        .custom(
            fred::types::CustomCommand::new_static("TIME", fred::types::ClusterHash::Random, false),
            Vec::<Value>::new(),
        )
        .await
        .map_err(e)?;
    for i in 0..REQUEST_IDS {
        let kid = request_id(i).key_id();
        let _: () = pipe.hgetall(format!("{ns}:{{{ns}.q0}}:s:{kid}")).await.map_err(e)?;
        let _: () = pipe.hgetall(format!("{ns}:r:{{{kid}}}")).await.map_err(e)?;
        let _: () = pipe.hlen(format!("{ns}:r:{{{kid}}}:res")).await.map_err(e)?;
        let _: () =
            pipe.zcount(format!("{ns}:r:{{{kid}}}:retry"), f64::INFINITY, f64::INFINITY).await.map_err(e)?;
        let _: () = pipe.lrange(format!("{ns}:r:{{{kid}}}:orph"), 0, -1).await.map_err(e)?;
        let _: () = pipe
            .zrange(format!("{ns}:r:{{{kid}}}:retry"), 0, -1, None, false, None, false)
            .await
            .map_err(e)?;
    }
    let mut replies: std::vec::IntoIter<Value> = pipe.all::<Vec<Value>>().await.map_err(e)?.into_iter();
    let mut next = || replies.next().unwrap_or(Value::Null);
    let active: Vec<String> = next().convert().map_err(e)?;
    let events: Vec<(String, HashMap<String, String>)> = next().convert().map_err(e)?;
    let (secs, micros): (u64, u64) = next().convert().map_err(e)?;
    let now = secs * 1000 + micros / 1000 + world.clock_ms;
    let mut out = BTreeMap::new();
    let mut lanes: HashMap<String, Vec<String>> = HashMap::new();
    for i in 0..REQUEST_IDS {
        let kid = request_id(i).key_id();
        let record: HashMap<String, Vec<u8>> = next().convert().map_err(e)?;
        let meta: HashMap<String, String> = next().convert().map_err(e)?;
        let results: u64 = next().convert().map_err(e)?;
        let dead: u64 = next().convert().map_err(e)?;
        let orphans: Vec<String> = next().convert().map_err(e)?;
        let retry: Vec<String> = next().convert().map_err(e)?;
        let listed_twice = orphans.into_iter().filter(|id| retry.contains(id)).collect();
        let events = events.iter().filter(|(_, f)| f.get("rid") == Some(&kid)).count() as u64;
        if meta.is_empty() && !record.is_empty() {
            out.insert(i, lane_seen(world, &mut lanes, &active, record, events).await?);
            continue;
        }
        let lane = None;
        out.insert(
            i,
            Seen { meta, events, indexed: active.contains(&kid), results, dead, listed_twice, lane },
        );
    }
    Ok((out, now))
}

/// A lane request as `snapshot` sees it, from its record: indexed while its lane is (its parts
/// are in the lane, or wait in the record for one of them to settle); `lanes` caches the holders
/// of each lane's held tokens.
async fn lane_seen(
    world: &World,
    lanes: &mut HashMap<String, Vec<String>>,
    active: &[String],
    record: HashMap<String, Vec<u8>>,
    events: u64,
) -> Result<Seen, String> {
    let ns = world.config.namespace_str();
    let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
    let meta = crate::protocol::lane::record_meta(&record);
    let prio = meta.get("prio").cloned().unwrap_or_default();
    let lane_kid = format!("~0.{prio}");
    if !lanes.contains_key(&lane_kid) {
        let lane_meta: HashMap<String, String> =
            world.reader.hgetall(format!("{ns}:{{{ns}.q0}}:lane:{prio}")).await.map_err(|e| e.to_string())?;
        let holders = lane_meta
            .iter()
            .filter(|(k, v)| k.starts_with('t') && v.starts_with("h|"))
            .filter_map(|(_, v)| v.split('|').nth(2).map(str::to_owned))
            .collect();
        lanes.insert(lane_kid.clone(), holders);
    }
    let mut lane = LaneSeen { holders: lanes[&lane_kid].clone(), ..LaneSeen::default() };
    let mut dead = 0;
    for (field, value) in record {
        let index = field.get(1..).and_then(|i| i.parse::<u64>().ok());
        match (field.chars().next(), index) {
            (Some('o'), Some(index)) => {
                lane.results.insert(index, rmp_serde::from_slice(&value).unwrap_or(u64::MAX));
            }
            (Some('e'), Some(index)) => {
                lane.errors.insert(index, text(&value));
            }
            (Some('x'), Some(_)) => dead += 1,
            _ => {}
        }
    }
    let results = lane.results.len() as u64;
    let indexed = active.contains(&lane_kid);
    Ok(Seen { meta, events, indexed, results, dead, listed_twice: Vec::new(), lane: Some(lane) })
}

/// The invariants that hold after every step.
pub(crate) async fn check_step(world: &World) -> Result<(), String> {
    if let Some(broken) = &world.model.broken {
        return Err(broken.clone());
    }
    let (seen, now) = snapshot(world).await?;
    for (i, s) in &seen {
        let r = request_id(*i);
        if s.meta.is_empty() {
            continue;
        }
        let limit = s.num("limit");
        let ntok = s.num("ntok");
        let held = s.tokens().filter(|(_, v)| v.starts_with("h|")).count() as u64;
        if ntok > limit || held > ntok {
            return Err(format!("{r}: {held} tokens held, {ntok} tokens, limit {limit}"));
        }
        // Exactly one event per finished lifecycle: never more, and written before the seal.
        let gen = s.num("gen");
        if s.events > gen + 1 {
            return Err(format!("{r}: {} events for lifecycle {gen} (one per lifecycle)", s.events));
        }
        if s.terminal()
            && s.meta.get("sealed").is_some_and(|v| v.parse::<u64>().ok() == Some(gen))
            && s.events != gen + 1
        {
            return Err(format!("{r}: sealed lifecycle {gen} with {} events", s.events));
        }
        // Its counters say what is left: every part without a result or a dead letter, no more, no
        // less (a part counted down twice ends a request while another part still has to run).
        // Results taken by the reader and deleted (`ntaken`), and results not stored (`discarded`),
        // count as results.
        if !s.terminal() && s.state() != "loading" {
            let (total, left, failed) = (s.num("total"), s.num("left"), s.num("failed"));
            let results = s.results + s.num("ntaken") + s.num("discarded");
            if left + results + s.dead != total || failed != s.dead {
                return Err(format!(
                    "{r}: left {left} and failed {failed}, but {results} of {total} parts have results \
                     ({} stored, {} taken, {} discarded) and {} are dead letters",
                    s.results,
                    s.num("ntaken"),
                    s.num("discarded"),
                    s.dead
                ));
            }
            // A windowed producer never lets more than its window of parts be unsettled, unless
            // a requeue gave some back.
            let window = s.num("window");
            let requeued = world.model.requests.get(i).is_some_and(|m| m.requeue_tried);
            if window > 0 && left > window && !requeued {
                return Err(format!("{r}: {left} parts unsettled, above its window of {window}"));
            }
        }
        // An entry waits in one place to be handed out again: listed twice, it runs twice and
        // (were `left` counted per ack) ends the request while another part still has to run.
        if !s.listed_twice.is_empty() {
            return Err(format!("{r}: entries both orphaned and in the retry set: {:?}", s.listed_twice));
        }
        // A request that exists, accepted work in it, must be where recovery finds it.
        if !s.terminal() && s.state() != "loading" && !s.indexed {
            return Err(format!(
                "{r}: state {} but not in the active index: nobody will recover it",
                s.state()
            ));
        }
    }
    // Handlers under live leases never above the limit. A lease is live while its holder's worker
    // is registered and its registration has not expired.
    let workers = registry(world).await?;
    let mut live: HashMap<String, u64> = HashMap::new();
    for (actor, (request, index, _)) in &world.model.running {
        let Some(holder) = world.holder_of(*actor) else { continue };
        let Some(i) = index_of(request) else { continue };
        let Some(s) = seen.get(&i) else { continue };
        let entry = format!("0-{}", index + 1);
        let worker_live =
            workers.get(holder.split('/').next().unwrap_or_default()).is_some_and(|&expiry| expiry > now);
        let lane_held = s.lane.as_ref().is_some_and(|l| l.holders.iter().any(|h| h.as_str() == holder));
        let under_live_lease = worker_live
            && (lane_held
                || s.tokens().any(|(_, v)| {
                    let f: Vec<&str> = v.split('|').collect();
                    f.len() >= 5 && f[0] == "h" && f[2] == holder && f[4].split(',').any(|id| id == entry)
                }));
        if under_live_lease {
            *live.entry(request.clone()).or_default() += 1;
        }
    }
    for (request, n) in live {
        let limit = index_of(&request).and_then(|i| seen.get(&i)).map_or(0, |s| s.num("limit"));
        if n > limit {
            return Err(format!("{request}: {n} handlers run under live leases, limit {limit}"));
        }
    }
    for (i, r) in &world.model.requests {
        if r.accepted > 1 {
            return Err(format!("{}: accepted {} times while retained", request_id(*i), r.accepted));
        }
    }
    Ok(())
}

/// The invariants that hold once everything has drained: every accepted part ended with a result
/// or a dead letter, one terminal record and one event per lifecycle, nothing left to expire.
pub(crate) async fn check_end(world: &World) -> Result<(), String> {
    let (seen, _) = snapshot(world).await?;
    let c = &world.reader;
    let e = |e: fred::error::Error| e.to_string();
    let ns = world.config.namespace_str();
    for (i, s) in &seen {
        let r = request_id(*i);
        let model = world.model.requests.get(i);
        let accepted = model.is_some_and(|m| m.accepted > 0);
        if s.meta.is_empty() {
            if accepted {
                return Err(format!("{r}: accepted, but its record is gone"));
            }
            continue;
        }
        if s.state() == "loading" {
            if accepted {
                return Err(format!("{r}: accepted, but still loading"));
            }
            continue;
        }
        if !s.terminal() {
            return Err(format!("{r}: stuck in state {} after the drain: {:?}", s.state(), s.meta));
        }
        let gen = s.num("gen");
        if s.events != gen + 1 {
            return Err(format!("{r}: {} events for {} lifecycles", s.events, gen + 1));
        }
        let total = s.num("total");
        if let Some(m) = model.filter(|m| m.accepted > 0) {
            if total < m.parts.0 || total > m.parts.1 {
                return Err(format!("{r}: {total} parts, the producer added {:?}", m.parts));
            }
            if s.state() == "cancelled" && !m.cancelled && !m.unfinalized {
                return Err(format!("{r}: cancelled, but nobody cancelled it"));
            }
        }
        // Outcomes below `tfirst` were taken by the reader and deleted: it must hold each of them.
        let tfirst = s.num("tfirst");
        for index in 0..tfirst {
            if !model.is_some_and(|m| m.read.contains_key(&index)) {
                return Err(format!("{r}: part {index}'s outcome was deleted, but the reader never got it"));
            }
        }
        let discard = s.meta.get("discard").map(String::as_str) == Some("1");
        if discard && s.state() == "completed" {
            let ok = s.results + s.num("ntaken") + s.num("discarded");
            if s.results > 0 || ok != total {
                return Err(format!(
                    "{r}: completed with {total} parts, {} results stored, {ok} counted",
                    s.results
                ));
            }
        }
        let kid = r.key_id();
        let (results, errors): (HashMap<u64, u64>, HashMap<u64, String>) = match &s.lane {
            Some(lane) => (lane.results.clone(), lane.errors.clone()),
            None => {
                let raw: HashMap<u64, Vec<u8>> =
                    c.hgetall(format!("{ns}:r:{{{kid}}}:res")).await.map_err(e)?;
                let results = raw
                    .into_iter()
                    .map(|(k, v)| (k, rmp_serde::from_slice(&v).unwrap_or(u64::MAX)))
                    .collect();
                (results, c.hgetall(format!("{ns}:r:{{{kid}}}:err")).await.map_err(e)?)
            }
        };
        for index in 0..total {
            // What the reader took was checked when it was read (a requeued dead letter that ran
            // again after its failure was taken records nothing new).
            if let Some(read) = model.and_then(|m| m.read.get(&index)) {
                // A failure is handed to the reader only once it is final: the part must not have
                // succeeded since, unless an operator requeued it.
                let requeued = model.is_some_and(|m| m.requeue_tried);
                if read.is_err() && results.contains_key(&index) && !requeued {
                    return Err(format!("{r}: part {index} was read as failed, then succeeded"));
                }
            }
            if index < tfirst || discard || model.is_some_and(|m| m.read.contains_key(&index)) {
                continue;
            }
            let want = payload(*i, index) * 3;
            match (results.get(&index), s.state()) {
                (Some(&got), _) if got != want => {
                    return Err(format!("{r}: part {index} has result {got}, not {want}"));
                }
                (Some(_), _) => {}
                (None, "completed") => {
                    return Err(format!(
                        "{r}: completed, but part {index} has no result (error: {:?})",
                        errors.get(&index)
                    ));
                }
                // Fail fast: the parts not yet run when the first dead letter ended it never run.
                (None, "failed")
                    if !errors.contains_key(&index)
                        && s.meta.get("failfast").map(String::as_str) != Some("1") =>
                {
                    return Err(format!(
                        "{r}: failed, and part {index} has neither a result nor a dead letter"
                    ));
                }
                (None, "failed") => {
                    let failed = model.is_some_and(|m| m.failed_parts.contains(&index));
                    let failfast = s.meta.get("failfast").map(String::as_str) == Some("1");
                    if !failed && !failfast {
                        return Err(format!("{r}: part {index} dead-lettered, but no run of it failed"));
                    }
                }
                _ => {}
            }
        }
        if s.state() == "failed" && errors.is_empty() && tfirst == 0 {
            return Err(format!("{r}: failed without an error record"));
        }
    }
    // The listing index holds each request in the set of its state, and once everything has
    // finished nothing live: what is left leaves with its retention (ix:exp, trimmed by finishes
    // and recovery's claims, and every index key expires).
    let ix = |set: &str| format!("{ns}:{{{ns}.q0}}:ix:{set}");
    let live: Vec<String> = c.zrange(ix("live"), 0, -1, None, false, None, false).await.map_err(e)?;
    if !live.is_empty() {
        return Err(format!("listed as live once everything finished: {live:?}"));
    }
    let expiring: HashSet<String> = c
        .zrange::<Vec<String>, _, _, _>(ix("exp"), 0, -1, None, false, None, false)
        .await
        .map_err(e)?
        .into_iter()
        .collect();
    for (i, s) in &seen {
        let kid = request_id(*i).key_id();
        let row: Option<String> = c.hget(ix("row"), kid.as_str()).await.map_err(e)?;
        if s.meta.is_empty() || s.state() == "loading" {
            // (Or its keys have expired with its retention, and its entry will follow.)
            if row.is_some() && !expiring.contains(&kid) {
                return Err(format!("{}: listed, but it was never created", request_id(*i)));
            }
            continue;
        }
        if row.is_none() {
            // Only a request that was never listed (submitted before the index existed) is not.
            return Err(format!("{}: {} but not listed", request_id(*i), s.state()));
        }
        let score: Option<f64> = c.zscore(ix(s.state()), kid.as_str()).await.map_err(e)?;
        if score.is_none() || !expiring.contains(&kid) {
            return Err(format!(
                "{}: {} but not in the index's {} set with an expiry",
                request_id(*i),
                s.state(),
                s.state()
            ));
        }
    }
    // Nothing leaks: every key left will expire (records and results for the retention; the
    // listing index's keys once they hold only finished requests).
    let keys: Vec<String> = {
        let mut out = Vec::new();
        let mut cursor = "0".to_string();
        loop {
            let (next, batch): (String, Vec<String>) = c
                .custom(
                    fred::types::CustomCommand::new_static("SCAN", fred::types::ClusterHash::Random, false),
                    vec![cursor.clone(), "MATCH".into(), format!("{ns}:*"), "COUNT".into(), "1000".into()],
                )
                .await
                .map_err(e)?;
            out.extend(batch);
            if next == "0" {
                break out;
            }
            cursor = next;
        }
    };
    for key in keys {
        let ttl: i64 = c.pttl(&key).await.map_err(e)?;
        if ttl < 0 && key.contains(":p:") {
            // A token list may keep stale elements put back by a slot's clean stop (a take it never
            // saw the reply of): those of finished requests, which the next slot to take drops.
            let elements: Vec<String> = c.lrange(&key, 0, -1).await.map_err(e)?;
            let kid_of = |s: &Seen| {
                s.meta.get("id").and_then(|id| RequestId::new(id.clone()).ok()).map(|r| r.key_id())
            };
            let stale = elements.iter().all(|el| {
                let kid = crate::protocol::TokenElement::parse(el).map(|t| t.key_id);
                seen.values().filter(|s| kid.is_some() && kid_of(s) == kid).all(Seen::terminal)
            });
            if stale {
                continue;
            }
        }
        if ttl < 0 {
            let kind: String = c.custom(fred::cmd!("TYPE"), vec![key.clone()]).await.map_err(e)?;
            let content: Value = match kind.as_str() {
                "hash" => c.hgetall(&key).await.map_err(e)?,
                "zset" => c.zrange(&key, 0, -1, None, false, None, true).await.map_err(e)?,
                "list" => c.lrange(&key, 0, -1).await.map_err(e)?,
                _ => Value::Null,
            };
            return Err(format!("key {key} is left without an expiry once everything finished: {content:?}"));
        }
    }
    Ok(())
}
