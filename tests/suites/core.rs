// The body of tests/integration/core.rs: written once, run against a single Redis and a 3-master Redis
// Cluster (`per_topology!` runs it once for each).

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use sluicegate::{Error, Listener, Producer, Quantum, RequestState};
use crate::support::{env_on, env_streams, assert_namespace_drains, start_built, start_worker, Job, Probe};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_requests_finish_in_order_and_reach_but_never_exceed_their_limits() {
    let env = env_on(TOPOLOGY, "fifty").await;
    let probe = Probe::default();
    let quantum = Quantum { parts: 8, time: Duration::from_millis(100) };
    let a = start_worker(&env.config, probe.clone(), 8, quantum).await;
    let b = start_worker(&env.config, probe.clone(), 8, quantum).await;
    let producer = Producer::connect(&env.config).await.unwrap();

    let mut handles = Vec::new();
    for r in 0..50u64 {
        let limit = 1 + (r % 5) as u32;
        let parts = (0..100).map(|i| Job::sleeping(r * 1000 + i, 2));
        let h = producer.request().concurrency(limit).unwrap().submit(parts).await.unwrap();
        handles.push((h, limit, r));
    }
    let mut reached = 0;
    let mut reached_per_limit = std::collections::BTreeMap::<u32, u32>::new();
    for (h, limit, r) in &handles {
        let done = h.wait_timeout::<u64>(Duration::from_secs(120)).await.unwrap();
        assert_eq!(done.state, RequestState::Completed);
        let outputs = done.into_outputs().unwrap();
        let expected: Vec<u64> = (0..100).map(|i| (r * 1000 + i) * 2).collect();
        assert_eq!(outputs, expected, "results of request {r} out of order or wrong");
        let max = probe.max_concurrency(h.id().as_str());
        assert!(max <= *limit, "request {r}: {max} handlers ran at once, limit {limit}");
        if max == *limit {
            reached += 1;
            *reached_per_limit.entry(*limit).or_default() += 1;
        }
    }
    // The test must be able to see a violation: most requests, and some of every limit class,
    // ran at their limit at some instant (a loaded machine may keep a few from getting there).
    assert!(reached >= handles.len() * 3 / 4, "only {reached} of {} requests reached their limit", handles.len());
    assert_eq!(reached_per_limit.len(), 5, "every limit class reached its limit: {reached_per_limit:?}");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slot_runs_every_part_of_the_highest_priority_first() {
    let env = env_on(TOPOLOGY, "prio").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let mut ids = Vec::new();
    // Queued before any worker exists, lowest first, so submission order cannot explain the result.
    for p in [10u8, 50, 90] {
        let h = producer
            .request()
            .priority(p)
            .unwrap()
            .concurrency(2)
            .unwrap()
            .submit((0..5).map(Job::new))
            .await
            .unwrap();
        ids.push(h);
    }
    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 1, Quantum::default()).await;
    for h in &ids {
        h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    }
    w.stop().await;
    let order: Vec<String> = probe.starts().into_iter().map(|(id, _)| id).collect();
    let expected: Vec<String> = [&ids[2], &ids[1], &ids[0]]
        .iter()
        .flat_map(|h| std::iter::repeat(h.id().to_string()).take(5))
        .collect();
    assert_eq!(order, expected, "parts must run highest priority first");
}

/// A worker of `slots` without the urgent slot (`WorkerBuilder::urgent(None)`): an urgent request
/// then waits for a busy slot to give way, which is what the tests using it look at.
fn no_urgent<H: sluicegate::Handler>(
    config: &sluicegate::Config,
    handler: H,
    slots: usize,
    quantum: Quantum,
) -> sluicegate::WorkerBuilder<H> {
    sluicegate::Worker::builder(config, handler).slots(slots).quantum(quantum).urgent(None)
}

/// A busy slot does not keep its token for the rest of its quantum once a higher priority is
/// waiting: the push onto the empty priority list is announced, and the slot gives way at the end
/// of its batch. With a quantum longer than the low request itself, the urgent one would otherwise
/// start only after every low part ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_slot_gives_way_to_a_higher_priority_before_its_quantum_ends() {
    let env = env_on(TOPOLOGY, "giveway").await;
    let probe = Probe::default();
    let quantum = Quantum { parts: 100_000, time: Duration::from_secs(600) };
    // No urgent slot: it would start the urgent request without a give-way.
    let w = start_built(no_urgent(&env.config, probe.clone(), 1, quantum)).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let low = producer
        .request()
        .priority(1)
        .unwrap()
        .concurrency(1)
        .unwrap()
        .submit((0..300).map(|i| Job::sleeping(i, 5)))
        .await
        .unwrap();
    while probe.starts().len() < 10 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let urgent = producer.request().priority(99).unwrap().submit([Job::new(7)]).await.unwrap();
    urgent.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    let starts = probe.starts();
    let at = starts.iter().position(|(id, _)| id == urgent.id().as_str()).expect("the urgent part ran");
    assert!(at < 200, "the urgent part started after {at} low parts: the busy slot kept its token for its quantum");
    low.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    w.stop().await;
}

/// A slot sizes a hold's first batch from the handler times of its last hold: after fast requests
/// that is a full batch. A slow request must still run at its limit: each hold is handed at most
/// its share of the parts left (`acquire`), so its other tokens find parts too, rather than one
/// slot holding them all while the rest park.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_fast_requests_a_slow_one_still_runs_at_its_limit() {
    let env = env_on(TOPOLOGY, "share").await;
    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 4, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let fast = producer.request().concurrency(4).unwrap().own_stream(true).submit((0..400).map(Job::new));
    fast.await.unwrap().wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    let slow = producer
        .request()
        .concurrency(4)
        .unwrap()
        .own_stream(true)
        .submit((0..8).map(|i| Job::sleeping(i, 300)))
        .await
        .unwrap();
    slow.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    let max = probe.max_concurrency(slow.id().as_str());
    assert_eq!(max, 4, "the slow request ran {max} parts at once, limit 4: one slot's first batch held its parts");
    w.stop().await;
}

