// The body of tests/integration/recovery.rs: written once, run against a single Redis and a 3-master Redis
// Cluster (`per_topology!` runs it once for each).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use sluicegate_testkit::connect;
use sluicegate::{
    async_trait, Config, Context, Handler, HandlerError, Listener, Producer, Quantum, RequestState, Worker,
};
use crate::support::{env_on, env_streams, assert_namespace_drains, fast, start_worker, Job, Probe};


/// The keys a foreign client would build (docs/protocol.md), for placing faults by hand: what a
/// worker's slot does, call by call, so that a test can stop it exactly where the fault goes.
struct Raw {
    client: Client,
    ns: String,
    lease_ms: u64,
}

fn fcall(name: &str) -> String {
    format!("sg{}_{name}", sluicegate::protocol::PROTOCOL_VERSION)
}

impl Raw {
    async fn new(url: &str, config: &Config) -> Self {
        Self {
            client: connect(url).await.unwrap(),
            ns: config.namespace_str().to_owned(),
            lease_ms: config.lease_duration().as_millis() as u64,
        }
    }
    fn token_key(&self, suffix: &str) -> String {
        format!("{0}:{{{0}.q0}}:{suffix}", self.ns)
    }
    fn list(&self, prio: u8) -> String {
        self.token_key(&format!("p:{prio}"))
    }
    fn request_keys(&self, key_id: &str) -> Vec<String> {
        let base = format!("{}:r:{{{key_id}}}", self.ns);
        ["", ":s", ":res", ":err", ":orph", ":retry"].iter().map(|s| format!("{base}{s}")).collect()
    }
    async fn call(&self, function: &str, keys: Vec<String>, args: Vec<Value>) -> Value {
        let mut all: Vec<Value> = vec![fcall(function).into(), (keys.len() as i64).into()];
        all.extend(keys.into_iter().map(Value::from));
        all.extend(args);
        let cmd = CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false);
        self.client.custom::<Value, Value>(cmd, all).await.unwrap()
    }
    /// Registers a worker that will never beat again: it is declared dead one lease later.
    async fn doomed_worker(&self, id: &str) {
        let info = format!(r#"{{"id":"{id}","slots":1,"pid":0,"host":"test","started_ms":0,"shards":1}}"#);
        let keys = vec![self.token_key("workers"), self.token_key("winfo"), self.token_key("reaping")];
        let args: Vec<Value> =
            vec![id.into(), (self.lease_ms as i64).into(), info.into(), "1".into(), 0.into(), 10_000.into()];
        self.call("beat", keys, args).await;
    }
    /// `take` on shard 0 as `holder` (take id 1): the element, recorded as held.
    async fn take(&self, holder: &str) -> String {
        match self.take_with(holder, 1).await {
            // (A lane token's reply has a third item: its first batch, acquired in the same call.)
            Value::Array(items) if items.len() >= 2 => items[1].as_string().unwrap(),
            other => panic!("take found nothing: {other:?}"),
        }
    }
    /// `take` on shard 0 as `holder` (take id 1), a lane token's first batch at most `batch`
    /// entries: the whole reply.
    async fn take_with(&self, holder: &str, batch: i64) -> Value {
        let keys = ["held", "bell", "active", "armed", "paused"].map(|k| self.token_key(k)).to_vec();
        let args: Vec<Value> = vec![
            holder.into(),
            1.into(),
            "".into(),
            "0".into(),
            holder.into(),
            batch.into(),
            self.token_key("lane:").into(),
            self.token_key("s:").into(),
            self.token_key("p:").into(),
        ];
        self.call("take", keys, args).await
    }
    /// The keys of the lane of priority `prio` on shard 0, as `lane_acquire` and `lane_ack` take
    /// them: the lane's own (as a request's), then those of its shard their KEYS list names.
    fn lane_keys(&self, prio: u8, shard_keys: &[&str]) -> Vec<String> {
        let base = self.token_key(&format!("lane:{prio}"));
        let mut keys: Vec<String> =
            ["", ":s", ":res", ":err", ":orph", ":retry"].iter().map(|s| format!("{base}{s}")).collect();
        keys.extend(shard_keys.iter().map(|k| self.token_key(k)));
        keys
    }
    /// `lane_acquire` of a lane token `element` of priority `prio` as `holder`: the raw reply.
    async fn lane_acquire(&self, element: &str, prio: u8, holder: &str, batch: i64) -> Vec<Value> {
        let parts: Vec<&str> = element.split('|').collect();
        let consumer = holder.split('/').next().unwrap();
        let mut args: Vec<Value> = [parts[0], parts[1], parts[2], holder, consumer].map(Value::from).to_vec();
        args.extend([batch.into(), self.token_key("s:").into()]);
        match self.call("lane_acquire", self.lane_keys(prio, &["active", "armed"]), args).await {
            Value::Array(items) => items,
            other => panic!("{other:?}"),
        }
    }
    /// `lane_ack` of `entries` (as `lane_acquire` handed them out), each `ok` with result `42`,
    /// asking for more (with none queued, the token parks in its lane): the raw reply.
    async fn lane_ack_ok(&self, element: &str, prio: u8, holder: &str, entries: &[Vec<Value>]) -> Vec<Value> {
        let parts: Vec<&str> = element.split('|').collect();
        let consumer = holder.split('/').next().unwrap();
        let channel = format!("{}:done", self.ns);
        let mut args: Vec<Value> =
            [parts[0], parts[1], parts[2], holder, consumer, "1", "60000", channel.as_str(), "1"].map(Value::from).to_vec();
        args.push(self.token_key("s:").into());
        for e in entries {
            args.extend([e[0].clone(), "ok".into(), Value::Bytes(rmp_serde::to_vec(&42u64).unwrap().into()), "0".into()]);
            args.extend([e[3].clone(), e[4].clone(), e[5].clone(), e[1].clone()]);
        }
        match self.call("lane_ack", self.lane_keys(prio, &["events", "active", "armed"]), args).await {
            Value::Array(items) => items,
            other => panic!("{other:?}"),
        }
    }
    /// Presents an element to acquire as `holder`: the token is now held.
    async fn acquire(&self, element: &str, holder: &str) -> Vec<Value> {
        let parts: Vec<&str> = element.split('|').collect();
        let consumer = holder.split('/').next().unwrap();
        let args = [parts[0], parts[1], parts[2], holder, consumer, "1"].map(Value::from).to_vec();
        match self.call("acquire", self.request_keys(parts[0]), args).await {
            Value::Array(items) => items,
            other => panic!("{other:?}"),
        }
    }
    /// Acks a batch of one entry with `outcome` (`ok` and the result bytes, or `dead` and the error
    /// record), as `holder`, giving the token back: the raw reply.
    async fn ack_one(&self, element: &str, holder: &str, entry: &str, outcome: (&str, Vec<u8>), attempt: &str) -> Vec<Value> {
        let parts: Vec<&str> = element.split('|').collect();
        let consumer = holder.split('/').next().unwrap();
        let channel = format!("{}:done", self.ns);
        let mut args: Vec<Value> =
            [parts[0], parts[1], parts[2], holder, consumer, "0", "1000", channel.as_str(), "1"].map(Value::from).to_vec();
        let (outcome, body) = outcome;
        args.extend([Value::from(entry), outcome.into(), Value::Bytes(body.into()), "0".into(), attempt.into()]);
        match self.call("ack", self.request_keys(parts[0]), args).await {
            Value::Array(items) => items,
            other => panic!("{other:?}"),
        }
    }
    /// Calls a token-side function of shard 0 with `keys` (suffixes after `<ns>:{<ns>.q0}:`).
    async fn token_fcall(&self, function: &str, keys: &[&str], args: Vec<Value>) -> Value {
        self.call(function, keys.iter().map(|k| self.token_key(k)).collect(), args).await
    }
    async fn in_active(&self, key_id: &str) -> bool {
        let score: Option<f64> = self.client.zscore(self.token_key("active"), key_id).await.unwrap();
        score.is_some()
    }
    /// Takes the token of priority `prio` and acquires it as slot 0 of a worker that then dies
    /// (registered, never to beat again): the element, and the first entry handed out (id, attempt).
    async fn take_entry(&self, worker: &str) -> (String, String, String) {
        self.doomed_worker(worker).await;
        let holder = format!("{worker}/0");
        let element = self.take(&holder).await;
        let reply = self.acquire(&element, &holder).await;
        let entry = match &reply[..] {
            [tag, _policy, Value::Array(entry), ..] if tag.as_str().as_deref() == Some("run") => entry.clone(),
            other => panic!("acquire did not hand out an entry: {other:?}"),
        };
        (element, entry[0].as_string().unwrap(), entry[3].as_string().unwrap())
    }
    /// A worker (`worker`, dying after) takes the only token of `kid`'s one-part request and
    /// dead-letters the part: the request fails. Then the steps after that finish run up to the seal
    /// (`finish_index`, `seal`), not `unindex`. Returns the failed lifecycle and the finish marks' key.
    async fn fail_and_seal(&self, worker: &str, kid: &str) -> (String, String) {
        let (element, id, attempt) = self.take_entry(worker).await;
        let record = br#"{"error":"broken","attempts":1,"permanent":true}"#.to_vec();
        let reply = self.ack_one(&element, &format!("{worker}/0"), &id, ("dead", record), &attempt).await;
        assert_eq!(reply[..2].iter().map(|v| v.as_string().unwrap()).collect::<Vec<_>>(), ["finished", "failed"]);
        let lifecycle = reply[2].as_string().unwrap();
        let marks = format!("f:{kid}");
        let args: Vec<Value> = vec![kid.into(), "failed".into(), 60_000.into(), lifecycle.as_str().into()];
        let indexed = self.token_fcall("finish_index", &["active", "events", "p:40", &marks, "bell"], args).await;
        assert_eq!(indexed, Value::Integer(1));
        let seal = self.call("seal", self.request_keys(kid), vec![lifecycle.as_str().into(), 60_000.into()]).await;
        assert_eq!(seal, Value::Integer(1));
        (lifecycle, marks)
    }
    /// `untake` of take id 1 of `holder` on shard 0: whether the take had happened.
    async fn untake(&self, holder: &str) -> bool {
        let keys = vec![self.token_key("held"), self.token_key("bell")];
        self.call("untake", keys, vec![holder.into(), 1.into()]).await == Value::Integer(1)
    }
    async fn list_len(&self, prio: u8) -> i64 {
        self.client.llen(self.list(prio)).await.unwrap()
    }
    /// `take` on shard 0 as `holder` with ARGV[10] `floor` (a floor, or a floor with an offer):
    /// the reply, or the error it was refused with.
    async fn take_offering(&self, holder: &str, floor: &str) -> Result<Value, fred::error::Error> {
        let keys = ["held", "bell", "active", "armed", "paused"].map(|k| self.token_key(k));
        let mut all: Vec<Value> = vec![fcall("take").into(), (keys.len() as i64).into()];
        all.extend(keys.into_iter().map(Value::from));
        all.extend([holder, "1", "", "0", holder, "1"].map(Value::from));
        all.extend([self.token_key("lane:"), self.token_key("s:"), self.token_key("p:")].map(Value::from));
        all.push(floor.into());
        let cmd = CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false);
        self.client.custom::<Value, Value>(cmd, all).await
    }
}

