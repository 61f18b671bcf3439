//! Shared set-up for the integration tests: a Redis of the test's own, a unique namespace, workers
//! that stop when the test ends, and a probe handler that records what ran when.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

pub mod census;
pub mod monitor;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Quantum, Worker};
use sluicegate_testkit::{keys_in_namespace, unique_namespace, TestBackend, Topology};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A test's own Redis (or REDIS_URL's) of the given topology, and a namespace no other test uses.
pub struct Env {
    pub redis: TestBackend,
    pub config: Config,
}

/// `env_on` with lanes off: every request has keys of its own, for the tests that look at a
/// request's own keys and steps (lanes are covered by the core, admin and chaos suites and the
/// randomized checker).
pub async fn env_streams(topology: Topology, name: &str) -> Env {
    let Env { redis, config } = env_on(topology, name).await;
    Env { redis, config: config.lane_tokens(0) }
}

pub async fn env_on(topology: Topology, name: &str) -> Env {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    let redis = TestBackend::start(topology).await.unwrap_or_else(|e| panic!("{e}"));
    let config = Config::new(redis.url())
        .namespace(unique_namespace(name))
        .lease(Duration::from_secs(5))
        .heartbeat(Duration::from_secs(1))
        .wait_poll(Duration::from_millis(500));
    Env { redis, config }
}

/// Waits until the namespace holds no key at all, for at most `within`; panics with `what` and
/// the keys left.
pub async fn assert_namespace_drains(url: &str, ns: &str, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    loop {
        let keys = keys_in_namespace(url, ns).await.unwrap();
        if keys.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {keys:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Short lease, heartbeat and recovery interval, so a test sees recovery within a second or two.
pub fn fast(config: &Config) -> Config {
    config
        .clone()
        .lease(Duration::from_millis(800))
        .heartbeat(Duration::from_millis(100))
        .recovery_interval(Duration::from_millis(150))
}

/// A worker running in the background until [`Running::stop`] or drop.
pub struct Running {
    stop: CancellationToken,
    task: Option<JoinHandle<sluicegate::Result<()>>>,
    metrics: Arc<sluicegate::WorkerMetrics>,
}

impl Running {
    pub fn metrics(&self) -> Arc<sluicegate::WorkerMetrics> {
        self.metrics.clone()
    }

    /// Drops the worker's task without a clean stop, as a crash would: its slots stop where they
    /// are, it stops beating, and other workers reclaim what it held once its lease has passed.
    pub fn crash(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }

    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.await.expect("worker task panicked").expect("worker failed");
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

pub async fn start_worker<H: Handler>(
    config: &Config,
    handler: H,
    slots: usize,
    quantum: Quantum,
) -> Running {
    start_built(Worker::builder(config, handler).slots(slots).quantum(quantum)).await
}

/// Starts the worker `builder` describes, with an idle poll of 100 ms.
pub async fn start_built<H: Handler>(builder: sluicegate::WorkerBuilder<H>) -> Running {
    let worker = builder.idle_poll(Duration::from_millis(100)).build().await.expect("worker builds");
    let stop = CancellationToken::new();
    let signal = stop.clone();
    let metrics = worker.metrics();
    let task = tokio::spawn(worker.run_until(async move { signal.cancelled().await }));
    Running { stop, task: Some(task), metrics }
}

/// The probe's input: a number to double, and how to behave.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Job {
    pub n: u64,
    pub sleep_ms: u64,
    pub fail: bool,
}

impl Job {
    pub fn new(n: u64) -> Self {
        Self { n, ..Self::default() }
    }
    pub fn sleeping(n: u64, ms: u64) -> Self {
        Self { n, sleep_ms: ms, fail: false }
    }
}

/// What the probe saw, shared with the test.
#[derive(Default)]
pub struct Record {
    /// request id -> (running now, most running at once)
    pub concurrency: HashMap<String, (u32, u32)>,
    /// (request id, index) in the order handlers started
    pub starts: Vec<(String, u64)>,
}

/// Runs its closure when dropped: a handler's count of the runs in progress is left when the run
/// ends, and also when a crashed worker aborts it.
pub struct OnDrop<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> OnDrop<F> {
    pub fn new(f: F) -> Self {
        Self(Some(f))
    }
}

impl<F: FnOnce()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f()
        }
    }
}

/// A handler that doubles `n`, sleeps or fails on request, and records concurrency and order.
#[derive(Clone, Default)]
pub struct Probe {
    pub record: Arc<Mutex<Record>>,
}

impl Probe {
    pub fn max_concurrency(&self, request: &str) -> u32 {
        self.record.lock().unwrap().concurrency.get(request).map_or(0, |c| c.1)
    }
    pub fn starts(&self) -> Vec<(String, u64)> {
        self.record.lock().unwrap().starts.clone()
    }
}

#[async_trait]
impl Handler for Probe {
    type Input = Job;
    type Output = u64;

    async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
        let id = ctx.request_id().to_string();
        {
            let mut r = self.record.lock().unwrap();
            r.starts.push((id.clone(), ctx.index()));
            let c = r.concurrency.entry(id.clone()).or_default();
            c.0 += 1;
            c.1 = c.1.max(c.0);
        }
        // Left when the run ends, or is dropped with a crashed worker (which aborts its handlers).
        let record = self.record.clone();
        let running = OnDrop::new(move || {
            let mut r = record.lock().unwrap_or_else(|e| e.into_inner());
            r.concurrency.get_mut(&id).expect("entered before").0 -= 1;
        });
        if job.sleep_ms > 0 {
            tokio::time::sleep(Duration::from_millis(job.sleep_ms)).await;
        }
        drop(running);
        if job.fail {
            return Err(HandlerError::new(format!("job {} failed on purpose", job.n)));
        }
        Ok(job.n * 2)
    }
}
