//! The reference model: what the checker knows happened (submits accepted, verdicts given,
//! requests cancelled), and the invariants of CONTRACT.md checked against Redis's state.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use fred::prelude::*;

use super::gate::{Fault, Verdict};
use super::ops::{Shape, Submit, REQUEST_IDS};
use super::world::{payload, request_id, Task, World};
use crate::protocol::listing::member_kids;
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
    /// `Admin::purge` answered: whether it deleted keys.
    Purged(bool),
    /// An operator's command was refused (`Error::Refused`): the request has not finished.
    Refused(String),
    /// A `submit_many`'s answers, one per request in order (each as a submit's).
    Many(Vec<Outcome>),
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
    /// An operator's purge (`Admin::purge` of it, or any `Admin::purge_finished`) was started.
    pub(crate) purge_tried: bool,
    /// Its keys went with a purge this many times (the id may be used again after each).
    pub(crate) purges: u32,
    /// Events of the id's purged requests, left in the events stream.
    pub(crate) events_before: u64,
    /// The last `Admin::purge` of it answered Ok: it left the listing index, its finish marks went.
    pub(crate) unlisted: bool,
    /// Its state as the last step's check saw it (`None`: no keys).
    pub(crate) last_state: Option<String>,
    /// When its handlers started (ms by the functions' clock), for the rate limit's check.
    pub(crate) starts: Vec<u64>,
    /// Submits of the id under way, and whether one died.
    pub(crate) submitting: u32,
    pub(crate) submit_died: bool,
    /// Whether any submit of the id asked to leave it out of the listing index
    /// (`RequestBuilder::unlisted`), and whether any did not.
    pub(crate) submitted_unlisted: bool,
    pub(crate) submitted_listed: bool,
}

impl Req {
    /// Whether the request with this id may still be listed under the entry of the purged request
    /// of its id: a registration that finds the id listed by a finished request cannot tell whether
    /// that one's keys are gone; the new request takes the entry at its first push, after it was
    /// created, and not if its producer dies before.
    fn may_wait_for_takeover(&self) -> bool {
        self.purges > 0 && (self.submitting > 0 || self.submit_died)
    }
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
    /// The stats by stage: a `stats_add` met a lost reply or was re-sent (its counts may be added
    /// twice); a producer died (what it counted and had not flushed is lost); a `stats_add` ran
    /// since the last step's check.
    pub(crate) stats_over: bool,
    pub(crate) stats_lost: bool,
    stats_added: bool,
    /// Submits that returned Ok (each counted once by its producer for the stats by stage), those
    /// that died (a streamed one may have been accepted and counted before), and handler runs that
    /// ended Ok and not Ok.
    pub(crate) submits_accepted: u64,
    pub(crate) submits_died: u64,
    pub(crate) runs_ok: u64,
    pub(crate) runs_failed: u64,
    /// Schedule ticks submitted by worker incarnations no longer running (each counted once by
    /// its worker for the stats by stage, as a submit).
    pub(crate) schedule_submits_before: u64,
    /// When each schedule was active, and what it fired.
    #[cfg(feature = "schedules")]
    pub(crate) schedules: super::schedules::Schedules,
}

/// The key id in a request key `<ns>:r:{<kid>}…`.
fn kid_of(key: &str) -> Option<&str> {
    let rest = key.split_once(":r:{")?.1;
    rest.split_once('}').map(|(kid, _)| kid)
}

impl Model {
    pub(crate) fn submitting(&mut self, s: &Submit) {
        let r = self.requests.entry(s.request).or_default();
        r.submitting += 1;
        if s.unlisted_here() {
            r.submitted_unlisted = true;
        } else {
            r.submitted_listed = true;
        }
    }

    pub(crate) fn call(&mut self, actor: u64, what: &str, key: &str, fault: Fault) {
        if what == "stats_add" {
            self.stats_added = true;
            if matches!(fault, Fault::LoseReply | Fault::Resend) {
                self.stats_over = true;
            }
        }
        if let Some(kid) = kid_of(key) {
            self.touched.entry(actor).or_default().insert(kid.to_owned());
        }
        self.running.remove(&actor);
    }

    /// A handler started, at `at_ms` by the functions' clock.
    pub(crate) fn handler_started(
        &mut self,
        actor: u64,
        request: &str,
        index: u64,
        attempt: u32,
        input: u64,
        at_ms: u64,
    ) {
        // Every part's payload names its index (world::payload): a handler is told the index of
        // the part it runs (`Context::index`, which users key their work by).
        if input % 1000 != index + 1 && self.broken.is_none() {
            self.broken = Some(format!(
                "{request}[{index}] attempt {attempt} ran with the payload of part {}",
                (input % 1000).wrapping_sub(1)
            ));
        }
        self.running.insert(actor, (request.to_owned(), index, attempt));
        if let Some(i) = index_of(request) {
            self.requests.entry(i).or_default().starts.push(at_ms);
        }
    }

    pub(crate) fn verdict(&mut self, request: &str, index: u64, _attempt: u32, verdict: Verdict) {
        let running: Vec<u64> =
            self.running.iter().filter(|(_, r)| r.0 == request && r.1 == index).map(|(a, _)| *a).collect();
        for a in running {
            self.running.remove(&a);
        }
        if verdict == Verdict::Ok {
            self.runs_ok += 1;
        } else {
            self.runs_failed += 1;
        }
        if verdict != Verdict::Ok {
            if let Some(r) = index_of(request) {
                self.requests.entry(r).or_default().failed_parts.insert(index);
            }
        }
    }

    /// An operator's purge may delete request `i`'s keys from now on.
    pub(crate) fn purging(&mut self, i: u8) {
        self.requests.entry(i).or_default().purge_tried = true;
    }

    pub(crate) fn touched(&self, actor: u64, kid: &str) -> bool {
        self.touched.get(&actor).is_some_and(|t| t.contains(kid))
    }

    pub(crate) fn died(&mut self, actor: u64, what: &Task) {
        self.touched.remove(&actor);
        self.running.remove(&actor);
        match what {
            // A cancel that died after its call may have taken effect.
            Task::Cancel(i) => self.requests.entry(*i).or_default().cancelled = true,
            Task::Submit(s) => self.submit_died(s),
            Task::SubmitMany(batch) => batch.iter().for_each(|s| self.submit_died(s)),
            _ => {}
        }
    }

    fn submit_died(&mut self, s: &Submit) {
        self.submits_died += 1;
        let r = self.requests.entry(s.request).or_default();
        r.submitting = r.submitting.saturating_sub(1);
        r.submit_died = true;
    }