/// A take's offer of a hand-off that would last 0 ms is refused, and refused before it changes
/// anything: the `wait` hash it would have set to expire at once keeps the other slots' offers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_offering_for_0_ms_is_refused_and_the_other_offers_stay() {
    let env = env_on(TOPOLOGY, "offer0").await;
    // (Connecting loads the library.)
    let _producer = Producer::connect(&env.config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &env.config).await;
    let found = raw.take_offering("w-a/0", "0|2|60000").await.unwrap();
    assert_eq!(found, Value::Array(Vec::new()), "nothing to take: the slot offers instead");
    let offers = raw.token_key("wait");
    let refused = raw.take_offering("w-b/0", "0|2|0").await.unwrap_err();
    assert!(refused.details().contains("SGINVALID take's offer must last at least 1 ms"), "{refused:?}");
    let left: Vec<String> = raw.client.hkeys(&offers).await.unwrap();
    assert_eq!(left, vec!["w-a/0".to_owned()], "the other slot's offer stays");
    assert!(raw.client.pttl::<i64, _>(&offers).await.unwrap() > 50_000);
}

/// A requeued one-part failure: its two lifecycles are announced, failed then completed, and the
/// request ends with the part's result (`Job::new(21)` -> 42).
async fn hear_the_failure_then_the_completion(listener: &mut Listener, h: &sluicegate::RequestHandle) {
    let mut heard = Vec::new();
    while heard.len() < 2 {
        let e = tokio::time::timeout(Duration::from_secs(10), listener.next())
            .await
            .unwrap_or_else(|_| panic!("heard only {heard:?}"))
            .unwrap();
        heard.push(e.state);
    }
    assert_eq!(heard, [RequestState::Failed, RequestState::Completed], "one event per lifecycle");
    let done = h.wait_timeout::<u64>(Duration::from_secs(5)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), [42]);
}

/// Submits `jobs` at priority 40 with one token, so a raw "worker" can take that token.
async fn one_token<I: IntoIterator<Item = Job>>(producer: &Producer, jobs: I) -> sluicegate::RequestHandle {
    producer.request().priority(40).unwrap().concurrency(1).unwrap().submit(jobs).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_taken_by_a_worker_that_died_before_acquiring_it_comes_back() {
    let env = env_streams(TOPOLOGY, "lostpop").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, (0..5).map(Job::new)).await;
    // The only token is taken by a slot whose worker dies before presenting it: the element is in
    // that slot's take record only.
    let raw = Raw::new(env.redis.url(), &config).await;
    raw.doomed_worker("w-dead").await;
    let _lost = raw.take("w-dead/0").await;
    assert_eq!(raw.list_len(40).await, 0);

    let probe = Probe::default();
    let w = start_worker(&config, probe.clone(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.expect("the dead worker's token is reclaimed");
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4, 6, 8]);
    assert_eq!(raw.list_len(40).await, 0, "no token is left behind once the request finished");
    w.stop().await;
}

