// The body of the tenant group tests in tests/integration/workflows.rs: written once, run against a single
// Redis and a 3-master Redis Cluster. A group's limit holds across all its requests, also through
// a worker's crash, and groups with work take turns.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use sluicegate::{async_trait, Admin, Context, Handler, HandlerError, Producer, Quantum, RequestState};

use crate::support::{env_streams, fast, start_worker, OnDrop};

/// What ran, by group (the request id's prefix before its first '-').
#[derive(Default)]
struct Seen {
    /// group -> (running now, most running at once)
    running: HashMap<String, (u32, u32)>,
    /// group -> parts done
    done: HashMap<String, u64>,
}

#[derive(Clone, Default)]
struct ByGroup {
    seen: Arc<Mutex<Seen>>,
}

impl ByGroup {
    fn most(&self, group: &str) -> u32 {
        self.seen.lock().unwrap().running.get(group).map_or(0, |r| r.1)
    }
    fn done(&self, group: &str) -> u64 {
        self.seen.lock().unwrap().done.get(group).copied().unwrap_or(0)
    }
}

#[async_trait]
impl Handler for ByGroup {
    type Input = u64;
    type Output = u64;

    async fn handle(&self, ctx: Context, sleep_ms: u64) -> Result<u64, HandlerError> {
        let id = ctx.request_id().to_string();
        let group = id.split('-').next().unwrap_or_default().to_owned();
        {
            let mut s = self.seen.lock().unwrap();
            let r = s.running.entry(group.clone()).or_default();
            r.0 += 1;
            r.1 = r.1.max(r.0);
        }
        // Left when the run ends, or is dropped with a crashed worker (which aborts its handlers).
        let (seen, left) = (self.seen.clone(), group.clone());
        let running = OnDrop::new(move || {
            let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
            s.running.get_mut(&left).expect("entered before").0 -= 1;
        });
        tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
        drop(running);
        *self.seen.lock().unwrap().done.entry(group).or_default() += 1;
        Ok(sleep_ms)
    }
}

/// Waits until `admin.group(name)` holds and queues none of its tokens: every one parked, as many
/// as its limit (no token lost, none too many).
async fn assert_group_settles(admin: &Admin, name: &str, limit: u32) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let g = admin.group(name).await.unwrap();
        if g.held == 0 && g.queued == 0 && g.parked == limit && g.waiting.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "group {name} never settled: {g:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Five requests of concurrency 4 in a group of limit 3, on 3 token shards, run by a worker of 16
/// slots: never more than 3 of the group's parts run at once (and 3 do), while a request outside
/// the group runs beside them. A second worker crashes holding the group's tokens: the limit
/// still holds, everything completes, and the group's tokens all come back, none lost, none
/// made (`Admin::group`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_limit_holds_across_requests_and_through_a_crash() {
    let env = env_streams(TOPOLOGY, "group-limit").await;
    let config = fast(&env.config).token_shards(3);
    let admin = Admin::connect(&config).await.unwrap();
    admin.set_group("g", 3).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let mut handles = Vec::new();
    for i in 0..5 {
        let id = format!("g-{i}");
        let r = producer.request().id(id).unwrap().group("g").unwrap().concurrency(4).unwrap();
        handles.push(r.submit(std::iter::repeat(40u64).take(12)).await.unwrap());
    }
    let free = producer.request().id("free-0").unwrap().concurrency(4).unwrap();
    let free = free.submit(std::iter::repeat(40u64).take(12)).await.unwrap();
    let probe = ByGroup::default();
    // The crashing worker first: it takes the group's tokens and dies holding them.
    let doomed = start_worker(&config, probe.clone(), 16, Quantum { parts: 2, time: Duration::from_secs(1) }).await;
    tokio::time::sleep(Duration::from_millis(60)).await;
    doomed.crash();
    let w = start_worker(&config, probe.clone(), 16, Quantum::default()).await;
    for h in handles.iter().chain([&free]) {
        let done = h.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
        assert_eq!(done.state, RequestState::Completed, "{}: {:?}", h.id(), done.reason);
    }
    assert!(probe.most("g") <= 3, "the group ran {} parts at once, over its limit of 3", probe.most("g"));
    assert_eq!(probe.most("g"), 3, "the group never used its limit");
    assert_eq!(probe.most("free"), 4);
    assert_group_settles(&admin, "g", 3).await;
    let g = admin.group("g").await.unwrap();
    assert!(g.configured);
    // A raised limit adds tokens at once; a lowered one retires the parked ones.
    admin.set_group("g", 5).await.unwrap();
    assert_group_settles(&admin, "g", 5).await;
    admin.set_group("g", 2).await.unwrap();
    assert_group_settles(&admin, "g", 2).await;
    assert!(admin.groups().await.unwrap().iter().any(|g| g.name == "g" && g.limit == 2));
    w.stop().await;
}

