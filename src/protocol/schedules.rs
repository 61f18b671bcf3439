//! Schedules' transitions (docs/protocol.md §5, "Schedules"): `sched_add`, `sched_pause`,
//! `sched_del` for operators, `sched_fire` and `sched_paid` for the workers that fire them, and
//! `sched_get` for both. Every key is on shard 0. The cron and the ticks are the caller's
//! (the schedule module): the functions only store, compare and set.

use std::time::Duration;

use fred::types::Value;

use super::{ms, Func};
use crate::error::{Error, Result};
use crate::reply;
use crate::store::Store;

/// A pause and the resume that ended it (ms, Redis time): ticks after `paused`, up to and at
/// `resumed`, are not owed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gap {
    pub(crate) paused: i64,
    pub(crate) resumed: i64,
}

impl Gap {
    /// Whether `tick` falls in the gap.
    pub(crate) fn covers(&self, tick: i64) -> bool {
        self.paused < tick && tick <= self.resumed
    }

    fn parse_all(text: &str) -> Vec<Gap> {
        text.split(',')
            .filter_map(|g| {
                let (p, r) = g.split_once(':')?;
                Some(Gap { paused: p.parse().ok()?, resumed: r.parse().ok()? })
            })
            .collect()
    }

    fn format_all(gaps: &[Gap]) -> String {
        gaps.iter().map(|g| format!("{}:{}", g.paused, g.resumed)).collect::<Vec<_>>().join(",")
    }
}

/// A schedule's state hash (lua/sched_add.lua says what each field means).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct State {
    /// New at every add, replace, pause and resume; `None`: no such schedule.
    pub(crate) gen: Option<i64>,
    /// Ticks at or before it are not owed (its add or replace).
    pub(crate) from: i64,
    /// The first tick not owed yet; `None` until its first firing.
    pub(crate) next: Option<i64>,
    /// When it was paused, while it is.
    pub(crate) paused: Option<i64>,
    /// The pauses since `next`.
    pub(crate) gaps: Vec<Gap>,
    /// Ticks owed and not yet submitted, oldest first.
    pub(crate) owe: Vec<i64>,
    /// The latest tick paid.
    pub(crate) last: Option<i64>,
}

/// What `sched_get` read.
#[derive(Clone, Debug)]
pub(crate) struct Read {
    /// The spec (JSON), `None` for no such schedule.
    pub(crate) spec: Option<String>,
    pub(crate) state: State,
}

fn opt_int(v: Option<&Value>) -> Result<Option<i64>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let text = reply::text(v)?;
            text.parse().map(Some).map_err(|_| Error::Protocol(format!("a schedule field holds {text:?}")))
        }
    }
}

fn opt_text(v: Option<&Value>) -> Result<Option<String>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => reply::text(v).map(Some),
    }
}

/// `sched_get`: schedule `name`'s spec and state.
pub(crate) async fn get(store: &Store, name: &str) -> Result<Read> {
    let (specs, state) = (store.keys.schedules(), store.keys.schedule_state(name));
    let items = reply::array(store.fcall(Func::SchedGet, &[&specs, &state], vec![name.into()]).await?)?;
    let owe = opt_text(items.get(6))?.unwrap_or_default();
    Ok(Read {
        spec: opt_text(items.first())?,
        state: State {
            gen: opt_int(items.get(1))?,
            from: opt_int(items.get(2))?.unwrap_or(0),
            next: opt_int(items.get(3))?,
            paused: opt_int(items.get(4))?,
            gaps: Gap::parse_all(&opt_text(items.get(5))?.unwrap_or_default()),
            owe: owe.split(',').filter_map(|t| t.parse().ok()).collect(),
            last: opt_int(items.get(7))?,
        },
    })
}

/// What `sched_add` answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stored {
    /// A new schedule.
    New,
    /// Another spec under this name was replaced.
    Replaced,
    /// This very spec was there already: nothing changed.
    Same,
    /// Another spec is there, and replacing was not asked for: nothing changed.
    Exists,
}

/// `sched_add`: stores `spec` (JSON) under `name`; replaces another spec only if `replace`.
pub(crate) async fn add(store: &Store, name: &str, spec: &str, replace: bool) -> Result<Stored> {
    let keys = [
        store.keys.schedules(),
        store.keys.schedules_due(),
        store.keys.schedule_state(name),
        store.keys.schedules_gen(),
    ];
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let args: Vec<Value> = vec![name.into(), spec.into(), if replace { "1" } else { "0" }.into()];
    let items = reply::array(store.fcall(Func::SchedAdd, &keys, args).await?)?;
    match items.first().map(reply::text).transpose()?.as_deref() {
        Some("added") => Ok(Stored::New),
        Some("replaced") => Ok(Stored::Replaced),
        Some("same") => Ok(Stored::Same),
        Some("exists") => Ok(Stored::Exists),
        other => Err(Error::Protocol(format!("unexpected sched_add reply {other:?}"))),
    }
}

