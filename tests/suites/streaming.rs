// The body of tests/integration/streaming.rs: written once, run against a single Redis and a 3-master Redis
// Cluster (`per_topology!` runs it once for each).

use std::time::{Duration, Instant};

use sluicegate::{Admin, Producer, Quantum, RequestState};
use crate::support::{env_on, fast, start_worker, Job, Probe};


#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_added_over_two_seconds_run_while_open_and_completion_waits_for_finalize() {
    let env = env_on(TOPOLOGY, "stream").await;
    let config = fast(&env.config);
    let probe = Probe::default();
    let w = start_worker(&config, probe.clone(), 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let mut open = producer.request().concurrency(2).unwrap().open().await.unwrap();
    let id = open.handle().id().clone();
    for round in 0..4u64 {
        open.add((0..5).map(|i| Job::new(round * 5 + i))).await.unwrap();
        let expected = ((round + 1) * 5) as usize;
        let deadline = Instant::now() + Duration::from_secs(5);
        while probe.starts().len() < expected {
            assert!(Instant::now() < deadline, "parts of an open request did not run");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let status = admin.status(&id).await.unwrap();
        assert!(status.open && !status.state.is_terminal(), "{status:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(open.handle().try_completion::<u64>().await.unwrap().is_none(), "not complete before finalize");
    let handle = open.finalize().await.unwrap();
    let done = handle.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.state, RequestState::Completed);
    assert_eq!(done.into_outputs().unwrap(), (0..20).map(|n| n * 2).collect::<Vec<u64>>());
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_request_does_not_start_before_its_time() {
    let env = env_on(TOPOLOGY, "delay").await;
    let config = fast(&env.config);
    let probe = Probe::default();
    let w = start_worker(&config, probe.clone(), 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let submitted = Instant::now();
    let h = producer.request().delay(Duration::from_secs(2)).submit((0..3).map(Job::new)).await.unwrap();
    assert_eq!(admin.status(h.id()).await.unwrap().state, RequestState::Scheduled);
    let now = producer.request().submit([Job::new(7)]).await.unwrap();
    now.wait_timeout::<u64>(Duration::from_secs(5)).await.unwrap();
    let done = h.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
    let waited = submitted.elapsed();
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4]);
    assert!(waited >= Duration::from_secs(2), "started too early: {waited:?}");
    let order: Vec<String> = probe.starts().into_iter().map(|(id, _)| id).collect();
    assert_eq!(order[0], now.id().as_str(), "the undelayed request ran first");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_request_can_be_finalized_by_an_operator_or_expire_cancelled() {
    let env = env_on(TOPOLOGY, "abandoned").await;
    let config = fast(&env.config);
    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();

    let mut open = producer.request().open().await.unwrap();
    open.add((0..3).map(Job::new)).await.unwrap();
    let handle = open.handle().clone();
    drop(open); // the producer "dies" without finalizing
    admin.finalize(handle.id()).await.unwrap();
    assert_eq!(
        handle.wait_timeout::<u64>(Duration::from_secs(5)).await.unwrap().into_outputs().unwrap(),
        [0, 2, 4]
    );
    let err = admin.finalize(handle.id()).await.unwrap_err();
    assert!(err.to_string().contains("not open"), "{err}");

    let mut open = producer.request().expire_open_after(Duration::from_millis(500)).open().await.unwrap();
    open.add([Job::new(1)]).await.unwrap();
    let done = open.handle().wait_timeout::<u64>(Duration::from_secs(5)).await.unwrap();
    assert_eq!(done.state, RequestState::Cancelled, "an expired open request is cancelled");
    let err = open.add([Job::new(2)]).await.unwrap_err();
    assert!(err.to_string().contains("not open for parts"), "{err}");
    w.stop().await;
}

/// A streamed request reprioritized while open: the tokens its later adds wake go to the new
/// priority's list, not to the one its producer opened it with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_added_after_a_reprioritize_wake_tokens_at_the_new_priority() {
    let env = env_on(TOPOLOGY, "stream-repri").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let admin = Admin::connect(&env.config).await.unwrap();
    let mut open = producer.request().priority(10).unwrap().concurrency(2).unwrap().open().await.unwrap();
    let id = open.handle().id().clone();
    // Its tokens are parked (no part yet): nothing waits to be moved.
    let raised = admin.reprioritize(&id, sluicegate::Priority::new(90).unwrap()).await.unwrap();
    assert_eq!((raised.from, raised.to, raised.moved), (10, 90, 0));
    open.add((0..4).map(Job::new)).await.unwrap();
    let waiting: Vec<(u8, u64)> =
        admin.stats().await.unwrap().tokens_waiting.iter().map(|p| (p.priority, p.tokens)).collect();
    assert_eq!(waiting, [(90, 2)]);
    let handle = open.finalize().await.unwrap();
    let w = start_worker(&env.config, Probe::default(), 2, Quantum::default()).await;
    let done = handle.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), vec![0, 2, 4, 6]);
    w.stop().await;
}
