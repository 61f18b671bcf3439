//! The schedules' part of the checker: what an operator's `Op::Schedule` does, and the model of
//! when each schedule was active, from which the ticks it owes follow.
//!
//! The model learns a schedule's lives and pauses by watching its state in Redis after every step
//! (each step runs at most one call, so no change goes unseen): a life begins with an add (its
//! `from`), a pause opens a gap at the time it recorded, a resume closes it at its `resumed`, a
//! removal ends the life. A tick `T` of a life is owed when `from < T`, it is not in a closed gap
//! `(paused, resumed]`, and not after a pause under way. Invariants:
//! - after every step, every request `s<n>@<T>` (found through its tag, `schedule:s<n>`) and
//!   every tick owed is such a tick of one of the name's lives, and not in the future;
//! - at the end, after the drain (which pauses every schedule), each schedule still there owes
//!   nothing, and fired exactly the ticks its lives owed up to that last pause (the checker's
//!   schedules catch up 100 ticks, so this does not depend on when the claims came);
//! - a tick's request is created again only after it was purged (the documented bound:
//!   docs/operations.md, "Schedules"), and each of its requests finished with one event.

use std::collections::BTreeMap;

use fred::prelude::*;

use super::ops::{ScheduleAction, SCHEDULES};
use crate::{Admin, Missed, ScheduleSpec};

/// The name of schedule `n`.
pub(crate) fn name(n: u8) -> String {
    format!("s{n}")
}

/// Runs an operator's action on schedule `n`; `Err` carries the refusal's words.
pub(crate) async fn act(admin: &Admin, n: u8, action: ScheduleAction) -> Result<(), String> {
    let name = name(n);
    let done = match action {
        ScheduleAction::Add { every_s, catch_up } => {
            let spec = ScheduleSpec::new(name, format!("*/{every_s} * * * * *"))
                .and_then(|s| s.missed(Missed::CatchUp(u32::from(catch_up))))
                .and_then(|s| s.parts([super::world::payload(100 + n, 0)]))
                .map(|s| s.own_stream(n % 2 == 1));
            match spec {
                Ok(spec) => admin.schedule_add(&spec).await,
                Err(e) => Err(e),
            }
        }
        ScheduleAction::Pause => admin.schedule_pause(&name).await.map(|_| ()),
        ScheduleAction::Resume => admin.schedule_resume(&name).await.map(|_| ()),
        ScheduleAction::Remove => admin.schedule_remove(&name).await,
    };
    done.map_err(|e| e.to_string())
}

/// One life of a schedule: from an add to its removal.
#[derive(Clone, Debug)]
struct Life {
    /// Ticks are the multiples of this (ms).
    every: i64,
    from: i64,
    /// Pauses that ended: `(paused, resumed]`.
    gaps: Vec<(i64, i64)>,
    /// A pause under way.
    paused: Option<i64>,
    removed: bool,
}

impl Life {
    fn owes(&self, tick: i64) -> bool {
        tick % self.every == 0
            && tick > self.from
            && !self.gaps.iter().any(|(p, r)| *p < tick && tick <= *r)
            && !matches!(self.paused, Some(p) if tick > p)
    }
}

/// What the model knows of one tick's requests.
#[derive(Clone, Copy, Debug, Default)]
struct Tick {
    /// Listed now.
    present: bool,
    /// How many of its requests were purged.
    purged: u64,
}

/// The schedules' model.
#[derive(Default, Debug)]
pub(crate) struct Schedules {
    lives: BTreeMap<u8, Vec<Life>>,
    ticks: BTreeMap<u8, BTreeMap<i64, Tick>>,
}

/// A schedule's state, as the step checks read it.
struct Seen {
    every: Option<i64>,
    state: std::collections::HashMap<String, String>,
    listed: Vec<String>,
}

async fn read(reader: &Client, ns: &str) -> Result<Vec<Seen>, String> {
    let e = |e: fred::error::Error| e.to_string();
    let shard0 = |suffix: &str| format!("{ns}:{{{ns}.q0}}:{suffix}");
    let pipe = reader.pipeline();
    for n in 0..SCHEDULES {
        let _: () = pipe.hget(shard0("sch"), name(n)).await.map_err(e)?;
        let _: () = pipe.hgetall(shard0(&format!("sch:s:{}", name(n)))).await.map_err(e)?;
        let _: () = pipe
            .zrange(shard0(&format!("ix:t:schedule:{}", name(n))), 0, -1, None, false, None, false)
            .await
            .map_err(e)?;
    }
    let replies: Vec<Value> = pipe.all().await.map_err(e)?;
    let mut replies = replies.into_iter();
    let mut out = Vec::new();
    for _ in 0..SCHEDULES {
        let spec: Option<String> = replies.next().unwrap_or(Value::Null).convert().map_err(e)?;
        let state = replies.next().unwrap_or(Value::Null).convert().map_err(e)?;
        let listed = replies.next().unwrap_or(Value::Null).convert().map_err(e)?;
        let every = spec.map(|json| every_of(&json)).transpose()?;
        out.push(Seen { every, state, listed });
    }
    Ok(out)
}

/// The tick period of a checker's spec (`*/<k> * * * * *`).
fn every_of(json: &str) -> Result<i64, String> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let cron = value["cron"].as_str().unwrap_or_default();
    cron.strip_prefix("*/")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|k| k.parse::<i64>().ok())
        .map(|k| k * 1000)
        .ok_or_else(|| format!("a schedule with cron {cron:?}, which the checker never adds"))
}

fn num(state: &std::collections::HashMap<String, String>, field: &str) -> Option<i64> {
    state.get(field).and_then(|v| v.parse().ok())
}