/// A first batch sized from fast handlers may hold many parts of a slow request: once it has run
/// for its budget, it hands back the rest unrun, so a higher priority gets the slot between the
/// slow parts rather than after the whole batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_batch_sized_by_fast_handlers_hands_back_a_slow_requests_rest() {
    let env = env_on(TOPOLOGY, "guess").await;
    let probe = Probe::default();
    let quantum = Quantum { parts: 100_000, time: Duration::from_secs(600) };
    let w = start_built(no_urgent(&env.config, probe.clone(), 1, quantum)).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let fast = producer.request().own_stream(true).submit((0..100).map(Job::new));
    fast.await.unwrap().wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    let slow = producer
        .request()
        .priority(1)
        .unwrap()
        .own_stream(true)
        .submit((0..20).map(|i| Job::sleeping(i, 100)))
        .await
        .unwrap();
    let ran_slow = |starts: &[(String, u64)]| starts.iter().filter(|(id, _)| id == slow.id().as_str()).count();
    while ran_slow(&probe.starts()) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let urgent = producer.request().priority(99).unwrap().submit([Job::new(7)]).await.unwrap();
    urgent.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    let starts = probe.starts();
    let at = starts.iter().position(|(id, _)| id == urgent.id().as_str()).expect("the urgent part ran");
    let before = ran_slow(&starts[..at]);
    assert!(before <= 3, "{before} slow parts started before the urgent one: the first batch ran whole");
    slow.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    w.stop().await;
}

/// A rate-limited request's parts are charged to its rate as they are handed out: a first batch
/// sized from fast handlers, then handed back after its budget, would have spent the starts of the
/// parts it did not run. Its first batch is one part, so a burst of four runs at once here, where a
/// spent start would wait 15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_request_spends_no_start_on_parts_a_first_batch_hands_back() {
    let env = env_on(TOPOLOGY, "guessrate").await;
    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 1, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let fast = producer.request().own_stream(true).submit((0..100).map(Job::new));
    fast.await.unwrap().wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    let limited = producer
        .request()
        .own_stream(true)
        .rate(4, Duration::from_secs(60))
        .unwrap()
        .submit((0..4).map(|i| Job::sleeping(i, 20)))
        .await
        .unwrap();
    let done = limited.wait_timeout::<u64>(Duration::from_secs(8)).await;
    assert!(done.is_ok(), "a burst of 4 within a rate of 4 a minute did not run at once: {done:?}");
    w.stop().await;
}

/// With two token shards, the slot that gives way takes next on the shard where the higher
/// priority waits, not on the next shard in turn (where, here, nothing waits: it would sit out a
/// shard poll there while the other slot runs the flood).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_shards_the_slot_that_gives_way_takes_where_the_higher_priority_waits() {
    let env = env_on(TOPOLOGY, "giveway2").await;
    let config = env.config.clone().token_shards(2);
    let probe = Probe::default();
    let quantum = Quantum { parts: 100_000, time: Duration::from_secs(600) };
    let builder = no_urgent(&config, probe.clone(), 2, quantum).shard_poll(Duration::from_secs(5));
    let w = start_built(builder).await;
    let producer = Producer::connect(&config).await.unwrap();
    // Two tokens, one on each shard: both slots busy, each holding one.
    let low = producer
        .request()
        .priority(1)
        .unwrap()
        .concurrency(2)
        .unwrap()
        .submit((0..4_000).map(|i| Job::sleeping(i, 2)))
        .await
        .unwrap();
    while probe.starts().len() < 20 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = probe.starts().len();
    let urgent = producer.request().priority(99).unwrap().submit([Job::new(7)]).await.unwrap();
    urgent.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    let starts = probe.starts();
    let at = starts.iter().position(|(id, _)| id == urgent.id().as_str()).expect("the urgent part ran");
    let between = at - before;
    assert!(
        between < 200,
        "{between} low parts started before the urgent one: the slot that gave way took on the other shard"
    );
    drop(low);
    w.stop().await;
}

/// A busy slot gives way only between batches: with handlers that run for a minute, an urgent
/// request would wait for the first of them to end. A slot reserved for priorities 90 and up takes
/// none of the long request's waiting tokens, and starts the urgent request as soon as it is
/// announced, while the other slot is still inside its handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_slot_starts_an_urgent_request_while_every_other_slot_runs_a_long_handler() {
    let env = env_on(TOPOLOGY, "reserved").await;
    let probe = Probe::default();
    let builder = sluicegate::Worker::builder(&env.config, probe.clone())
        .slots(2)
        .reserve(1, 90)
        .shutdown_grace(Duration::from_millis(100));
    let w = start_built(builder).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    // Two tokens, both waiting for a slot: only the unreserved one may take one.
    let long = producer
        .request()
        .priority(89)
        .unwrap()
        .concurrency(2)
        .unwrap()
        .submit((0..2).map(|i| Job::sleeping(i, 60_000)))
        .await
        .unwrap();
    while probe.starts().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Long enough for an idle slot to take the second token (it polls every 100 ms here).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(probe.starts().len(), 1, "the slot reserved for priorities 90 and up ran a part of priority 89");
    let urgent = producer.request().priority(90).unwrap().submit([Job::new(7)]).await.unwrap();
    let done = urgent.wait_timeout::<u64>(Duration::from_secs(20)).await;
    assert!(done.is_ok(), "the urgent request waited for a minute-long handler: {done:?}");
    assert_eq!(probe.starts().len(), 2, "only the urgent part started beside the long one");
    let metrics = w.metrics();
    w.stop().await;
    // The long part outlived the stop's grace: its ack reported it unrun.
    let back = metrics.handed_back.load(Relaxed);
    assert_eq!(back, 1, "the worker counted {back} parts reported unrun (WorkerMetrics::handed_back)");
    drop(long);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_refuses_settings_that_leave_no_slot_for_every_priority_or_reserve_nothing() {
    let env = env_on(TOPOLOGY, "reserve_bad").await;
    let build = |slots: usize, reserved: usize, priority: u8| {
        sluicegate::Worker::builder(&env.config, Probe::default()).slots(slots).reserve(reserved, priority).build()
    };
    for (slots, reserved, priority, says) in [
        (2, 2, 90, "at least one must take every priority"),
        (4, 5, 90, "at least one must take every priority"),
        (2, 1, 0, "reserves nothing"),
        (2, 1, 100, "from 1 to 99"),
    ] {
        match build(slots, reserved, priority).await {
            Err(Error::Config(message)) => {
                assert!(message.contains(says), "reserve({reserved}, {priority}) of {slots}: {message}")
            }
            Err(e) => panic!("reserve({reserved}, {priority}) of {slots}: not a configuration error: {e}"),
            Ok(_) => panic!("reserve({reserved}, {priority}) of {slots} was accepted"),
        }
    }
    // No slot reserved is no reservation at all.
    assert!(build(2, 0, 0).await.is_ok());
    // Nor does the urgent slot take a priority out of range.
    for p in [0, 100] {
        let built = sluicegate::Worker::builder(&env.config, Probe::default()).urgent(Some(p)).build().await;
        match built {
            Err(Error::Config(message)) => assert!(
                message.contains("urgent(Some(") && message.contains("from 1 to 99"),
                "urgent(Some({p})): {message}"
            ),
            Err(e) => panic!("urgent(Some({p})): not a configuration error: {e}"),
            Ok(_) => panic!("urgent(Some({p})) was accepted"),
        }
    }
}

