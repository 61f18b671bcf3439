//! Taking tokens and running parts (docs/protocol.md §5, "Taking tokens and running parts"):
//! `take`, `untake`, `give_back` and `release` on a shard's token side; `acquire`, `ack` and the
//! read-only `holds` on a request's keys.

use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::interfaces::{KeysInterface, ListInterface};
use fred::types::Value;

use super::{ms, Finished, Func, TokenElement};
use crate::error::{Error, Result};
use crate::keys::{group_of_queue, lane_of};
use crate::reply;
use crate::request::Priority;
use crate::store::Store;

/// What `take` popped: the list it came from and the element's text (parsed by the slot, which
/// drops a malformed one).
#[derive(Debug)]
pub(crate) struct Taken {
    /// The priority list the element was taken from.
    pub(crate) list: String,
    /// The element, `<kid>|<k>|<epoch>` when well formed.
    pub(crate) element: String,
    /// For a lane's token: what acquiring it in the same call answered.
    pub(crate) acquired: Option<Next>,
    /// For a request in a rate-limited tenant group: the take started one part only (its start
    /// was charged to the group's bucket), so the slot runs one and gives the token back.
    pub(crate) one_part: bool,
}

/// What a `take` came back with.
pub(crate) enum Take {
    /// A token element, recorded as held.
    Took(Taken),
    /// Every priority list of the shard is empty.
    Empty,
    /// An operator paused the namespace, or every priority (`Admin::pause`): nothing was taken.
    Paused,
    /// Nothing was taken, and a group token of the shard waits for its rate limit to refill, in
    /// this long: the slot asks again then.
    Wait(Duration),
}

/// A token a slot gives back in the same call as its next take on the same shard: `give_back`'s
/// list, take id and elements (after ack's `requeue`).
#[derive(Debug, Clone)]
pub(crate) struct GiveBack {
    /// The shard the token was taken on.
    pub(crate) shard: u32,
    /// The priority list (or group queue) its elements go to.
    pub(crate) list: String,
    /// The take id the slot's record must carry to be ended.
    pub(crate) take: String,
    pub(crate) elements: Vec<Value>,
}

/// `take` on `shard`: pops the highest-priority element and records it for `holder` as take
/// `take` (`previous`: the id of the slot's previous take on this shard, whose record ends).
/// `woken`: the slot popped a bell itself. `Empty` when every list is empty, `Paused` when an
/// operator paused the shard's priorities. The same call re-sent returns what it took the first
/// time (without a batch). A lane's token is acquired in the same call, for a first batch of at
/// most `want` entries handed to `consumer`. `floor`: the lowest priority popped (a reserved
/// slot's, `WorkerBuilder::reserve`; `Priority::MIN` for any). `offer`: the slot's next take id
/// and how long it waits (a reserved slot's, or a worker's standby's): when nothing is taken, the
/// slot is offered a hand-off ([`hand`], [`hand_or_bell`]). `give_back` (on this shard) is done first, in the same step, as [`give_back`] does it.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn take(
    store: &Store,
    shard: u32,
    holder: &str,
    consumer: &str,
    take: u64,
    previous: Option<u64>,
    woken: bool,
    want: u32,
    floor: Priority,
    offer: Option<(u64, Duration)>,
    give_back: Option<&GiveBack>,
) -> Result<Take> {
    let keys = &store.keys;
    let (held, bell, active, armed, paused) =
        (keys.held(shard), keys.bell(shard), keys.active(shard), keys.armed(shard), keys.paused(shard));
    let mut names: Vec<&str> = vec![&held, &bell, &active, &armed, &paused];
    let previous = previous.map(|p| p.to_string()).unwrap_or_default();
    let mut args: Vec<Value> = vec![
        holder.into(),
        (take as i64).into(),
        previous.into(),
        (if woken { "1" } else { "0" }).into(),
        consumer.into(),
        // (Not with an offer: a library older than flat entries keeps the text in its `wait`
        // record, where the `|` would break the record for every submit that reads it. An offering
        // take's first batch comes as arrays, as a handed one does.)
        if offer.is_some() { i64::from(want).into() } else { batch(store, want, take) },
        keys.lane_prefix(shard).into(),
        keys.record_prefix(shard).into(),
        keys.list_prefix(shard).into(),
    ];
    let give_back = give_back.filter(|gb| gb.shard == shard);
    // (Left out when neither a floor nor a give-back follows: the call then reads as before both.
    // An offer rides in the floor's argument, "<floor>|<take id>|<ms>", which a library older than
    // hand-offs refuses rather than misreads.)
    if floor > Priority::MIN || offer.is_some() || give_back.is_some() {
        args.push(match offer {
            Some((id, lasts)) => format!("{}|{id}|{}", floor.get(), lasts.as_millis()).into(),
            None if floor == Priority::MIN => Value::from(""),
            None => floor.get().to_string().into(),
        });
    }
    if let Some(gb) = give_back {
        names.push(&gb.list);
        args.push(gb.take.as_str().into());
        args.extend(gb.elements.iter().cloned());
    }
    let sent = Instant::now();
    taken(reply::array(store.fcall(Func::Take, &names, args).await?)?, sent)
}

