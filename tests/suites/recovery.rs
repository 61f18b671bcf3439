// The body of tests/recovery.rs and tests/recovery_cluster.rs: written once, run against a single
// Redis and a 3-master Redis Cluster (the wrappers set TOPOLOGY).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use sluicegate::testing::connect;
use sluicegate::{
    async_trait, Config, Context, Handler, HandlerError, Listener, Producer, Quantum, RequestState, Worker,
};
use support::{assert_namespace_drains, env, fast, start_worker, Job, Probe};


/// The keys a foreign client would build (docs/protocol.md), for placing faults by hand.
struct Raw {
    client: Client,
    ns: String,
}

impl Raw {
    async fn new(url: &str, config: &Config) -> Self {
        Self { client: connect(url).await.unwrap(), ns: config.namespace_str().to_owned() }
    }
    fn list(&self, prio: u8) -> String {
        format!("{0}:{{{0}.q0}}:p:{prio}", self.ns)
    }
    fn request_keys(&self, key_id: &str) -> Vec<String> {
        let base = format!("{}:r:{{{key_id}}}", self.ns);
        ["", ":s", ":res", ":err", ":orph", ":retry"].iter().map(|s| format!("{base}{s}")).collect()
    }
    /// BRPOP one token element, as a worker that is then killed would.
    async fn pop_token(&self, prio: u8) -> String {
        let (_, element): (String, String) = self.client.brpop(self.list(prio), 5.0).await.unwrap();
        element
    }
    /// Presents a popped element to acquire as `holder`: the token is now held and leased.
    async fn acquire(&self, element: &str, holder: &str) -> Vec<Value> {
        let parts: Vec<&str> = element.split('|').collect();
        let mut args: Vec<Value> = vec!["sg1_acquire".into(), 6.into()];
        args.extend(self.request_keys(parts[0]).into_iter().map(Value::from));
        args.extend([parts[0], parts[1], parts[2], holder, "dead-worker", "800", "1"].map(Value::from));
        let cmd = CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false);
        self.client.custom::<Vec<Value>, Value>(cmd, args).await.unwrap()
    }
    /// Acks a batch of one entry with `outcome` (`ok` and the result bytes, or `dead` and the error
    /// record), as `holder` (token element `element`), giving the token back: the raw reply.
    async fn ack_one(&self, element: &str, holder: &str, entry: &str, outcome: (&str, Vec<u8>), attempt: &str) -> Vec<Value> {
        let parts: Vec<&str> = element.split('|').collect();
        let mut args: Vec<Value> = vec!["sg1_ack".into(), 6.into()];
        args.extend(self.request_keys(parts[0]).into_iter().map(Value::from));
        let channel = format!("{}:done", self.ns);
        args.extend(
            [parts[0], parts[1], parts[2], holder, "dead-worker", "800", "0", "1000", channel.as_str(), "1"]
                .map(Value::from),
        );
        let (outcome, body) = outcome;
        args.extend([Value::from(entry), outcome.into(), Value::Bytes(body.into()), "0".into(), attempt.into()]);
        let cmd = CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false);
        self.client.custom::<Vec<Value>, Value>(cmd, args).await.unwrap()
    }
    /// Calls a token-side function of shard 0 with `keys` (suffixes after `<ns>:{<ns>.q0}:`).
    async fn token_fcall(&self, function: &str, keys: &[&str], args: Vec<Value>) -> Value {
        let mut all: Vec<Value> = vec![function.into(), (keys.len() as i64).into()];
        all.extend(keys.iter().map(|k| Value::from(format!("{0}:{{{0}.q0}}:{k}", self.ns))));
        all.extend(args);
        let cmd = CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false);
        self.client.custom::<Value, Value>(cmd, all).await.unwrap()
    }
    async fn in_active(&self, key_id: &str) -> bool {
        let score: Option<f64> = self.client.zscore(format!("{0}:{{{0}.q0}}:active", self.ns), key_id).await.unwrap();
        score.is_some()
    }
    /// Pops the token of priority `prio` and acquires it as `holder`, as a worker that then dies
    /// would: the element, and the first entry handed out (id, attempt).
    async fn take_entry(&self, prio: u8, holder: &str) -> (String, String, String) {
        let element = self.pop_token(prio).await;
        let reply = self.acquire(&element, holder).await;
        let entry = match &reply[..] {
            [tag, _policy, Value::Array(entry), ..] if tag.as_str().as_deref() == Some("run") => entry.clone(),
            other => panic!("acquire did not hand out an entry: {other:?}"),
        };
        (element, entry[0].as_string().unwrap(), entry[3].as_string().unwrap())
    }
    async fn list_len(&self, prio: u8) -> i64 {
        self.client.llen(self.list(prio)).await.unwrap()
    }
}