/// An element on a list may be a copy an earlier request under the same id left there before its
/// purge (given back after an ack's re-queue, or pushed by a reclaim), naming a token of the
/// request that has the id now, whose epoch may match it: epochs are Redis time, and run ahead of
/// it by one per re-issue within a millisecond. Such a copy on a shard's list, of a request in a
/// tenant group, is refused by `acquire` (told the group of the list it came from): accepted, it
/// would run without its group's token. The request then runs once, under its group's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_an_earlier_request_under_the_id_left_on_a_shard_list_is_refused_to_a_grouped_one() {
    let env = env_streams(TOPOLOGY, "twin").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let request = producer.request().id("twin").unwrap().group("g").unwrap().priority(10).unwrap();
    let h = request.concurrency(1).unwrap().submit([Job::new(21)]).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    // Its token waits in its group's queue: the element "twin|0|<epoch>".
    let meta = raw.request_keys("twin").remove(0);
    let t0: String = raw.client.hget(&meta, "t0").await.unwrap();
    let epoch = t0.split('|').nth(1).unwrap().to_owned();
    let element = format!("twin|0|{epoch}");
    // The same text on the shard's list of a higher priority, where a slot's take finds it first.
    let _: i64 = raw.client.lpush(raw.list(40), element.as_str()).await.unwrap();
    raw.doomed_worker("w-twin").await;
    assert_eq!(raw.take("w-twin/0").await, element);
    let channel = format!("{}:done", raw.ns);
    let acquire = |group: &str| -> Vec<Value> {
        ["twin", "0", &epoch, "w-twin/0", "w-twin", "1", "60000", &channel, group].map(Value::from).to_vec()
    };
    let reply = raw.call("acquire", raw.request_keys("twin"), acquire("")).await;
    assert_eq!(reply, Value::Array(vec!["stale".into()]), "a copy from a shard's list is refused");
    let t0_after: String = raw.client.hget(&meta, "t0").await.unwrap();
    assert_eq!(t0_after, t0, "the refusal leaves the token queued in its group's queue");
    // The dead slot's take record of the copy is left to recovery: its reclaim, told the list's
    // group, leaves the grouped request alone.

    let probe = Probe::default();
    let w = start_worker(&config, probe.clone(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.expect("the request runs from its group's queue");
    assert_eq!(done.into_outputs().unwrap(), [42]);
    w.stop().await;
}

/// A lane's token is acquired by `take` itself, so the slot that took it holds a batch as soon as
/// the take ran. If its worker dies then, the batch runs again elsewhere and the lane token comes
/// back: the request completes with every result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_batch_handed_out_by_take_to_a_worker_that_died_runs_again() {
    let env = env_on(TOPOLOGY, "lanepop").await;
    let config = fast(&env.config).lane_tokens(1);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, (0..5).map(Job::new)).await;
    let raw = Raw::new(env.redis.url(), &config).await;
    raw.doomed_worker("w-dead").await;
    let _lost = raw.take("w-dead/0").await;
    assert_eq!(raw.list_len(40).await, 0, "the lane's only token is taken");

    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.expect("the dead slot's batch runs again");
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4, 6, 8]);
    w.stop().await;
}

/// A slot whose `take` reply was lost takes again (the same take id) and gets the element without
/// a batch, then acquires it: `lane_acquire` hands out again what the first take handed out. An
/// entry of a request cancelled in between is acked away, and the token then names exactly what
/// the slot will ack, so the ack is not fenced; with nothing left the hand-out starts afresh. It
/// used to answer `stale`: the slot forgot the token while its record said this live slot held it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_lane_acquire_hands_out_what_is_still_live_or_else_afresh() {
    let env = env_on(TOPOLOGY, "laneresend").await;
    let config = fast(&env.config).lane_tokens(1);
    let producer = Producer::connect(&config).await.unwrap();
    let one = |n: u64| producer.request().priority(40).unwrap().submit([Job::new(n)]);
    let (a, c) = (one(1).await.unwrap(), one(2).await.unwrap());
    let raw = Raw::new(env.redis.url(), &config).await;
    let holder = "w-live/0";
    let kid = |e: &Vec<Value>| e[4].as_string().unwrap();
    let batch = |items: &[Value]| -> Vec<Vec<Value>> {
        assert_eq!(items[0].as_str().as_deref(), Some("run"), "a batch: {items:?}");
        items[1..].iter().map(|e| e.clone().into_array()).collect()
    };

    // The first take hands out both; its reply is lost. A is cancelled before the slot asks again.
    let element = match raw.take_with(holder, 2).await {
        Value::Array(items) => {
            let Value::Array(first) = &items[2] else { panic!("a lane take acquires: {items:?}") };
            assert_eq!(batch(first).len(), 2);
            items[1].as_string().unwrap()
        }
        other => panic!("{other:?}"),
    };
    a.cancel().await.unwrap();
    let again = raw.lane_acquire(&element, 40, holder, 2).await;
    let entries = batch(&again);
    assert_eq!(entries.iter().map(kid).collect::<Vec<_>>(), [c.id().key_id()], "only C is handed out again");
    let pending: Value = raw
        .client
        .custom(CustomCommand::new_static("XPENDING", ClusterHash::FirstKey, false), vec![raw.lane_keys(40, &[])[1].clone(), "g".into()])
        .await
        .unwrap();
    assert_eq!(pending.into_array()[0].as_i64(), Some(1), "A's entry was acked away");
    let acked = raw.lane_ack_ok(&element, 40, holder, &entries).await;
    assert_ne!(acked[0].as_str().as_deref(), Some("fenced"), "the ack of what was handed out again is not fenced");
    let done = c.wait_timeout::<u64>(Duration::from_secs(5)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), [42]);

    // Everything the first hand-out gave is cancelled before the slot asks again: it gets new work.
    let (d, e) = (one(3).await.unwrap(), one(4).await.unwrap());
    raw.client.hdel::<i64, _, _>(raw.token_key("held"), holder).await.unwrap();
    let element = match raw.take_with(holder, 1).await {
        Value::Array(items) => items[1].as_string().unwrap(),
        other => panic!("{other:?}"),
    };
    d.cancel().await.unwrap();
    let again = raw.lane_acquire(&element, 40, holder, 1).await;
    let entries = batch(&again);
    assert_eq!(entries.iter().map(kid).collect::<Vec<_>>(), [e.id().key_id()], "a fresh hand-out, not `stale`");
    raw.lane_ack_ok(&element, 40, holder, &entries).await;
    assert_eq!(e.wait_timeout::<u64>(Duration::from_secs(5)).await.unwrap().into_outputs().unwrap(), [42]);
}

/// A slot that stops without having seen its take's reply undoes the take (`untake`). A lane's
/// take may have handed out a batch already, so its token is not pushed back as if untouched (a
/// second holder would then run beside the batch): its record is left for recovery, which runs the
/// batch again and restores the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untaken_lane_take_is_left_to_recovery_and_its_batch_runs_again() {
    let env = env_on(TOPOLOGY, "laneuntake").await;
    let config = fast(&env.config).lane_tokens(1);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, (0..5).map(Job::new)).await;
    let raw = Raw::new(env.redis.url(), &config).await;
    raw.doomed_worker("w-stopped").await;
    let _taken = raw.take("w-stopped/0").await;
    assert!(raw.untake("w-stopped/0").await);
    assert_eq!(raw.list_len(40).await, 0, "the token is not pushed back beside its handed-out batch");
    let lost: Option<String> = raw.client.hget(raw.token_key("held"), "w-stopped/0/lost/1").await.unwrap();
    assert!(lost.is_some(), "the take's record is kept for recovery");

    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.expect("recovery settles the untaken lane take");
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4, 6, 8]);
    w.stop().await;
}

