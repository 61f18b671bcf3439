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
    async_trait, Config, Context, Handler, HandlerError, Producer, Quantum, RequestState, Worker,
};
use support::{env, fast, start_worker, Job, Probe};


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
    async fn list_len(&self, prio: u8) -> i64 {
        self.client.llen(self.list(prio)).await.unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_survive_a_worker_killed_between_brpop_and_recording_the_token() {
    let env = env("lostpop").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer
        .request()
        .priority(40)
        .unwrap()
        .concurrency(1)
        .unwrap()
        .submit((0..5).map(Job::new))
        .await
        .unwrap();
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
    let h = producer
        .request()
        .priority(40)
        .unwrap()
        .concurrency(1)
        .unwrap()
        .submit((0..3).map(Job::new))
        .await
        .unwrap();
    let raw = Raw::new(env.redis.url(), &config).await;
    let element = raw.pop_token(40).await;
    let reply = raw.acquire(&element, "dead-worker/0").await;
    assert_eq!(reply[0].as_string().as_deref(), Some("run"), "{reply:?}");
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