/// Submits `jobs` at priority 40 with one token, so a raw "worker" can take that token.
async fn one_token<I: IntoIterator<Item = Job>>(producer: &Producer, jobs: I) -> sluicegate::RequestHandle {
    producer.request().priority(40).unwrap().concurrency(1).unwrap().submit(jobs).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_survive_a_worker_killed_between_brpop_and_recording_the_token() {
    let env = env("lostpop").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, (0..5).map(Job::new)).await;
    // The only token is popped into a reply nobody will present: the process "died" right here.
    let raw = Raw::new(env.redis.url(), &config).await;
    let _lost = raw.pop_token(40).await;
    assert_eq!(raw.list_len(40).await, 0);

    let probe = Probe::default();
    let w = start_worker(&config, probe.clone(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.expect("the lost token is restored");
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4, 6, 8]);
    assert_eq!(raw.list_len(40).await, 0, "no token is left behind once the request finished");
    w.stop().await;
}

/// The finishing worker dies right after the ack that made its request terminal, before the steps
/// on the token side (event, seal, unindex), and no worker runs for longer than the retention (a
/// stall of every client, as in a cluster master's restart). The finish is completed by the next
/// worker's recovery: the record outlived the retention, the event is written once, and the keys
/// go one retention after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_left_undone_by_a_dead_worker_is_completed_by_recovery_even_after_the_retention() {
    let env = env("deadfin").await;
    let retention = Duration::from_secs(1);
    let config = fast(&env.config).retention(retention);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, [Job::new(21)]).await;
    let mut listener = Listener::from_beginning(&config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    let (element, id, attempt) = raw.take_entry(40, "dead-worker/0").await;
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
    let env = env("lateunidx").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let admin = sluicegate::Admin::connect(&config).await.unwrap();
    let h = one_token(&producer, [Job::new(21)]).await;
    let kid = h.id().key_id();
    let mut listener = Listener::from_beginning(&config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    // A slow worker: its one part is dead-lettered, the request fails (lifecycle 0), and the worker
    // gets as far as the event and the seal before it stalls.
    let (element, id, attempt) = raw.take_entry(40, "slow-worker/0").await;
    let record = br#"{"error":"broken","attempts":1,"permanent":true}"#.to_vec();
    let reply = raw.ack_one(&element, "slow-worker/0", &id, ("dead", record), &attempt).await;
    assert_eq!(reply[..3].iter().map(|v| v.as_string().unwrap()).collect::<Vec<_>>(), ["finished", "failed", "0"]);
    let marks = format!("f:{kid}");
    let args: Vec<Value> = vec![kid.as_str().into(), "failed".into(), 60_000.into(), 0.into()];
    assert_eq!(raw.token_fcall("sg1_finish_index", &["active", "events", "p:40", &marks], args).await, Value::Integer(1));
    let mut seal: Vec<Value> = vec!["sg1_seal".into(), 6.into()];
    seal.extend(raw.request_keys(&kid).into_iter().map(Value::from));
    seal.extend([Value::from(0), 60_000.into()]);
    let cmd = CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false);
    assert_eq!(raw.client.custom::<Value, Value>(cmd, seal).await.unwrap(), Value::Integer(1));

    // The operator requeues it: lifecycle 1. Then the slow worker's unindex of lifecycle 0 lands.
    assert_eq!(admin.requeue_dead(h.id()).await.unwrap(), 1);
    let late = raw.token_fcall("sg1_unindex", &["active", &marks], vec![kid.as_str().into(), 0.into(), 60_000.into()]).await;
    assert_eq!(late, Value::Integer(0), "a late unindex of lifecycle 0 is refused");
    assert!(raw.in_active(&kid).await, "the reopened request stays where recovery finds it");

    let w = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
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
    let again = tokio::time::timeout(Duration::from_millis(1500), listener.next()).await;
    assert!(again.is_err(), "no third event: {again:?}");
    w.stop().await;
}