/// The finishing worker dies right after the ack that made its request terminal, before the steps
/// on the token side (event, seal, unindex), and no worker runs for longer than the retention (a
/// stall of every client, as in a cluster master's restart). The finish is completed by the next
/// worker's recovery: the record outlived the retention, the event is written once, and the keys
/// go one retention after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_left_undone_by_a_dead_worker_is_completed_by_recovery_even_after_the_retention() {
    let env = env_streams(TOPOLOGY, "deadfin").await;
    let retention = Duration::from_secs(1);
    let config = fast(&env.config).retention(retention);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, [Job::new(21)]).await;
    let mut listener = Listener::from_beginning(&config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    let (element, id, attempt) = raw.take_entry("dead-worker").await;
    let result = rmp_serde::to_vec(&42u64).unwrap();
    let reply = raw.ack_one(&element, "dead-worker/0", &id, ("ok", result), &attempt).await;
    assert_eq!(reply[0].as_str().as_deref(), Some("finished"), "{reply:?}");
    // The worker "died" here. Twice the retention passes with no worker at all.
    tokio::time::sleep(retention * 2 + Duration::from_millis(300)).await;
    let meta = &raw.request_keys(h.id().key_id().as_str())[0];
    let kept: i64 = raw.client.exists(meta.as_str()).await.unwrap();
    assert_eq!(kept, 1, "the record of a finish not yet announced outlives the retention");

    let w = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    let heard = tokio::time::timeout(Duration::from_secs(10), listener.next())
        .await
        .expect("recovery writes the event of the finish the dead worker left undone")
        .unwrap();
    assert_eq!((heard.id.key_id(), heard.state), (h.id().key_id(), RequestState::Completed));
    let done = h.wait_timeout::<u64>(Duration::from_secs(5)).await.expect("the record is still readable");
    assert_eq!(done.into_outputs().unwrap(), [42]);
    let again = tokio::time::timeout(Duration::from_millis(1500), listener.next()).await;
    assert!(again.is_err(), "the event is written once, heard again: {again:?}");
    w.stop().await;
    let (url, ns) = (env.redis.url(), config.namespace_str());
    assert_namespace_drains(url, ns, Duration::from_secs(10), "keys left one retention after recovery sealed it")
        .await;
}

/// A failed request is requeued (reopened as lifecycle 1) while the last step after its failure
/// (`unindex` of lifecycle 0) is still on its way from a slow finisher. That late step must leave
/// the reopened request in recovery's index, and each lifecycle gets its one event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_unindex_of_a_failure_leaves_the_requeued_request_in_the_index() {
    let env = env_streams(TOPOLOGY, "lateunidx").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let admin = sluicegate::Admin::connect(&config).await.unwrap();
    let h = one_token(&producer, [Job::new(21)]).await;
    let kid = h.id().key_id();
    let mut listener = Listener::from_beginning(&config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    // A slow worker: its one part is dead-lettered, the request fails (lifecycle 0), and the worker
    // gets as far as the event and the seal before it stalls.
    let (lifecycle, marks) = raw.fail_and_seal("slow-worker", &kid).await;

    // The operator requeues it: the next lifecycle. Then the slow worker's unindex of the failed
    // one lands.
    assert_eq!(admin.requeue_dead(h.id()).await.unwrap(), 1);
    let args: Vec<Value> = vec![kid.as_str().into(), lifecycle.as_str().into(), 60_000.into()];
    let late = raw.token_fcall("unindex", &["active", &marks, "reg", "armed"], args).await;
    let next = lifecycle.parse::<i64>().unwrap() + 1;
    assert_eq!(late, Value::Integer(next), "a late unindex of the failed lifecycle is refused, naming the new one");
    assert!(raw.in_active(&kid).await, "the reopened request stays where recovery finds it");

    let w = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    hear_the_failure_then_the_completion(&mut listener, &h).await;
    let again = tokio::time::timeout(Duration::from_millis(1500), listener.next()).await;
    assert!(again.is_err(), "no third event: {again:?}");
    w.stop().await;
}

/// An operator's requeue dies after `reopen` marked the next lifecycle and before `requeue_dead`
/// reopened the request: recovery completes the requeue (it used to leave the request failed and
/// in its index, looked at every five leases until the retention ran out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_whose_operator_died_after_reopen_is_completed_by_recovery() {
    let env = env_streams(TOPOLOGY, "halfrequeue").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, [Job::new(21)]).await;
    let kid = h.id().key_id();
    let mut listener = Listener::from_beginning(&config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    // A worker dead-letters the one part: the request fails (lifecycle L) and its finish steps run.
    let (lifecycle, marks) = raw.fail_and_seal("a-worker", &kid).await;
    let args: Vec<Value> = vec![kid.as_str().into(), lifecycle.as_str().into(), 60_000.into()];
    assert_eq!(raw.token_fcall("unindex", &["active", &marks, "reg", "armed"], args).await, Value::Integer(1));

    // The operator's requeue: `reopen` marks lifecycle L + 1 and indexes the request again; the
    // operator dies before its `requeue_dead`.
    let next = (lifecycle.parse::<i64>().unwrap() + 1).to_string();
    let args: Vec<Value> = vec![kid.as_str().into(), 0.into(), next.as_str().into()];
    raw.token_fcall("reopen", &["active", "reg", &marks], args).await;
    assert!(raw.in_active(&kid).await);

    let w = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    hear_the_failure_then_the_completion(&mut listener, &h).await;
    let left = tokio::time::timeout(Duration::from_secs(5), async {
        while raw.in_active(&kid).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(left.is_ok(), "the completed request left recovery's index");
    w.stop().await;
}

/// A request fails in the hands of a worker that stalls right after that ack (before any of the
/// steps after a finish), and an operator requeues its dead letter before any recovery came by.
/// The failed lifecycle still gets its event, before the reopened one's, and only one: the
/// stalled worker's own finish_index, landing late, writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_requeued_before_its_event_was_written_is_still_announced() {
    let env = env_streams(TOPOLOGY, "requeuefirst").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let admin = sluicegate::Admin::connect(&config).await.unwrap();
    let h = one_token(&producer, [Job::new(21)]).await;
    let mut listener = Listener::from_beginning(&config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    let (element, id, attempt) = raw.take_entry("dead-worker").await;
    let record = br#"{"error":"broken","attempts":1,"permanent":true}"#.to_vec();
    let reply = raw.ack_one(&element, "dead-worker/0", &id, ("dead", record), &attempt).await;
    assert_eq!(reply[0].as_string().as_deref(), Some("finished"), "{reply:?}");
    let lifecycle = reply[2].as_string().unwrap();
    // The worker stalls here; no worker (and so no recovery) runs before the requeue.
    assert_eq!(admin.requeue_dead(h.id()).await.unwrap(), 1);
    let kid = h.id().key_id();
    let marks = format!("f:{kid}");
    let args: Vec<Value> = vec![kid.as_str().into(), "failed".into(), 60_000.into(), lifecycle.as_str().into()];
    let late = raw.token_fcall("finish_index", &["active", "events", "p:40", &marks, "bell"], args).await;
    assert_eq!(late, Value::Integer(0), "the stalled worker's late finish_index of the failed lifecycle writes nothing");

    let w = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    let mut heard = Vec::new();
    while heard.len() < 2 {
        let e = tokio::time::timeout(Duration::from_secs(10), listener.next())
            .await
            .unwrap_or_else(|_| panic!("heard only {heard:?}"))
            .unwrap();
        heard.push(e.state);
    }
    assert_eq!(heard, [RequestState::Failed, RequestState::Completed], "one event per lifecycle, in order");
    let again = tokio::time::timeout(Duration::from_millis(1500), listener.next()).await;
    assert!(again.is_err(), "no third event: {again:?}");
    assert_eq!(h.wait_timeout::<u64>(Duration::from_secs(5)).await.unwrap().into_outputs().unwrap(), [42]);
    w.stop().await;
}

/// Records the attempt number each index ran with.
#[derive(Clone, Default)]
struct Attempts(Arc<Mutex<HashMap<u64, Vec<u32>>>>);

#[async_trait]
impl Handler for Attempts {
    type Input = Job;
    type Output = u64;
    async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
        self.0.lock().unwrap().entry(ctx.index()).or_default().push(ctx.attempt());
        Ok(job.n * 2)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_whose_worker_died_before_acking_runs_again_with_the_next_attempt_number() {
    let env = env_streams(TOPOLOGY, "deadack").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, (0..3).map(Job::new)).await;
    let raw = Raw::new(env.redis.url(), &config).await;
    let _held = raw.take_entry("dead-worker").await;
    // The "worker" ran index 0 and died before its ack: its registration lapses.

    let attempts = Attempts::default();
    let w = start_worker(&config, attempts.clone(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.expect("the orphaned entry runs again");
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4]);
    assert_eq!(attempts.0.lock().unwrap()[&0], [2], "index 0 ran again, told it is attempt 2");
    w.stop().await;
}

/// Index 0's first attempt blocks its thread for longer than the lease (a CPU-bound handler,
/// a blocking call).
struct Staller;

#[async_trait]
impl Handler for Staller {
    type Input = Job;
    type Output = u64;
    async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
        if ctx.index() == 0 && ctx.attempt() == 1 {
            std::thread::sleep(Duration::from_millis(2_500));
            return Ok(999_999);
        }
        Ok(job.n * 2)
    }
}

/// A worker whose handler blocks every thread of its runtime for three leases is alive: its
/// heartbeat runs on a thread of its own. Nobody takes its part over, and its result counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_busy_in_a_blocking_handler_is_never_declared_dead() {
    let env = env_streams(TOPOLOGY, "busy").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer.request().concurrency(1).unwrap().submit((0..3).map(Job::new)).await.unwrap();

    // The staller runs on a runtime of its own, with one thread, which the handler blocks.
    let (metrics_tx, metrics_rx) = std::sync::mpsc::channel();
    let stall_config = config.clone();
    let staller = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let worker = Worker::builder(&stall_config, Staller)
                .slots(1)
                .idle_poll(Duration::from_millis(100))
                .build()
                .await
                .unwrap();
            metrics_tx.send(worker.metrics()).unwrap();
            worker.run_until(tokio::time::sleep(Duration::from_secs(5))).await.unwrap();
        });
    });
    let stalled_metrics = metrics_rx.recv().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let w = start_worker(&config, Staller, 1, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), [999_999, 2, 4], "the busy worker's result is kept: nobody ran index 0 again");
    staller.join().unwrap();
    assert_eq!(stalled_metrics.fenced.load(Relaxed), 0, "the busy worker was never fenced");
    assert_eq!(w.metrics().holds_reclaimed.load(Relaxed), 0, "nobody reclaimed its token");
    w.stop().await;
}