/// What `take` answered (or a hand-off's message: `lane_submit` or `push` did the take for the
/// slot; a lane's token comes with its first batch, another without).
fn taken(items: Vec<Value>, sent: Instant) -> Result<Take> {
    let mut items = items.into_iter();
    let (list, element) = match (items.next(), items.next()) {
        (Some(word), Some(ms)) if reply::text(&word)? == "wait" => {
            return Ok(Take::Wait(Duration::from_millis(reply::int(&ms)?.max(1) as u64)))
        }
        (Some(list), Some(element)) => (list, element),
        (Some(word), None) if reply::text(&word)? == "paused" => return Ok(Take::Paused),
        _ => return Ok(Take::Empty),
    };
    let (mut acquired, mut one_part) = (None, false);
    match items.next() {
        Some(word) if matches!(&word, Value::String(_) | Value::Bytes(_)) && reply::text(&word)? == "one" => {
            one_part = true;
        }
        Some(reply) => acquired = Some(next(reply, Reading::LaneAcquire, sent)?.0),
        None => {}
    }
    Ok(Take::Took(Taken { list: reply::text(&list)?, element: reply::text(&element)?, acquired, one_part }))
}

/// The token `lane_submit` or `push` handed to a slot that offered to take it (lua/prelude.lua,
/// "Hand-offs"), from the slot's hand list `hand`: the take's reply, packed (MessagePack). Waits up
/// to `wait` on the blocking connection `blocking` (`None`: does not block, for the checker).
/// `Ok(None)` when nothing came.
pub(crate) async fn hand(
    store: &Store,
    blocking: &fred::clients::Client,
    hand: &str,
    wait: Option<Duration>,
) -> Result<Option<Take>> {
    let packed: Option<Bytes> = store
        .call("blpop", hand, || async {
            let Some(wait) = wait else {
                return Ok(store.client.lpop(hand, None).await?);
            };
            match blocking.blpop::<Option<(String, Bytes)>, _>(hand, wait.as_secs_f64()).await {
                Ok(popped) => Ok(popped.map(|(_, packed)| packed)),
                Err(e) if *e.kind() == fred::error::ErrorKind::Timeout => Ok(None),
                Err(e) => Err(e.into()),
            }
        })
        .await?;
    packed.map(|packed| unpack_hand(&packed)).transpose()
}

/// What woke a worker's standby slot ([`hand_or_bell`]).
pub(crate) enum Woken {
    /// A token `lane_submit` or `push` handed to it: the take its offer stood for.
    Handed(Take),
    /// A bell it popped: something was pushed on the shard.
    Bell,
    /// Neither, within its wait.
    Timeout,
}

/// A standby slot's wait (`Slot::standby`): for a token handed to it on its hand list `hand` (as
/// [`hand`] reads it) or a bell on `bell` (the same shard's), whichever comes first, for up to
/// `wait` on the blocking connection `blocking`. The pop runs to its server-side timeout.
pub(crate) async fn hand_or_bell(
    store: &Store,
    blocking: &fred::clients::Client,
    hand: &str,
    bell: &str,
    wait: Duration,
) -> Result<Woken> {
    let popped: Option<(String, Bytes)> = store
        .call("blpop", hand, || async {
            match blocking.blpop::<Option<(String, Bytes)>, _>(vec![hand, bell], wait.as_secs_f64()).await {
                Ok(popped) => Ok(popped),
                Err(e) if *e.kind() == fred::error::ErrorKind::Timeout => Ok(None),
                Err(e) => Err(e.into()),
            }
        })
        .await?;
    match popped {
        None => Ok(Woken::Timeout),
        Some((key, _)) if key == bell => Ok(Woken::Bell),
        Some((_, packed)) => Ok(Woken::Handed(unpack_hand(&packed)?)),
    }
}

/// A hand-off's message: the take's reply, packed.
fn unpack_hand(packed: &[u8]) -> Result<Take> {
    let sent = Instant::now();
    let Packed(reply) = rmp_serde::from_slice(packed)
        .map_err(|e| Error::Protocol(format!("a hand-off's message is not MessagePack: {e}")))?;
    taken(reply::array(reply)?, sent)
}

/// A Lua value packed by `cmsgpack`, read as fred reads what Redis replies for it: a number as an
/// integer (Redis truncates), `true` as 1 and `false` as nil, text as a string when it is UTF-8 and
/// as bytes otherwise, and a table with holes (packed as a map) as the array up to its first hole.
struct Packed(Value);

impl<'de> serde::Deserialize<'de> for Packed {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(PackedVisitor).map(Packed)
    }
}

struct PackedVisitor;