/// The urgent slot (`WorkerBuilder::urgent`, on by default for priorities 90 and up) sits beside
/// the worker's slots: an urgent request starts while every slot is inside a handler that only
/// the test ends. `slots` bounds what runs from one batch to the next: the first slot to end its
/// part then gives its token back and starts nothing until the urgent part ends, and the worker
/// never runs more than `slots + 1` parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_urgent_slot_starts_an_urgent_request_beside_busy_slots_and_the_next_batch_end_makes_room() {
    let env = env_on(TOPOLOGY, "urgent").await;
    let gated = Gated::default();
    let w = start_built(sluicegate::Worker::builder(&env.config, gated.clone()).slots(2)).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    // A request of its own keys: two tokens of its own, one in each slot.
    let low = producer.request().priority(10).unwrap().concurrency(2).unwrap().own_stream(true);
    let low = low.submit((0..4).map(Job::new));
    let low = low.await.unwrap();
    gated.wait_for(|s| s.running.len() == 2, "both slots start a low part").await;
    let urgent = producer.request().priority(95).unwrap().submit([Job::new(100)]).await.unwrap();
    gated.wait_for(|s| s.running.contains(&100), "the urgent part starts beside two running").await;
    // One low part ends: its slot's batch ends with the worker one hold over its slots, so it
    // gives its token back and waits; the other low token's slot is still inside its part.
    let first = gated.running_low()[0];
    gated.release(first);
    gated.wait_for(|s| !s.running.contains(&first), "the released part ends").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let state = gated.state();
    assert_eq!(state.running.len(), 2, "a low part started while the urgent one ran beside another: {state:?}");
    // The urgent part ends: room again, and a low part starts in the slot that waited.
    gated.release(100);
    assert_eq!(urgent.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap().into_outputs().unwrap(), [200]);
    gated.wait_for(|s| s.running.len() == 2, "the slot that made room takes again").await;
    for n in 0..4 {
        gated.release(n);
    }
    low.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    let most = gated.state().most;
    assert_eq!(most, 3, "at most slots + 1 parts ran at once (and that many did): {most}");
    w.stop().await;
}