    pub(crate) fn ended(&mut self, what: &Task, outcome: Outcome) {
        if let Task::SubmitMany(batch) = what {
            // Each request ends as its own submit would; an actor that ended otherwise (it
            // panicked) ended every request of its batch so.
            let outcomes = match outcome {
                Outcome::Many(each) if each.len() == batch.len() => each,
                Outcome::Many(each) => {
                    self.broken =
                        Some(format!("submit_many answered {} of {} requests", each.len(), batch.len()));
                    vec![Outcome::Error("no answer".into()); batch.len()]
                }
                other => vec![other; batch.len()],
            };
            for (s, o) in batch.iter().zip(outcomes) {
                self.ended(&Task::Submit(s.clone()), o);
            }
            return;
        }
        if let Task::Submit(s) = what {
            let r = self.requests.entry(s.request).or_default();
            r.submitting = r.submitting.saturating_sub(1);
        }
        match (what, outcome) {
            (Task::Submit(s), Outcome::Accepted(parts)) => {
                self.submits_accepted += 1;
                let r = self.requests.entry(s.request).or_default();
                r.accepted += 1;
                r.spec = Some(s.clone());
                r.parts = (parts, parts);
            }
            (Task::Submit(s), Outcome::Streamed { added, ambiguous, error }) => {
                self.submits_accepted += 1;
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
            (Task::Purge(i), Outcome::Purged(_)) => self.requests.entry(*i).or_default().unlisted = true,
            (Task::Read(i, asked, purges), Outcome::Read { first, terminal, results }) => {
                let r = self.requests.entry(*i).or_default();
                if r.purges != *purges {
                    // A page of a request purged since (or of the one that took its id).
                    return;
                }
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

/// The completions an events stream's entries hold, as (request key id, state): one per entry
/// of a single request (`rid`, `state`), one per line of an entry of a lane call's (`done`).
pub(crate) fn completions(
    entries: &[(String, HashMap<String, String>)],
) -> impl Iterator<Item = (&str, &str)> + '_ {
    entries.iter().flat_map(|(_, f)| {
        let single = f.get("rid").map(String::as_str).zip(f.get("state").map(String::as_str));
        let lines = f.get("done").into_iter().flat_map(|d| d.lines().filter_map(|l| l.rsplit_once('|')));
        single.into_iter().chain(lines)
    })
}

fn index_of(request: &str) -> Option<u8> {
    request.strip_prefix('r')?.parse().ok()
}

/// One request's state in Redis.
#[derive(Debug, Default, Clone)]
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

/// A lane as `snapshot` reads it once: the holders of its held tokens, and its running marks (by
/// `<kid>|<lc>`, the hand-out ms: `lane::marks_of`).
type LaneCache = (Vec<String>, HashMap<String, String>);

/// What a lane request's record holds beside its fields.
#[derive(Debug, Default, Clone)]
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

/// What a downstream's meta says of its upstream `ukid` (`u:<ukid>`): its status (`w`, `c`, `f`)
/// and the lifecycle it names.
fn upstream_field(d: &Seen, ukid: &str) -> Option<(String, u64)> {
    let field = d.meta.get(&format!("u:{ukid}"))?;
    let mut f = field.split('|');
    Some((f.next()?.to_owned(), f.next()?.parse().ok()?))
}

/// The request of the pool behind upstream `ukid` of a downstream, as seen now, if it is the one
/// the downstream linked to (the same created ms as the lifecycle `lc` its field names), with its
/// lifecycle now.
fn same_upstream<'a>(seen: &'a BTreeMap<u8, Seen>, ukid: &str, lc: u64) -> Option<(&'a Seen, u64)> {
    let u = seen.get(&index_of(ukid)?)?;
    let created = u.num("created");
    // A lane request's record has its lifecycle (`lc`), which its created ms and gen do not
    // make (prelude.lua, sg_lane_clock); a request of its own stream's meta hash has none.
    let now = u.meta.get("lc").and_then(|v| v.parse().ok()).unwrap_or(created * 1000 + u.num("gen"));
    (created > 0 && created == lc / 1000).then_some((u, now))
}

/// A downstream's gate, checked while a handler of its runs under a live lease: every upstream it
/// linked to has completed (its policy 'fail'), or ended (its policy 'run') in the lifecycle it
/// waited on. An upstream whose id went with a purge, or was taken by a later request, is not
/// the one it waited on.
fn check_gate(r: &RequestId, d: &Seen, seen: &BTreeMap<u8, Seen>) -> Result<(), String> {
    let Some(ups) = d.meta.get("ups") else { return Ok(()) };
    let run = d.meta.get("onup").map(String::as_str) == Some("run");
    for ukid in ups.split(',') {
        let Some((status, lc)) = upstream_field(d, ukid) else {
            return Err(format!("{r} runs, but has no field for its upstream {ukid}"));
        };
        let Some((u, now)) = same_upstream(seen, ukid, lc) else { continue };
        let ended = if run { u.terminal() || now > lc } else { u.state() == "completed" };
        if !ended || status == "w" {
            return Err(format!(
                "{r} runs while its upstream {ukid} is {} (lifecycle {now}; its field: {status} {lc}; policy {})",
                u.state(),
                if run { "run" } else { "fail" }
            ));
        }
    }
    Ok(())
}

/// A downstream that failed because of an upstream (`why` = `upstream:<ukid>`): its policy is
/// 'fail', its field says that upstream failed (or, between the release that recorded the
/// upstream's completion and the requeue that reopens the downstream, completed), and (`end`: once
/// everything has drained) that upstream has not completed since, or the downstream would have
/// reopened.
fn check_failed_by_upstream(
    r: &RequestId,
    d: &Seen,
    seen: &BTreeMap<u8, Seen>,
    end: bool,
) -> Result<(), String> {
    let Some(ukid) = d.meta.get("why").and_then(|w| w.strip_prefix("upstream:")) else { return Ok(()) };
    if d.state() != "failed" || d.meta.get("onup").map(String::as_str) == Some("run") {
        return Err(format!(
            "{r} is {} because of upstream {ukid}, with policy {:?}",
            d.state(),
            d.meta.get("onup")
        ));
    }
    let Some((status, lc)) = upstream_field(d, ukid) else {
        return Err(format!("{r} failed because of {ukid}, which is not its upstream"));
    };
    if status == "c" && !end {
        // The release of that upstream's completion recorded it and answered "reopen": its caller
        // requeues the downstream next (and a re-run of the release, from the outbox, if it dies
        // first). Once everything has drained, it must have.
        return Ok(());
    }
    if status != "f" {
        return Err(format!("{r} failed because of its upstream {ukid}, whose field says {status} {lc}"));
    }
    if let Some((u, now)) = same_upstream(seen, ukid, lc) {
        if u.state() == "completed" && (end || now == lc) {
            return Err(format!(
                "{r} failed because of its upstream {ukid} (lifecycle {lc}), which completed (lifecycle {now})"
            ));
        }
    }
    Ok(())
}

/// Once everything has drained, a downstream that ran (completed, or failed by its own parts)
/// did so after each upstream it waited on completed ('fail') or ended ('run').
fn check_ran_after_upstreams(r: &RequestId, d: &Seen, seen: &BTreeMap<u8, Seen>) -> Result<(), String> {
    let Some(ups) = d.meta.get("ups") else { return Ok(()) };
    let why = d.meta.get("why").map(String::as_str).unwrap_or("");
    if !(d.state() == "completed" || (d.state() == "failed" && why.is_empty())) {
        return Ok(());
    }
    let run = d.meta.get("onup").map(String::as_str) == Some("run");
    for ukid in ups.split(',') {
        let Some((_, lc)) = upstream_field(d, ukid) else { continue };
        let Some((u, _)) = same_upstream(seen, ukid, lc) else { continue };
        if !u.terminal() || (!run && u.state() != "completed") {
            return Err(format!(
                "{r} is {} but its upstream {ukid} is {} after the drain",
                d.state(),
                u.state()
            ));
        }
    }
    Ok(())
}

/// Tenant groups (prelude.lua, "Tenant groups"): each group has at least its limit of tokens
/// (none lost), and the counters say what the fields do; every take record that names a group
/// token holds it (`h`, same epoch and holder) and every held group token is named by exactly one
/// record (none held twice, none leaked); and every handler of a grouped request that runs under
/// a live lease does so under a group token its slot holds, so that at most the group's held
/// tokens' worth of its parts run at once.
async fn check_groups(
    world: &World,
    seen: &BTreeMap<u8, Seen>,
    workers: &HashMap<String, u64>,
    now: u64,
) -> Result<(), String> {
    let ns = world.config.namespace_str();
    let e = |e: fred::error::Error| e.to_string();
    let records: HashMap<String, String> =
        world.reader.hgetall(format!("{ns}:{{{ns}.q0}}:held")).await.map_err(e)?;
    // group -> token -> (epoch, holder), from the records.
    let mut named: HashMap<String, HashMap<String, (String, String)>> = HashMap::new();
    for (field, record) in &records {
        let f: Vec<&str> = record.split('|').collect();
        if f.len() == 8 {
            let holder = field.split("/lost/").next().unwrap_or(field).to_owned();
            let previous =
                named.entry(f[5].to_owned()).or_default().insert(f[6].to_owned(), (f[7].to_owned(), holder));
            if previous.is_some() {
                return Err(format!("group {} token {} named by two take records: {records:?}", f[5], f[6]));
            }
        }
    }
    let mut held_by: HashMap<String, Vec<String>> = HashMap::new();
    for g in 0..super::ops::GROUPS {
        let name = super::ops::group_name(g);
        let meta: HashMap<String, String> =
            world.reader.hgetall(format!("{ns}:{{{ns}.q0}}:grp:{name}")).await.map_err(e)?;
        let names = named.remove(&name).unwrap_or_default();
        if meta.is_empty() {
            if !names.is_empty() {
                return Err(format!("group {name} has no meta but take records hold its tokens {names:?}"));
            }
            continue;
        }
        let num = |f: &str| meta.get(f).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let tokens: Vec<(u64, Vec<&str>)> = meta
            .iter()
            .filter_map(|(f, v)| Some((f.strip_prefix('t')?.parse::<u64>().ok()?, v.split('|').collect())))
            .collect();
        // Tokens retire only while the group has more than its limit: never fewer.
        if (tokens.len() as u64) < num("limit") {
            return Err(format!(
                "group {name}: {} tokens for its limit {}: {meta:?}",
                tokens.len(),
                num("limit")
            ));
        }
        let parked = tokens.iter().filter(|(_, v)| v[0] == "p").count() as u64;
        let waiting = tokens.iter().filter(|(_, v)| v[0] == "r").count() as u64;
        if tokens.len() as u64 != num("nlive")
            || parked != num("npark")
            || waiting != num("nwait")
            || tokens.iter().any(|(k, _)| *k >= num("ntok"))
        {
            return Err(format!("group {name}: counters disagree with its tokens: {meta:?}"));
        }
        for (k, v) in &tokens {
            let record = names.get(&k.to_string());
            match (v[0], record) {
                ("h", Some((epoch, holder)))
                    if v.get(1) == Some(&epoch.as_str()) && v.get(2) == Some(&holder.as_str()) =>
                {
                    held_by.entry(name.clone()).or_default().push(holder.clone());
                }
                ("h", _) | (_, Some(_)) => {
                    return Err(format!(
                        "group {name}: token {k} is {v:?} but its take record says {record:?}"
                    ));
                }
                _ => {}
            }
        }
        if names.keys().any(|k| !tokens.iter().any(|(t, _)| t.to_string() == *k)) {
            return Err(format!("group {name}: take records name tokens it has not: {names:?} {meta:?}"));
        }
    }
    for (actor, (request, _, _)) in &world.model.running {
        let Some(holder) = world.holder_of(*actor) else { continue };
        let Some(s) = index_of(request).and_then(|i| seen.get(&i)) else { continue };
        let Some(group) = s.meta.get("grp") else { continue };
        let worker_live =
            workers.get(holder.split('/').next().unwrap_or_default()).is_some_and(|&expiry| expiry > now);
        let holds_token = s.tokens().any(|(_, v)| {
            let f: Vec<&str> = v.split('|').collect();
            f.len() >= 5 && f[0] == "h" && f[2] == holder
        });
        if worker_live && holds_token {
            if !held_by.get(group).is_some_and(|h| h.contains(&holder)) {
                return Err(format!(
                    "{request} of group {group} runs in {holder} under a live lease without a group token"
                ));
            }
            GROUPED_RUNS_CHECKED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    Ok(())
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
    snapshot_with_index(world).await.map(|(seen, now, _)| (seen, now))
}

/// `snapshot`, and the listing index in the same round trip.
async fn snapshot_with_index(world: &World) -> Result<(BTreeMap<u8, Seen>, u64, IndexSeen), String> {
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
    let ix = |set: &str| format!("{ns}:{{{ns}.q0}}:ix:{set}");
    let _: () = pipe.hkeys(ix("row")).await.map_err(e)?;
    let _: () = pipe.zrange(ix("live"), 0, -1, None, false, None, false).await.map_err(e)?;
    let _: () = pipe.zrange(ix("tracked"), 0, -1, None, false, None, false).await.map_err(e)?;
    let _: () = pipe.hget(ix("tl"), " tracked").await.map_err(e)?;
    let _: () = pipe.pttl(ix("tracked")).await.map_err(e)?;
    let _: () = pipe.zrange(ix("exp"), 0, -1, None, false, None, false).await.map_err(e)?;
    for state in ["completed", "failed", "cancelled"] {
        let _: () = pipe.zrange(ix(state), 0, -1, None, false, None, false).await.map_err(e)?;
    }
    let _: () = pipe.get(ix("lq")).await.map_err(e)?;
    let mut replies: std::vec::IntoIter<Value> = pipe.all::<Vec<Value>>().await.map_err(e)?.into_iter();
    let mut next = || replies.next().unwrap_or(Value::Null);
    let active: Vec<String> = next().convert().map_err(e)?;
    let events: Vec<(String, HashMap<String, String>)> = next().convert().map_err(e)?;
    let (secs, micros): (u64, u64) = next().convert().map_err(e)?;
    let now = secs * 1000 + micros / 1000 + world.clock_ms;
    let mut out = BTreeMap::new();
    let mut lanes: HashMap<String, LaneCache> = HashMap::new();
    // Lane requests whose records keep their listing rows (no tags: docs/protocol.md §5), and
    // which of them may be listed from their lanes: queued, or running with every part fed at
    // the submit (no `nf`) and none requeued (no `rqd`).
    let (mut kept_rows, mut queued) = (HashSet::new(), HashSet::new());
    for i in 0..REQUEST_IDS {
        let kid = request_id(i).key_id();
        let record: HashMap<String, Vec<u8>> = next().convert().map_err(e)?;
        if record.contains_key("ix") {
            kept_rows.insert(kid.clone());
            let state = record.get("state").map(Vec::as_slice);
            let fed_at_submit = !record.contains_key("nf") && !record.contains_key("rqd");
            if state == Some(b"queued") || (state == Some(b"running") && fed_at_submit) {
                queued.insert(kid.clone());
            }
        }
        let meta: HashMap<String, String> = next().convert().map_err(e)?;
        let results: u64 = next().convert().map_err(e)?;
        let dead: u64 = next().convert().map_err(e)?;
        let orphans: Vec<String> = next().convert().map_err(e)?;
        let retry: Vec<String> = next().convert().map_err(e)?;
        let listed_twice = orphans.into_iter().filter(|id| retry.contains(id)).collect();
        let events = completions(&events).filter(|(rid, _)| *rid == kid).count() as u64;
        if meta.is_empty() && !record.is_empty() {
            out.insert(i, lane_seen(world, &mut lanes, &active, &kid, record, events).await?);
            continue;
        }
        let lane = None;
        out.insert(
            i,
            Seen { meta, events, indexed: active.contains(&kid), results, dead, listed_twice, lane },
        );
    }
    let rows: Vec<String> = next().convert().map_err(e)?;
    let live: Vec<String> = next().convert().map_err(e)?;
    let tracked: Vec<String> = next().convert().map_err(e)?;
    let tracked_live: Option<i64> = next().convert().map_err(e)?;
    let tracked_ttl: i64 = next().convert().map_err(e)?;
    let (expiring, batched) = expiring_kids(next().convert().map_err(e)?);
    let mut states = vec![live.clone()];
    for _ in 0..3 {
        // A group member ("|<kid>|<kid>|...") holds the lane requests one call finished that were
        // submitted in one millisecond; each is listed while its record agrees (list.lua).
        let members: Vec<String> = next().convert().map_err(e)?;
        let groups = members.iter().filter(|m| m.starts_with('|')).count() as u64;
        TERMINAL_GROUPS_SEEN.fetch_add(groups, std::sync::atomic::Ordering::Relaxed);
        states.push(members.iter().flat_map(|m| member_kids(m)).map(str::to_owned).collect());
    }
    // A batch in ix:exp keeps naming a request whose entries left (unlist, a purge, a later
    // request of the id): it is listed while an entry of it is.
    let finished: HashSet<&String> = states[1..].iter().flatten().collect();
    let expiring: Vec<String> =
        expiring.into_iter().chain(batched.into_iter().filter(|kid| finished.contains(kid))).collect();
    let queued_count: Option<i64> = next().convert().map_err(e)?;
    // Listed as live: in `live` with a row, or a lane request found in its lane.
    let listed_live = live
        .iter()
        .filter(|k| rows.contains(*k) || kept_rows.contains(*k))
        .chain(queued.iter().filter(|k| !live.contains(*k)))
        .cloned()
        .collect();
    // Listed: a row in ix:row or kept in a lane record, or an entry of the index (a purged lane
    // request's kept row went with its record; its entries stay until `unlist` or its expiry).
    let rows = rows.into_iter().chain(kept_rows).chain(live.iter().cloned()).chain(expiring).collect();
    let index = IndexSeen {
        rows,
        states,
        from_lanes: queued.into_iter().filter(|k| !live.contains(k)).collect(),
        from_lanes_count: queued_count.unwrap_or(0),
        listed_live,
        live: live.into_iter().collect(),
        tracked,
        tracked_live: tracked_live.unwrap_or(0),
        tracked_ttl,
    };
    Ok((out, now, index))
}

/// A lane request as `snapshot` sees it, from its record: indexed while its lane is (its parts
/// are in the lane, or wait in the record for one of them to settle); `lanes` caches the holders
/// of each lane's held tokens.
async fn lane_seen(
    world: &World,
    lanes: &mut HashMap<String, LaneCache>,
    active: &[String],
    kid: &str,
    record: HashMap<String, Vec<u8>>,
    events: u64,
) -> Result<Seen, String> {
    let ns = world.config.namespace_str();
    let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
    let mut meta = crate::protocol::lane::record_meta(&record);
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
        let cancelled: u64 = world
            .reader
            .scard(format!("{ns}:{{{ns}.q0}}:lane:{prio}:err"))
            .await
            .map_err(|e| e.to_string())?;
        CANCELLED_IN_LANE.fetch_add(cancelled, std::sync::atomic::Ordering::Relaxed);
        lanes.insert(lane_kid.clone(), (holders, crate::protocol::lane::marks_of(&lane_meta)));
    }
    let marked = format!("{kid}|{}", meta.get("lc").map_or("", String::as_str));
    // Cancelled while its entry waited (no `started`: no hand-out had marked it), its entry is
    // dropped by the hand-out that meets it; a running mark for it now means its cancelled part
    // was handed out and runs.
    if meta.get("state").map(String::as_str) == Some("cancelled")
        && !meta.contains_key("started")
        && lanes[&lane_kid].1.contains_key(&marked)
    {
        return Err(format!(
            "lane request {kid}: cancelled before any hand-out, but its lane's running marks name \
             it: its part was handed out after the cancel"
        ));
    }
    // Handed out without its record, it reads running from its lane's marks, as status shows it.
    if meta.get("state").map(String::as_str) == Some("queued") {
        let mark = lanes[&lane_kid].1.get(&marked).cloned();
        RUNNING_BY_MARKS.fetch_add(u64::from(mark.is_some()), std::sync::atomic::Ordering::Relaxed);
        crate::protocol::lane::mark_running(&mut meta, mark);
    }
    let mut lane = LaneSeen { holders: lanes[&lane_kid].0.clone(), ..LaneSeen::default() };
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

/// Requests whose keys went since the last step: only a finished request's keys go, all of them
/// at once, and only by an operator's purge (nothing expires in a checker run but what a producer
/// left loading). The model then forgets what it knew of the request: its id may be used again.
async fn purged_since(world: &mut World, seen: &BTreeMap<u8, Seen>) -> Result<(), String> {
    let ns = world.config.namespace_str().to_owned();
    for (i, s) in seen {
        let r = request_id(*i);
        let now = (!s.meta.is_empty()).then(|| s.state().to_owned());
        let m = world.model.requests.entry(*i).or_default();
        let was = std::mem::replace(&mut m.last_state, now.clone());
        let Some(was) = was.filter(|w| w != "loading" && now.is_none()) else { continue };
        if !matches!(was.as_str(), "completed" | "failed" | "cancelled") {
            return Err(format!("{r}: its keys are gone while it was {was}"));
        }
        if !m.purge_tried {
            return Err(format!("{r}: its keys are gone ({was}), and nobody purged it"));
        }
        m.purges += 1;
        m.events_before = s.events;
        m.unlisted = false;
        m.read.clear();
        m.read_next = 0;
        m.failed_parts.clear();
        let left = scan(&world.reader, &format!("{ns}:r:{{{}}}*", r.key_id())).await?;
        if !left.is_empty() {
            return Err(format!("{r}: purged ({was}), but some of its keys are left: {left:?}"));
        }
    }
    Ok(())
}

/// The keys that match `pattern`.
async fn scan(c: &Client, pattern: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cursor = "0".to_string();
    loop {
        let (next, batch): (String, Vec<String>) = c
            .custom(
                fred::types::CustomCommand::new_static("SCAN", fred::types::ClusterHash::Random, false),
                vec![cursor.clone(), "MATCH".into(), pattern.to_owned(), "COUNT".into(), "1000".into()],
            )
            .await
            .map_err(|e| e.to_string())?;
        out.extend(batch);
        if next == "0" {
            return Ok(out);
        }
        cursor = next;
    }
}

/// The listing row of `kid` on shard 0: in the index's rows, or kept in its lane record (a lane
/// request without tags, docs/protocol.md §5).
async fn listed_row(c: &Client, ns: &str, kid: &str) -> Result<Option<String>, String> {
    let e = |e: fred::error::Error| e.to_string();
    let row: Option<String> = c.hget(format!("{ns}:{{{ns}.q0}}:ix:row"), kid).await.map_err(e)?;
    if row.is_some() {
        return Ok(row);
    }
    c.hget(format!("{ns}:{{{ns}.q0}}:s:{kid}"), "ix").await.map_err(e)
}

/// The key ids `ix:exp`'s members name: a member is a key id, or a batch of the lane requests one
/// call finished into one terminal set, "|<state>|<submit ms>,<key id>|..." (prelude.lua,
/// sg_ix_batch). Returns the members' key ids, and the batches'.
fn expiring_kids(members: Vec<String>) -> (Vec<String>, Vec<String>) {
    let (mut own, mut batched) = (Vec::with_capacity(members.len()), Vec::new());
    for member in members {
        match member.strip_prefix('|') {
            Some(batch) => batched.extend(
                batch
                    .split('|')
                    .skip(1)
                    .filter_map(|item| item.split_once(','))
                    .map(|(_, kid)| kid.to_owned()),
            ),
            None => own.push(member),
        }
    }
    (own, batched)
}

/// The listing index of shard 0, as the step checks read it.
struct IndexSeen {
    /// The requests listed, by a row or by an entry in `ix:live` or `ix:exp`.
    rows: HashSet<String>,
    /// The members of `ix:live`, `ix:completed`, `ix:failed` and `ix:cancelled`.
    states: Vec<Vec<String>>,
    live: HashSet<String>,
    /// Live lane requests whose records keep their rows and that are not in `ix:live`: queued
    /// ones, and running ones whose parts were all fed at their submit and none requeued (`list`
    /// finds them in their lanes); and `ix:lq`'s count of them.
    from_lanes: HashSet<String>,
    from_lanes_count: i64,
    /// What `list` of the live requests must show: the members of `ix:live` with a row, and
    /// `from_lanes`.
    listed_live: HashSet<String>,
    tracked: Vec<String>,
    /// `ix:tl`'s count of the tracked set's live members, and the set's expiry (PTTL).
    tracked_live: i64,
    tracked_ttl: i64,
}

/// The listing index's invariants: a live request is listed as live (in `ix:live`, or a lane
/// request listed from its lane, counted exactly by `ix:lq`), unless it was submitted unlisted, and one only ever
/// submitted unlisted is not listed; no request is in two state sets; the tracked set holds
/// listed requests only, counts its live ones exactly (`ix:tl`), and keeps no expiry while it has
/// one.
fn check_index(world: &World, seen: &BTreeMap<u8, Seen>, ix: &IndexSeen) -> Result<(), String> {
    let mut state_of: HashMap<&str, usize> = HashMap::new();
    for (n, members) in ix.states.iter().enumerate() {
        for kid in members {
            if let Some(other) = state_of.insert(kid.as_str(), n) {
                let names = ["live", "completed", "failed", "cancelled"];
                return Err(format!("{kid} is in the index's {} and {} sets", names[other], names[n]));
            }
        }
    }
    for (i, s) in seen {
        let kid = request_id(*i).key_id();
        let model = world.model.requests.get(i);
        if model.is_some_and(|m| m.submitted_unlisted && !m.submitted_listed) && ix.rows.contains(&kid) {
            return Err(format!("{}: submitted unlisted only, but listed", request_id(*i)));
        }
        if model.is_some_and(|m| m.submitted_unlisted) {
            continue;
        }
        let takeover = model.is_some_and(|m| m.may_wait_for_takeover());
        if takeover && ix.rows.contains(&kid) {
            continue;
        }
        if !s.meta.is_empty()
            && !s.terminal()
            && s.state() != "loading"
            && !ix.live.contains(&kid)
            && !ix.from_lanes.contains(&kid)
        {
            let listed = if ix.rows.contains(&kid) { "listed, but not as live" } else { "not listed" };
            return Err(format!("{}: {} but {listed} in the listing index", request_id(*i), s.state()));
        }
    }
    if ix.from_lanes.len() as i64 != ix.from_lanes_count {
        return Err(format!(
            "the index counts {} lane requests listed from their lanes, but {} are: {:?}",
            ix.from_lanes_count,
            ix.from_lanes.len(),
            ix.from_lanes
        ));
    }
    if let Some(stray) = ix.tracked.iter().find(|k| !ix.rows.contains(*k)) {
        return Err(format!("{stray} is tracked but not listed"));
    }
    let live = ix.tracked.iter().filter(|k| ix.live.contains(*k)).count() as i64;
    if live != ix.tracked_live {
        return Err(format!(
            "the tracked set has {live} live requests, the index counts {} ({:?})",
            ix.tracked_live, ix.tracked
        ));
    }
    if live > 0 && ix.tracked_ttl != -1 {
        return Err(format!("the tracked set has live requests but expires in {} ms", ix.tracked_ttl));
    }
    Ok(())
}

/// `list` of the live requests, walked a page of two entries at a time (so that cursors, ties and
/// the lanes' binary search are exercised), shows each request listed as live once, and nothing
/// else.
async fn check_listing(world: &World, ix: &IndexSeen) -> Result<(), String> {
    let ns = world.config.namespace_str();
    let rows_key = format!("{ns}:{{{ns}.q0}}:ix:row");
    let (mut score, mut passed) = ("+inf".to_owned(), 0i64);
    let mut shown: Vec<String> = Vec::new();
    for _ in 0..200 {
        let args: Vec<Value> = vec![
            "sg2_list".into(),
            1.into(),
            rows_key.as_str().into(),
            "live".into(),
            "".into(),
            score.as_str().into(),
            passed.into(),
            "".into(),
            2.into(),
            2.into(),
            "".into(),
            "".into(),
            "".into(),
        ];
        let fcall_ro =
            fred::types::CustomCommand::new_static("FCALL_RO", fred::types::ClusterHash::FirstKey, false);
        let reply: Vec<Value> = match world.reader.custom(fcall_ro, args).await {
            Ok(reply) => reply,
            // A lane walk that passed over more than the checker's 2 entries without reaching one
            // below the cursor cannot page on: refused, not answered wrong.
            Err(e) if e.to_string().contains("SGSTATE a lane holds more than") => return Ok(()),
            Err(e) => return Err(format!("list: {e}")),
        };
        let text = |v: &Value| v.as_string().unwrap_or_default();
        for row in reply.get(3..).unwrap_or_default().chunks(7) {
            shown.push(text(&row[0]));
        }
        let next = reply.first().map(text).unwrap_or_default();
        if next.is_empty() {
            let mut unique: Vec<String> = shown.clone();
            unique.sort();
            unique.dedup();
            if unique.len() != shown.len() {
                return Err(format!("list of the live requests showed one twice: {shown:?}"));
            }
            let got: HashSet<String> = shown.into_iter().collect();
            if got != ix.listed_live {
                return Err(format!(
                    "list of the live requests showed {got:?}, but {:?} are listed as live",
                    ix.listed_live
                ));
            }
            return Ok(());
        }
        score = next;
        passed = reply.get(1).and_then(Value::as_i64).unwrap_or(0);
    }
    Err(format!("list of the live requests did not end within 200 pages: {shown:?}"))
}

/// The stats by stage as stored, summed by priority. Whatever the faults (a lost flush, a flush
/// counted twice), every minute's hash has an expiry no longer than the stats' retention, holds
/// only fields this version writes with counts above 0, and each flush adds a sample of the queue
/// wait with each request started and one of the duration with each request completed or failed.
async fn check_stats(world: &World) -> Result<crate::stats::StageStats, String> {
    let e = |e: fred::error::Error| e.to_string();
    let ns = world.config.namespace_str();
    let keep = world.config.stats_keep().as_millis() as i64;
    let mut minutes = Vec::new();
    for key in scan(&world.reader, &format!("{ns}:{{{ns}.q0}}:st:*")).await? {
        let ttl: i64 = world.reader.pttl(&key).await.map_err(e)?;
        let fields: HashMap<String, String> = world.reader.hgetall(&key).await.map_err(e)?;
        if ttl <= 0 || ttl > keep {
            return Err(format!("stats key {key} expires in {ttl} ms (kept {keep} ms): {fields:?}"));
        }
        let mut counts = BTreeMap::new();
        for (field, value) in fields {
            match value.parse::<u64>() {
                Ok(n) if n > 0 && crate::stats::is_known_field(&field) => counts.insert(field, n),
                _ => return Err(format!("stats key {key} holds {field} = {value}")),
            };
        }
        minutes.push(crate::stats::MinuteStats { minute_ms: 0, fields: counts });
    }
    let stats = crate::stats::StageStats::from_minutes(0, 0, minutes);
    for p in &stats.priorities {
        if p.queue_wait.count() != p.started || p.duration.count() != p.completed + p.failed {
            return Err(format!(
                "stats of priority {}: {} started with {} queue waits, {} completed and {} failed with {} durations",
                p.priority,
                p.started,
                p.queue_wait.count(),
                p.completed,
                p.failed,
                p.duration.count()
            ));
        }
    }
    Ok(stats)
}

/// The invariants that hold after every step.
pub(crate) async fn check_step(world: &mut World) -> Result<(), String> {
    if let Some(broken) = &world.model.broken {
        return Err(broken.clone());
    }
    let (seen, now, index) = snapshot_with_index(world).await?;
    purged_since(world, &seen).await?;
    #[cfg(feature = "schedules")]
    {
        let (reader, ns) = (world.reader.clone(), world.config.namespace_str().to_owned());
        world.model.schedules.step(&reader, &ns, now as i64).await?;
    }
    check_index(world, &seen, &index)?;
    check_listing(world, &index).await?;
    if std::mem::take(&mut world.model.stats_added) {
        check_stats(world).await?;
    }
    let world = &*world;
    for (i, s) in &seen {
        let r = request_id(*i);
        if s.meta.is_empty() {
            continue;
        }
        // Events of the id's earlier requests, purged, stay in the stream.
        let before = world.model.requests.get(i).map_or(0, |m| m.events_before);
        let s = &Seen { events: s.events.saturating_sub(before), ..s.clone() };
        let limit = s.num("limit");
        let ntok = s.num("ntok");
        let held = s.tokens().filter(|(_, v)| v.starts_with("h|")).count() as u64;
        if ntok > limit || held > ntok {
            return Err(format!("{r}: {held} tokens held, {ntok} tokens, limit {limit}"));
        }
        // A request reopened by a requeue is closed for parts: a streamed one that failed (fast)
        // before its finalize had its producer's adds and finalize refused from then on, so open it
        // would wait for ever for a finalize (the drain's operator would close it, and hide that).
        if s.num("gen") > 0 && s.meta.get("open").map(String::as_str) == Some("1") {
            return Err(format!("{r}: reopened by a requeue, but still open for parts"));
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
        // A request ends at its deadline only once it has come (`dl`, the functions' clock), and
        // only as failed.
        if s.meta.get("why").map(String::as_str) == Some("deadline") {
            let (dl, finished) = (s.num("dl"), s.num("finished"));
            if s.state() != "failed" || dl == 0 || finished < dl {
                return Err(format!(
                    "{r}: ended at its deadline as {} at {finished}, deadline {dl}",
                    s.state()
                ));
            }
        }
        // A rate-limited request (`rate` = "<R>/<interval ms>") starts at most R * W / interval + R
        // parts in any window W: at most 2R in any interval (its handlers start in the step of the
        // hand-out that gave them their part, at that step's time).
        if let Some((n, per)) = s.meta.get("rate").and_then(|v| v.split_once('/')) {
            let (n, per) = (n.parse::<usize>().unwrap_or(0), per.parse::<u64>().unwrap_or(0));
            let created = s.num("created");
            let mut starts: Vec<u64> = world
                .model
                .requests
                .get(i)
                .map(|m| m.starts.iter().copied().filter(|t| *t >= created).collect())
                .unwrap_or_default();
            starts.sort_unstable();
            for (at, t) in starts.iter().enumerate() {
                let within = starts[at..].iter().take_while(|u| **u < t + per).count();
                if within > 2 * n {
                    return Err(format!(
                        "{r}: {within} parts started within {per} ms from {t}, rate {n}/{per} ms"
                    ));
                }
            }
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
        check_failed_by_upstream(&r, s, &seen, false)?;
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
            // Status and list show it running from its first hand-out on.
            if s.state() == "queued" {
                return Err(format!(
                    "{request}[{index}] runs under a live lease, but the request reads queued"
                ));
            }
            *live.entry(request.clone()).or_default() += 1;
            check_gate(&request_id(i), s, &seen)?;
        }
    }
    for (request, n) in live {
        let limit = index_of(&request).and_then(|i| seen.get(&i)).map_or(0, |s| s.num("limit"));
        if n > limit {
            return Err(format!("{request}: {n} handlers run under live leases, limit {limit}"));
        }
    }
    check_groups(world, &seen, &workers, now).await?;
    for (i, r) in &world.model.requests {
        // (Each purge frees the id for one more.)
        if r.accepted > r.purges + 1 {
            return Err(format!(
                "{}: accepted {} times while retained (purged {} times)",
                request_id(*i),
                r.accepted,
                r.purges
            ));
        }
    }
    Ok(())
}

/// Requests the sequences' ends found ended at their deadline: the summary says how often the
/// deadline paths ran.
pub(crate) static ENDED_AT_DEADLINE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Downstreams the sequences' ends found failed because of an upstream, and ran after their
/// upstreams (completed, or failed by their own parts): how often the dependencies' paths ran.
pub(crate) static FAILED_BY_UPSTREAM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
pub(crate) static RAN_AFTER_UPSTREAMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Handler runs of grouped requests under live leases that the steps' checks found under a group
/// token: how often the tenant groups' paths ran.
pub(crate) static GROUPED_RUNS_CHECKED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Group members (several finished lane requests of one submit millisecond) seen in the terminal
/// sets by the snapshots, for the search's report.
pub(crate) static TERMINAL_GROUPS_SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Lane requests of one part the snapshots saw running by their lanes' running marks while their
/// records still read queued (handed out without their records: `lane_acquire`'s fast path).
pub(crate) static RUNNING_BY_MARKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Members of lanes' cancelled sets (single-part requests cancelled while their entries waited)
/// the snapshots saw: how often the cancel of an entry not yet handed out ran.
pub(crate) static CANCELLED_IN_LANE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Lane tokens a submit handed to a worker's waiting slot that the slot read from its hand list
/// (the others were taken under the offered id): how often the hand-offs' paths ran.
pub(crate) static HANDED_OFF: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Sub-requests the slots reported unrun (`skip`, `WorkerMetrics::handed_back`): from first
/// batches cut after their first part (`Op::Take::cut`), at deadlines, and from runs stopped as
/// their holds ended.
pub(crate) static HANDED_BACK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Batches of more than two handler runs reported by one call (`Op::Take::wide`): how often an
/// `ack` settled a run of several outcomes.
pub(crate) static WIDE_BATCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Copies of token elements pushed onto lists again (`Op::Plant`): onto the list each was seen
/// on, or, with the epoch its token is queued with now, onto any list seen so far.
pub(crate) static PLANTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Releases of lane requests' downstreams that ran to their end as actors of their own
/// (`Op::Take::apart`): how often the path of a worker's release tasks ran.
pub(crate) static RELEASED_APART: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The invariants that hold once everything has drained: every accepted part ended with a result
/// or a dead letter, one terminal record and one event per lifecycle, nothing left to expire.
/// Listeners hear every completion the events stream holds, once and in order, however often they
/// stop and resume from an event's cursor: from a pseudo-random fifth of the positions, those
/// inside an entry of several events included.
async fn check_listeners(world: &World) -> Result<(), String> {
    let ns = world.config.namespace_str();
    let entries: Vec<(String, HashMap<String, String>)> = world
        .reader
        .xrange(format!("{ns}:{{{ns}.q0}}:events"), "-", "+", None)
        .await
        .map_err(|e| e.to_string())?;
    let expected: Vec<(String, String)> =
        completions(&entries).map(|(kid, state)| (kid.to_owned(), state.to_owned())).collect();
    let listen = |cursor: crate::Cursor| async move {
        crate::events::Listener::start(world.store.clone(), world.reader.clone(), &cursor)
            .await
            .map_err(|e| format!("a listener after {cursor}: {e}"))
    };
    let mut listener = listen(crate::Cursor::beginning()).await?;
    for (n, (kid, state)) in expected.iter().enumerate() {
        let heard = tokio::time::timeout(std::time::Duration::from_secs(5), listener.next())
            .await
            .map_err(|_| format!("listeners: event {n} of {} never came", expected.len()))?
            .map_err(|e| format!("listeners: event {n}: {e}"))?;
        if heard.id.key_id() != *kid || heard.state.to_string() != *state {
            return Err(format!(
                "listeners: event {n} is {} {}, the events stream's is {kid} {state}",
                heard.id, heard.state
            ));
        }
        if (n * 7 + expected.len()) % 5 == 0 {
            listener = listen(heard.cursor.to_string().parse().map_err(|e| format!("{e}"))?).await?;
        }
    }
    Ok(())
}

pub(crate) async fn check_end(world: &World) -> Result<(), String> {
    check_listeners(world).await?;
    let (seen, _) = snapshot(world).await?;
    let c = &world.reader;
    let e = |e: fred::error::Error| e.to_string();
    let ns = world.config.namespace_str();
    let ix = |set: &str| format!("{ns}:{{{ns}.q0}}:ix:{set}");
    for (i, s) in &seen {
        let r = request_id(*i);
        let model = world.model.requests.get(i);
        let accepted = model.is_some_and(|m| m.accepted > 0);
        let purged = model.is_some_and(|m| m.purges > 0);
        if s.meta.is_empty() {
            if accepted && !purged {
                return Err(format!("{r}: accepted, but its record is gone"));
            }
            // A purge that answered Ok took the request out of the index, and its finish marks.
            if model.is_some_and(|m| m.unlisted) {
                let kid = r.key_id();
                let row = listed_row(c, ns, &kid).await?;
                // A row its record kept went with the record: its entries must have gone too (its
                // own in ix:exp, or its terminal set's, which a batch in ix:exp names).
                let mut row = row;
                for set in ["exp", "live", "completed", "failed", "cancelled"] {
                    let entry: Option<f64> = c.zscore(ix(set), kid.as_str()).await.map_err(e)?;
                    if row.is_none() && entry.is_some() {
                        row = Some(format!("(an entry in ix:{set})"));
                    }
                }
                let marks: i64 = c.exists(format!("{ns}:{{{ns}.q0}}:f:{kid}")).await.map_err(e)?;
                if row.is_some() || marks > 0 {
                    return Err(format!(
                        "{r}: purged, but its listing row ({row:?}) or finish marks ({marks}) are left"
                    ));
                }
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
        let events = s.events.saturating_sub(model.map_or(0, |m| m.events_before));
        if events != gen + 1 {
            return Err(format!("{r}: {events} events for {} lifecycles", gen + 1));
        }
        let total = s.num("total");
        // (Once an id was purged, a late answer of its earlier request may have overwritten what
        // the model knew of the one that took it over.)
        if let Some(m) = model.filter(|m| m.accepted > 0 && m.purges == 0) {
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
        let at_deadline = s.meta.get("why").map(String::as_str) == Some("deadline");
        if at_deadline {
            ENDED_AT_DEADLINE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // Failed because of an upstream: none of its parts ran.
        let by_upstream = s.meta.get("why").is_some_and(|w| w.starts_with("upstream:"));
        if by_upstream {
            FAILED_BY_UPSTREAM.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else if s.meta.contains_key("ups") && s.state() != "cancelled" {
            RAN_AFTER_UPSTREAMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        check_failed_by_upstream(&r, s, &seen, true)?;
        check_ran_after_upstreams(&r, s, &seen)?;
        let at_deadline = at_deadline || by_upstream;
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
                // A success clears the error record an earlier attempt left.
                (Some(_), _) if errors.contains_key(&index) => {
                    return Err(format!(
                        "{r}: part {index} succeeded, but keeps an error record: {:?}",
                        errors.get(&index)
                    ));
                }
                (Some(_), _) => {}
                (None, "completed") => {
                    return Err(format!(
                        "{r}: completed, but part {index} has no result (error: {:?})",
                        errors.get(&index)
                    ));
                }
                // Fail fast: the parts not yet run when the first dead letter ended it never run;
                // nor do those of a request that reached its deadline.
                (None, "failed")
                    if !errors.contains_key(&index)
                        && s.meta.get("failfast").map(String::as_str) != Some("1")
                        && !at_deadline =>
                {
                    return Err(format!(
                        "{r}: failed, and part {index} has neither a result nor a dead letter"
                    ));
                }
                (None, "failed") if !errors.contains_key(&index) => {}
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
        if s.state() == "failed" && errors.is_empty() && tfirst == 0 && !at_deadline {
            return Err(format!("{r}: failed without an error record"));
        }
    }
    // The listing index holds each request in the set of its state, and once everything has
    // finished nothing live: what is left leaves with its retention (ix:exp, trimmed by finishes
    // and recovery's claims, and every index key expires).
    let live: Vec<String> = c.zrange(ix("live"), 0, -1, None, false, None, false).await.map_err(e)?;
    if !live.is_empty() {
        return Err(format!("listed as live once everything finished: {live:?}"));
    }
    let (own, batched) = expiring_kids(
        c.zrange::<Vec<String>, _, _, _>(ix("exp"), 0, -1, None, false, None, false).await.map_err(e)?,
    );
    let expiring: HashSet<String> = own.into_iter().chain(batched).collect();
    // Every entry of a terminal set leaves with its retention: ix:exp names it (its own entry, or a
    // batch's), or the set expires first. A group member ("|<kid>|<kid>|...") holds several.
    let mut terminal: HashMap<&str, HashMap<String, f64>> = HashMap::new();
    for state in ["completed", "failed", "cancelled"] {
        let ttl: i64 = c.pttl(ix(state)).await.map_err(e)?;
        let members: Vec<(String, f64)> =
            c.zrange(ix(state), 0, -1, None, false, None, true).await.map_err(e)?;
        let kids: HashMap<String, f64> = members
            .iter()
            .flat_map(|(m, score)| member_kids(m).into_iter().map(|k| (k.to_owned(), *score)))
            .collect();
        if let Some(kid) = kids.keys().find(|kid| !expiring.contains(*kid)) {
            return Err(format!(
                "{kid} is in the index's {state} set (which expires in {ttl} ms), but ix:exp names it nowhere"
            ));
        }
        terminal.insert(state, kids);
    }
    for (i, s) in &seen {
        let kid = request_id(*i).key_id();
        let row = listed_row(c, ns, &kid).await?;
        let model = world.model.requests.get(i);
        if model.is_some_and(|m| m.submitted_unlisted) {
            if row.is_some() && !model.is_some_and(|m| m.submitted_listed) {
                return Err(format!("{}: submitted unlisted only, but listed", request_id(*i)));
            }
            if row.is_none() {
                continue;
            }
        }
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
        let score: Option<f64> = match terminal.get(s.state()) {
            Some(kids) => kids.get(&kid).copied(),
            None => c.zscore(ix(s.state()), kid.as_str()).await.map_err(e)?,
        };
        let takeover = world.model.requests.get(i).is_some_and(|m| m.may_wait_for_takeover());
        if (score.is_none() || !expiring.contains(&kid)) && !takeover {
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
    let keys = scan(c, &format!("{ns}:*")).await?;
    for key in keys {
        let ttl: i64 = c.pttl(&key).await.map_err(e)?;
        // Schedules hold until they are removed, and tenant groups' limits until they are set again.
        if ttl < 0 && (key.ends_with(":sch") || key.contains(":sch:") || key.ends_with(":gconf")) {
            continue;
        }
        // A tenant group's meta and its set of priorities with work stay while stale elements
        // (of finished requests) wait in its queues, or its tokens on the shard's lists: the next
        // take of each drops it, and the group's meta expires once its tokens are all parked.
        if ttl < 0 && key.contains(":grp:") && !key.contains(":p:") {
            let meta = key.trim_end_matches(":w");
            let fields: HashMap<String, String> = c.hgetall(meta).await.map_err(e)?;
            let queued = fields.iter().any(|(f, v)| f.starts_with('t') && v.starts_with("q|"));
            let queues = scan(c, &format!("{meta}:p:*")).await?;
            if queued || !queues.is_empty() {
                continue;
            }
        }
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
    // The stats by stage, once every process has flushed: exact while no flush was lost or
    // counted twice; a re-sent or lost-reply `stats_add` may only add, a producer's death may only
    // lose. What workers count has no exact figure to meet (an ack whose reply is lost is not
    // counted), but without a flush counted twice it never exceeds what happened.
    #[cfg(feature = "schedules")]
    world.model.schedules.end(c, ns).await?;
    let stats = check_stats(world).await?;
    let sum = |f: fn(&crate::stats::PriorityStages) -> u64| stats.priorities.iter().map(f).sum::<u64>();
    let m = &world.model;
    let submitted = sum(|p| p.submitted);
    // Schedules' ticks are submitted by workers, which count them alike.
    let most = m.submits_accepted + m.submits_died + m.schedule_submits_before;
    if (!m.stats_over && submitted > most) || (!m.stats_lost && submitted < m.submits_accepted) {
        return Err(format!(
            "stats: {submitted} requests submitted, {} submits accepted and {} died (a flush re-sent: {}, a \
             producer died: {})",
            m.submits_accepted, m.submits_died, m.stats_over, m.stats_lost
        ));
    }
    if !m.stats_over {
        let events: Vec<(String, HashMap<String, String>)> =
            c.xrange(format!("{ns}:{{{ns}.q0}}:events"), "-", "+", None).await.map_err(e)?;
        let ended = |state: &str| completions(&events).filter(|(_, s)| *s == state).count() as u64;
        let (completed, failed) = (sum(|p| p.completed), sum(|p| p.failed));
        let (succeeded, not_ok) = (sum(|p| p.succeeded), sum(|p| p.retried + p.dead_lettered));
        if completed > ended("completed")
            || failed > ended("failed")
            || succeeded > m.runs_ok
            || not_ok > m.runs_failed
        {
            return Err(format!(
                "stats: {completed} completed, {failed} failed, {succeeded} attempts succeeded and {not_ok} not, \
                 but {} and {} such events, {} and {} such runs",
                ended("completed"),
                ended("failed"),
                m.runs_ok,
                m.runs_failed
            ));
        }
    }
    Ok(())
}