impl<'de> serde::de::Visitor<'de> for PackedVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Lua value packed by cmsgpack")
    }
    fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(if v { Value::Integer(1) } else { Value::Null })
    }
    fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::Integer(v))
    }
    fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::Integer(v as i64))
    }
    fn visit_f64<E>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(Value::Integer(v as i64))
    }
    fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.into()))
    }
    fn visit_bytes<E>(self, v: &[u8]) -> std::result::Result<Value, E> {
        Ok(Value::Bytes(Bytes::copy_from_slice(v)))
    }
    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(Packed(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut at = std::collections::BTreeMap::new();
        while let Some((Packed(k), Packed(v))) = map.next_entry()? {
            if let Value::Integer(k) = k {
                at.insert(k, v);
            }
        }
        let mut out = Vec::new();
        while let Some(v) = at.remove(&(out.len() as i64 + 1)) {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
}

/// `untake` on `shard`: undoes take `take` of `holder`, whose reply was never seen. Returns
/// whether the take had happened (and is undone).
pub(crate) async fn untake(store: &Store, shard: u32, holder: &str, take: u64) -> Result<bool> {
    let (held, bell) = (store.keys.held(shard), store.keys.bell(shard));
    let args: Vec<Value> = vec![holder.into(), (take as i64).into()];
    Ok(reply::int(&store.fcall(Func::Untake, &[&held, &bell], args).await?)? == 1)
}

/// Whether a slot holding a token taken on `shard` may run on for another quantum when its
/// quantum's parts are used up: nothing is paused on the shard (a pause lets the running quanta
/// end), and no token waits there at any priority (the shard's bell is empty: one bell per element
/// pushed, popped with it), so that handing the token back would only have it taken again.
pub(crate) async fn may_run_on(store: &Store, shard: u32) -> Result<bool> {
    let (bell, paused) = (store.keys.bell(shard), store.keys.paused(shard));
    let (bells, pauses): (i64, i64) = store
        .call("llen", &bell, || async {
            let pipe = store.client.pipeline();
            let _: () = pipe.llen(bell.as_str()).await?;
            let _: () = pipe.exists(paused.as_str()).await?;
            Ok(pipe.all().await?)
        })
        .await?;
    Ok(bells == 0 && pauses == 0)
}

/// `release` on `shard`: ends `holder`'s take record if it carries take id `take`. Returns
/// whether a record was removed.
pub(crate) async fn release(store: &Store, shard: u32, holder: &str, take: &str) -> Result<bool> {
    let held = store.keys.held(shard);
    let args: Vec<Value> = vec![holder.into(), take.into()];
    Ok(reply::int(&store.fcall(Func::Release, &[&held], args).await?)? == 1)
}

/// `give_back` on `shard`: pushes `elements` onto `list` and ends `holder`'s take record if it
/// carries take id `take`, in one step. Returns how many elements were pushed.
pub(crate) async fn give_back(
    store: &Store,
    shard: u32,
    list: &str,
    holder: &str,
    take: &str,
    elements: Vec<Value>,
) -> Result<i64> {
    let (held, bell) = (store.keys.held(shard), store.keys.bell(shard));
    let mut args: Vec<Value> = vec![holder.into(), take.into()];
    args.extend(elements);
    reply::int(&store.fcall(Func::GiveBack, &[&held, &bell, list], args).await?)
}

/// A request's retry policy, as `acquire` reports it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    /// Runs per sub-request at most.
    pub(crate) max_attempts: u32,
    /// Per-attempt timeout, if any.
    pub(crate) timeout: Option<Duration>,
    /// Retry backoff base.
    pub(crate) backoff_base: Duration,
    /// Retry backoff cap.
    pub(crate) backoff_max: Duration,
    /// The token shards the request was submitted with.
    pub(crate) shards: u32,
    /// When the request's deadline falls, by this process's clock (`acquire`'s report); the slot
    /// cancels the handlers still running then, and starts no part after it.
    pub(crate) deadline: Option<Instant>,
}

/// What a `lane_ack` reports of the lane requests it finished, beside its next step: each one's
/// state and lifecycle (the call announced them itself; the slot counts them), and those with
/// downstreams, whose releases are owed (in the outbox) and the slot's to run.
#[derive(Debug, Default)]
pub(crate) struct LaneFinishes {
    pub(crate) done: Vec<Done>,
    pub(crate) releases: Vec<Owed>,
}

/// The release a `lane_ack` owes for a request with downstreams that it finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Owed {
    /// The request's key id.
    pub(crate) key_id: String,
    /// The lifecycle that ended, and how.
    pub(crate) ended: super::dag::Ended,
    /// Its whole set of downstreams (`<dkid>|<shards>` entries), when the call named it (a small
    /// set): the release then reads none of it.
    pub(crate) downstreams: Option<Vec<String>>,
}

/// A request a `lane_ack` finished (the reply's trailing `{'done', state, lifecycle, ...}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Done {
    /// Its terminal state (`completed` or `failed`).
    pub(crate) state: String,
    /// Its lifecycle: its created ms * 1000, plus less than 1000 (a lane request's, prelude.lua
    /// `sg_lane_clock`).
    pub(crate) lifecycle: i64,
}

/// One sub-request handed to a slot: `{entry id, index, payload, attempt}`.
#[derive(Debug)]
pub(crate) struct Entry {
    /// Its stream entry id.
    pub(crate) id: String,
    /// Its index in the request.
    pub(crate) index: u64,
    /// Its payload (MessagePack).
    pub(crate) payload: Bytes,
    /// Which attempt this is (1 for the first).
    pub(crate) attempt: u32,
    /// For an entry of a lane: the request it belongs to.
    pub(crate) lane: Option<LaneEntry>,
    /// When handing out this entry started its request (state queued to running): how long the
    /// request had waited to start, by Redis's clock (for the stats by stage).
    pub(crate) started_after: Option<Duration>,
}

impl Entry {
    /// The policy it runs under: its own request's for a lane entry, else its batch's.
    pub(crate) fn policy(&self, batch: Policy) -> Policy {
        self.lane.as_ref().map_or(batch, |l| l.policy)
    }
}