/// The bound holds while the urgent slot runs: a slot whose holds keep ending (a quantum of one
/// part, each part released by the test as soon as it runs) and the slot that made room both want
/// to take at each hold's end, and only one may (`bound::Bound::claim`): beside the urgent part, no
/// more than `slots` parts ever run once the first batch end made room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_urgent_slot_runs_a_slot_that_keeps_ending_parts_starts_none_beyond_the_slots() {
    let env = env_on(TOPOLOGY, "urgent-claim").await;
    let gated = Gated::default();
    let quantum = Quantum { parts: 1, time: Duration::from_secs(10) };
    let builder = sluicegate::Worker::builder(&env.config, gated.clone()).slots(2).quantum(quantum);
    let w = start_built(builder).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let low = producer.request().priority(10).unwrap().concurrency(2).unwrap().own_stream(true);
    let low = low.submit((0..200).map(Job::new)).await.unwrap();
    gated.wait_for(|s| s.running.len() == 2, "both slots start a low part").await;
    let urgent = producer.request().priority(95).unwrap().submit([Job::new(100)]).await.unwrap();
    gated.wait_for(|s| s.running.contains(&100), "the urgent part starts beside two running").await;
    let first = gated.running_low()[0];
    gated.release(first);
    gated.wait_for(|s| s.running.len() == 2, "a batch end makes room").await;
    gated.0.lock().unwrap().most = 2;
    for _ in 0..25 {
        for n in gated.running_low() {
            gated.release(n);
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let state = gated.state();
    assert!(state.released.len() > 5, "the low parts kept ending: {state:?}");
    assert_eq!(state.most, 2, "more than the slots ran beside the urgent part: {state:?}");
    gated.0.lock().unwrap().open = true;
    urgent.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    low.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    w.stop().await;
}

/// A handler whose parts run until the test releases them (by `Job::n`), recording what runs.
#[derive(Clone, Default)]
struct Gated(std::sync::Arc<std::sync::Mutex<GateState>>);

#[derive(Clone, Debug, Default)]
struct GateState {
    running: Vec<u64>,
    released: Vec<u64>,
    most: usize,
    /// Every part runs through without waiting.
    open: bool,
}

impl Gated {
    fn state(&self) -> GateState {
        self.0.lock().unwrap().clone()
    }

    fn release(&self, n: u64) {
        self.0.lock().unwrap().released.push(n);
    }

    fn running_low(&self) -> Vec<u64> {
        self.state().running.into_iter().filter(|&n| n < 100).collect()
    }

    async fn wait_for(&self, done: impl Fn(&GateState) -> bool, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done(&self.state()) {
            assert!(Instant::now() < deadline, "{what}: not within 20 s: {:?}", self.state());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[sluicegate::async_trait]
impl sluicegate::Handler for Gated {
    type Input = Job;
    type Output = u64;

    async fn handle(&self, _: sluicegate::Context, job: Job) -> Result<u64, sluicegate::HandlerError> {
        {
            let mut s = self.0.lock().unwrap();
            s.running.push(job.n);
            s.most = s.most.max(s.running.len());
        }
        while !self.0.lock().unwrap().released.contains(&job.n) && !self.0.lock().unwrap().open {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.0.lock().unwrap().running.retain(|&n| n != job.n);
        Ok(job.n * 2)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_urgent_request_gets_the_next_free_slot_within_one_quantum() {
    let env = env_on(TOPOLOGY, "preempt").await;
    let probe = Probe::default();
    let quantum = Quantum { parts: 5, time: Duration::from_secs(10) };
    let w = start_built(no_urgent(&env.config, probe.clone(), 1, quantum)).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let huge = producer
        .request()
        .priority(1)
        .unwrap()
        .concurrency(1)
        .unwrap()
        .submit((0..2_000).map(|i| Job::sleeping(i, 2)))
        .await
        .unwrap();
    // Let the huge request get going.
    while probe.starts().len() < 20 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = probe.starts().len();
    let urgent = producer.request().priority(99).unwrap().submit((0..3).map(Job::new)).await.unwrap();
    urgent.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    let starts = probe.starts();
    let first_urgent = starts.iter().position(|(id, _)| id == urgent.id().as_str()).unwrap();
    let huge_parts_in_between = first_urgent - before;
    assert!(
        huge_parts_in_between <= quantum.parts as usize,
        "{huge_parts_in_between} low-priority parts started before the urgent one; quantum is {}",
        quantum.parts
    );
    drop(huge);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_sizes_one_part_a_hundred_thousand_parts_and_a_ten_megabyte_part() {
    let env = env_on(TOPOLOGY, "sizes").await;
    let w = start_worker(&env.config, Probe::default(), 8, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();

    let one = producer.request().submit([Job::new(21)]).await.unwrap();
    assert_eq!(one.wait::<u64>().await.unwrap().into_outputs().unwrap(), [42]);

    let started = Instant::now();
    let many = producer.request().concurrency(8).unwrap().submit((0..100_000).map(Job::new)).await.unwrap();
    let submitted = started.elapsed();
    let done = many.wait_timeout::<u64>(Duration::from_secs(300)).await.unwrap();
    let outputs = done.into_outputs().unwrap();
    assert_eq!(outputs.len(), 100_000);
    assert!(outputs.iter().enumerate().all(|(i, &o)| o == 2 * i as u64));
    eprintln!("100,000 parts: submitted in {submitted:?}, completed in {:?}", started.elapsed());
    w.stop().await;

    // A 10 MB part, with a handler that answers with its length.
    struct Len;
    #[sluicegate::async_trait]
    impl sluicegate::Handler for Len {
        type Input = serde_bytes_compat::Blob;
        type Output = usize;
        async fn handle(
            &self,
            _: sluicegate::Context,
            b: Self::Input,
        ) -> Result<usize, sluicegate::HandlerError> {
            Ok(b.0.len())
        }
    }
    let w = start_worker(&env.config, Len, 1, Quantum::default()).await;
    let big = serde_bytes_compat::Blob(vec![7u8; 10 * 1024 * 1024]);
    let h = producer.request().submit([big]).await.unwrap();
    assert_eq!(h.wait::<usize>().await.unwrap().into_outputs().unwrap(), [10 * 1024 * 1024]);
    w.stop().await;
}

/// A byte blob that MessagePack stores as binary (not an array of integers).
mod serde_bytes_compat {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    pub struct Blob(pub Vec<u8>);
    impl Serialize for Blob {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(&self.0)
        }
    }
    impl<'de> Deserialize<'de> for Blob {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl serde::de::Visitor<'_> for V {
                type Value = Blob;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("bytes")
                }
                fn visit_bytes<E>(self, v: &[u8]) -> Result<Blob, E> {
                    Ok(Blob(v.to_vec()))
                }
                fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<Blob, E> {
                    Ok(Blob(v))
                }
            }
            d.deserialize_byte_buf(V)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_part_is_recorded_and_the_request_ends_failed() {
    let env = env_on(TOPOLOGY, "fail").await;
    let w = start_worker(&env.config, Probe::default(), 2, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let parts = (0..4).map(|n| Job { n, sleep_ms: 0, fail: n == 2 });
    let done = producer.request().submit(parts).await.unwrap().wait::<u64>().await.unwrap();
    assert_eq!(done.state, RequestState::Failed);
    assert_eq!(done.results[0], Ok(0));
    assert_eq!(done.results[1], Ok(2));
    assert_eq!(done.results[2].as_ref().unwrap_err().message, "job 2 failed on purpose");
    assert_eq!(done.results[3], Ok(6));
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_recorded_and_the_worker_keeps_going() {
    struct Panics;
    #[sluicegate::async_trait]
    impl sluicegate::Handler for Panics {
        type Input = u32;
        type Output = u32;
        async fn handle(&self, _: sluicegate::Context, n: u32) -> Result<u32, sluicegate::HandlerError> {
            assert!(n != 1, "part one panics");
            Ok(n)
        }
    }
    let env = env_on(TOPOLOGY, "panic").await;
    let w = start_worker(&env.config, Panics, 1, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let done = producer.request().submit([0u32, 1, 2]).await.unwrap().wait::<u32>().await.unwrap();
    assert_eq!(done.state, RequestState::Failed);
    assert!(done.results[1].as_ref().unwrap_err().message.contains("part one panics"));
    let again = producer.request().submit([5u32]).await.unwrap().wait::<u32>().await.unwrap();
    assert_eq!(again.into_outputs().unwrap(), [5], "the worker survived the panic");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awkward_ids_work_and_bad_ids_and_duplicates_are_refused_clearly() {
    let env = env_on(TOPOLOGY, "ids").await;
    let w = start_worker(&env.config, Probe::default(), 2, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let long = "L".repeat(512);
    for id in ["a{b}c", "}{", "x:y:z", "with spaces", "März ✓ 数据", "%41", "a|b|1", long.as_str()] {
        let h = producer.request().id(id).unwrap().submit([Job::new(1)]).await.unwrap();
        assert_eq!(h.id().as_str(), id);
        assert_eq!(h.wait::<u64>().await.unwrap().into_outputs().unwrap(), [2], "id {id:?}");
    }
    let err = producer.request().id("x".repeat(10 * 1024)).err().expect("10 KB id refused");
    assert!(matches!(err, Error::InvalidRequestId(_)), "{err}");
    assert!(err.to_string().contains("at most 512 bytes"), "{err}");

    let err =
        producer.request().id("a{b}c").unwrap().submit([Job::new(1)]).await.expect_err("duplicate refused");
    assert!(matches!(err, Error::DuplicateRequestId(_)), "{err}");
    assert!(err.to_string().contains("already in use"), "{err}");

    let err = producer.request().priority(100).err().expect("priority 100 refused");
    assert!(err.to_string().contains("0 (lowest) to 99"), "{err}");
    let err = producer.request().concurrency(0).err().expect("concurrency 0 refused");
    assert!(err.to_string().contains("concurrency 0"), "{err}");
    let err = producer.request().submit(Vec::<Job>::new()).await.expect_err("empty request refused");
    assert!(err.to_string().contains("at least one part"), "{err}");

    let err = producer
        .handle(sluicegate::RequestId::new("never-submitted").unwrap())
        .wait::<u64>()
        .await
        .err()
        .unwrap();
    assert!(matches!(err, Error::UnknownRequest(_)), "{err}");
    w.stop().await;
}

/// `submit_many` submits each request as `submit` would, with one answer per request in the order
/// given: small requests of several priorities go in lane calls of many, a large one takes its own
/// stream, and a refused one (its id in use, in Redis or earlier in the same batch; no parts; tags
/// on an unlisted request) is refused alone, naming why, while the others run to completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_many_answers_each_request_and_refuses_only_the_bad_ones() {
    let env = env_on(TOPOLOGY, "bulk").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    producer.request().id("taken").unwrap().submit([Job::new(0)]).await.unwrap();
    let mut batch = Vec::new();
    for r in 0..600u64 {
        let parts: Vec<Job> = (0..1 + r % 3).map(|i| Job::new(r * 10 + i)).collect();
        let request = producer.request().priority((r % 3) as u8 * 40).unwrap();
        batch.push((request, parts));
    }
    batch.push((producer.request().id("taken").unwrap(), vec![Job::new(1)]));
    batch.push((producer.request().id("twice").unwrap(), vec![Job::new(2)]));
    batch.push((producer.request().id("twice").unwrap(), vec![Job::new(3)]));
    batch.push((producer.request(), Vec::new()));
    batch.push((producer.request().unlisted().tag("t").unwrap(), vec![Job::new(4)]));
    batch.push((producer.request().concurrency(8).unwrap(), (0..500).map(Job::new).collect()));
    let answers = producer.submit_many(batch).await;
    assert_eq!(answers.len(), 606);
    let err = |i: usize| answers[i].as_ref().err().unwrap_or_else(|| panic!("request {i} was not refused"));
    assert!(matches!(err(600), Error::DuplicateRequestId(_)), "{}", err(600));
    assert!(answers[601].is_ok(), "{:?}", answers[601].as_ref().err());
    assert!(matches!(err(602), Error::DuplicateRequestId(_)), "{}", err(602));
    assert!(err(603).to_string().contains("at least one part"), "{}", err(603));
    assert!(err(604).to_string().contains("unlisted request cannot carry tags"), "{}", err(604));

    let w = start_worker(&env.config, Probe::default(), 8, Quantum::default()).await;
    for (r, answer) in answers.iter().take(600).enumerate() {
        let done = answer.as_ref().unwrap().wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
        let r = r as u64;
        let expected: Vec<u64> = (0..1 + r % 3).map(|i| 2 * (r * 10 + i)).collect();
        assert_eq!(done.into_outputs().unwrap(), expected, "request {r}");
    }
    let twice = answers[601].as_ref().unwrap().wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    assert_eq!(twice.into_outputs().unwrap(), [4], "the first of the id in the batch is the one created");
    let large = answers[605].as_ref().unwrap().wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    assert_eq!(large.into_outputs().unwrap(), (0..500).map(|i| 2 * i).collect::<Vec<u64>>());
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_after_completion_returns_the_same_results_and_listeners_see_each_completion_once() {
    let env = env_on(TOPOLOGY, "listen").await;
    let mut first = Listener::connect(&env.config).await.unwrap();
    let mut second = Listener::connect(&env.config).await.unwrap();
    let w = start_worker(&env.config, Probe::default(), 4, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let mut handles = Vec::new();
    for r in 0..10u64 {
        handles.push(
            producer
                .request()
                .concurrency(2)
                .unwrap()
                .submit((0..10).map(|i| Job::new(r * 10 + i)))
                .await
                .unwrap(),
        );
    }
    let mut results = Vec::new();
    for h in &handles {
        results.push(h.wait::<u64>().await.unwrap().into_outputs().unwrap());
    }
    for (h, before) in handles.iter().zip(&results) {
        let again = producer.handle(h.id().clone()).wait::<u64>().await.unwrap().into_outputs().unwrap();
        assert_eq!(&again, before);
    }
    for listener in [&mut first, &mut second] {
        let mut seen = Vec::new();
        for _ in 0..handles.len() {
            let event =
                tokio::time::timeout(Duration::from_secs(10), listener.next()).await.unwrap().unwrap();
            assert_eq!(event.state, RequestState::Completed);
            seen.push(event.id);
        }
        let mut expected: Vec<_> = handles.iter().map(|h| h.id().clone()).collect();
        seen.sort();
        expected.sort();
        assert_eq!(seen, expected, "each completion exactly once");
        let extra = tokio::time::timeout(Duration::from_millis(300), listener.next()).await;
        assert!(extra.is_err(), "no duplicate completion: {extra:?}");
    }
    // A listener that starts late replays what is retained.
    let mut late = Listener::from_beginning(&env.config).await.unwrap();
    for _ in 0..handles.len() {
        tokio::time::timeout(Duration::from_secs(5), late.next()).await.unwrap().unwrap();
    }
    w.stop().await;
}

// Each waiting call is rung by its own request's completion message: with a poll far longer than
// the test, every wait (two at once on one handle among them), all begun before any worker runs,
// returns its own request's results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_waits_are_each_rung_by_their_own_request() {
    let env = env_on(TOPOLOGY, "rung").await;
    let config = env.config.clone().wait_poll(Duration::from_secs(600));
    let producer = Producer::connect(&config).await.unwrap();
    let mut handles = Vec::new();
    for r in 0..20u64 {
        let parts = if r % 2 == 0 { 1 } else { 5 };
        handles.push(producer.request().submit((0..parts).map(|i| Job::new(r * 10 + i))).await.unwrap());
    }
    let waits =
        futures::future::join_all(handles.iter().map(|h| h.wait_timeout::<u64>(Duration::from_secs(30))));
    let again = handles[1].wait_timeout::<u64>(Duration::from_secs(30));
    let worker = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        start_worker(&config, Probe::default(), 8, Quantum::default()).await
    };
    let (done, again, w) = tokio::join!(waits, again, worker);
    for (r, d) in done.into_iter().enumerate() {
        let r = r as u64;
        let parts = if r % 2 == 0 { 1 } else { 5 };
        let want: Vec<u64> = (0..parts).map(|i| (r * 10 + i) * 2).collect();
        assert_eq!(d.expect("rung, not polled").into_outputs().unwrap(), want, "request {r}");
    }
    assert_eq!(again.expect("rung, not polled").into_outputs().unwrap(), [20, 22, 24, 26, 28]);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_requests_finished_by_one_call_share_an_entry_and_a_cursor_inside_it_resumes_at_the_next() {
    let env = env_on(TOPOLOGY, "evbatch").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    // Queued before the worker starts, so that its batches (growing to 16 with fast handlers)
    // finish several single-part requests per lane_ack.
    let specs = (0..200u64).map(|r| (producer.request(), vec![Job::new(r)]));
    let handles: Vec<_> = producer.submit_many(specs).await.into_iter().map(Result::unwrap).collect();
    let w = start_worker(&env.config, Probe::default(), 2, Quantum::default()).await;
    for h in &handles {
        h.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    }
    w.stop().await;
    let mut listener = Listener::from_beginning(&env.config).await.unwrap();
    let mut events = Vec::new();
    while events.len() < handles.len() {
        events.push(tokio::time::timeout(Duration::from_secs(10), listener.next()).await.unwrap().unwrap());
    }
    let mut ids: Vec<_> = events.iter().map(|e| e.id.clone()).collect();
    ids.sort();
    let mut expected: Vec<_> = handles.iter().map(|h| h.id().clone()).collect();
    expected.sort();
    assert_eq!(ids, expected, "each completion once");
    let inside: Vec<usize> =
        (0..events.len()).filter(|&n| events[n].cursor.to_string().contains('/')).collect();
    assert!(inside.len() >= 10, "few events shared an entry: {} of {}", inside.len(), events.len());
    // From a cursor inside an entry, and from one at an entry's end, a new listener goes on with the
    // very next event, and with all of them.
    let ends = (0..events.len() - 1).filter(|n| !inside.contains(n)).take(3);
    for n in inside.iter().copied().step_by(inside.len() / 8).chain(ends) {
        let cursor: sluicegate::Cursor = events[n].cursor.to_string().parse().unwrap();
        let mut resumed = Listener::resume_after(&env.config, &cursor).await.unwrap();
        for (m, want) in events.iter().enumerate().skip(n + 1) {
            let got = tokio::time::timeout(Duration::from_secs(10), resumed.next()).await.unwrap().unwrap();
            assert_eq!((&got.id, &got.cursor), (&want.id, &want.cursor), "event {m} after cursor {cursor}");
        }
        let extra = tokio::time::timeout(Duration::from_millis(200), resumed.next()).await;
        assert!(extra.is_err(), "nothing after the last event: {extra:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_left_in_the_namespace_once_retention_has_passed() {
    let env = env_on(TOPOLOGY, "leak").await;
    let config = env.config.clone().retention(Duration::from_secs(1));
    let w = start_worker(&config, Probe::default(), 4, Quantum { parts: 3, time: Duration::from_millis(50) })
        .await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = sluicegate::Admin::connect(&config).await.unwrap();
    for r in 0..5u64 {
        let parts = (0..20).map(|i| Job { n: r + i, sleep_ms: 1, fail: i == 7 });
        // Tagged and tracked, so that the listing index's tag and tracked sets are there too.
        let h = producer.request().concurrency(3).unwrap().tag(format!("t{}", r % 2)).unwrap();
        let h = h.submit(parts).await.unwrap();
        if r % 2 == 0 {
            admin.track(h.id(), true).await.unwrap();
        }
        h.wait::<u64>().await.unwrap();
    }
    // And lane requests, one tracked after it finished.
    let small = producer.request().tag("t0").unwrap().submit([Job::new(1)]).await.unwrap();
    small.wait::<u64>().await.unwrap();
    admin.track(small.id(), true).await.unwrap();
    w.stop().await;
    let (url, ns) = (env.redis.url(), config.namespace_str());
    assert_namespace_drains(url, ns, Duration::from_secs(10), "keys left after retention").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_stops_new_takes_holds_across_a_worker_restart_and_a_resume_restarts_them() {
    use sluicegate::{Admin, Priority};
    let env = env_on(TOPOLOGY, "pause").await;
    let admin = Admin::connect(&env.config).await.unwrap();
    let producer = Producer::connect(&env.config).await.unwrap();
    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 4, Quantum::default()).await;
    // The whole namespace: a submit is accepted, and nothing of it starts over many idle polls
    // (100 ms each), nor after the worker is replaced.
    admin.pause(None).await.unwrap();
    let stats = admin.stats().await.unwrap();
    assert!(stats.paused.all, "{:?}", stats.paused);
    let held = producer.request().concurrency(2).unwrap().submit((0..3).map(Job::new)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    w.stop().await;
    let w = start_worker(&env.config, probe.clone(), 4, Quantum::default()).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(probe.starts().is_empty(), "ran while paused: {:?}", probe.starts());
    let status = admin.status(held.id()).await.unwrap();
    assert!(status.paused && status.done == 0, "{status:?}");
    // One priority: the others run, it does not.
    admin.resume(None).await.unwrap();
    admin.pause(Some(Priority::new(90).unwrap())).await.unwrap();
    let urgent = producer.request().priority(90).unwrap().submit([Job::new(7)]).await.unwrap();
    let low = producer.request().priority(10).unwrap().submit([Job::new(8)]).await.unwrap();
    assert_eq!(low.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap().into_outputs().unwrap(), vec![16]);
    held.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let urgent_id = urgent.id().to_string();
    assert!(!probe.starts().iter().any(|(id, _)| *id == urgent_id), "a paused priority ran");
    let stats = admin.stats().await.unwrap();
    assert!(!stats.paused.all && stats.paused.priorities == vec![90], "{:?}", stats.paused);
    assert!(admin.status(urgent.id()).await.unwrap().paused);
    assert!(!admin.status(low.id()).await.unwrap().paused, "a finished request is not paused");
    admin.resume(Some(Priority::new(90).unwrap())).await.unwrap();
    assert_eq!(urgent.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap().into_outputs().unwrap(), vec![14]);
    assert!(admin.stats().await.unwrap().paused.is_empty());
    w.stop().await;
}

/// A request alone on its shard runs on past its quantum's parts (handing its token back would
/// only have it taken again), but a pause still ends the running quantum: the slot does not run on
/// while its shard is paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_runs_on_past_its_quantum_but_a_pause_ends_the_quantum() {
    use sluicegate::Admin;
    let env = env_on(TOPOLOGY, "run-on").await;
    let admin = Admin::connect(&env.config).await.unwrap();
    let producer = Producer::connect(&env.config).await.unwrap();
    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 1, Quantum { parts: 4, time: Duration::from_secs(30) }).await;
    let long = producer.request().own_stream(true).submit((0..400).map(|n| Job::sleeping(n, 5))).await.unwrap();
    let began = Instant::now();
    while probe.starts().len() < 10 {
        assert!(began.elapsed() < Duration::from_secs(20), "the request never got going");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    admin.pause(None).await.unwrap();
    let at_pause = probe.starts().len();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let after = probe.starts().len() - at_pause;
    // At most the rest of the running quantum (4 parts), and a batch being handed out as the
    // pause landed; running on would have started about a hundred.
    assert!(after <= 8, "{after} parts started after the pause: the slot ran on while its shard was paused");
    admin.resume(None).await.unwrap();
    let done = long.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), (0..400).map(|n| n * 2).collect::<Vec<_>>());
    w.stop().await;
}

/// A handler that runs 300 ms (or `run_ms`) unless its context is cancelled first, and logs when each run
/// started and ended (ms since the Unix epoch: the test's Redis runs on this machine's clock).
/// The end is logged when the run's future is dropped, which also catches a run stopped at an
/// await without returning.
#[derive(Clone, Default)]
struct Punctual {
    runs: std::sync::Arc<std::sync::Mutex<Vec<(u64, u64)>>>,
    /// The parts whose run was not cut short.
    done: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
    /// How long a run takes, when not 300 ms.
    run_ms: Option<u64>,
}

fn epoch_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

#[sluicegate::async_trait]
impl sluicegate::Handler for Punctual {
    type Input = u64;
    type Output = u64;

    async fn handle(&self, ctx: sluicegate::Context, n: u64) -> Result<u64, sluicegate::HandlerError> {
        struct Ended(std::sync::Arc<std::sync::Mutex<Vec<(u64, u64)>>>, u64);
        impl Drop for Ended {
            fn drop(&mut self) {
                self.0.lock().unwrap().push((self.1, epoch_ms()));
            }
        }
        let _ended = Ended(self.runs.clone(), epoch_ms());
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(self.run_ms.unwrap_or(300))) => {
                self.done.lock().unwrap().push(n);
                Ok(n)
            }
            _ = ctx.cancelled().cancelled() => Err(sluicegate::HandlerError::new("cancelled")),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_a_request_on_time() {
    let env = env_on(TOPOLOGY, "deadline").await;
    let handler = Punctual::default();
    let w = start_worker(&env.config, handler.clone(), 4, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    let h = producer
        .request()
        .concurrency(4)
        .unwrap()
        // Mid-run: the rounds of 300 ms start about 0, 300, ... 1500 ms after the submit.
        .deadline_in(Duration::from_millis(1650))
        .submit(0..200u64)
        .await
        .unwrap();
    let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.state, RequestState::Failed);
    assert_eq!(done.reason.as_deref(), Some("deadline"));
    let status = admin.status(h.id()).await.unwrap();
    let (dl, finished) = (status.deadline_ms.unwrap(), status.finished_ms.unwrap());
    assert!(finished >= dl && finished <= dl + 250, "finished {} ms after its deadline", finished as i64 - dl as i64);
    assert_eq!(status.reason.as_deref(), Some("deadline"));
    assert!(status.done < 200, "{} parts done", status.done);

    // About 4 slots x 5 rounds of 300 ms ran; every run began before the deadline (the decision
    // to start is taken before it; the handler's first line runs a scheduling delay later) and
    // every run still going at the deadline was stopped within 100 ms of it.
    let runs = handler.runs.lock().unwrap().clone();
    assert!((8..200).contains(&runs.len()), "{} runs", runs.len());
    for (start, end) in &runs {
        assert!(*start <= dl + 10, "a run started {} ms after the deadline", start - dl);
        assert!(*end <= dl + 100, "a run ended {} ms after the deadline", end - dl);
    }
    let ok = done.results.iter().filter(|r| r.is_ok()).count();
    assert!((8..200).contains(&ok), "{ok} parts succeeded");
    // Runs going at the deadline were cut short (a slot's timer may fire a round trip before
    // Redis's clock reaches it: it counts from when its acquire was sent).
    assert!(runs.iter().any(|(start, end)| end - start < 250), "no run was cut short at the deadline");
    for e in done.results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(e.message.contains("deadline"), "{}", e.message);
    }
    // Every run that was not cut short kept its result: the request finished only once the
    // slots still holding batches at the deadline had acked.
    for n in handler.done.lock().unwrap().iter() {
        assert_eq!(done.results[*n as usize], Ok(*n), "part {n} ran to its end");
    }
    // Ended for good: a requeue would end it again at once.
    let refused = admin.requeue_dead(h.id()).await.unwrap_err();
    assert!(refused.to_string().contains("deadline"), "{refused}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_a_request_that_nothing_hands_out_and_spares_one_that_completes() {
    let env = env_on(TOPOLOGY, "deadline_idle").await;
    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 2, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    let second = Duration::from_secs(1);
    // Its parts fail and wait 30 s for a retry: its tokens park, and only recovery's look at
    // the deadline can end it.
    let retrying = producer
        .request()
        .concurrency(2)
        .unwrap()
        .max_attempts(5)
        .unwrap()
        .backoff(Duration::from_secs(30), Duration::from_secs(30))
        .unwrap()
        .deadline_in(second)
        .submit((0..2).map(|n| Job { n, sleep_ms: 0, fail: true }))
        .await
        .unwrap();
    // Delayed past its deadline: it never runs.
    let late = producer
        .request()
        .delay(Duration::from_secs(3))
        .deadline_in(second)
        .submit([Job::new(7)])
        .await
        .unwrap();
    // Done long before its deadline: it completes as any request.
    let quick = producer.request().deadline_in(Duration::from_secs(60)).submit([Job::new(3)]).await.unwrap();
    assert_eq!(quick.wait::<u64>().await.unwrap().reason, None);

    for h in [&retrying, &late] {
        let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
        assert_eq!((done.state, done.reason.as_deref()), (RequestState::Failed, Some("deadline")), "{}", h.id());
        let status = admin.status(h.id()).await.unwrap();
        let (dl, finished) = (status.deadline_ms.unwrap(), status.finished_ms.unwrap());
        assert!(finished >= dl && finished <= dl + 1_000, "{}: finished {} ms after its deadline", h.id(), finished as i64 - dl as i64);
    }
    let done = retrying.wait::<u64>().await.unwrap();
    assert!(done.results.iter().all(|r| r.as_ref().is_err_and(|e| e.message == "job 0 failed on purpose" || e.message == "job 1 failed on purpose")));
    assert!(probe.starts().iter().all(|(id, _)| id != late.id().as_str()), "the delayed request ran");

    // A deadline already passed, or ten years away, is refused before anything is written.
    let past = std::time::SystemTime::now() - Duration::from_secs(1);
    let Err(e) = producer.request().deadline(past).submit([Job::new(1)]).await else { panic!("accepted") };
    assert!(matches!(e, Error::InvalidRequest(ref m) if m.contains("deadline has passed")), "{e}");
    let far = producer.request().deadline_in(Duration::from_secs(11 * 365 * 24 * 3600)).submit([Job::new(1)]).await;
    let Err(e) = far else { panic!("accepted") };
    assert!(e.to_string().contains("deadline"), "{e}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_keeps_the_result_of_every_part_that_ran_to_its_end() {
    // Many slots acking short runs around the deadline: the first ack past it must not fence
    // the others' batches, whose parts ended before their slots' timers fired.
    let env = env_streams(TOPOLOGY, "deadline_acks").await;
    let handler = Punctual { run_ms: Some(2), ..Punctual::default() };
    let a = start_worker(&env.config, handler.clone(), 8, Quantum::default()).await;
    let b = start_worker(&env.config, handler.clone(), 8, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    for round in 0..3 {
        let h = producer
            .request()
            .concurrency(16)
            .unwrap()
            .deadline_in(Duration::from_millis(700))
            .submit(round * 100_000..round * 100_000 + 20_000u64)
            .await
            .unwrap();
        let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.reason.as_deref(), Some("deadline"));
        let ran: Vec<u64> = handler.done.lock().unwrap().iter().copied().filter(|n| n / 100_000 == round).collect();
        let ok = done.results.iter().filter(|r| r.is_ok()).count();
        assert!(!ran.is_empty() && ok < 20_000, "{ok} results");
        let lost: Vec<&u64> = ran.iter().filter(|n| done.results[(**n % 100_000) as usize].is_err()).collect();
        assert!(lost.is_empty(), "{} of {} parts ran to their end but have no result: {lost:?}", lost.len(), ran.len());
    }
    a.stop().await;
    b.stop().await;
}