/// A worker that stops beating (frozen, cut off) while its slot runs a part is declared dead after
/// a lease: its part runs elsewhere as the next attempt, and its late ack is fenced: it records
/// nothing and counts nothing down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stops_beating_is_fenced_and_the_other_attempt_result_is_kept() {
    let env = env_streams(TOPOLOGY, "stall").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, (0..3).map(Job::new)).await;
    let raw = Raw::new(env.redis.url(), &config).await;
    let (element, id, attempt) = raw.take_entry("frozen").await;
    let attempts = Attempts::default();
    let w = start_worker(&config, attempts.clone(), 1, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4]);
    assert_eq!(attempts.0.lock().unwrap()[&0], [2], "index 0 ran again elsewhere, as attempt 2");
    // The frozen worker wakes up and acks its stale result.
    let late = raw.ack_one(&element, "frozen/0", &id, ("ok", rmp_serde::to_vec(&999_999u64).unwrap()), &attempt).await;
    assert_eq!(late[0].as_string().as_deref(), Some("fenced"), "{late:?}");
    let again = h.wait_timeout::<u64>(Duration::from_secs(5)).await.unwrap();
    assert_eq!(again.into_outputs().unwrap(), [0, 2, 4], "the late result never counts");
    w.stop().await;
}

/// A worker declared dead while it lives (cut off longer than the lease: its registration was
/// claimed) goes on under a new id. Its slots' take records, offers and owed tokens under the old
/// holder names end at each slot's next take, as a clean stop ends them, rather than waiting for
/// recovery's backstop (here an hour away), which no worker runs once the fleet has stopped: no
/// record of the old id outlives the work, and the `held` key goes with the last take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_going_on_under_a_new_id_ends_the_take_records_of_its_old_one() {
    let env = env_on(TOPOLOGY, "renewed").await;
    let config = fast(&env.config).census_interval(Duration::from_secs(3600));
    let raw = Raw::new(env.redis.url(), &config).await;
    let (held, workers) = (raw.token_key("held"), raw.token_key("workers"));
    let records = |prefix: String| {
        let (client, held) = (raw.client.clone(), held.clone());
        async move {
            let all: HashMap<String, String> = client.hgetall(held.as_str()).await.unwrap();
            all.into_keys().filter(|f| f.starts_with(&prefix)).collect::<Vec<_>>()
        }
    };
    let worker = Worker::builder(&config, Probe::default())
        .slots(2)
        .idle_poll(Duration::from_millis(100))
        .build()
        .await
        .unwrap();
    let old = worker.id();
    let stop = tokio_util::sync::CancellationToken::new();
    let signal = stop.clone();
    let running = tokio::spawn(worker.run_until(async move { signal.cancelled().await }));
    let producer = Producer::connect(&config).await.unwrap();
    let first = producer
        .request()
        .own_stream(true)
        .concurrency(2)
        .unwrap()
        .submit((0..8).map(|n| Job::sleeping(n, 150)))
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while records(format!("{old}/")).await.is_empty() {
        assert!(std::time::Instant::now() < deadline, "the worker's slots never recorded a take");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // What a reaper's beat does to a worker not heard from for a lease: its registration leaves
    // the registry. Nobody else reaps it here; its next beat finds it gone and takes a new id.
    let removed: i64 = raw.client.zrem(workers.as_str(), old.as_str()).await.unwrap();
    assert_eq!(removed, 1, "{old} was registered");
    while {
        let ids: Vec<String> = raw.client.zrange(workers.as_str(), 0, -1, None, false, None, false).await.unwrap();
        ids.iter().all(|id| *id == old)
    } {
        assert!(std::time::Instant::now() < deadline, "the worker never went on under a new id");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let done = first.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), (0..8).map(|n| n * 2).collect::<Vec<_>>());
    // Both slots take again under the new id (a part each at least).
    let second = producer.request().concurrency(2).unwrap().submit((0..4).map(Job::new)).await.unwrap();
    second.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(records(format!("{old}/")).await, Vec::<String>::new(), "take records of the old id {old} are left");
    stop.cancel();
    running.await.unwrap().unwrap();
    let left: bool = raw.client.exists(held.as_str()).await.unwrap();
    assert!(!left, "the held records outlived the stop: {:?}", records(String::new()).await);
}

/// Fails index 1 always, retryably or permanently.
struct Poison {
    permanent: bool,
    runs: Arc<Mutex<Vec<u32>>>,
}

