//! Lanes (docs/protocol.md §5): how a lane frees its settled entries, and that it leaves nothing
//! behind once its requests are done. Their results, limits, cancellation and recovery are covered
//! by the core, admin and chaos suites and the randomized checker, which run with lanes on.

use std::time::{Duration, Instant};

use crate::support::monitor::Monitor;
use crate::support::{env_on, start_built, start_worker, Env, Job, Probe, Running};
use fred::prelude::{HashesInterface, KeysInterface, StreamsInterface};
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

/// A handle its producer got from submitting a lane request knows where the request lives: its
/// wait reads the record, and never looks for the meta hash a request with keys of its own has
/// (one round trip fewer per read, docs/protocol.md §6.7). A handle made from the id alone does
/// not know, and finds the record after the meta hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_requests_wait_reads_its_record_alone() {
    let env = env_on(Topology::Single, "lane-wait").await;
    let ns = env.config.namespace_str().to_owned();
    let producer = Producer::connect(&env.config).await.unwrap();
    let submitted = producer.request().submit([Job::new(1)]).await.unwrap();
    let id = submitted.id().clone();
    // No worker: the request ends by its cancellation, and is then read as any terminal one.
    submitted.cancel().await.unwrap();
    let meta = format!("{ns}:r:{{{}}}", id.as_str());
    let record = format!("{ns}:{{{ns}.q0}}:s:{}", id.as_str());

    let monitor = Monitor::start(env.redis.url(), id.as_str()).await;
    let done = submitted.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
    let by_id = producer.handle(id.clone()).wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
    let commands = monitor.stop().await;
    assert_eq!(done.state, RequestState::Cancelled);
    assert_eq!(by_id.state, RequestState::Cancelled);
    let reads = |key: &str| commands.iter().filter(|c| c.get(1).map(String::as_str) == Some(key)).count();
    // (The id-made handle's wait: one read of the meta hash, then the record's.)
    assert_eq!(reads(&meta), 1, "the submitting handle's wait looked for a meta hash: {commands:?}");
    assert_eq!(reads(&record), 2, "each wait reads the record once: {commands:?}");
}

/// A worker of two slots, one kept for priorities 90 and up (`reserve(1, 90)`); returns once its
/// reserved slot's take found nothing and the slot offered to be handed a token (its offer, floor
/// 90, is in the shard's `wait` hash).
async fn reserved_worker_offering(env: &Env, probe: &Probe) -> Running {
    let ns = env.config.namespace_str().to_owned();
    let redis = connect(env.redis.url()).await.unwrap();
    let builder = sluicegate::Worker::builder(&env.config, probe.clone())
        .slots(2)
        .reserve(1, 90)
        .shutdown_grace(Duration::from_millis(100));
    let w = start_built(builder).await;
    // (The worker's standby slot offers too, for any priority: its floor is 0.)
    wait_for_offer(&redis, &ns, 90).await;
    w
}

/// Returns once a slot of floor `floor` offers to be handed a token on shard 0 (its offer is in the
/// shard's `wait` hash), within 10 s.
async fn wait_for_offer(redis: &fred::clients::Client, ns: &str, floor: u8) {
    let (offers, prefix) = (format!("{ns}:{{{ns}.q0}}:wait"), format!("{floor}|"));
    let began = Instant::now();
    while !redis.hvals::<Vec<String>, _>(&offers).await.unwrap().iter().any(|o| o.starts_with(&prefix)) {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "no slot of floor {floor} offered to be handed a token"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A subscriber to shard 0's `up` channel, where a push onto an empty priority list is announced,
/// and its messages.
async fn listen_up(
    env: &Env,
) -> (fred::clients::SubscriberClient, tokio::sync::broadcast::Receiver<fred::types::Message>) {
    use fred::prelude::{ClientLike, EventInterface, PubsubInterface};
    let ns = env.config.namespace_str();
    let subscriber =
        fred::types::Builder::from_config(fred::types::config::Config::from_url(env.redis.url()).unwrap())
            .build_subscriber_client()
            .unwrap();
    subscriber.init().await.unwrap();
    let announced = subscriber.message_rx();
    subscriber.subscribe(format!("{ns}:{{{ns}.q0}}:up")).await.unwrap();
    (subscriber, announced)
}

/// A reserved slot that found nothing of its priorities offers to be handed the next such lane
/// token (docs/protocol.md, "Hand-offs"): the submit of an urgent small request records the token
/// as the slot's and leaves it on the slot's hand list, rather than pushing it onto the priority
/// list and announcing it there. So nothing is announced, while the other slot is inside a
/// minute-long handler, and the urgent request still runs at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_urgent_lane_request_is_handed_to_a_waiting_reserved_slot_without_a_push() {
    use fred::prelude::ClientLike;
    let env = env_on(Topology::Single, "lane-hand").await;
    let probe = Probe::default();
    let w = reserved_worker_offering(&env, &probe).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let long = producer.request().priority(10).unwrap().submit([Job::sleeping(0, 60_000)]).await.unwrap();
    while probe.starts().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (subscriber, mut announced) = listen_up(&env).await;

    let urgent = producer.request().priority(95).unwrap().submit([Job::new(7)]).await.unwrap();
    let done = urgent.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), vec![14]);
    assert_eq!(probe.starts().len(), 2, "only the urgent part started beside the long one");
    tokio::time::sleep(Duration::from_millis(100)).await;
    if let Ok(message) = announced.try_recv() {
        panic!(
            "the urgent token was pushed and announced ({:?}), not handed to the waiting slot",
            message.value
        );
    }
    subscriber.quit().await.unwrap();
    w.stop().await;
    drop(long);
}