/// Which request a lane entry belongs to (docs/protocol.md, "Lanes").
#[derive(Clone, Debug)]
pub(crate) struct LaneEntry {
    /// The request's key id.
    pub(crate) key_id: String,
    /// Its lifecycle when the entry was added: an ack records nothing for another.
    pub(crate) lifecycle: String,
    /// Its retry policy.
    pub(crate) policy: Policy,
}

/// What `acquire` or `ack` answered.
#[derive(Debug)]
pub(crate) enum Next {
    /// `{'run', [policy,] entry...}`: the slot holds the token, with a batch to run (the policy
    /// only from `acquire`).
    Run(Vec<Entry>, Option<Policy>),
    /// `{'requeue', element, priority}` (`ack`): push the element back (`give_back`) onto the
    /// list of `priority`, the request's priority now (an operator may have changed it since the
    /// take); `None` (a lane's ack, whose priority never changes): the list it was taken from.
    Requeue(String, Option<Priority>),
    /// `{'park', wake[, shards]}`: parked; a retry falls due, or the rate limit has room, in `wake`
    /// (zero: neither); `acquire` also names the request's token shards.
    Park(Duration, Option<u32>),
    /// `{'finished', ...}` (`ack`): the request just turned terminal.
    Finished(Finished),
    /// `{'drop'}` (`acquire`): the request is finished, cancelled or unknown.
    Drop,
    /// `{'stale'}` (`acquire`): not the token's current element.
    Stale,
    /// `{'fenced'}` (`ack`): this slot no longer holds the token as it was; nothing recorded.
    Fenced,
}

/// A slot's hold on a token, as `acquire` and `ack` present it: the element it took, its take's
/// holder name, and its worker's stream consumer name.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Holding<'a> {
    /// The token element taken.
    pub(crate) element: &'a TokenElement,
    /// The holder (`<worker>#<slot>`), as in its take record.
    pub(crate) holder: &'a str,
    /// Its worker's consumer name in the request's consumer group.
    pub(crate) consumer: &'a str,
}

impl Holding<'_> {
    /// `ARGV[1..5]` of `acquire` and `ack`.
    fn args(&self) -> Vec<Value> {
        vec![
            self.element.key_id.as_str().into(),
            self.element.k.to_string().into(),
            self.element.epoch.to_string().into(),
            self.holder.into(),
            self.consumer.into(),
        ]
    }
}

/// What an `ack` asks for once its batch is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Then {
    /// Keep the token and hand out at most this many more entries.
    More(u32),
    /// Give the token back (quantum used up, shutting down).
    GiveBack,
}

/// `acquire` (`lane_acquire` for a lane's token): the slot presents the element it took from
/// `list` and asks for at most `want` entries. The list's tenant group (none for a shard's list)
/// lets the function refuse a copy an earlier request under the same id left on a list of another
/// kind than the request's, should its epoch match the token's now.
pub(crate) async fn acquire(store: &Store, holding: &Holding<'_>, list: &str, want: u32) -> Result<Next> {
    let keys = store.keys.request(&holding.element.key_id);
    let mut args = holding.args();
    if let Some((shard, _)) = lane_of(&holding.element.key_id) {
        args.push(batch(store, want, holding.element.epoch));
        args.push(store.keys.record_prefix(shard).into());
        let (active, armed) = (store.keys.active(shard), store.keys.armed(shard));
        let mut keys = keys.all().to_vec();
        keys.extend([active.as_str(), armed.as_str()]);
        return Ok(next(
            store.fcall(Func::LaneAcquire, &keys, args).await?,
            Reading::LaneAcquire,
            Instant::now(),
        )?
        .0);
    }
    // For a request it finishes at its deadline.
    args.extend([
        batch(store, want, holding.element.epoch),
        ms(store.config.retention),
        store.keys.done_channel().into(),
        group_of_queue(list).unwrap_or_default().into(),
    ]);
    let sent = Instant::now();
    let next = next(store.fcall(Func::Acquire, &keys.all(), args).await?, Reading::Acquire, sent)?.0;
    if store.deterministic() {
        // The randomized checker runs the functions on a virtual clock and decides when handlers
        // end: a timer on this process's clock would race with it and spoil the replay. The
        // deadline is still enforced where the checker looks, in the functions.
        if let Next::Run(entries, Some(policy)) = next {
            return Ok(Next::Run(entries, Some(Policy { deadline: None, ..policy })));
        }
    }
    Ok(next)
}

/// How one entry of a batch ended, as `ack` records it.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// `ok`: its result (MessagePack).
    Ok(Bytes),
    /// `retry`: a retryable failure (its error record, JSON), retried after `delay`.
    Retry {
        /// The error record.
        record: Bytes,
        /// The backoff before the retry.
        delay: Duration,
    },
    /// `dead`: dead-lettered (its error record, JSON).
    Dead(Bytes),
    /// `skip`: it did not run; handed out again first.
    Skip,
}

/// One entry's report in an `ack`.
#[derive(Debug)]
pub(crate) struct Report<'a> {
    /// Its stream entry id.
    pub(crate) id: &'a str,
    /// How it ended.
    pub(crate) outcome: Outcome,
    /// The attempt that ran.
    pub(crate) attempt: u32,
    /// Its index in its request.
    pub(crate) index: u64,
    /// For a lane entry: its request's key id and lifecycle.
    pub(crate) lane: Option<(&'a str, &'a str)>,
}