#[async_trait]
impl Handler for Poison {
    type Input = Job;
    type Output = u64;
    async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
        if ctx.index() == 1 {
            self.runs.lock().unwrap().push(ctx.attempt());
            return Err(if self.permanent {
                HandlerError::permanent("poison")
            } else {
                HandlerError::new("poison")
            });
        }
        Ok(job.n * 2)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_sub_request_is_dead_lettered_after_max_attempts_and_the_rest_still_run() {
    let env = env_streams(TOPOLOGY, "poison").await;
    let config = fast(&env.config);
    let runs = Arc::new(Mutex::new(Vec::new()));
    let w =
        start_worker(&config, Poison { permanent: false, runs: runs.clone() }, 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer
        .request()
        .concurrency(2)
        .unwrap()
        .max_attempts(3)
        .unwrap()
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .unwrap()
        .submit((0..4).map(Job::new))
        .await
        .unwrap();
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.state, RequestState::Failed);
    let err = done.results[1].as_ref().unwrap_err();
    assert_eq!((err.message.as_str(), err.attempts, err.permanent), ("poison", 3, false));
    assert_eq!(done.results[0], Ok(0));
    assert_eq!(done.results[3], Ok(6));
    assert_eq!(*runs.lock().unwrap(), [1, 2, 3]);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_error_is_not_retried() {
    let env = env_streams(TOPOLOGY, "permanent").await;
    let config = fast(&env.config);
    let runs = Arc::new(Mutex::new(Vec::new()));
    let w =
        start_worker(&config, Poison { permanent: true, runs: runs.clone() }, 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer.request().max_attempts(5).unwrap().submit((0..3).map(Job::new)).await.unwrap();
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    let err = done.results[1].as_ref().unwrap_err();
    assert_eq!((err.attempts, err.permanent), (1, true));
    assert_eq!(*runs.lock().unwrap(), [1]);
    w.stop().await;
}

/// Fails the first attempt of every fifth part (retried at once), and records every run whose
/// context names another index than its payload's.
#[derive(Clone, Default)]
struct IndexCheck {
    wrong: Arc<Mutex<Vec<(u64, u64)>>>,
}

#[async_trait]
impl Handler for IndexCheck {
    type Input = Job;
    type Output = u64;
    async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
        if ctx.index() != job.n {
            self.wrong.lock().unwrap().push((ctx.index(), job.n));
        }
        if job.n % 5 == 0 && ctx.attempt() == 1 {
            return Err(HandlerError::new("first attempt of a fifth part"));
        }
        Ok(job.n)
    }
}

// A slot's batch holds the retries that fell due first, then new entries: each is handed out
// with its own index (the library numbers a run of new entries from its first id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_parts_handed_out_before_new_ones_keep_their_indices() {
    let env = env_streams(TOPOLOGY, "indices").await;
    let config = fast(&env.config);
    let handler = IndexCheck::default();
    let w = start_worker(&config, handler.clone(), 1, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer
        .request()
        .max_attempts(2)
        .unwrap()
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .unwrap()
        .submit((0..300).map(Job::new))
        .await
        .unwrap();
    let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), (0..300).collect::<Vec<u64>>());
    assert_eq!(*handler.wrong.lock().unwrap(), Vec::<(u64, u64)>::new(), "(context index, payload's index) of runs told another index");
    // Each part that failed once and then succeeded had its error record cleared.
    let status = sluicegate::Admin::connect(&config).await.unwrap().status(h.id()).await.unwrap();
    assert_eq!(status.errors.iter().map(|e| e.index).collect::<Vec<u64>>(), Vec::<u64>::new(), "error records left");
    w.stop().await;
}

/// Sleeps 2 s on the first attempt of every part, then answers at once.
struct SlowFirst;