/// A worker of two slots, idle: one of them its standby (docs/protocol.md, "Hand-offs").
async fn idle_worker_of_two_slots(env: &Env) -> Running {
    let builder = sluicegate::Worker::builder(&env.config, Probe::default())
        .slots(2)
        .shutdown_grace(Duration::from_millis(100));
    start_built(builder).await
}

/// Nothing was announced on the shard's `up` channel: every token was handed, none pushed.
fn assert_none_announced(announced: &mut tokio::sync::broadcast::Receiver<fred::types::Message>) {
    if let Ok(message) = announced.try_recv() {
        panic!("a token was pushed and announced ({:?}), not handed to the standby slot", message.value);
    }
}

/// An idle worker's standby slot (one of its unreserved slots at a time) offers to be handed the
/// next lane token of any priority (docs/protocol.md, "Hand-offs"): the submit of a small request
/// records the token as the slot's and leaves it on the slot's hand list, so nothing is pushed onto
/// a priority list or announced, and the slot runs the part without a take of its own
/// (`WorkerMetrics::handed_off`). Once done it offers again, and the next request is handed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_workers_standby_slot_is_handed_each_small_request_by_its_submit() {
    use fred::prelude::ClientLike;
    use std::sync::atomic::Ordering::Relaxed;
    let env = env_on(Topology::Single, "lane-standby").await;
    let ns = env.config.namespace_str().to_owned();
    let redis = connect(env.redis.url()).await.unwrap();
    let w = idle_worker_of_two_slots(&env).await;
    let (subscriber, mut announced) = listen_up(&env).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    for n in 0..3u64 {
        wait_for_offer(&redis, &ns, 0).await;
        let done = producer.request().submit([Job::new(n)]).await.unwrap();
        let done = done.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
        assert_eq!(done.into_outputs().unwrap(), vec![2 * n]);
    }
    assert_eq!(w.metrics().handed_off.load(Relaxed), 3, "each request was handed to the standby slot");
    assert_none_announced(&mut announced);
    subscriber.quit().await.unwrap();
    w.stop().await;
}

/// The push of a request of its own stream hands its token to an idle worker's standby slot too
/// (docs/protocol.md, "Hand-offs"): the submit's push, and the push of a downstream whose upstream's
/// finish opened its gate. The slot acquires the handed token without a take of its own
/// (`WorkerMetrics::handed_off`), and nothing is pushed onto a priority list or announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_of_a_request_of_its_own_stream_is_handed_to_the_standby_slot() {
    use fred::prelude::ClientLike;
    use std::sync::atomic::Ordering::Relaxed;
    let env = env_on(Topology::Single, "push-standby").await;
    let ns = env.config.namespace_str().to_owned();
    let redis = connect(env.redis.url()).await.unwrap();
    let w = idle_worker_of_two_slots(&env).await;
    let (subscriber, mut announced) = listen_up(&env).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let own = || producer.request().own_stream(true).concurrency(1).unwrap();
    wait_for_offer(&redis, &ns, 0).await;
    let up = own().submit([Job::sleeping(1, 300)]).await.unwrap();
    let down = own().after([up.id().clone()]).submit([Job::new(2)]).await.unwrap();
    assert_eq!(
        up.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap().into_outputs().unwrap(),
        vec![2]
    );
    let done = down.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), vec![4]);
    assert_eq!(
        w.metrics().handed_off.load(Relaxed),
        2,
        "the upstream's push and the downstream's release each handed its token to the standby slot"
    );
    assert_none_announced(&mut announced);
    subscriber.quit().await.unwrap();
    w.stop().await;
}