/// `ack`: the slot reports the batch it ran, in the order it was handed out, and asks for more or
/// gives the token back (`then`). Also returns the lane requests the call finished (a `lane_ack`
/// announces them itself; the slot only counts them).
pub(crate) async fn ack(
    store: &Store,
    holding: &Holding<'_>,
    then: Then,
    reports: Vec<Report<'_>>,
) -> Result<(Next, LaneFinishes)> {
    let mut keys: Vec<String> =
        store.keys.request(&holding.element.key_id).all().iter().map(|k| (*k).to_owned()).collect();
    let lane = lane_of(&holding.element.key_id).map(|(shard, _)| shard);
    if let Some(shard) = lane {
        keys.extend([store.keys.events(shard), store.keys.active(shard), store.keys.armed(shard)]);
    }
    let (keep_going, want) = match then {
        Then::More(want) => ("1", want),
        // ARGV[9] is read only when the slot keeps going.
        Then::GiveBack => ("0", 0),
    };
    let mut args = holding.args();
    args.extend([
        keep_going.into(),
        ms(store.config.retention),
        store.keys.done_channel().into(),
        batch(store, want, holding.element.epoch),
    ]);
    if let Some(shard) = lane {
        args.push(store.keys.record_prefix(shard).into());
        // The downstream sets' prefix: the reply names the downstreams of each request it releases
        // (a small set), so that the release reads none. (Under the checker, not on every other
        // pair of epochs: a client older than that asks without, and the release reads the set.)
        if !(store.deterministic() && holding.element.epoch / 2 % 2 == 1) {
            keys.push(store.keys.downstreams(shard, ""));
        }
    }
    for r in reports {
        let (kind, body, delay): (&str, Value, Duration) = match r.outcome {
            Outcome::Ok(bytes) => ("ok", Value::Bytes(bytes), Duration::ZERO),
            Outcome::Skip => ("skip", "".into(), Duration::ZERO),
            Outcome::Dead(record) => ("dead", Value::Bytes(record), Duration::ZERO),
            Outcome::Retry { record, delay } => ("retry", Value::Bytes(record), delay),
        };
        args.extend([r.id.into(), kind.into(), body, ms(delay), i64::from(r.attempt).into()]);
        if let (Some(_), Some((key_id, lifecycle))) = (lane, r.lane) {
            args.extend([key_id.into(), lifecycle.into(), (r.index as i64).into()]);
        }
    }
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let (func, reading) =
        if lane.is_some() { (Func::LaneAck, Reading::LaneAck) } else { (Func::Ack, Reading::Ack) };
    next(store.fcall(func, &keys, args).await?, reading, Instant::now())
}

/// A batch size as `acquire`, `ack`, their lanes' and `take` take it, asking for flat entries in
/// a `run` reply: a request's three items each (id, payload, attempt) rather than an array of
/// four, a lane's eight rather than an array of seven or eight, which cost Redis about a tenth of a
/// part to build (docs/protocol.md, the hand-out). Under the randomized checker, calls of odd
/// `parity` (a hold's token epoch, a take's id) ask for arrays, as a client older than flat
/// entries does: its search covers both forms, and the two side by side.
fn batch(store: &Store, want: u32, parity: u64) -> Value {
    if store.deterministic() && parity % 2 == 1 {
        return i64::from(want).into();
    }
    format!("{want}|flat").into()
}

/// Which call's reply [`next`] reads: where a `run` reply's policy comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reading {
    /// `acquire`: the policy is the item after the tag.
    Acquire,
    /// A lane's acquire (`lane_acquire`, or `take`'s): from the first entry's own policy.
    LaneAcquire,
    /// `ack`: none; the slot keeps the one its acquire reported.
    Ack,
    /// `lane_ack`: none, as `ack`; its entries carry their requests' own.
    LaneAck,
}