/// What `sched_pause` answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Switched {
    /// Paused, or resumed, by this call.
    Done,
    /// It was so already.
    Already,
    /// No such schedule.
    Unknown,
}

/// `sched_pause`: pauses schedule `name` (`pause`), or resumes it.
pub(crate) async fn pause(store: &Store, name: &str, pause: bool) -> Result<Switched> {
    let (due, state, gen) =
        (store.keys.schedules_due(), store.keys.schedule_state(name), store.keys.schedules_gen());
    let args: Vec<Value> = vec![name.into(), if pause { "1" } else { "0" }.into()];
    let items = reply::array(store.fcall(Func::SchedPause, &[&due, &state, &gen], args).await?)?;
    match items.first().map(reply::text).transpose()?.as_deref() {
        Some("paused" | "resumed") => Ok(Switched::Done),
        Some("already") => Ok(Switched::Already),
        Some("unknown") => Ok(Switched::Unknown),
        other => Err(Error::Protocol(format!("unexpected sched_pause reply {other:?}"))),
    }
}

/// A firing's compare-and-set: what the caller read, and what it computed from it.
#[derive(Clone, Debug)]
pub(crate) struct Firing<'a> {
    pub(crate) name: &'a str,
    /// The `gen` and `next` read.
    pub(crate) gen: i64,
    pub(crate) next: Option<i64>,
    /// The first tick after the time the ticks were computed up to.
    pub(crate) new_next: i64,
    /// The gaps that still matter from `new_next` on.
    pub(crate) gaps: &'a [Gap],
    /// The ticks to owe, oldest first.
    pub(crate) ticks: &'a [i64],
    /// How long others leave the schedule alone while ticks are owed.
    pub(crate) claim: Duration,
}

/// What `sched_fire` answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Fired {
    /// This call moved the ticks (else the state had changed since it was read: `conflict`).
    pub(crate) moved: bool,
    /// Every tick owed now, oldest first: to submit, and pay.
    pub(crate) owe: Vec<i64>,
}

/// `sched_fire`: moves the ticks of `firing` into the schedule's debt, if its state is still as
/// read.
pub(crate) async fn fire(store: &Store, firing: &Firing<'_>) -> Result<Fired> {
    let (due, state) = (store.keys.schedules_due(), store.keys.schedule_state(firing.name));
    let mut args: Vec<Value> = vec![
        firing.name.into(),
        firing.gen.into(),
        firing.next.map_or_else(String::new, |n| n.to_string()).into(),
        firing.new_next.into(),
        Gap::format_all(firing.gaps).into(),
        ms(firing.claim),
    ];
    args.extend(firing.ticks.iter().map(|t| Value::from(*t)));
    let items = reply::array(store.fcall(Func::SchedFire, &[&due, &state], args).await?)?;
    let mut items = items.iter();
    let moved = match items.next().map(reply::text).transpose()?.as_deref() {
        Some("ok") => true,
        Some("conflict") => false,
        other => return Err(Error::Protocol(format!("unexpected sched_fire reply {other:?}"))),
    };
    let owe = items.map(reply::int).collect::<Result<Vec<i64>>>()?;
    Ok(Fired { moved, owe })
}

/// `sched_paid`: tick `tick` of schedule `name` was submitted. Returns whether it was owed.
pub(crate) async fn paid(store: &Store, name: &str, tick: i64) -> Result<bool> {
    let (due, state) = (store.keys.schedules_due(), store.keys.schedule_state(name));
    let args: Vec<Value> = vec![name.into(), tick.into()];
    Ok(reply::int(&store.fcall(Func::SchedPaid, &[&due, &state], args).await?)? == 1)
}

/// `sched_del`: removes schedule `name`. Returns whether it existed.
pub(crate) async fn del(store: &Store, name: &str) -> Result<bool> {
    let keys = [store.keys.schedules(), store.keys.schedules_due(), store.keys.schedule_state(name)];
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    Ok(reply::int(&store.fcall(Func::SchedDel, &keys, vec![name.into()]).await?)? == 1)
}

/// Every schedule: name -> spec (JSON), read with a plain `HGETALL` on shard 0.
pub(crate) async fn all(store: &Store) -> Result<std::collections::BTreeMap<String, String>> {
    use fred::interfaces::HashesInterface;
    let key = store.keys.schedules();
    store.call("hgetall", &key, || async { Ok(store.client.hgetall(key.as_str()).await?) }).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_read_back_as_written() {
        let gaps = [Gap { paused: 10, resumed: 20 }, Gap { paused: 30, resumed: 45 }];
        let text = Gap::format_all(&gaps);
        assert_eq!(text, "10:20,30:45");
        assert_eq!(Gap::parse_all(&text), gaps);
        assert_eq!(Gap::parse_all(""), []);
        assert!(gaps[0].covers(20) && !gaps[0].covers(10) && gaps[0].covers(11));
    }
}
