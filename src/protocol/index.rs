//! Recovery's index and the token lists (docs/protocol.md §5, "Recovery's index"): `register`,
//! `push`, `reopen` and `arm`, on a request's home shard (and `push` on any shard).

use std::time::Duration;

use fred::types::Value;

use super::{ms, Func};
use crate::error::Result;
use crate::reply;
use crate::request::RequestId;
use crate::store::Store;

/// What `register` answers: `{added, now}`, of which only `now` is needed (whether this call
/// entered the request makes no difference to its producer).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Registered {
    /// Redis time (ms) of the registration, on the home shard.
    pub(crate) at_ms: i64,
}

/// `register`: enters request `key_id` in the `active` index of its home shard `home`, first
/// looked at `first_look` from now, and in the listing index with `row` (`listing::Row::encode`).
pub(crate) async fn register(
    store: &Store,
    key_id: &str,
    home: u32,
    first_look: Duration,
    row: &str,
) -> Result<Registered> {
    let (active, reg) = (store.keys.active(home), store.keys.registrations(home));
    let record = store.keys.record(home, key_id);
    let reply = store
        .fcall(Func::Register, &[&active, &reg, &record], vec![key_id.into(), ms(first_look), row.into()])
        .await
        .map_err(|e| match RequestId::from_key_id(key_id) {
            Ok(id) => super::submit::created(&id, e),
            Err(_) => e,
        })?;
    let items = reply::array(reply)?;
    let at_ms = items.get(1).map(reply::int).transpose()?.unwrap_or(0);
    Ok(Registered { at_ms })
}

/// How a push on the home shard moves the request's next look.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PushLook {
    /// The push that follows a submit, with the score its registration wrote: while that score is
    /// still there, the look is set as asked, however far.
    First {
        /// The registration's score.
        score: i64,
    },
    /// The next look only ever moves earlier.
    More,
}

/// `push` on the home shard `home`, with the index keys: queues `elements` on the request's
/// priority list (there may be none), keeps the request indexed, and sets its next look
/// `next_look` from now as `look` says. An element goes instead to a slot that offered to take
/// its priority (a reserved slot, or an idle worker's standby: docs/protocol.md, "Hand-offs"),
/// which then acquires it without a take. Returns how many elements were pushed or handed.
pub(crate) async fn push_home(
    store: &Store,
    key_id: &str,
    home: u32,
    list: &str,
    next_look: Duration,
    look: PushLook,
    elements: Vec<Value>,
) -> Result<i64> {
    let mode = match look {
        PushLook::First { score } => format!("first:{score}"),
        PushLook::More => "more".to_owned(),
    };
    let mut args: Vec<Value> = vec![key_id.into(), ms(next_look), mode.into()];
    args.extend(elements);
    let keys = &store.keys;
    let (bell, active, reg, held, offers) =
        (keys.bell(home), keys.active(home), keys.registrations(home), keys.held(home), keys.offers(home));
    reply::int(&store.fcall(Func::Push, &[list, &bell, &active, &reg, &held, &offers], args).await?)
}

/// `push` without the index keys: queues `elements` on `list`, a priority list of `shard`.
/// Returns how many were pushed.
pub(crate) async fn push(
    store: &Store,
    key_id: &str,
    shard: u32,
    list: &str,
    elements: Vec<Value>,
) -> Result<i64> {
    let bell = store.keys.bell(shard);
    let mut args: Vec<Value> = vec![key_id.into(), 0.into(), "more".into()];
    args.extend(elements);
    reply::int(&store.fcall(Func::Push, &[list, &bell], args).await?)
}

/// `reopen`: before requeue reopens a failed request as `lifecycle`, indexes it again on its home
/// shard `home` (first looked at `first_look` from now) and marks that lifecycle. Returns whether
/// this call entered it in the index.
pub(crate) async fn reopen(
    store: &Store,
    key_id: &str,
    home: u32,
    first_look: Duration,
    lifecycle: i64,
) -> Result<bool> {
    let (active, reg, marks) =
        (store.keys.active(home), store.keys.registrations(home), store.keys.finish_marks(home, key_id));
    let args: Vec<Value> = vec![key_id.into(), ms(first_look), lifecycle.into()];
    Ok(reply::int(&store.fcall(Func::Reopen, &[&active, &reg, &marks], args).await?)? == 1)
}

/// Which kind of look `arm` asks for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arming {
    /// A look by then (only ever earlier than planned).
    Look,
    /// Recovery's own re-arm after a census: with the score its claim wrote (`None` when it looks
    /// at a request it did not claim), the look is set as asked even if later.
    Census {
        /// The claim's score.
        claim: Option<i64>,
    },
    /// A look before a step that is to run before the look falls due (kept in `armed` too).
    Step,
}

/// The claim argument of recovery's calls: the score its claim wrote, or `''`.
pub(crate) fn claim_arg(claim: Option<i64>) -> Value {
    claim.map_or(Value::from(""), Value::from)
}

/// `arm`: asks recovery to look at request `key_id`, homed on `home`, within `within`. Returns
/// when that look is due (Redis time, ms), or `None` if the request is not indexed.
pub(crate) async fn arm(
    store: &Store,
    key_id: &str,
    home: u32,
    within: Duration,
    arming: Arming,
) -> Result<Option<i64>> {
    let (active, armed) = (store.keys.active(home), store.keys.armed(home));
    let mut args: Vec<Value> = vec![key_id.into(), ms(within)];
    match arming {
        Arming::Look => {}
        Arming::Census { claim } => args.push(claim_arg(claim)),
        Arming::Step => args.extend(["".into(), "step".into()]),
    }
    let due = reply::int(&store.fcall(Func::Arm, &[&active, &armed], args).await?)?;
    Ok((due > 0).then_some(due))
}