/// A request fails in the hands of a worker that stalls right after that ack (before any of the
/// steps after a finish), and an operator requeues its dead letter before any recovery came by.
/// The failed lifecycle still gets its event, before the reopened one's, and only one: the
/// stalled worker's own finish_index, landing late, writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_requeued_before_its_event_was_written_is_still_announced() {
    let env = env("requeuefirst").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let admin = sluicegate::Admin::connect(&config).await.unwrap();
    let h = one_token(&producer, [Job::new(21)]).await;
    let mut listener = Listener::from_beginning(&config).await.unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    let (element, id, attempt) = raw.take_entry(40, "dead-worker/0").await;
    let record = br#"{"error":"broken","attempts":1,"permanent":true}"#.to_vec();
    let reply = raw.ack_one(&element, "dead-worker/0", &id, ("dead", record), &attempt).await;
    assert_eq!(reply[0].as_string().as_deref(), Some("finished"), "{reply:?}");
    // The worker stalls here; no worker (and so no recovery) runs before the requeue.
    assert_eq!(admin.requeue_dead(h.id()).await.unwrap(), 1);
    let kid = h.id().key_id();
    let marks = format!("f:{kid}");
    let args: Vec<Value> = vec![kid.as_str().into(), "failed".into(), 60_000.into(), 0.into()];
    let late = raw.token_fcall("sg1_finish_index", &["active", "events", "p:40", &marks], args).await;
    assert_eq!(late, Value::Integer(0), "the stalled worker's late finish_index of lifecycle 0 writes nothing");

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
    let env = env("deadack").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = one_token(&producer, (0..3).map(Job::new)).await;
    let raw = Raw::new(env.redis.url(), &config).await;
    let _held = raw.take_entry(40, "dead-worker/0").await;
    // The "worker" ran index 0 and died before its ack: nothing renews its lease.

    let attempts = Attempts::default();
    let w = start_worker(&config, attempts.clone(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.expect("the orphaned entry runs again");
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4]);
    assert_eq!(attempts.0.lock().unwrap()[&0], [2], "index 0 ran again, told it is attempt 2");
    w.stop().await;
}

/// Index 0's first attempt stalls the whole runtime it runs on (a GC pause, a frozen VM), so its
/// worker cannot renew the lease either.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_worker_past_its_lease_is_fenced_and_the_other_attempt_result_is_kept() {
    let env = env("stall").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer.request().concurrency(1).unwrap().submit((0..3).map(Job::new)).await.unwrap();

    // The staller runs on a runtime of its own, with one thread: the stall freezes its heartbeat.
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
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4], "the late result (999999) never counts");
    staller.join().unwrap();
    assert_eq!(
        stalled_metrics.fenced.load(Relaxed),
        1,
        "the stalled worker's late ack was fenced and counted"
    );
    w.stop().await;
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
    let env = env("poison").await;
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
    let env = env("permanent").await;
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
    let env = env("timeout").await;
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
    let env = env("graceful").await;
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
    let env = env("failfast").await;
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
    // Only the rest of the batch the failing part came in (at most 16 parts) may have run.
    assert!(never_ran >= 48 - 16, "the rest was not run: only {never_ran} of 48 never ran");
    drop(probe);
    w.stop().await;
}