/// Reads an acquire or ack reply (`with_policy`: which), and the lane requests a `lane_ack`
/// reports finished (trailing `{'done', ...}` and `{'rel', ...}` items).
fn next(reply: Value, with_policy: Reading, sent: Instant) -> Result<(Next, LaneFinishes)> {
    let mut items = reply::array(reply)?;
    let trailing = |items: &mut Vec<Value>, tag: &str| match items.last() {
        Some(Value::Array(last)) if last.first().and_then(Value::as_str).as_deref() == Some(tag) => {
            reply::array(items.pop().unwrap_or(Value::Null))
        }
        _ => Ok(Vec::new()),
    };
    // `{'dn', key id, n, entry * n, ...}`, after `rel` (asked for with the sets' prefix).
    let mut sets = std::collections::HashMap::new();
    let mut dn = trailing(&mut items, "dn")?.into_iter().skip(1);
    while let (Some(kid), Some(n)) = (dn.next(), dn.next()) {
        let n = usize::try_from(reply::int(&n)?).unwrap_or(0);
        let entries = dn.by_ref().take(n).map(|e| reply::text(&e)).collect::<Result<Vec<String>>>()?;
        if entries.len() < n {
            return Err(Error::Protocol("short 'dn' item in a lane_ack reply".into()));
        }
        sets.insert(reply::text(&kid)?, entries);
    }
    // `{'rel', key id, state, lifecycle, ...}`.
    let rel = trailing(&mut items, "rel")?;
    let mut releases = Vec::new();
    for triple in rel.get(1..).unwrap_or_default().chunks(3) {
        if let [kid, state, lifecycle] = triple {
            let ended = super::dag::Ended { lifecycle: reply::int(lifecycle)?, state: reply::text(state)? };
            let key_id = reply::text(kid)?;
            let downstreams = sets.remove(&key_id);
            releases.push(Owed { key_id, ended, downstreams });
        }
    }
    let done = read_done(trailing(&mut items, "done")?)?;
    let finishes = LaneFinishes { done, releases };
    let mut items = items.into_iter();
    let tag = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
    let next = match tag.as_str() {
        "run" => {
            // A lane's entries carry their own policies, its replies none of their own.
            let mut started_after = None;
            let mut policy = if with_policy == Reading::Acquire {
                let (policy, waited) = read_policy(items.next().unwrap_or(Value::Null), sent)?;
                started_after = waited;
                Some(policy)
            } else {
                None
            };
            let mut entries = Vec::new();
            let mut items = items.peekable();
            // Flat entries (asked for with "<n>|flat"): a lane's eight items, a request's three.
            // A library older than flat entries answers with arrays, which the loop below reads.
            let flat = items.peek().is_some_and(|first| !matches!(first, Value::Array(_)));
            if flat && matches!(with_policy, Reading::LaneAcquire | Reading::LaneAck) {
                while let Some(id) = items.next() {
                    let f: Vec<Value> = items.by_ref().take(7).collect();
                    let Ok([index, payload, attempt, key_id, lifecycle, p, waited]) =
                        <[Value; 7]>::try_from(f)
                    else {
                        return Err(Error::Protocol("short lane entry in a 'run' reply".into()));
                    };
                    let waited = reply::int(&waited)?;
                    entries.push(Entry {
                        id: reply::text(&id)?,
                        index: reply::int(&index)? as u64,
                        payload: reply::bytes(payload)?,
                        attempt: reply::int(&attempt)? as u32,
                        lane: Some(LaneEntry {
                            key_id: reply::text(&key_id)?,
                            lifecycle: reply::text(&lifecycle)?,
                            policy: read_lane_policy(&reply::text(&p)?)?,
                        }),
                        started_after: (waited >= 0).then(|| Duration::from_millis(waited as u64)),
                    });
                }
            } else if flat {
                while let Some(id) = items.next() {
                    let (Some(payload), Some(attempt)) = (items.next(), items.next()) else {
                        return Err(Error::Protocol("short entry in a 'run' reply".into()));
                    };
                    let id = reply::text(&id)?;
                    let index = entry_index(&id)?;
                    entries.push(Entry {
                        id,
                        index,
                        payload: reply::bytes(payload)?,
                        attempt: reply::int(&attempt)? as u32,
                        lane: None,
                        started_after: started_after.take(),
                    });
                }
            }
            for item in items {
                let mut f = reply::array(item)?.into_iter();
                let (Some(id), Some(index), Some(payload), Some(attempt)) =
                    (f.next(), f.next(), f.next(), f.next())
                else {
                    return Err(Error::Protocol("short entry in a 'run' reply".into()));
                };
                let lane = match (f.next(), f.next(), f.next()) {
                    (Some(key_id), Some(lifecycle), Some(p)) => Some(LaneEntry {
                        key_id: reply::text(&key_id)?,
                        lifecycle: reply::text(&lifecycle)?,
                        policy: read_lane_policy(&reply::text(&p)?)?,
                    }),
                    _ => None,
                };
                // A lane entry's eighth field; a request's wait, from the policy, goes with its
                // batch's first entry.
                let waited = match f.next() {
                    Some(ms) => Some(Duration::from_millis(reply::int(&ms)?.max(0) as u64)),
                    None => started_after.take(),
                };
                entries.push(Entry {
                    id: reply::text(&id)?,
                    index: reply::int(&index)? as u64,
                    payload: reply::bytes(payload)?,
                    attempt: reply::int(&attempt)? as u32,
                    lane,
                    started_after: waited,
                });
            }
            let Some(first) = entries.first() else {
                return Err(Error::Protocol("a 'run' reply without entries".into()));
            };
            if with_policy == Reading::LaneAcquire {
                policy = first.lane.as_ref().map(|l| l.policy);
            }
            Next::Run(entries, policy)
        }
        "requeue" => {
            let element = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_default();
            Next::Requeue(element, super::priority_item(items.next())?)
        }
        "park" => {
            let wake = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or(0);
            let shards = items.next().map(|v| reply::int(&v)).transpose()?.map(|s| s.clamp(1, 1024) as u32);
            Next::Park(Duration::from_millis(wake.max(0) as u64), shards)
        }
        "finished" => Next::Finished(Finished::from_reply(items)?),
        "drop" => Next::Drop,
        "stale" => Next::Stale,
        "fenced" => Next::Fenced,
        other => return Err(Error::Protocol(format!("unexpected reply {other:?}"))),
    };
    Ok((next, finishes))
}

/// A request entry's index from its id: the stream's entries are `0-1`, `0-2`, ... in the order
/// of their parts (docs/protocol.md, the stream key).
fn entry_index(id: &str) -> Result<u64> {
    id.strip_prefix("0-")
        .and_then(|n| n.parse::<u64>().ok())
        .and_then(|n| n.checked_sub(1))
        .ok_or_else(|| Error::Protocol(format!("entry id {id:?} is not 0-<n>, n >= 1")))
}