#[async_trait]
impl Handler for SlowFirst {
    type Input = Job;
    type Output = u32;
    async fn handle(&self, ctx: Context, _: Job) -> Result<u32, HandlerError> {
        if ctx.attempt() == 1 {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        Ok(ctx.attempt())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_past_its_timeout_is_abandoned_and_retried() {
    let env = env_streams(TOPOLOGY, "timeout").await;
    let config = fast(&env.config);
    let w = start_worker(&config, SlowFirst, 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer
        .request()
        .max_attempts(2)
        .unwrap()
        .timeout(Duration::from_millis(100))
        .unwrap()
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
        .unwrap()
        .submit((0..2).map(Job::new))
        .await
        .unwrap();
    let done = h.wait_timeout::<u32>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), [2, 2], "each part succeeded on its second attempt");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_hands_tokens_back_without_waiting_for_leases() {
    let env = env_streams(TOPOLOGY, "graceful").await;
    // A lease far longer than the test: anything that waited for an expiry would time out.
    let config = env.config.clone().lease(Duration::from_secs(60)).heartbeat(Duration::from_secs(5));
    let probe = Probe::default();
    let first = start_worker(&config, probe.clone(), 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer
        .request()
        .concurrency(2)
        .unwrap()
        .submit((0..40).map(|i| Job::sleeping(i, 20)))
        .await
        .unwrap();
    while probe.starts().len() < 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.stop().await;
    let second = start_worker(&config, probe.clone(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(15)).await.expect("tokens came back at shutdown");
    assert_eq!(done.into_outputs().unwrap().len(), 40);
    assert!(probe.max_concurrency(h.id().as_str()) <= 2);
    second.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_fast_ends_the_request_at_the_first_dead_letter() {
    let env = env_streams(TOPOLOGY, "failfast").await;
    let config = fast(&env.config);
    let runs = Arc::new(Mutex::new(Vec::new()));
    let probe = Probe::default();
    let w =
        start_worker(&config, Poison { permanent: true, runs: runs.clone() }, 1, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer.request().fail_fast(true).submit((0..50).map(Job::new)).await.unwrap();
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.state, RequestState::Failed);
    assert_eq!(done.results[0], Ok(0));
    assert_eq!(done.results[1].as_ref().unwrap_err().message, "poison");
    let never_ran =
        done.results.iter().skip(2).filter(|r| r.as_ref().is_err_and(|e| e.attempts == 0)).count();
    // Only the rest of the batch the failing part came in (at most `max_batch`, 32 by default)
    // may have run.
    assert!(never_ran >= 48 - 32, "the rest was not run: only {never_ran} of 48 never ran");
    drop(probe);
    w.stop().await;
}

// ------------------------------------------------------------------------------------------------
// Defects found by an adversarial read (issue 11), each with the test that fails on the code that
// had it.

/// Fails every part permanently while `failing` is set; counts the runs of each index after.
#[derive(Clone, Default)]
struct Flip {
    failing: Arc<std::sync::atomic::AtomicBool>,
    runs_after: Arc<Mutex<HashMap<u64, u32>>>,
    running: Arc<Mutex<(u32, u32)>>,
    sleep: Duration,
}

#[async_trait]
impl Handler for Flip {
    type Input = Job;
    type Output = u64;
    async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
        if self.failing.load(Relaxed) && ctx.index() == 0 || self.failing.load(Relaxed) && job.fail {
            return Err(HandlerError::permanent("broken until the fix"));
        }
        if !self.failing.load(Relaxed) {
            *self.runs_after.lock().unwrap().entry(ctx.index()).or_default() += 1;
        }
        {
            let mut r = self.running.lock().unwrap();
            r.0 += 1;
            r.1 = r.1.max(r.0);
        }
        tokio::time::sleep(self.sleep).await;
        self.running.lock().unwrap().0 -= 1;
        Ok(job.n * 2)
    }
}

/// The ack that dead-letters a request's last part turns it failed; that part is then a dead letter
/// only, not also an orphan of the token whose ack it was (which made requeue hand it out twice,
/// count it down twice, and end the request `completed` while another part had no result).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeued_failure_hands_each_dead_letter_out_once_and_completes_with_every_result() {
    let env = env_streams(TOPOLOGY, "requeue-once").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let admin = sluicegate::Admin::connect(&config).await.unwrap();
    let flip = Flip { failing: Arc::new(true.into()), sleep: Duration::from_millis(20), ..Flip::default() };
    let w = start_worker(&config, flip.clone(), 2, Quantum::default()).await;
    let jobs: Vec<Job> = (0..3).map(|n| Job { n, sleep_ms: 0, fail: true }).collect();
    let h = producer.request().concurrency(2).unwrap().submit(jobs).await.unwrap();
    let failed = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(failed.state, RequestState::Failed);
    let raw = Raw::new(env.redis.url(), &config).await;
    let keys = raw.request_keys(&h.id().key_id());
    let orphans: Vec<String> = raw.client.lrange(keys[4].as_str(), 0, -1).await.unwrap();
    assert!(orphans.is_empty(), "a dead letter is also listed as an orphan: {orphans:?}");

    flip.failing.store(false, Relaxed);
    assert_eq!(admin.requeue_dead(h.id()).await.unwrap(), 3);
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!((done.state, done.into_outputs().unwrap()), (RequestState::Completed, vec![0, 2, 4]));
    let runs = flip.runs_after.lock().unwrap().clone();
    assert_eq!(runs, HashMap::from([(0, 1), (1, 1), (2, 1)]), "each dead letter ran once after the requeue");
    w.stop().await;
}

/// Producers racing to submit the same ids: for each id exactly one is accepted, and every
/// accepted request runs (a loser used to take back the winner's registration with recovery, so
/// the winner's tokens were never pushed and its request stayed queued forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_racing_on_the_same_ids_never_strand_the_requests_they_accept() {
    let env = env_streams(TOPOLOGY, "dup-race").await;
    let config = fast(&env.config);
    let w = start_worker(&config, Probe::default(), 4, Quantum::default()).await;
    let ids: Vec<String> = (0..200).map(|i| format!("race-{i}")).collect();
    let mut producers = Vec::new();
    for _ in 0..4 {
        let (config, ids) = (config.clone(), ids.clone());
        producers.push(tokio::spawn(async move {
            let producer = Producer::connect(&config).await.unwrap();
            let mut accepted = Vec::new();
            for id in ids {
                match producer.request().id(id).unwrap().submit([Job::new(7)]).await {
                    Ok(h) => accepted.push(h),
                    Err(sluicegate::Error::DuplicateRequestId(_)) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            accepted
        }));
    }
    let mut accepted = Vec::new();
    for p in producers {
        accepted.extend(p.await.unwrap());
    }
    let mut by_id: HashMap<String, u32> = HashMap::new();
    for h in &accepted {
        *by_id.entry(h.id().to_string()).or_default() += 1;
    }
    assert_eq!(by_id.len(), ids.len(), "every id accepted once");
    assert!(by_id.values().all(|&n| n == 1), "an id accepted twice");
    for h in &accepted {
        let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{}: {e}", h.id()));
        assert_eq!(done.into_outputs().unwrap(), [14]);
    }
    w.stop().await;
}

/// A producer that stalls between registering a request and creating it, until recovery could
/// drop the registration, is refused: it cannot create a request nobody would recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_that_stalls_past_its_deadline_creates_nothing() {
    let env = env_streams(TOPOLOGY, "late-submit").await;
    let config = fast(&env.config).loading_ttl(Duration::from_secs(2));
    let _loads_the_library = Producer::connect(&config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    let kid = "stalled";
    let grace = config.lease_duration().as_millis() as i64 * 2;
    let reply = raw.token_fcall("register", &["active", "reg"], vec![kid.into(), grace.into()]).await;
    let registered_at = match reply {
        Value::Array(items) => items[1].as_i64().unwrap(),
        other => panic!("{other:?}"),
    };
    // The deadline is half the loading ttl after the registration; the stall outlasts it.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let payload = Value::Bytes(rmp_serde::to_vec(&Job::new(1)).unwrap().into());
    let mut args: Vec<Value> =
        ["stalled", "50", "1", "2000", "1", "0", "0", "0", "nonce", "0", "0", "1"].map(Value::from).to_vec();
    args.push((registered_at + 1_000).into());
    args.push(kid.into());
    args.push("".into()); // no trace context
    args.push(0.into()); // no deadline
    args.push("".into()); // no rate limit
    args.push(payload);
    let mut all: Vec<Value> = vec![fcall("submit_small").into(), 6.into()];
    all.extend(raw.request_keys(kid).into_iter().map(Value::from));
    all.extend(args);
    let cmd = CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false);
    let refused = raw.client.custom::<Value, Value>(cmd, all).await.unwrap_err();
    assert!(refused.details().starts_with("SGLATE"), "{refused:?}");
    let meta: i64 = raw.client.exists(raw.request_keys(kid)[0].as_str()).await.unwrap();
    assert_eq!(meta, 0, "nothing was created");
    // And recovery drops the registration once no producer can create the request any more.
    let w = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while raw.in_active(kid).await {
        assert!(std::time::Instant::now() < deadline, "the registration of a request never created stays");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w.stop().await;
}

/// A request with 10,000 tokens: no single call of its life (submit, census, cancel) blocks Redis
/// for long. Census used to re-list every queued token at each pass and check each with an
/// `LPOS` over the whole list: about 1.3 s per pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_ten_thousand_tokens_never_blocks_redis_for_long() {
    let env = env_streams(TOPOLOGY, "bigtok").await;
    let config = fast(&env.config).census_interval(Duration::from_millis(500));
    let raw = Raw::new(env.redis.url(), &config).await;
    let slowlog = |args: Vec<Value>| {
        let client = raw.client.clone();
        async move {
            let cmd = CustomCommand::new_static("SLOWLOG", ClusterHash::Random, false);
            client.custom::<Value, Value>(cmd, args).await.unwrap()
        }
    };
    // Every call over 50 ms is logged (the target is 10 ms; this machine is shared).
    let set = CustomCommand::new_static("CONFIG", ClusterHash::Random, false);
    let _: Value = raw.client.custom(set, vec!["SET", "slowlog-log-slower-than", "50000"]).await.unwrap();
    slowlog(vec!["RESET".into()]).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer
        .request()
        .priority(40)
        .unwrap()
        .concurrency(10_000)
        .unwrap()
        .submit((0..10_000).map(Job::new))
        .await
        .unwrap();
    // One worker slot, so almost every token waits queued past the grace while recovery looks.
    let w = start_worker(&config, Probe::default(), 1, Quantum { parts: 1, time: Duration::from_secs(1) }).await;
    tokio::time::sleep(config.lease_duration() * 2 + Duration::from_secs(3)).await;
    h.cancel().await.unwrap();
    w.stop().await;
    // Recovery's calls stay under 50 ms. Creating and cancelling the request are single calls over
    // all 10,000 tokens (about 30 to 45 ms here): they are only held to stay linear (under 200 ms).
    let logged = slowlog(vec!["GET".into(), 100.into()]).await;
    let Value::Array(entries) = &logged else { panic!("SLOWLOG GET replied {logged:?}") };
    for entry in entries {
        let Value::Array(fields) = entry else { panic!("a SLOWLOG entry {entry:?}") };
        let micros = fields[2].as_i64().unwrap();
        let call: Vec<String> = match &fields[3] {
            Value::Array(args) => args.iter().take(2).filter_map(Value::as_string).collect(),
            other => panic!("a SLOWLOG entry's arguments {other:?}"),
        };
        let whole_request = call.iter().any(|a| a == "sg2_cancel" || a == "sg2_submit_commit");
        let limit = if whole_request { 200_000 } else { 50_000 };
        assert!(micros < limit, "{call:?} took {micros} µs (at most {limit} µs); all calls over 50 ms: {logged:?}");
    }
}

/// A handler that blocks or spins past its attempt timeout cannot be stopped; its slot keeps the
/// token until it ends, so no other part of its request starts beside it.
// Four runtime threads: the blocked one must not be the only one left to run the other slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_ignores_its_timeout_never_runs_beside_another_part_of_its_request() {
    struct Blocker(Arc<Mutex<(u32, u32)>>);
    #[async_trait]
    impl Handler for Blocker {
        type Input = Job;
        type Output = u64;
        async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
            {
                let mut r = self.0.lock().unwrap();
                r.0 += 1;
                r.1 = r.1.max(r.0);
            }
            if ctx.index() == 0 && ctx.attempt() == 1 {
                // Blocks (so its abort cannot stop it), in place, so other tasks go on meanwhile.
                tokio::task::block_in_place(|| std::thread::sleep(Duration::from_millis(800)));
            } else {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            self.0.lock().unwrap().0 -= 1;
            Ok(job.n * 2)
        }
    }
    let env = env_streams(TOPOLOGY, "zombie").await;
    let config = fast(&env.config);
    let running = Arc::new(Mutex::new((0, 0)));
    let w = start_worker(&config, Blocker(running.clone()), 3, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer
        .request()
        .concurrency(1)
        .unwrap()
        .max_attempts(2)
        .unwrap()
        .timeout(Duration::from_millis(100))
        .unwrap()
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
        .unwrap()
        .submit((0..4).map(Job::new))
        .await
        .unwrap();
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4, 6]);
    assert_eq!(running.lock().unwrap().1, 1, "never more handlers of the request at once than its limit");
    w.stop().await;
}

/// A delay too long to represent is refused, not run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delay_too_long_is_refused_not_run_at_once() {
    let env = env_streams(TOPOLOGY, "delay-overflow").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    for delay in [Duration::MAX, Duration::from_secs(u64::MAX / 1000), Duration::from_secs(11 * 365 * 24 * 3600)] {
        let refused = producer.request().delay(delay).submit([Job::new(1)]).await;
        match refused {
            Err(sluicegate::Error::InvalidRequest(why)) => assert!(why.contains("delay"), "{why}"),
            Err(other) => panic!("{other}"),
            Ok(h) => panic!("a delay of {delay:?} was accepted as request {}", h.id()),
        }
    }
    let keys = sluicegate_testkit::keys_in_namespace(env.redis.url(), env.config.namespace_str()).await.unwrap();
    assert!(keys.is_empty(), "a refused request left keys: {keys:?}");
}

/// A failed request that is requeued runs again with its full limit (it used to get one token per
/// dead letter requeued: a fail-fast request whose other parts never ran then ran them one by one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeued_failure_runs_with_its_full_limit_again() {
    let env = env_streams(TOPOLOGY, "requeue-limit").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let admin = sluicegate::Admin::connect(&config).await.unwrap();
    let flip = Flip { failing: Arc::new(true.into()), sleep: Duration::from_millis(100), ..Flip::default() };
    let w = start_worker(&config, flip.clone(), 4, Quantum::default()).await;
    let h = producer.request().concurrency(4).unwrap().fail_fast(true).submit((0..12).map(Job::new)).await.unwrap();
    assert_eq!(h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap().state, RequestState::Failed);
    // Handlers of the failed lifecycle still running (fail fast stops none) finish first.
    while flip.running.lock().unwrap().0 > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    *flip.running.lock().unwrap() = (0, 0);
    flip.failing.store(false, Relaxed);
    admin.requeue_dead(h.id()).await.unwrap();
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.state, RequestState::Completed);
    assert_eq!(flip.running.lock().unwrap().1, 4, "the reopened request ran with all 4 of its tokens");
    w.stop().await;
}

