// The body of tests/integration/stats.rs: written once, run against a single Redis and a 3-master Redis
// Cluster (`per_topology!` runs it once for each).

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sluicegate::{
    async_trait, Admin, Context, Handler, HandlerError, PriorityStages, Producer, Quantum, RequestState, Worker,
};
use sluicegate_testkit::{connect, keys_in_namespace};

use crate::support::{env_on, start_worker};

/// A part that fails its first `fail_first` attempts, after sleeping `sleep_ms`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default)]
struct Part {
    fail_first: u32,
    sleep_ms: u64,
}

#[derive(Clone, Default)]
struct Flaky;

#[async_trait]
impl Handler for Flaky {
    type Input = Part;
    type Output = u32;
    async fn handle(&self, ctx: Context, part: Part) -> Result<u32, HandlerError> {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(part.sleep_ms)) => {}
            _ = ctx.cancelled().cancelled() => return Err(HandlerError::new("cancelled")),
        }
        if ctx.attempt() <= part.fail_first {
            return Err(HandlerError::new(format!("attempt {} fails on purpose", ctx.attempt())));
        }
        Ok(ctx.attempt())
    }
}

/// One request of the known workload and what it must count.
struct Planned {
    priority: u8,
    /// A stream of its own (else, being small, it takes its priority's lane).
    own_stream: bool,
    max_attempts: u32,
    parts: Vec<Part>,
}

impl Planned {
    fn part(fail_first: u32) -> Part {
        Part { fail_first, sleep_ms: 25 }
    }