/// The tick of a listed request's key id, `s<n>%40<tick>`.
fn tick_of(kid: &str, n: u8) -> Option<i64> {
    kid.strip_prefix(&format!("{}%40", name(n)))?.parse().ok()
}

impl Schedules {
    /// After every step: learns what changed, and checks every request and owed tick (`now`: the
    /// functions' clock).
    pub(crate) async fn step(&mut self, reader: &Client, ns: &str, now: i64) -> Result<(), String> {
        for (n, seen) in (0..SCHEDULES).zip(read(reader, ns).await?) {
            let lives = self.lives.entry(n).or_default();
            let current = lives.last_mut().filter(|l| !l.removed);
            match (seen.every, current) {
                (None, Some(life)) => life.removed = true,
                (None, None) => {}
                (Some(every), current) => {
                    let from = num(&seen.state, "from").unwrap_or(0);
                    let paused = num(&seen.state, "paused");
                    match current {
                        Some(life) if life.from == from => {
                            if life.paused != paused {
                                if let Some(p) = life.paused {
                                    let resumed = num(&seen.state, "resumed").ok_or_else(|| {
                                        format!("{}: resumed, but its state has no resume time", name(n))
                                    })?;
                                    life.gaps.push((p, resumed));
                                }
                                life.paused = paused;
                            }
                        }
                        other => {
                            if let Some(life) = other {
                                life.removed = true;
                            }
                            lives.push(Life { every, from, gaps: Vec::new(), paused, removed: false });
                        }
                    }
                }
            }
            let lives = &self.lives[&n];
            let owes = |tick: i64| lives.iter().any(|l| l.owes(tick));
            let ticks = self.ticks.entry(n).or_default();
            let mut listed = std::collections::BTreeSet::new();
            for kid in &seen.listed {
                let tick = tick_of(kid, n).ok_or_else(|| format!("{kid} is tagged schedule:{}", name(n)))?;
                if tick > now || !owes(tick) {
                    return Err(format!(
                        "{}: request {kid} for tick {tick}, which no life of it owes (now {now}; lives {lives:?})",
                        name(n)
                    ));
                }
                listed.insert(tick);
            }
            // A request that leaves the listing was purged (it had finished: it has its event), or
            // was a registration whose request never came (no event: recovery dropped it).
            let gone: Vec<i64> =
                ticks.iter().filter(|(t, s)| s.present && !listed.contains(t)).map(|(t, _)| *t).collect();
            for tick in gone {
                let t = ticks.entry(tick).or_default();
                t.present = false;
                if events(reader, ns, &format!("{}%40{tick}", name(n))).await? > 0 {
                    t.purged += 1;
                }
            }
            for tick in listed {
                ticks.entry(tick).or_default().present = true;
            }
            for owed in seen.state.get("owe").map(String::as_str).unwrap_or_default().split(',') {
                let Ok(tick) = owed.parse::<i64>() else { continue };
                if tick > now || !owes(tick) {
                    return Err(format!(
                        "{}: owes tick {tick}, which none of its lives owes ({lives:?})",
                        name(n)
                    ));
                }
            }
        }
        Ok(())
    }
}

/// How many completion events request `kid` has in the events stream.
async fn events(reader: &Client, ns: &str, kid: &str) -> Result<u64, String> {
    let events: Vec<(String, std::collections::HashMap<String, String>)> =
        reader.xrange(format!("{ns}:{{{ns}.q0}}:events"), "-", "+", None).await.map_err(|e| e.to_string())?;
    Ok(super::model::completions(&events).filter(|(rid, _)| *rid == kid).count() as u64)
}

impl Schedules {
    /// Whether schedule `n` is there and not paused (the drain pauses those).
    pub(crate) fn active(&self, n: u8) -> bool {
        self.lives.get(&n).and_then(|l| l.last()).is_some_and(|l| !l.removed && l.paused.is_none())
    }

    /// Once everything has drained (and every schedule was paused): each schedule still there
    /// owes nothing and fired exactly the ticks its lives owed; each tick's requests finished
    /// with one event each.
    pub(crate) async fn end(&self, reader: &Client, ns: &str) -> Result<(), String> {
        for (n, seen) in (0..SCHEDULES).zip(read(reader, ns).await?) {
            let empty = BTreeMap::new();
            let ticks = self.ticks.get(&n).unwrap_or(&empty);
            if seen.every.is_some() && seen.state.get("owe").is_some_and(|o| !o.is_empty()) {
                return Err(format!("{}: still owes {:?} after the drain", name(n), seen.state["owe"]));
            }
            if let Some(life) = self.lives.get(&n).and_then(|l| l.last()).filter(|l| !l.removed) {
                let Some(end) = life.paused else {
                    return Err(format!("{}: not paused after the drain: {life:?}", name(n)));
                };
                let first = (life.from / life.every + 1) * life.every;
                let expected: Vec<i64> =
                    (first..=end).step_by(life.every as usize).filter(|t| life.owes(*t)).collect();
                let fired: Vec<i64> = ticks
                    .iter()
                    .filter(|(t, s)| **t > life.from && (s.present || s.purged > 0))
                    .map(|(t, _)| *t)
                    .collect();
                if fired != expected {
                    return Err(format!(
                        "{}: fired ticks {fired:?}, but its life {life:?} owed {expected:?}",
                        name(n)
                    ));
                }
            }
            for (tick, t) in ticks {
                let kid = format!("{}%40{tick}", name(n));
                let events = events(reader, ns, &kid).await?;
                let requests = t.purged + u64::from(t.present);
                if events != requests {
                    return Err(format!(
                        "{kid}: {events} events for {requests} requests ({} purged)",
                        t.purged
                    ));
                }
            }
        }
        Ok(())
    }
}