/// Bad group names and limits are refused with errors that say why; a request in a group keeps
/// its priority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_groups_are_refused_and_a_grouped_request_keeps_its_priority() {
    let env = env_streams(TOPOLOGY, "group-bad").await;
    let admin = Admin::connect(&env.config).await.unwrap();
    let producer = Producer::connect(&env.config).await.unwrap();
    for bad in ["", "a b", "x|y", &"n".repeat(65)] {
        let e = producer.request().group(bad).err().expect("refused");
        assert!(e.to_string().contains("group name"), "{e}");
        assert!(admin.set_group(bad, 3).await.unwrap_err().to_string().contains("group name"));
    }
    for bad in [0, 10_001] {
        let e = admin.set_group("ok", bad).await.unwrap_err();
        assert!(e.to_string().contains("group limit"), "{e}");
    }
    // A group with only a rate set is listed, with it.
    admin.set_group_rate("only-rate", Some((5, Duration::from_secs(1)))).await.unwrap();
    let listed = admin.groups().await.unwrap();
    let g = listed.iter().find(|g| g.name == "only-rate").expect("listed");
    assert_eq!((g.rate.map(|r| (r.n, r.per_ms)), g.configured), (Some((5, 1_000)), false));
    let h = producer.request().group("t").unwrap().submit([1u64]).await.unwrap();
    let e = admin.reprioritize(h.id(), sluicegate::Priority::new(50).unwrap()).await.unwrap_err();
    assert!(e.to_string().contains("tenant group"), "{e}");
    // Nothing else broke: the request still runs.
    let w = start_worker(&env.config, ByGroup::default(), 2, Quantum::default()).await;
    let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.state, RequestState::Completed);
    w.stop().await;
}

/// Tenant `a` queues 1,000 single-part requests, then tenant `b` one request of 600 parts; both
/// groups have limit 4, the worker 4 slots and a quantum of one part, so slots are what they
/// compete for. While both have work, they take turns: their parts done stay within 20% of each
/// other, although `b`'s request came after all of `a`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_take_turns_whatever_their_backlogs() {
    let env = env_streams(TOPOLOGY, "group-fair").await;
    let config = env.config.clone();
    let admin = Admin::connect(&config).await.unwrap();
    admin.set_group("a", 4).await.unwrap();
    admin.set_group("b", 4).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let submits = futures::stream::iter(0..1000).map(|i| {
        let producer = producer.clone();
        async move {
            let r = producer.request().id(format!("a-{i}")).unwrap().group("a").unwrap();
            r.submit([5u64]).await.unwrap()
        }
    });
    let a: Vec<_> = submits.buffer_unordered(32).collect().await;
    let b = producer.request().id("b-0").unwrap().group("b").unwrap().concurrency(8).unwrap();
    let b = b.submit(std::iter::repeat(5u64).take(600)).await.unwrap();
    // Every request token waits (in its group's queue) and the stats say so: the groups' own
    // tokens on the shard's lists are not counted for them.
    let stats = admin.stats().await.unwrap();
    let waiting: u64 = stats.tokens_waiting.iter().map(|p| p.tokens).sum();
    assert_eq!((waiting, stats.tally.token_capacity, stats.tally.tokens_parked), (1008, 1008, 0));
    let probe = ByGroup::default();
    let w = start_worker(&config, probe.clone(), 4, Quantum { parts: 1, time: Duration::from_secs(1) }).await;
    // Measure while both have a backlog: until one of them has done 300 parts.
    let deadline = Instant::now() + Duration::from_secs(120);
    while probe.done("a") < 300 && probe.done("b") < 300 {
        assert!(Instant::now() < deadline, "too slow: a {} b {}", probe.done("a"), probe.done("b"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (da, db) = (probe.done("a") as f64, probe.done("b") as f64);
    assert!(
        (da - db).abs() <= 0.2 * da.max(db),
        "tenants did not take turns: a did {da} parts, b {db}"
    );
    assert!(probe.most("a") <= 4 && probe.most("b") <= 4);
    let done = b.wait_timeout::<u64>(Duration::from_secs(120)).await.unwrap();
    assert_eq!(done.state, RequestState::Completed);
    for h in a.iter().take(5) {
        assert_eq!(h.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap().state, RequestState::Completed);
    }
    w.stop().await;
}

/// A group token whose take record is lost (the shard's records expired, or a failover lost them)
/// stays with its live slot: recovery's audit does not hand it out again while that worker lives,
/// so the limit holds; once the worker is gone, the audit gives it back and the group's work goes
/// on in another worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_token_whose_record_is_lost_stays_with_its_live_slot_and_comes_back_when_it_dies() {
    use fred::prelude::{Builder, ClientLike, Config as FredConfig, KeysInterface};

    let env = env_streams(TOPOLOGY, "group-lost").await;
    let config = fast(&env.config).census_interval(Duration::from_millis(300));
    let admin = Admin::connect(&config).await.unwrap();
    admin.set_group("lost", 1).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let r = producer.request().id("lost-0").unwrap().group("lost").unwrap().concurrency(2).unwrap();
    let h = r.submit(std::iter::repeat(700u64).take(4)).await.unwrap();
    let probe = ByGroup::default();
    let first = start_worker(&config, probe.clone(), 2, Quantum { parts: 1, time: Duration::from_secs(1) }).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while probe.done("lost") == 0 && probe.most("lost") == 0 {
        assert!(Instant::now() < deadline, "the group's first part never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The shard's take records go, as if they had expired.
    let redis = Builder::from_config(FredConfig::from_url(env.redis.url()).unwrap()).build().unwrap();
    redis.init().await.unwrap();
    let ns = config.namespace_str();
    let () = redis.del(format!("{ns}:{{{ns}.q0}}:held")).await.unwrap();
    // A second worker, and several audits, while the first lives: the group's one token stays
    // where it is.
    let second = start_worker(&config, probe.clone(), 2, Quantum::default()).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(probe.most("lost"), 1, "the lost record's group token was handed out again");
    let g = admin.group("lost").await.unwrap();
    assert_eq!((g.held, g.queued + g.parked), (1, 0), "{g:?}");
    // The first worker dies: once it is gone, the token comes back and the second finishes.
    first.crash();
    let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.state, RequestState::Completed, "{:?}", done.reason);
    assert_eq!(probe.most("lost"), 1);
    assert_group_settles(&admin, "lost", 1).await;
    second.stop().await;
}