/// A request reusing the id of an earlier one whose finish marks outlive its record (they can, by
/// up to the retention, when the earlier finisher died between its steps) gets its own event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_id_gets_its_own_event_while_the_marks_of_the_earlier_request_remain() {
    let env = env_streams(TOPOLOGY, "reuse-id").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let mut listener = Listener::connect(&config).await.unwrap();
    let w = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    let first = producer.request().id("again").unwrap().priority(40).unwrap().submit([Job::new(1)]).await.unwrap();
    first.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(10), listener.next()).await.unwrap().unwrap();
    assert_eq!(heard.id.as_str(), "again");
    // The earlier request's record is gone (its retention ran out); its finish marks remain.
    let raw = Raw::new(env.redis.url(), &config).await;
    let marks = raw.token_key("f:again");
    let _: i64 = raw.client.persist(marks.as_str()).await.unwrap();
    let kept: i64 = raw.client.exists(marks.as_str()).await.unwrap();
    assert_eq!(kept, 1, "the marks are there");
    let _: i64 = raw.client.del(raw.request_keys("again")).await.unwrap();

    let second = producer.request().id("again").unwrap().priority(40).unwrap().submit([Job::new(2)]).await.unwrap();
    assert_eq!(second.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap().into_outputs().unwrap(), [4]);
    let heard = tokio::time::timeout(Duration::from_secs(10), listener.next())
        .await
        .expect("the second request's completion is announced")
        .unwrap();
    assert_eq!((heard.id.as_str(), heard.state), ("again", RequestState::Completed));
    let _: i64 = raw.client.del(marks.as_str()).await.unwrap();
    w.stop().await;
}

/// With thousands of active requests and a single surviving worker, at the default settings, a
/// crashed worker's part runs again within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_workers_part_runs_again_within_seconds_among_thousands_of_active_requests() {
    #[derive(Clone, Default)]
    struct Stuck(Arc<Mutex<Vec<std::time::Instant>>>);
    #[async_trait]
    impl Handler for Stuck {
        type Input = Job;
        type Output = u64;
        async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
            if ctx.priority().get() == 90 {
                self.0.lock().unwrap().push(std::time::Instant::now());
                if ctx.attempt() == 1 {
                    ctx.cancelled().cancelled().await;
                }
            }
            Ok(job.n * 2)
        }
    }
    let env = env_streams(TOPOLOGY, "crash-among-many").await;
    // The default timings: lease 2 s, heartbeat 500 ms, recovery interval 200 ms.
    let config = Config::new(env.redis.url()).namespace(env.config.namespace_str());
    let producer = Producer::connect(&config).await.unwrap();
    let mut waiting = Vec::new();
    for i in 0..3_000 {
        waiting.push(producer.request().priority(10).unwrap().submit([Job::new(i)]).await.unwrap());
    }
    let urgent = producer.request().priority(90).unwrap().submit([Job::new(21)]).await.unwrap();
    let stuck = Stuck::default();
    let doomed = start_worker(&config, stuck.clone(), 1, Quantum::default()).await;
    while stuck.0.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    doomed.crash();
    let crashed_at = std::time::Instant::now();
    let survivor = start_worker(&config, stuck.clone(), 1, Quantum::default()).await;
    let done = urgent.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), [42]);
    let rerun = stuck.0.lock().unwrap()[1];
    let took = rerun - crashed_at;
    assert!(took < Duration::from_secs(10), "the crashed worker's part ran again only after {took:?}");
    survivor.stop().await;
    drop(waiting);
}