/// The requests of a `lane_ack`'s trailing `{'done', state, lifecycle, ...}` (its items).
fn read_done(item: Vec<Value>) -> Result<Vec<Done>> {
    let mut fields = item.into_iter().skip(1);
    let mut done = Vec::new();
    while let (Some(state), Some(lifecycle)) = (fields.next(), fields.next()) {
        let lifecycle = reply::text(&lifecycle)?
            .parse()
            .map_err(|_| Error::Protocol("a finished lane request's lifecycle is not a number".into()))?;
        done.push(Done { state: reply::text(&state)?, lifecycle });
    }
    Ok(done)
}

/// A lane request's policy from its record's settings (`lane::Settings`): the library hands the
/// string out as it is, so that Lua does not split it on the hot path.
fn read_lane_policy(pol: &str) -> Result<Policy> {
    let [_, _, _, max_attempts, timeout, base, cap] =
        super::lane::Settings::parse(pol)?.values.map(|v| v as i64);
    Ok(read_policy(
        Value::Array(vec![max_attempts.into(), timeout.into(), base.into(), cap.into()]),
        Instant::now(),
    )?
    .0)
}

/// A policy as the library reports it: `{max attempts, timeout ms, backoff base ms, backoff max ms
/// [, token shards [, queue wait ms (-1: none) [, deadline ms]]]}`, and the queue wait when
/// `acquire` started the request. `sent`: when the call was sent, before Redis read its clock, so
/// that the deadline this process keeps is never later than Redis's.
fn read_policy(value: Value, sent: Instant) -> Result<(Policy, Option<Duration>)> {
    let p: Vec<i64> = reply::array(value)?.iter().map(reply::int).collect::<Result<_>>()?;
    let [max_attempts, timeout, base, cap, ref rest @ ..] = p[..] else {
        return Err(Error::Protocol("a policy has fewer than four fields".into()));
    };
    let policy = Policy {
        max_attempts: max_attempts.max(1) as u32,
        timeout: (timeout > 0).then(|| Duration::from_millis(timeout as u64)),
        backoff_base: Duration::from_millis(base.max(0) as u64),
        backoff_max: Duration::from_millis(cap.max(0) as u64),
        shards: rest.first().map_or(1, |s| (*s).clamp(1, 1024) as u32),
        deadline: rest.get(2).map(|d| sent + Duration::from_millis((*d).max(0) as u64)),
    };
    let waited = rest.get(1).filter(|w| **w >= 0).map(|w| Duration::from_millis(*w as u64));
    Ok((policy, waited))
}

/// One hold to check with `holds`: token `k` at `epoch`, held by `holder`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hold<'a> {
    /// The token number.
    pub(crate) k: &'a str,
    /// The epoch it was held at.
    pub(crate) epoch: &'a str,
    /// The slot holding it.
    pub(crate) holder: &'a str,
}