/// A stopping worker wakes its slots blocked on Redis for work (`CLIENT UNBLOCK`): they end
/// cleanly at once, the standby's offer with them, rather than at the end of their poll. With a
/// poll of 9 s, longer than the stop waits for its slots (the grace and 5 s), a slot still blocked
/// would be aborted, and its offer left in the shard's `wait` hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_wakes_its_idle_slots_and_withdraws_its_offer() {
    let env = env_on(Topology::Single, "stop-unblock").await;
    let ns = env.config.namespace_str().to_owned();
    let redis = connect(env.redis.url()).await.unwrap();
    // (Built here: `start_built` sets a short poll.)
    let worker = sluicegate::Worker::builder(&env.config, Probe::default())
        .slots(3)
        .idle_poll(Duration::from_secs(9))
        .shutdown_grace(Duration::from_millis(100))
        .build()
        .await
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let signal = stop.clone();
    let running = tokio::spawn(worker.run_until(async move { signal.cancelled().await }));
    wait_for_offer(&redis, &ns, 0).await;
    // Every slot blocked by now: the standby on its hand list and the bell, the others on the bell.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let offers: Vec<String> = redis.hvals(format!("{ns}:{{{ns}.q0}}:wait")).await.unwrap();
    assert!(offers.is_empty(), "the standby's offer outlived its worker: {offers:?}");
}

/// A hand-off respects an operator's pause: a reserved slot that offered (its floor's other
/// priorities are not paused) is not handed a token of a paused priority; the token waits on its
/// list, and runs once the priority is resumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_priority_is_not_handed_to_a_waiting_reserved_slot() {
    let env = env_on(Topology::Single, "lane-hand-pause").await;
    let probe = Probe::default();
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    admin.pause(Some(sluicegate::Priority::new(95).unwrap())).await.unwrap();
    let w = reserved_worker_offering(&env, &probe).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let urgent = producer.request().priority(95).unwrap().submit([Job::new(7)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(probe.starts().is_empty(), "a part of a paused priority was handed to the reserved slot and ran");
    admin.resume(Some(sluicegate::Priority::new(95).unwrap())).await.unwrap();
    let done = urgent.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), vec![14]);
    w.stop().await;
}

/// A whole request submitted with `discard_results`, on its priority's lane and on a stream of its
/// own: Redis stores none of its results and its completion carries none, only its counts; its
/// errors are kept (of a part that failed twice), and its status says that it discards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submitted_request_that_discards_its_results_stores_none_and_keeps_its_errors() {
    let env = env_on(Topology::Single, "lane-discard").await;
    let ns = env.config.namespace_str().to_owned();
    let redis = connect(env.redis.url()).await.unwrap();
    let w = start_worker(&env.config, Probe::default(), 4, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    for own in [false, true] {
        let parts = (0..5u64).map(|n| Job { fail: n == 3, ..Job::new(n) });
        let handle = producer
            .request()
            .concurrency(2)
            .unwrap()
            .max_attempts(2)
            .unwrap()
            .backoff(Duration::from_millis(10), Duration::from_millis(20))
            .unwrap()
            .own_stream(own)
            .discard_results(true)
            .submit(parts)
            .await
            .unwrap();
        let done = handle.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        let shape = if own { "on a stream of its own" } else { "on a lane" };
        assert_eq!(
            (done.state, done.first, done.total, done.failed),
            (RequestState::Failed, 5, 5, 1),
            "{shape}: {done:?}"
        );
        assert!(done.results.is_empty(), "{shape}: {done:?}");
        let status = admin.status(handle.id()).await.unwrap();
        assert!(status.discard_results, "{shape}: {status:?}");
        assert_eq!((status.done, status.failed), (5, 1), "{shape}: {status:?}");
        assert_eq!(status.errors.iter().map(|e| e.index).collect::<Vec<_>>(), [3], "{shape}: {status:?}");
        // Nothing of the results in Redis: no results hash, no result field in a lane record.
        let kid = handle.id().key_id();
        let results: u64 = redis.hlen(format!("{ns}:r:{{{kid}}}:res")).await.unwrap();
        assert_eq!(results, 0, "{shape}: results stored");
        for shard in 0..4 {
            let record: std::collections::HashMap<String, Vec<u8>> =
                redis.hgetall(format!("{ns}:{{{ns}.q{shard}}}:s:{kid}")).await.unwrap();
            let stored: Vec<&String> = record
                .keys()
                .filter(|k| {
                    k.strip_prefix('o')
                        .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
                })
                .collect();
            assert!(stored.is_empty(), "{shape}: results stored in the record: {stored:?}");
        }
    }
    w.stop().await;
}
