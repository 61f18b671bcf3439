//! Lanes (docs/protocol.md §5): how a lane frees its settled entries, and that it leaves nothing
//! behind once its requests are done. Their results, limits, cancellation and recovery are covered
//! by the core, admin and chaos suites and the randomized checker, which run with lanes on.

use std::time::{Duration, Instant};

use crate::support::{env_on, start_worker, Job, Probe};
use fred::prelude::{KeysInterface, StreamsInterface};
use sluicegate::{Producer, Quantum, RequestState};
use sluicegate_testkit::{connect, Topology};

/// The lane stream of priority 50 on shard 0.
fn lane_stream(ns: &str) -> String {
    format!("{ns}:{{{ns}.q0}}:lane:50:s")
}

/// Settled lane entries are trimmed away behind the oldest one still out; while that one has been
/// out for long (a slow handler here; a retry waiting out its backoff alike), the entries settled
/// after it are deleted instead, so that it does not hold them in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_lane_entry_does_not_hold_the_settled_ones_in_memory() {
    let env = env_on(Topology::Single, "lane-slow").await;
    let ns = env.config.namespace_str().to_owned();
    let redis = connect(env.redis.url()).await.unwrap();
    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 4, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();

    let slow = producer.request().submit([Job::sleeping(0, 6000)]).await.unwrap();
    let began = Instant::now();
    while !probe.starts().iter().any(|(id, _)| id == slow.id().as_str()) {
        assert!(began.elapsed() < Duration::from_secs(10), "the slow request never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Out for longer than the lane's trim bound (1 s) before the quick ones come.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut quick = Vec::new();
    for n in 1..=300 {
        quick.push(producer.request().submit([Job::new(n)]).await.unwrap());
    }
    for h in &quick {
        let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.state, RequestState::Completed);
    }
    assert!(slow.try_completion::<u64>().await.unwrap().is_none(), "the slow request is still running");
    let left: u64 = redis.xlen(lane_stream(&ns)).await.unwrap();
    assert!(left <= 1, "{left} entries in the lane while only the slow one is unsettled");

    let done = slow.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), vec![0]);
    w.stop().await;
}

/// A lane whose requests are all done is emptied when its last token parks, and its keys expire a
/// few seconds later: a namespace that goes quiet keeps no lane. A submit while it is idle revives
/// it (the request runs, and the lane is kept until it is idle again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_lane_empties_and_expires() {
    let env = env_on(Topology::Single, "lane-idle").await;
    let ns = env.config.namespace_str().to_owned();
    let redis = connect(env.redis.url()).await.unwrap();
    let producer = Producer::connect(&env.config).await.unwrap();
    let mut handles = Vec::new();
    for n in 0..500 {
        handles.push(producer.request().submit([Job::new(n)]).await.unwrap());
    }
    let queued: u64 = redis.xlen(lane_stream(&ns)).await.unwrap();
    assert_eq!(queued, 500, "every request is one entry in its lane");
    let w = start_worker(&env.config, Probe::default(), 8, Quantum::default()).await;
    for h in &handles {
        h.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    }
    let began = Instant::now();
    loop {
        let ttl: i64 = redis.pttl(lane_stream(&ns)).await.unwrap();
        if ttl > 0 {
            break;
        }
        assert!(began.elapsed() < Duration::from_secs(10), "the drained lane never fell idle (expiry {ttl})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let late = producer.request().submit([Job::new(7)]).await.unwrap();
    let done = late.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), vec![14], "a request submitted to an idle lane runs");
    let began = Instant::now();
    loop {
        let exists: u64 = redis.exists(lane_stream(&ns)).await.unwrap();
        if exists == 0 {
            break;
        }
        let left: u64 = redis.xlen(lane_stream(&ns)).await.unwrap();
        let ttl: i64 = redis.pttl(lane_stream(&ns)).await.unwrap();
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "the drained lane is still there: {left} entries, expiry in {ttl} ms"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    w.stop().await;
}