    /// (succeeded, retried, dead-lettered, attempts run) of its parts.
    fn outcomes(&self) -> (u64, u64, u64, u64) {
        let mut o = (0, 0, 0, 0);
        for p in &self.parts {
            let attempts = (p.fail_first + 1).min(self.max_attempts);
            let dead = p.fail_first >= self.max_attempts;
            o.0 += u64::from(!dead);
            o.1 += u64::from(attempts - 1);
            o.2 += u64::from(dead);
            o.3 += u64::from(attempts);
        }
        o
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_by_stage_count_a_known_workload_exactly_and_time_every_sample() {
    let env = env_on(TOPOLOGY, "stage-stats").await;
    let config = env.config.clone();
    let p = Planned::part;
    let plan = [
        // Priority 7, streams of their own: one failed (a part dead after a retry, another
        // succeeding on its second attempt), one completed.
        Planned { priority: 7, own_stream: true, max_attempts: 2, parts: vec![p(0), p(5), p(1), p(0), p(0)] },
        Planned { priority: 7, own_stream: true, max_attempts: 2, parts: vec![p(0), p(0), p(0)] },
        // Priority 3, in the lane: one failed after two retries, two completed (one after retries).
        Planned { priority: 3, own_stream: false, max_attempts: 3, parts: vec![p(0), p(9)] },
        Planned { priority: 3, own_stream: false, max_attempts: 3, parts: vec![p(2), p(0)] },
        Planned { priority: 3, own_stream: false, max_attempts: 3, parts: vec![p(0)] },
    ];
    let producer = Producer::connect(&config).await.unwrap();
    let mut handles = Vec::new();
    for r in &plan {
        let builder = producer
            .request()
            .priority(r.priority)
            .unwrap()
            .concurrency(2)
            .unwrap()
            .max_attempts(r.max_attempts)
            .unwrap()
            .backoff(Duration::from_millis(10), Duration::from_millis(20))
            .unwrap()
            .own_stream(r.own_stream);
        handles.push(builder.submit(r.parts.clone()).await.unwrap());
    }
    let w = start_worker(&config, Flaky, 3, Quantum::default()).await;
    let mut terminal = Vec::new();
    for h in &handles {
        terminal.push(h.wait::<u32>().await.unwrap().state);
    }
    let expected_failed = |r: &Planned| r.outcomes().2 > 0;
    for (r, state) in plan.iter().zip(&terminal) {
        let want = if expected_failed(r) { RequestState::Failed } else { RequestState::Completed };
        assert_eq!(*state, want, "the workload ran as planned");
    }
    let metrics = w.metrics();
    // The worker adds its last counts when it stops; the producer when asked.
    w.stop().await;
    producer.flush_stats().await.unwrap();

    let admin = Admin::connect(&config).await.unwrap();
    let stats = admin.stats_since(Duration::from_secs(3600)).await.unwrap();
    assert_eq!(stats.priorities.iter().map(|p| p.priority).collect::<Vec<_>>(), [7, 3], "{stats:?}");
    for got in &stats.priorities {
        let mine: Vec<&Planned> = plan.iter().filter(|r| r.priority == got.priority).collect();
        let n = mine.len() as u64;
        let failed = mine.iter().filter(|r| expected_failed(r)).count() as u64;
        let sum = |f: fn((u64, u64, u64, u64)) -> u64| mine.iter().map(|r| f(r.outcomes())).sum::<u64>();
        let want = PriorityStagesCounts {
            submitted: n,
            started: n,
            completed: n - failed,
            failed,
            succeeded: sum(|o| o.0),
            retried: sum(|o| o.1),
            dead_lettered: sum(|o| o.2),
            fenced: 0,
            waits: n,
            runs: sum(|o| o.3),
            durations: n,
        };
        assert_eq!(PriorityStagesCounts::of(got), want, "priority {}", got.priority);
        // Every run slept 25 ms: no sample below the (20, 50] ms bucket. Every request took at
        // least one run, so no duration below it either.
        for (what, h) in [("run", &got.run_time), ("duration", &got.duration)] {
            assert!(h.buckets.iter().all(|b| b.le_ms.map_or(true, |le| le >= 50)), "{what}: {h:?}");
        }
        let p99 = got.duration.quantile(0.99).unwrap();
        assert!(p99 >= got.duration.quantile(0.5).unwrap() && p99 < Duration::from_secs(60), "{p99:?}");
    }
    // The worker's own histogram saw the same starts.
    assert_eq!(metrics.queue_wait.snapshot().1, plan.len() as u64);
    assert_eq!(metrics.leases_lost.load(Relaxed), 0);

    // The minutes' hashes are on shard 0's tag, and expire.
    let redis = connect(env.redis.url()).await.unwrap();
    let keys = keys_in_namespace(env.redis.url(), config.namespace_str()).await.unwrap();
    let minutes: Vec<&String> = keys.iter().filter(|k| k.contains(":st:")).collect();
    assert!(!minutes.is_empty() && minutes.len() <= 3, "{keys:?}");
    for key in minutes {
        assert!(key.starts_with(&format!("{0}:{{{0}.q0}}:st:", config.namespace_str())), "{key}");
        let ttl: i64 = fred::interfaces::KeysInterface::pttl(&redis, key.as_str()).await.unwrap();
        assert!(ttl > 0 && ttl <= 24 * 3600 * 1000, "{key} expires in {ttl} ms");
    }
}

/// The counts of a [`PriorityStages`], and its histograms' sample counts, for one comparison.
#[derive(Debug, PartialEq, Eq)]
struct PriorityStagesCounts {
    submitted: u64,
    started: u64,
    completed: u64,
    failed: u64,
    succeeded: u64,
    retried: u64,
    dead_lettered: u64,
    fenced: u64,
    waits: u64,
    runs: u64,
    durations: u64,
}

impl PriorityStagesCounts {
    fn of(p: &PriorityStages) -> Self {
        Self {
            submitted: p.submitted,
            started: p.started,
            completed: p.completed,
            failed: p.failed,
            succeeded: p.succeeded,
            retried: p.retried,
            dead_lettered: p.dead_lettered,
            fenced: p.fenced,
            waits: p.queue_wait.count(),
            runs: p.run_time.count(),
            durations: p.duration.count(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_stage_stats_adds_nothing_to_redis_and_a_zero_retention_turns_them_off() {
    let env = env_on(TOPOLOGY, "stage-stats-off").await;
    let config = env.config.clone();
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer.request().priority(4).unwrap().submit([Part::default(), Part::default()]).await.unwrap();
    let worker = Worker::builder(&config, Flaky).slots(2).stage_stats(false).build().await.unwrap();
    let metrics = worker.metrics();
    let stop = tokio_util::sync::CancellationToken::new();
    let signal = stop.clone();
    let running = tokio::spawn(worker.run_until(async move { signal.cancelled().await }));
    h.wait::<u32>().await.unwrap();
    stop.cancel();
    running.await.unwrap().unwrap();
    producer.flush_stats().await.unwrap();
    // The worker's metrics count either way.
    assert_eq!((metrics.succeeded.load(Relaxed), metrics.queue_wait.snapshot().1), (2, 1));
    let admin = Admin::connect(&config).await.unwrap();
    let stats = admin.stats_since(Duration::from_secs(600)).await.unwrap();
    let counted: Vec<(u8, u64, u64, u64)> =
        stats.priorities.iter().map(|p| (p.priority, p.submitted, p.started, p.run_time.count())).collect();
    assert_eq!(counted, [(4, 1, 0, 0)], "only the producer counted");

    // With a stats retention of zero, nobody counts.
    let off = config.clone().namespace(format!("{}-off", config.namespace_str())).stats_retention(Duration::ZERO);
    let producer = Producer::connect(&off).await.unwrap();
    let h = producer.request().submit([Part::default()]).await.unwrap();
    let w = start_worker(&off, Flaky, 1, Quantum::default()).await;
    h.wait::<u32>().await.unwrap();
    w.stop().await;
    producer.flush_stats().await.unwrap();
    let keys = keys_in_namespace(env.redis.url(), off.namespace_str()).await.unwrap();
    assert!(keys.iter().all(|k| !k.contains(":st:")), "{keys:?}");
    let stats = Admin::connect(&off).await.unwrap().stats_since(Duration::from_secs(600)).await.unwrap();
    assert!(stats.priorities.is_empty() && stats.minutes.is_empty(), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_lost_to_a_cancel_while_its_handler_runs_counts_one_lease_lost() {
    let env = env_on(TOPOLOGY, "lease-lost").await;
    let config = crate::support::fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let long = Part { fail_first: 0, sleep_ms: 60_000 };
    // One part of its own stream, one in a lane: each hold is lost once.
    let streamed = producer.request().own_stream(true).submit([long]).await.unwrap();
    let laned = producer.request().submit([long]).await.unwrap();
    let w = start_worker(&config, Flaky, 2, Quantum::default()).await;
    let metrics = w.metrics();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metrics.busy_slots.load(Relaxed) < 2 {
        assert!(Instant::now() < deadline, "both parts never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    streamed.cancel().await.unwrap();
    laned.cancel().await.unwrap();
    // The hold check of the next beats finds both holds gone, and stops the handlers.
    while metrics.leases_lost.load(Relaxed) < 2 || metrics.busy_slots.load(Relaxed) > 0 {
        assert!(Instant::now() < deadline, "lost {}", metrics.leases_lost.load(Relaxed));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Checked again at later beats, they are not counted again.
    tokio::time::sleep(config.lease_duration()).await;
    assert_eq!(metrics.leases_lost.load(Relaxed), 2);
    w.stop().await;
}