/// `holds` (read-only) on the request whose meta hash is `meta`: which of `held` no longer
/// stand. Returns their token numbers.
pub(crate) async fn holds(store: &Store, meta: &str, held: &[Hold<'_>]) -> Result<Vec<String>> {
    let mut args: Vec<Value> = Vec::with_capacity(held.len() * 3);
    for h in held {
        args.extend([h.k.into(), h.epoch.into(), h.holder.into()]);
    }
    let lost = reply::array(store.fcall(Func::Holds, &[meta], args).await?)?;
    Ok(lost.iter().filter_map(|v| v.as_string()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Value {
        Value::String(s.into())
    }

    /// An `acquire` reply with flat entries reads as the same batch as one with arrays: ids,
    /// indices from the ids, payloads, attempts, and the policy's queue wait with the first.
    #[test]
    fn a_run_reply_reads_the_same_with_flat_entries_and_with_arrays() {
        let policy = || Value::Array(vec![text("3"), text("0"), text("0"), text("0"), text("1"), 7.into()]);
        let flat = Value::Array(vec![
            text("run"),
            policy(),
            text("0-1"),
            Value::Bytes("a".into()),
            1.into(),
            text("0-12"),
            Value::Bytes("b".into()),
            2.into(),
        ]);
        let arrays = Value::Array(vec![
            text("run"),
            policy(),
            Value::Array(vec![text("0-1"), 0.into(), Value::Bytes("a".into()), 1.into()]),
            Value::Array(vec![text("0-12"), 11.into(), Value::Bytes("b".into()), 2.into()]),
        ]);
        let read = |reply| match next(reply, Reading::Acquire, Instant::now()).unwrap().0 {
            Next::Run(entries, Some(policy)) => {
                let entries: Vec<_> = entries
                    .into_iter()
                    .map(|e| (e.id, e.index, e.payload, e.attempt, e.started_after))
                    .collect();
                (entries, policy.max_attempts)
            }
            other => panic!("{other:?}"),
        };
        let (entries, max_attempts) = read(flat);
        assert_eq!(max_attempts, 3);
        assert_eq!(entries[0], ("0-1".into(), 0, "a".into(), 1, Some(Duration::from_millis(7))));
        assert_eq!(entries[1], ("0-12".into(), 11, "b".into(), 2, None));
        assert_eq!(read(arrays).0, entries);
        let short = Value::Array(vec![text("run"), text("0-1"), Value::Bytes("a".into())]);
        assert!(next(short, Reading::Ack, Instant::now()).is_err());
        let bad_id = Value::Array(vec![text("run"), text("7"), Value::Bytes("a".into()), 1.into()]);
        assert!(next(bad_id, Reading::Ack, Instant::now()).is_err());
    }

    /// A lane's `run` reply reads the same with flat entries (eight items each, the queue wait -1
    /// when the hand-out did not start the request) and with arrays (seven items, or eight).
    #[test]
    fn a_lane_run_reply_reads_the_same_with_flat_entries_and_with_arrays() {
        let e1 = || {
            vec![
                text("0-4"),
                2.into(),
                Value::Bytes("a".into()),
                1.into(),
                text("k1"),
                text("17"),
                text("50,1,1,3"),
            ]
        };
        let e2 = || {
            vec![
                text("0-5"),
                0.into(),
                Value::Bytes("b".into()),
                2.into(),
                text("k2"),
                text("18"),
                text("50,1,1"),
            ]
        };
        let mut flat = vec![text("run")];
        flat.extend(e1().into_iter().chain([9.into()]));
        flat.extend(e2().into_iter().chain([(-1).into()]));
        let arrays =
            vec![text("run"), Value::Array(e1().into_iter().chain([9.into()]).collect()), Value::Array(e2())];
        let read = |reply: Vec<Value>, reading| match next(Value::Array(reply), reading, Instant::now())
            .unwrap()
            .0
        {
            Next::Run(entries, policy) => {
                let max_attempts = policy.map(|p| p.max_attempts);
                let entries: Vec<_> = entries
                    .into_iter()
                    .map(|e| {
                        let lane = e.lane.unwrap();
                        (e.id, e.index, e.payload, e.attempt, lane.key_id, lane.lifecycle, e.started_after)
                    })
                    .collect();
                (entries, max_attempts)
            }
            other => panic!("{other:?}"),
        };
        let (entries, max_attempts) = read(flat.clone(), Reading::LaneAcquire);
        assert_eq!(max_attempts, Some(3), "a lane acquire's policy is its first entry's");
        assert_eq!(
            entries[0],
            ("0-4".into(), 2, "a".into(), 1, "k1".into(), "17".into(), Some(Duration::from_millis(9)))
        );
        assert_eq!(entries[1], ("0-5".into(), 0, "b".into(), 2, "k2".into(), "18".into(), None));
        assert_eq!(read(arrays.clone(), Reading::LaneAcquire).0, entries);
        assert_eq!(read(flat.clone(), Reading::LaneAck), (entries.clone(), None));
        assert_eq!(read(arrays, Reading::LaneAck), (entries, None));
        flat.pop();
        assert!(next(Value::Array(flat), Reading::LaneAck, Instant::now()).is_err(), "a short lane entry");
    }

    /// A `lane_ack` reply that finished requests, some with downstreams: the `done` pairs for the
    /// stats, and each release with the state and lifecycle that ended (the release reads nothing
    /// first).
    #[test]
    fn a_lane_acks_trailing_items_name_what_finished_and_the_releases_owed() {
        let reply = Value::Array(vec![
            text("park"),
            0.into(),
            Value::Array(vec![
                text("done"),
                text("completed"),
                text("1795000000000000"),
                text("failed"),
                text("7"),
            ]),
            Value::Array(vec![text("rel"), text("r1"), text("completed"), text("1795000000000000")]),
        ]);
        let (step, finishes) = next(reply, Reading::Ack, Instant::now()).unwrap();
        assert!(matches!(step, Next::Park(..)), "{step:?}");
        assert_eq!(finishes.done.len(), 2);
        let ended = super::super::dag::Ended { lifecycle: 1_795_000_000_000_000, state: "completed".into() };
        assert_eq!(
            finishes.releases,
            vec![Owed { key_id: "r1".to_owned(), ended: ended.clone(), downstreams: None }]
        );

        // With the downstream sets' prefix, the sets come after the releases (r2's was too large).
        let reply = Value::Array(vec![
            text("park"),
            0.into(),
            Value::Array(vec![
                text("rel"),
                text("r1"),
                text("completed"),
                text("1795000000000000"),
                text("r2"),
                text("completed"),
                text("1795000000000000"),
            ]),
            Value::Array(vec![text("dn"), text("r1"), 2.into(), text("d1|1"), text("d2|3")]),
        ]);
        let (_, finishes) = next(reply, Reading::LaneAck, Instant::now()).unwrap();
        assert_eq!(
            finishes.releases,
            vec![
                Owed {
                    key_id: "r1".to_owned(),
                    ended: ended.clone(),
                    downstreams: Some(vec!["d1|1".to_owned(), "d2|3".to_owned()])
                },
                Owed { key_id: "r2".to_owned(), ended, downstreams: None },
            ]
        );
        let short = Value::Array(vec![
            text("park"),
            0.into(),
            Value::Array(vec![text("rel"), text("r1"), text("completed"), text("1")]),
            Value::Array(vec![text("dn"), text("r1"), 2.into(), text("d1|1")]),
        ]);
        assert!(next(short, Reading::LaneAck, Instant::now()).is_err(), "a short 'dn' item");
    }
}
