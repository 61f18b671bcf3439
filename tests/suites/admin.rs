// The body of tests/integration/admin.rs: written once, run against a single Redis and a 3-master Redis
// Cluster (`per_topology!` runs it once for each).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluicegate::{
    async_trait, Admin, Cancelled, Context, Handler, HandlerError, Listener, Producer, Quantum, RequestState,
};
use crate::support::{env_on, fast, start_worker, Job, Probe};


#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_counts_errors_and_timings() {
    let env = env_on(TOPOLOGY, "status").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let parts = (0..6).map(|n| Job { n, sleep_ms: 0, fail: n % 3 == 0 });
    let h = producer.request().priority(70).unwrap().concurrency(2).unwrap().submit(parts).await.unwrap();
    let queued = admin.status(h.id()).await.unwrap();
    assert_eq!(
        (queued.state, queued.total, queued.done, queued.priority, queued.concurrency),
        (RequestState::Queued, 6, 0, 70, 2)
    );
    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    h.wait::<u64>().await.unwrap();
    let s = admin.status(h.id()).await.unwrap();
    assert_eq!((s.state, s.done, s.failed, s.running), (RequestState::Failed, 6, 2, 0));
    assert_eq!(s.errors.iter().map(|e| e.index).collect::<Vec<_>>(), [0, 3]);
    assert!(s.started_ms.is_some() && s.finished_ms >= s.started_ms && s.started_ms >= Some(s.created_ms));
    let err = admin.status(&sluicegate::RequestId::new("nope").unwrap()).await.unwrap_err();
    assert!(matches!(err, sluicegate::Error::UnknownRequest(_)), "{err}");
    w.stop().await;
}

/// Records starts, and whether a running handler saw its context cancelled.
#[derive(Clone, Default)]
struct Watcher {
    starts: Arc<Mutex<Vec<Instant>>>,
    saw_cancel: Arc<AtomicBool>,
}

#[async_trait]
impl Handler for Watcher {
    type Input = Job;
    type Output = u64;
    async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
        self.starts.lock().unwrap().push(Instant::now());
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(job.sleep_ms)) => Ok(job.n),
            _ = ctx.cancelled().cancelled() => {
                self.saw_cancel.store(true, Ordering::SeqCst);
                Err(HandlerError::new("cancelled"))
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_run_stops_new_starts_signals_running_handlers_and_records_once() {
    let env = env_on(TOPOLOGY, "cancel").await;
    let config = fast(&env.config);
    let mut listener = Listener::connect(&config).await.unwrap();
    let watcher = Watcher::default();
    let w = start_worker(&config, watcher.clone(), 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    // The first parts run long, so a handler is surely running when the cancel lands.
    let parts = (0..40).map(|n| Job::sleeping(n, if n < 2 { 3_000 } else { 50 }));
    let h = producer.request().concurrency(2).unwrap().submit(parts).await.unwrap();
    while watcher.starts.lock().unwrap().len() < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(h.cancel().await.unwrap(), Cancelled::Now);
    let cancelled_at = Instant::now();
    assert_eq!(h.cancel().await.unwrap(), Cancelled::AlreadyFinished(RequestState::Cancelled));

    let done = h.wait::<u64>().await.unwrap();
    assert_eq!(done.state, RequestState::Cancelled);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(watcher.saw_cancel.load(Ordering::SeqCst), "running handlers see their context cancelled");
    let late = watcher.starts.lock().unwrap().iter().filter(|t| **t > cancelled_at).count();
    assert_eq!(late, 0, "no handler starts after the cancel");
    let event = tokio::time::timeout(Duration::from_secs(5), listener.next()).await.unwrap().unwrap();
    assert_eq!((event.id.as_str(), event.state), (h.id().as_str(), RequestState::Cancelled));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), listener.next()).await.is_err(),
        "one event only"
    );
    w.stop().await;
}

/// Fails index 1 permanently while `broken` is set.
/// Fails the parts `fails` picks (by their index and input) permanently while `broken` holds;
/// doubles the rest.
#[derive(Clone)]
struct Fragile {
    broken: Arc<AtomicBool>,
    fails: fn(u64, &Job) -> bool,
}

#[async_trait]
impl Handler for Fragile {
    type Input = Job;
    type Output = u64;
    async fn handle(&self, ctx: Context, job: Job) -> Result<u64, HandlerError> {
        if (self.fails)(ctx.index(), &job) && self.broken.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent("broken"));
        }
        Ok(job.n * 2)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeued_dead_letters_complete_a_failed_request() {
    let env = env_on(TOPOLOGY, "requeue").await;
    let config = fast(&env.config);
    let broken = Arc::new(AtomicBool::new(true));
    let w = start_worker(&config, Fragile { broken: broken.clone(), fails: |index, _| index == 1 }, 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let h = producer.request().concurrency(2).unwrap().submit((0..4).map(Job::new)).await.unwrap();
    let first = h.wait::<u64>().await.unwrap();
    assert_eq!(first.state, RequestState::Failed);

    broken.store(false, Ordering::SeqCst);
    assert_eq!(admin.requeue_dead(h.id()).await.unwrap(), 1);
    let done = completed_again(&admin, &h).await;
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4, 6]);
    assert_eq!(admin.status(h.id()).await.unwrap().failed, 0);
    let err = admin.requeue_dead(h.id()).await.unwrap_err();
    assert!(err.to_string().contains("no dead letters"), "{err}");
    w.stop().await;
}

/// A streamed request that fails fast before its finalize refuses its producer from then on (its
/// adds and its finalize): requeued, it runs the parts it has and completes with them, rather than
/// wait for a finalize that will not come (it stayed running for ever, `open`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeued_streamed_request_that_failed_fast_before_its_finalize_completes() {
    let env = env_on(TOPOLOGY, "requeue-open").await;
    let config = fast(&env.config);
    let broken = Arc::new(AtomicBool::new(true));
    let w = start_worker(&config, Fragile { broken: broken.clone(), fails: |index, _| index == 1 }, 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let mut open = producer.request().concurrency(2).unwrap().fail_fast(true).open().await.unwrap();
    open.add((0..4).map(Job::new)).await.unwrap();
    let h = open.handle().clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin.status(h.id()).await.unwrap().state != RequestState::Failed {
        assert!(Instant::now() < deadline, "the request did not fail fast");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(open.add([Job::new(4)]).await.is_err(), "a failed request took more parts");

    broken.store(false, Ordering::SeqCst);
    assert_eq!(admin.requeue_dead(h.id()).await.unwrap(), 1);
    let done = completed_again(&admin, &h).await;
    assert_eq!(done.into_outputs().unwrap(), [0, 2, 4, 6]);
    w.stop().await;
}

/// The completion of a request whose dead letters were requeued (its handle may still read the
/// failure it replaces for a moment), within 10 s.
async fn completed_again(admin: &Admin, h: &sluicegate::RequestHandle) -> sluicegate::Completion<u64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(done) = h.try_completion::<u64>().await.unwrap() {
            if done.state == RequestState::Completed {
                return done;
            }
        }
        let status = admin.status(h.id()).await.unwrap();
        assert!(Instant::now() < deadline, "the requeued request did not complete: {status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_show_waiting_tokens_active_requests_and_live_workers() {
    let env = env_on(TOPOLOGY, "stats").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let a = producer
        .request()
        .priority(80)
        .unwrap()
        .concurrency(3)
        .unwrap()
        .submit((0..5).map(Job::new))
        .await
        .unwrap();
    let b = producer
        .request()
        .priority(20)
        .unwrap()
        .concurrency(2)
        .unwrap()
        .submit((0..5).map(Job::new))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s = admin.stats().await.unwrap();
    let waiting: Vec<(u8, u64)> = s.tokens_waiting.iter().map(|p| (p.priority, p.tokens)).collect();
    assert_eq!(waiting, [(80, 3), (20, 2)]);
    assert!(s.tokens_waiting.iter().all(|p| (150..60_000).contains(&p.oldest_waiting_ms)), "{:?}", s.tokens_waiting);
    assert_eq!((s.active_requests, s.workers.len(), s.tokens_held), (2, 0, 0));
    assert_eq!((s.requests.unfinished, s.requests.completed), (2, 0));
    // Every token the records own is waiting, held or parked (the small requests ride their
    // priority's lane: its idle tokens are parked).
    let waiting: u64 = s.tokens_waiting.iter().map(|p| p.tokens).sum();
    let t = s.tally.clone();
    assert_eq!(t.token_capacity, waiting + s.tokens_held + t.tokens_parked, "{t:?}");
    assert!(t.token_capacity >= 5 && t.dead_letters == 0 && t.complete, "{t:?}");
    assert!(s.redis_memory_bytes > 100_000, "{}", s.redis_memory_bytes);
    // A streamed request's tokens are parked until its parts come.
    let open = producer.request().concurrency(4).unwrap().open().await.unwrap();
    let s = admin.stats().await.unwrap();
    assert_eq!((s.tally.token_capacity, s.tally.tokens_parked), (t.token_capacity + 4, t.tokens_parked + 4));
    open.handle().cancel().await.unwrap();

    let w = start_worker(&config, Probe::default(), 3, Quantum::default()).await;
    a.wait::<u64>().await.unwrap();
    b.wait::<u64>().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = admin.stats().await.unwrap();
    assert_eq!(s.active_requests, 0);
    assert_eq!((s.requests.unfinished, s.requests.completed, s.requests.failed), (0, 2, 0));
    // Its three slots and its urgent one (`WorkerBuilder::urgent`).
    assert_eq!(s.workers.iter().map(|w| w.slots).collect::<Vec<_>>(), [4]);
    w.stop().await;
    assert!(admin.stats().await.unwrap().workers.is_empty(), "a stopped worker unregisters");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_lists_each_dead_letters_error_and_payload_for_lane_and_own_stream_requests() {
    let env = env_on(TOPOLOGY, "dead").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let parts = || (0..5).map(|n| Job { n, sleep_ms: 0, fail: n % 2 == 1 });
    let lane = producer.request().submit(parts()).await.unwrap();
    let own = producer.request().own_stream(true).submit(parts()).await.unwrap();
    let fine = producer.request().submit([Job::new(9)]).await.unwrap();
    for h in [&lane, &own, &fine] {
        h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    }
    for h in [&lane, &own] {
        let dead = admin.dead(h.id()).await.unwrap();
        let seen: Vec<(u64, Job, u32)> = dead
            .iter()
            .map(|d| (d.index, sluicegate::codec::decode::<Job>(&d.payload).unwrap(), d.error.attempts))
            .collect();
        assert_eq!(seen, vec![(1, Job { n: 1, sleep_ms: 0, fail: true }, 1), (3, Job { n: 3, sleep_ms: 0, fail: true }, 1)]);
        assert!(dead.iter().all(|d| d.error.message == format!("job {} failed on purpose", d.index)), "{dead:?}");
    }
    assert!(admin.dead(fine.id()).await.unwrap().is_empty());
    // The failed requests' dead letters, both kinds, count while they are retained.
    let tally = admin.stats().await.unwrap().tally;
    assert_eq!(tally.dead_letters, 4, "{tally:?}");
    let unknown = admin.dead(&sluicegate::RequestId::new("never").unwrap()).await.unwrap_err();
    assert!(matches!(unknown, sluicegate::Error::UnknownRequest(_)), "{unknown}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_of_a_namespace_is_refused_while_workers_run_and_then_leaves_no_key_of_it() {
    use sluicegate_testkit::keys_in_namespace;
    let env = env_on(TOPOLOGY, "purge").await;
    let config = fast(&env.config);
    // A neighbour whose name starts with ours keeps its keys.
    let neighbour = config.clone().namespace(format!("{}x", config.namespace_str()));
    let kept = Producer::connect(&neighbour).await.unwrap().request().submit([Job::new(1)]).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let done = producer.request().submit((0..3).map(Job::new)).await.unwrap();
    let failed = producer.request().own_stream(true).submit([Job { n: 1, sleep_ms: 0, fail: true }]).await.unwrap();
    done.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    failed.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    let err = admin.purge_namespace(false).await.unwrap_err();
    assert!(matches!(err, sluicegate::Error::Refused(_)) && err.to_string().contains("1 worker(s) are registered"), "{err}");
    w.stop().await;
    admin.pause(None).await.unwrap();
    producer.request().concurrency(2).unwrap().submit((0..100).map(Job::new)).await.unwrap();
    let ns = config.namespace_str();
    assert!(!keys_in_namespace(env.redis.url(), ns).await.unwrap().is_empty());
    let deleted = admin.purge_namespace(false).await.unwrap();
    assert!(deleted > 5, "{deleted}");
    let left = keys_in_namespace(env.redis.url(), ns).await.unwrap();
    assert!(left.is_empty(), "keys left after the purge: {left:?}");
    assert!(!keys_in_namespace(env.redis.url(), neighbour.namespace_str()).await.unwrap().is_empty());
    let status = Admin::connect(&neighbour).await.unwrap().status(kept.id()).await.unwrap();
    assert_eq!(status.total, 1);
}

/// Ten thousand queued requests, tagged and at two priorities: pages of the listing walk them all
/// newest first, each page reading a bounded part of the index, and the filters find exactly theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_pages_and_filters_ten_thousand_requests_through_the_index() {
    use futures::StreamExt;
    use sluicegate::{ListQuery, ListState, Priority};
    let env = env_on(TOPOLOGY, "list").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    const N: u64 = 10_000;
    let submitted: Vec<String> = futures::stream::iter(0..N)
        .map(|n| {
            let producer = producer.clone();
            async move {
                let mut r = producer.request().priority(if n % 4 == 0 { 20 } else { 10 }).unwrap();
                r = r.tag(if n % 2 == 0 { "even" } else { "odd" }).unwrap();
                if n % 1000 == 0 {
                    r = r.tag("thousand").unwrap();
                }
                r.submit([Job::new(n)]).await.unwrap().id().to_string()
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    assert_eq!(submitted.len() as u64, N);

    // One page of 100 of 10,000 reads 100 entries per index set, not the whole index.
    let first = admin.list(&ListQuery::new()).await.unwrap();
    assert_eq!(first.requests.len(), 100);
    // (100 rows from each of the four state sets of each shard at most.)
    assert!(first.looked_at <= 1200, "{}", first.looked_at);

    // Every request once, newest first, over pages of 1,000.
    let mut seen = std::collections::HashSet::new();
    let mut cursor = None;
    let mut last_ms = i64::MAX;
    loop {
        let mut q = ListQuery::new().limit(1000);
        if let Some(c) = cursor.take() {
            q = q.cursor(c);
        }
        let page = admin.list(&q).await.unwrap();
        for r in &page.requests {
            assert!(r.submitted_ms <= last_ms, "not newest first");
            last_ms = r.submitted_ms;
            assert!(seen.insert(r.id.clone()), "{} listed twice", r.id);
            assert_eq!(r.state, RequestState::Queued);
            assert_eq!((r.total, r.done), (1, 0));
        }
        match page.cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen.len() as u64, N);

    let count = |q: ListQuery| {
        let admin = admin.clone();
        async move {
            let mut n = 0usize;
            let mut q = q.limit(1000);
            loop {
                let page = admin.list(&q).await.unwrap();
                n += page.requests.len();
                match page.cursor {
                    Some(c) => q = q.cursor(c),
                    None => return n,
                }
            }
        }
    };
    assert_eq!(count(ListQuery::new().tag("even")).await, 5000);
    assert_eq!(count(ListQuery::new().tag("thousand")).await, 10);
    assert_eq!(count(ListQuery::new().priority(Priority::new(20).unwrap())).await, 2500);
    assert_eq!(count(ListQuery::new().tag("even").priority(Priority::new(20).unwrap())).await, 2500);
    assert_eq!(count(ListQuery::new().state(ListState::Queued)).await, 10_000);
    assert_eq!(count(ListQuery::new().state(ListState::Completed)).await, 0);
    assert_eq!(count(ListQuery::new().older_than(Duration::from_secs(3600))).await, 0);
    let tagged = admin.list(&ListQuery::new().tag("thousand")).await.unwrap();
    assert!(tagged.requests.iter().all(|r| r.tags == ["even", "thousand"] && r.priority == 20), "{:?}", tagged.requests);

    // Tracking.
    let id = sluicegate::RequestId::new(tagged.requests[0].id.as_str()).unwrap();
    admin.track(&id, true).await.unwrap();
    let tracked = admin.list(&ListQuery::new().tracked()).await.unwrap();
    assert_eq!(tracked.requests.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), [id.as_str()]);
    assert!(tracked.requests[0].tracked && admin.status(&id).await.unwrap().tracked);
    admin.track(&id, false).await.unwrap();
    assert!(admin.list(&ListQuery::new().tracked()).await.unwrap().requests.is_empty());
    let unknown = admin.track(&sluicegate::RequestId::new("never").unwrap(), true).await.unwrap_err();
    assert!(matches!(unknown, sluicegate::Error::UnknownRequest(_)), "{unknown}");
    let bad = admin.list(&ListQuery::new().cursor("garbage")).await.unwrap_err();
    assert!(bad.to_string().contains("not a list cursor"), "{bad}");
}

/// Queued small requests are found in their lanes (they are listed as live only once handed out):
/// every one once, newest first, whatever the page size, with the ones submitted together in one
/// millisecond told apart, the unlisted and the cancelled left out, and the same after some were
/// tracked (which lists them as live) and after a worker ran some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_lane_requests_list_from_their_lanes_once_each_newest_first() {
    use sluicegate::{ListQuery, ListState, Priority};
    let env = env_on(TOPOLOGY, "lanelist").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let mut listed = Vec::new();
    for round in 0..6u64 {
        // One at a time (a millisecond each, or a few sharing one), then 50 in one call (all in
        // the same millisecond), then unlisted ones between them.
        for n in 0..20 {
            let prio = if n % 3 == 0 { 20 } else { 10 };
            let h = producer.request().priority(prio).unwrap().submit([Job::new(n)]).await.unwrap();
            listed.push(h);
        }
        let batch = (0..50u64).map(|n| (producer.request().priority(10).unwrap(), vec![Job::new(round * 100 + n)]));
        for h in producer.submit_many(batch).await {
            listed.push(h.unwrap());
        }
        for n in 0..10 {
            producer.request().unlisted().priority(10).unwrap().submit([Job::new(n)]).await.unwrap();
        }
    }
    // Cancelled while queued: listed as cancelled, not live.
    let cancelled: Vec<_> = listed.iter().step_by(17).map(|h| h.id().to_string()).collect();
    for h in listed.iter().step_by(17) {
        admin.cancel(h.id()).await.unwrap();
    }
    let expect: std::collections::HashSet<String> =
        listed.iter().map(|h| h.id().to_string()).filter(|id| !cancelled.contains(id)).collect();
    let all = |q: ListQuery| list_all(&admin, q);
    let check = |ids: Vec<String>, want: &std::collections::HashSet<String>, what: &str| {
        let n = ids.len();
        let got: std::collections::HashSet<String> = ids.into_iter().collect();
        assert_eq!(got.len(), n, "{what}: a request listed twice");
        assert_eq!(&got, want, "{what}");
    };
    for size in [1, 7, 64, 1000] {
        check(all(ListQuery::new().state(ListState::Queued).limit(size)).await, &expect, &format!("pages of {size}"));
    }
    check(all(ListQuery::new().limit(9)).await, &listed.iter().map(|h| h.id().to_string()).collect(), "every state");
    let at_20: std::collections::HashSet<String> = listed
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 70 < 20 && (i % 70) % 3 == 0)
        .map(|(_, h)| h.id().to_string())
        .collect();
    check(all(ListQuery::new().priority(Priority::new(20).unwrap()).limit(5)).await, &at_20, "priority 20");
    let queued_at_20 = at_20.iter().filter(|id| !cancelled.contains(*id)).cloned().collect();
    let q = ListQuery::new().state(ListState::Queued).priority(Priority::new(20).unwrap()).limit(3);
    check(all(q).await, &queued_at_20, "queued at priority 20");
    assert_eq!(admin.stats().await.unwrap().requests.unfinished, expect.len() as u64);

    // Tracked while queued: listed as live from the index now, once.
    for h in listed.iter().skip(1).step_by(23) {
        admin.track(h.id(), true).await.unwrap();
    }
    check(all(ListQuery::new().state(ListState::Queued).limit(11)).await, &expect, "after tracking");
    assert_eq!(admin.stats().await.unwrap().requests.unfinished, expect.len() as u64);

    // A worker runs them all: none is live any more, each is completed once.
    let w = start_worker(&config, Probe::default(), 4, Quantum::default()).await;
    for h in &listed {
        h.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    }
    w.stop().await;
    check(all(ListQuery::new().state(ListState::Queued).limit(50)).await, &Default::default(), "all done");
    check(all(ListQuery::new().state(ListState::Completed).limit(50)).await, &expect, "completed");
    let counts = admin.stats().await.unwrap().requests;
    assert_eq!((counts.unfinished, counts.completed), (0, expect.len() as u64), "{counts:?}");
}

/// Every page of `q`, followed by its cursor: the ids listed, checked newest first.
async fn list_all(admin: &Admin, mut q: sluicegate::ListQuery) -> Vec<String> {
    let (mut ids, mut last_ms) = (Vec::new(), i64::MAX);
    loop {
        let page = admin.list(&q).await.unwrap();
        for r in &page.requests {
            assert!(r.submitted_ms <= last_ms, "not newest first");
            last_ms = r.submitted_ms;
            ids.push(r.id.clone());
        }
        match page.cursor {
            Some(c) => q = q.cursor(c),
            None => return ids,
        }
    }
}

/// A lane walk that passes over more than 10,000 entries it does not show (here unlisted queued
/// requests between two groups of listed ones) ends its page where it stopped, and the next page
/// goes on from there: every listed request is shown once, none is skipped, and the requests of
/// another lane older than where the walk stopped wait for a later page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_walk_past_ten_thousand_hidden_entries_pages_on_from_where_it_stopped() {
    use sluicegate::{ListQuery, ListState};
    let env = env_on(TOPOLOGY, "lanefloor").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let mut listed = std::collections::HashSet::new();
    let submit_listed = |n: u64, priority: u8| {
        let producer = producer.clone();
        async move { producer.request().priority(priority).unwrap().submit([Job::new(n)]).await.unwrap().id().to_string() }
    };
    for (n, priority) in (0..60).map(|n| (n, if n < 30 { 10 } else { 20 })) {
        listed.insert(submit_listed(n, priority).await);
    }
    let hidden = (0..10_300u64).map(|n| (producer.request().unlisted().priority(10).unwrap(), vec![Job::new(n)]));
    assert!(producer.submit_many(hidden).await.iter().all(Result::is_ok));
    for (n, priority) in (0..60).map(|n| (n, if n < 30 { 10 } else { 20 })) {
        listed.insert(submit_listed(n, priority).await);
    }
    for limit in [7, 1000] {
        let (mut shown, mut q, mut pages) = (Vec::new(), ListQuery::new().state(ListState::Queued).limit(limit), 0);
        loop {
            let page = admin.list(&q).await.unwrap();
            shown.extend(page.requests.iter().map(|r| r.id.clone()));
            pages += 1;
            match page.cursor {
                Some(c) => q = q.cursor(c),
                None => break,
            }
            assert!(pages < 100, "no end after 100 pages: {} shown", shown.len());
        }
        let n = shown.len();
        let got: std::collections::HashSet<String> = shown.into_iter().collect();
        assert_eq!(got.len(), n, "pages of {limit}: a request shown twice");
        assert_eq!(got, listed, "pages of {limit}");
    }
    assert_eq!(admin.stats().await.unwrap().requests.unfinished, 120);
}

/// Finished requests move to their state's set; purge of one leaves no key of it, purge of a
/// state by age takes only those, and a live request is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_requests_list_by_state_and_purge_leaves_no_key_of_them() {
    use sluicegate::{ListQuery, ListState};
    use sluicegate_testkit::keys_in_namespace;
    let env = env_on(TOPOLOGY, "listpurge").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let fails = |n| Job { n, sleep_ms: 0, fail: true };
    let ok_lane = producer.request().tag("t").unwrap().submit([Job::new(1)]).await.unwrap();
    let ok_own = producer.request().own_stream(true).submit((0..3).map(Job::new)).await.unwrap();
    let bad_lane = producer.request().submit([fails(1)]).await.unwrap();
    let bad_own = producer.request().own_stream(true).submit([fails(2), Job::new(3)]).await.unwrap();
    for h in [&ok_lane, &ok_own, &bad_lane, &bad_own] {
        h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    }
    w.stop().await;
    let ids = |page: sluicegate::ListPage| {
        let mut v: Vec<String> = page.requests.into_iter().map(|r| r.id).collect();
        v.sort();
        v
    };
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let completed = admin.list(&ListQuery::new().state(ListState::Completed)).await.unwrap();
    assert!(completed.requests.iter().all(|r| r.done == r.total && r.failed == 0));
    assert_eq!(ids(completed), sorted(vec![ok_lane.id().to_string(), ok_own.id().to_string()]));
    let failed = admin.list(&ListQuery::new().state(ListState::Failed)).await.unwrap();
    assert_eq!(ids(failed), sorted(vec![bad_lane.id().to_string(), bad_own.id().to_string()]));
    let live = producer.request().submit([Job::new(7)]).await.unwrap();
    let refused = admin.purge(live.id()).await.unwrap_err();
    assert!(matches!(refused, sluicegate::Error::Refused(_)) && refused.to_string().contains("cancel it first"), "{refused}");

    // Purge one: none of its keys is left, and it is no longer listed.
    let key_id = ok_own.id().key_id();
    assert!(admin.purge(ok_own.id()).await.unwrap());
    let ns = config.namespace_str();
    let left: Vec<String> =
        keys_in_namespace(env.redis.url(), ns).await.unwrap().into_iter().filter(|k| k.contains(&key_id)).collect();
    assert!(left.is_empty(), "keys of the purged request left: {left:?}");
    assert!(!admin.purge(ok_own.id()).await.unwrap(), "a second purge finds nothing");
    assert!(matches!(admin.status(ok_own.id()).await.unwrap_err(), sluicegate::Error::UnknownRequest(_)));
    let completed = admin.list(&ListQuery::new().state(ListState::Completed)).await.unwrap();
    assert_eq!(ids(completed), [ok_lane.id().to_string()]);

    // By state and age: none is an hour old; all failed ones are older than nothing.
    assert_eq!(admin.purge_finished(ListState::Failed, Duration::from_secs(3600)).await.unwrap(), 0);
    assert_eq!(admin.purge_finished(ListState::Failed, Duration::ZERO).await.unwrap(), 2);
    assert!(admin.list(&ListQuery::new().state(ListState::Failed)).await.unwrap().requests.is_empty());
    for h in [&bad_lane, &bad_own] {
        assert!(matches!(admin.status(h.id()).await.unwrap_err(), sluicegate::Error::UnknownRequest(_)));
    }
    assert!(admin.purge_finished(ListState::Queued, Duration::ZERO).await.is_err());
    // What was left alone is still there.
    assert_eq!(admin.status(ok_lane.id()).await.unwrap().state, RequestState::Completed);
    assert_eq!(admin.list(&ListQuery::new().state(ListState::Queued)).await.unwrap().requests.len(), 1);
}

/// Counts, in one atomic read of shard 0's token side, the token elements of request `kid` in
/// every priority list and the take records naming it: every token of it that exists outside its
/// meta hash (a take record stays after its token parked or finished, until the slot's next take,
/// so the count is an upper bound).
async fn tokens_outside(redis: &fred::prelude::Client, ns: &str, kid: &str) -> i64 {
    use fred::prelude::*;
    const COUNT: &str = r"
local n, prefix = 0, ARGV[1] .. '|'
local function mine(v) return string.sub(v, 1, #prefix) == prefix end
for i = 1, #KEYS - 1 do
  for _, e in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do if mine(e) then n = n + 1 end end
end
for _, r in ipairs(redis.call('HVALS', KEYS[#KEYS])) do if mine(r) then n = n + 1 end end
return n
";
    let mut keys: Vec<String> = (0..100).map(|p| format!("{ns}:{{{ns}.q0}}:p:{p}")).collect();
    keys.push(format!("{ns}:{{{ns}.q0}}:held"));
    redis.eval(COUNT, keys, vec![kid.to_owned()]).await.unwrap()
}

/// A running request whose tokens are partly held by slots and partly waiting behind another
/// request is raised, then lowered below the other one, while workers run: it completes with
/// exactly its results, never runs more handlers than its limit, and at no instant has more
/// tokens in the lists and take records than its limit (a moved token is never in two lists, a
/// token handed back never both in a list and in its slot's record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reprioritizing_a_running_request_moves_its_tokens_without_making_one_too_many() {
    use std::sync::atomic::AtomicI64;
    let env = env_on(TOPOLOGY, "repri").await;
    let config = env.config.clone();
    let ns = config.namespace_str().to_owned();
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let probe = Probe::default();
    // Three slots, short quanta: the other request's two tokens keep two slots busy, so three of
    // this request's four tokens wait in its list until it is raised.
    let w = start_worker(&config, probe.clone(), 3, Quantum { parts: 2, time: Duration::from_millis(30) }).await;
    let other = producer
        .request()
        .priority(50)
        .unwrap()
        .concurrency(2)
        .unwrap()
        .own_stream(true)
        .submit((0..150).map(|n| Job::sleeping(1000 + n, 3)))
        .await
        .unwrap();
    let limit = 4;
    let h = producer
        .request()
        .priority(10)
        .unwrap()
        .concurrency(limit)
        .unwrap()
        .own_stream(true)
        .submit((0..150).map(|n| Job::sleeping(n, 3)))
        .await
        .unwrap();
    let kid = h.id().key_id();

    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let (most, stop) = (Arc::new(AtomicI64::new(0)), Arc::new(AtomicBool::new(false)));
    let watch = {
        let (most, stop, ns, kid) = (most.clone(), stop.clone(), ns.clone(), kid.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let n = tokens_outside(&redis, &ns, &kid).await;
                most.fetch_max(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    let started = |n: usize| {
        let probe = probe.clone();
        let id = h.id().to_string();
        async move {
            let began = Instant::now();
            while probe.starts().iter().filter(|(r, _)| *r == id).count() < n {
                assert!(began.elapsed() < Duration::from_secs(30), "the request stopped running");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };

    started(10).await;
    let up = admin.reprioritize(h.id(), sluicegate::Priority::new(90).unwrap()).await.unwrap();
    assert_eq!((up.from, up.to), (10, 90));
    assert!(up.moved >= 2, "its waiting tokens were not moved: {up:?}");
    assert_eq!(admin.status(h.id()).await.unwrap().priority, 90);
    started(60).await;
    let down = admin.reprioritize(h.id(), sluicegate::Priority::new(30).unwrap()).await.unwrap();
    assert_eq!((down.from, down.to), (90, 30));

    let done = h.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.state, RequestState::Completed);
    assert_eq!(done.into_outputs().unwrap(), (0..150).map(|n| n * 2).collect::<Vec<_>>());
    let done = other.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), (0..150).map(|n| (1000 + n) * 2).collect::<Vec<_>>());
    stop.store(true, Ordering::SeqCst);
    watch.await.unwrap();
    let runs = probe.starts().iter().filter(|(r, _)| *r == h.id().as_str()).count();
    assert_eq!(runs, 150, "every part ran once");
    assert!(probe.max_concurrency(h.id().as_str()) <= limit, "more handlers than its limit");
    let most = most.load(Ordering::SeqCst);
    // Also a check that the count sees its tokens at all.
    assert_eq!(most, i64::from(limit), "at most {limit} tokens outside its meta hash, and all of them at some instant");
    let status = admin.status(h.id()).await.unwrap();
    assert_eq!((status.state, status.priority), (RequestState::Completed, 30));
    w.stop().await;
}

/// Tokens already waiting move at once: raised above a request queued at a higher priority,
/// every part of the raised one runs first on a single slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_reprioritize_higher_its_waiting_tokens_are_taken_before_a_lower_ones() {
    let env = env_on(TOPOLOGY, "repri-up").await;
    let admin = Admin::connect(&env.config).await.unwrap();
    let producer = Producer::connect(&env.config).await.unwrap();
    let mut handles = Vec::new();
    for p in [10u8, 50] {
        let h = producer
            .request()
            .priority(p)
            .unwrap()
            .concurrency(2)
            .unwrap()
            .own_stream(true)
            .submit((0..5).map(Job::new))
            .await
            .unwrap();
        handles.push(h);
    }
    let (low, mid) = (&handles[0], &handles[1]);
    let raised = admin.reprioritize(low.id(), sluicegate::Priority::new(90).unwrap()).await.unwrap();
    assert_eq!((raised.from, raised.to, raised.moved, raised.left), (10, 90, 2, 0));
    // A repeat (a re-sent call, an operator trying again) changes nothing.
    let again = admin.reprioritize(low.id(), sluicegate::Priority::new(90).unwrap()).await.unwrap();
    assert_eq!((again.to, again.moved), (90, 0));
    // The listing shows it at its new priority, and filters by it.
    let at_90 = admin.list(&sluicegate::ListQuery::new().priority(sluicegate::Priority::new(90).unwrap())).await.unwrap();
    assert_eq!(at_90.requests.iter().map(|r| (r.id.as_str(), r.priority)).collect::<Vec<_>>(), [(low.id().as_str(), 90)]);
    let s = admin.stats().await.unwrap();
    let waiting: Vec<(u8, u64)> = s.tokens_waiting.iter().map(|p| (p.priority, p.tokens)).collect();
    assert_eq!(waiting, [(90, 2), (50, 2)]);

    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 1, Quantum::default()).await;
    for h in &handles {
        h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    }
    w.stop().await;
    let order: Vec<String> = probe.starts().into_iter().map(|(id, _)| id).collect();
    let expected: Vec<String> = [low, mid].iter().flat_map(|h| std::iter::repeat(h.id().to_string()).take(5)).collect();
    assert_eq!(order, expected, "the raised request's parts must all run first");
}

/// A finished request, a small request in a shared lane and an unknown id are refused with an
/// error that says why; nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reprioritize_refuses_finished_lane_and_unknown_requests_clearly() {
    use sluicegate::{Error, Priority};
    let env = env_on(TOPOLOGY, "repri-no").await;
    let admin = Admin::connect(&env.config).await.unwrap();
    let producer = Producer::connect(&env.config).await.unwrap();
    let p = Priority::new(70).unwrap();
    admin.pause(None).await.unwrap();
    let lane = producer.request().priority(20).unwrap().submit([Job::new(1)]).await.unwrap();
    let err = admin.reprioritize(lane.id(), p).await.unwrap_err();
    assert!(matches!(err, Error::Refused(_)) && err.to_string().contains("lane of priority 20"), "{err}");
    assert_eq!(admin.status(lane.id()).await.unwrap().priority, 20);
    admin.resume(None).await.unwrap();

    let w = start_worker(&env.config, Probe::default(), 1, Quantum::default()).await;
    let own = producer.request().own_stream(true).submit([Job::new(2)]).await.unwrap();
    own.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    lane.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    for h in [&own, &lane] {
        let err = admin.reprioritize(h.id(), p).await.unwrap_err();
        assert!(
            matches!(err, Error::Refused(_)) && err.to_string().contains("has already finished (completed)"),
            "{err}"
        );
    }
    assert_eq!(admin.status(own.id()).await.unwrap().priority, 50);
    let err = admin.reprioritize(&sluicegate::RequestId::new("never").unwrap(), p).await.unwrap_err();
    assert!(matches!(err, Error::UnknownRequest(_)), "{err}");
    w.stop().await;
}

/// A token held by a slot moves at its hand-back: lowered below a waiting request while its one
/// token runs, a request gives way at the end of its slot's quantum, not when it is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_token_goes_to_the_new_priority_when_it_is_handed_back() {
    let env = env_on(TOPOLOGY, "repri-held").await;
    let admin = Admin::connect(&env.config).await.unwrap();
    let producer = Producer::connect(&env.config).await.unwrap();
    let probe = Probe::default();
    let w = start_worker(&env.config, probe.clone(), 1, Quantum { parts: 3, time: Duration::from_secs(10) }).await;
    let long = producer
        .request()
        .priority(50)
        .unwrap()
        .own_stream(true)
        .submit((0..100).map(|n| Job::sleeping(n, 10)))
        .await
        .unwrap();
    let began = Instant::now();
    while probe.starts().is_empty() {
        assert!(began.elapsed() < Duration::from_secs(20), "the long request never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let waiting = producer.request().priority(40).unwrap().own_stream(true).submit((0..3).map(Job::new)).await.unwrap();
    let lowered = admin.reprioritize(long.id(), sluicegate::Priority::new(10).unwrap()).await.unwrap();
    // Its one token is held by the slot: nothing waits to be moved now.
    assert_eq!((lowered.from, lowered.to), (50, 10));
    assert!(lowered.moved <= 1, "{lowered:?}");
    waiting.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    let ran = probe.starts().iter().filter(|(r, _)| *r == long.id().as_str()).count();
    assert!(ran < 20, "{ran} parts of the lowered request ran before the waiting one: its token went back to its old priority");
    let done = long.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), (0..100).map(|n| n * 2).collect::<Vec<_>>());
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_say_who_holds_each_one_and_the_audit_finds_no_drift() {
    let env = env_on(TOPOLOGY, "tokens").await;
    let config = fast(&env.config).lane_tokens(0);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let handle = producer
        .request()
        .priority(60)
        .unwrap()
        .concurrency(3)
        .unwrap()
        .submit((0..40).map(|n| Job::sleeping(n, 100)))
        .await
        .unwrap();
    let id = handle.id().clone();
    let queued = admin.tokens(&id).await.unwrap();
    assert_eq!((queued.expected, queued.queued, queued.held, queued.parked), (3, 3, 0, 0), "{queued:?}");
    assert_eq!(queued.drift(), 0);

    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let running = loop {
        let t = admin.tokens(&id).await.unwrap();
        if t.held == 2 {
            break t;
        }
        assert!(Instant::now() < deadline, "two slots never held tokens: {t:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let workers = admin.workers().await.unwrap();
    let worker = &workers[0];
    let expires = worker.registration_expires_ms.expect("the registry's expiry is read");
    assert!(expires > worker.started_ms, "{worker:?}");
    for token in &running.tokens {
        if let sluicegate::TokenState::Held { worker: holder, batch, .. } = token {
            assert_eq!(holder, &worker.id);
            assert!(*batch >= 1);
        }
    }
    let audit = admin.token_audit(100).await.unwrap();
    assert_eq!(audit.unfinished, 1);
    let row = audit.requests.iter().find(|r| r.id == id.to_string()).expect("listed");
    assert_eq!((row.expected, row.drift()), (3, 0), "{row:?}");
    assert!(row.tokens.is_empty(), "the audit counts, it does not list");
    assert!(admin.token_audit(0).await.is_err());

    handle.wait::<u64>().await.unwrap();
    let done = admin.tokens(&id).await.unwrap();
    assert_eq!((done.expected, done.queued, done.held, done.parked, done.tokens.len()), (0, 0, 0, 0, 0), "{done:?}");
    assert!(matches!(
        admin.tokens(&sluicegate::RequestId::new("nobody").unwrap()).await,
        Err(sluicegate::Error::UnknownRequest(_))
    ));
    w.stop().await;
}

/// `unlisted()`: the request runs and answers by id as any other (wait, status, cancel, events,
/// dead, purge), but `list` and the request counts of `stats` never see it; tags on it, and a
/// request that would not take a lane, are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlisted_requests_run_and_answer_by_id_but_are_not_listed_or_counted() {
    use sluicegate::ListQuery;
    let env = env_on(TOPOLOGY, "unlisted").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let mut events = Listener::connect(&config).await.unwrap();
    let refused = producer.request().unlisted().tag("t").unwrap().submit([Job::new(1)]).await.err().unwrap();
    assert!(refused.to_string().contains("unlisted request cannot carry tags"), "{refused}");
    let refused = producer.request().tag("t").unwrap().unlisted().open().await.err().unwrap();
    assert!(refused.to_string().contains("unlisted request cannot carry tags"), "{refused}");
    let lane_only = "only a request that takes its priority's lane can be unlisted";
    let refused = producer.request().unlisted().own_stream(true).submit([Job::new(1)]).await.err().unwrap();
    assert!(refused.to_string().contains(lane_only), "{refused}");
    let refused = producer.request().unlisted().submit((0..65).map(Job::new)).await.err().unwrap();
    assert!(refused.to_string().contains(lane_only), "{refused}");
    let refused = producer.request().unlisted().open().await.err().unwrap();
    assert!(refused.to_string().contains(lane_only), "{refused}");

    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let listed = producer.request().submit([Job::new(1)]).await.unwrap();
    let lane = producer.request().unlisted().submit([Job::new(2)]).await.unwrap();
    let several = producer.request().unlisted().concurrency(2).unwrap().submit((0..3).map(Job::new)).await.unwrap();
    let failing = producer.request().unlisted().submit([Job { n: 4, sleep_ms: 0, fail: true }]).await.unwrap();
    assert_eq!(lane.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap().into_outputs().unwrap(), vec![4]);
    assert_eq!(several.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap().into_outputs().unwrap(), vec![0, 2, 4]);
    assert_eq!(failing.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap().state, RequestState::Failed);
    listed.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    w.stop().await;
    // Cancelled while queued (no worker runs).
    let queued = producer.request().unlisted().submit([Job::new(5)]).await.unwrap();
    admin.cancel(queued.id()).await.unwrap();

    for (h, state) in [
        (&lane, RequestState::Completed),
        (&several, RequestState::Completed),
        (&failing, RequestState::Failed),
        (&queued, RequestState::Cancelled),
    ] {
        assert_eq!(admin.status(h.id()).await.unwrap().state, state, "{}", h.id());
    }
    let mut seen = std::collections::HashSet::new();
    while seen.len() < 5 {
        let e = tokio::time::timeout(Duration::from_secs(10), events.next()).await.unwrap().unwrap();
        seen.insert(e.id.to_string());
    }
    for h in [&listed, &lane, &several, &failing, &queued] {
        assert!(seen.contains(&h.id().to_string()), "no event of {}", h.id());
    }
    let page = admin.list(&ListQuery::new()).await.unwrap();
    let ids: Vec<String> = page.requests.into_iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![listed.id().to_string()], "only the listed request is listed");
    let counts = admin.stats().await.unwrap().requests;
    assert_eq!(
        (counts.unfinished, counts.completed, counts.failed, counts.cancelled),
        (0, 1, 0, 0),
        "only the listed request is counted: {counts:?}"
    );
    // Its dead letters, and a purge by id.
    assert_eq!(admin.dead(failing.id()).await.unwrap().len(), 1);
    assert!(admin.purge(lane.id()).await.unwrap());
    assert!(matches!(admin.status(lane.id()).await.unwrap_err(), sluicegate::Error::UnknownRequest(_)));
}

/// While a change of `token_shards` rolls out, an admin whose count differs from the producers'
/// still shows every lane request in the shards it walks (the record is read where the request was
/// listed, not where the admin's own count would put it), and finds each by id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_with_another_shard_count_lists_and_finds_every_lane_request() {
    use fred::prelude::SortedSetsInterface;
    use sluicegate::ListQuery;
    let env = env_on(TOPOLOGY, "listshards").await;
    let producer = Producer::connect(&env.config.clone().token_shards(3)).await.unwrap();
    let mut handles = Vec::new();
    for n in 0..40 {
        handles.push(producer.request().submit([Job::new(n)]).await.unwrap());
    }
    let admin = Admin::connect(&env.config.clone().token_shards(2)).await.unwrap();
    let ns = env.config.namespace_str();
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let mut indexed = 0u64;
    for shard in 0..2 {
        // Queued lane requests are counted in `lq` until they are handed out (docs/protocol.md §5).
        let rows: u64 = redis.zcard(format!("{ns}:{{{ns}.q{shard}}}:ix:live")).await.unwrap();
        let queued: Option<u64> =
            fred::interfaces::KeysInterface::get(&redis, format!("{ns}:{{{ns}.q{shard}}}:ix:lq")).await.unwrap();
        indexed += rows + queued.unwrap_or(0);
    }
    assert!(indexed > 0 && indexed < 40, "the 40 requests spread over 3 shards: {indexed} on shards 0 and 1");
    let page = admin.list(&ListQuery::new()).await.unwrap();
    assert_eq!(page.requests.len() as u64, indexed, "every request listed on the shards walked is shown");
    // By id, every one is found wherever it lives, and an unknown id is still unknown.
    for h in &handles {
        let status = admin.status(h.id()).await.unwrap();
        assert_eq!(status.state, RequestState::Queued, "{}", h.id());
    }
    assert!(admin.dead(handles[0].id()).await.unwrap().is_empty());
    admin.cancel(handles[1].id()).await.unwrap();
    assert_eq!(admin.status(handles[1].id()).await.unwrap().state, RequestState::Cancelled);
    let unknown = sluicegate::RequestId::new("never-submitted").unwrap();
    assert!(matches!(admin.status(&unknown).await.unwrap_err(), sluicegate::Error::UnknownRequest(_)));
}

/// Finished lane requests whose records keep their rows enter the listing index's `ix:exp` a batch
/// per call (docs/protocol.md §5): while the shard stays busy, each leaves its terminal set with its
/// retention, and every entry of a terminal set is named by `ix:exp` (so none is left behind when
/// a batch is trimmed in the millisecond its records expire). Busy here means requests listed
/// from their lanes only, none in `ix:live`: after the first round the shard had none live, so
/// its shared index keys were given the expiry of its latest finished request, and a submit that
/// counts one in `ix:lq` must take that expiry off again, or `ix:exp` would expire with the
/// entries of the requests finished since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_lane_requests_leave_the_index_with_their_retention_while_the_shard_stays_busy() {
    use fred::interfaces::SortedSetsInterface;
    use std::collections::HashSet;
    let env = env_on(TOPOLOGY, "ixexp").await;
    let config = env.config.clone().retention(Duration::from_secs(1));
    let w = start_worker(&config, Probe::default(), 8, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let ns = config.namespace_str().to_owned();
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let round = |n: u64| {
        let producer = &producer;
        async move {
            let handles: Vec<_> = producer
                .submit_many((0..n).map(|i| (producer.request(), [Job::new(i)])))
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
            for h in &handles {
                h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
            }
            handles.iter().map(|h| h.id().key_id()).collect::<Vec<_>>()
        }
    };
    let first: HashSet<String> = round(200).await.into_iter().collect();
    // Single-part requests running (listed from their lanes) for all of what follows, each alone in
    // its lane (a priority of its own), so that no slot runs two of them or a round's behind one.
    let mut sleepers = Vec::new();
    for p in 20..24u8 {
        sleepers.push(producer.request().priority(p).unwrap().submit([Job::sleeping(0, 4_000)]).await.unwrap());
    }
    // Finishes go on for three retentions; each trims what has expired.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        round(20).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for h in &sleepers {
        h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    }
    w.stop().await;
    for shard in 0..4 {
        let ix = |set: &str| format!("{ns}:{{{ns}.q{shard}}}:ix:{set}");
        let members: Vec<String> = redis.zrange(ix("exp"), 0, -1, None, false, None, false).await.unwrap();
        let named: HashSet<String> = members
            .iter()
            .flat_map(|m| match m.strip_prefix('|') {
                Some(batch) => batch.split('|').skip(1).filter_map(|i| i.split_once(',')).map(|(_, k)| k.to_owned()).collect(),
                None => vec![m.clone()],
            })
            .collect();
        let members: Vec<String> = redis.zrange(ix("completed"), 0, -1, None, false, None, false).await.unwrap();
        // A group member ("|<kid>|<kid>|...") holds requests one call finished that were submitted
        // in one millisecond.
        let completed: Vec<String> = members
            .iter()
            .flat_map(|m| match m.strip_prefix('|') {
                Some(group) => group.split('|').map(str::to_owned).collect(),
                None => vec![m.clone()],
            })
            .collect();
        let left: Vec<&String> = completed.iter().filter(|k| first.contains(*k)).collect();
        assert!(left.is_empty(), "shard {shard}: {} of the first round's requests are still listed: {left:?}", left.len());
        let unnamed: Vec<&String> = completed.iter().filter(|k| !named.contains(*k)).collect();
        assert!(unnamed.is_empty(), "shard {shard}: entries ix:exp names nowhere: {unnamed:?}");
    }
}

/// Holds every handler until the test lets it go: one permit a run.
#[derive(Clone)]
struct Held {
    permits: Arc<tokio::sync::Semaphore>,
    started: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait]
impl Handler for Held {
    type Input = Job;
    type Output = u64;
    async fn handle(&self, _ctx: Context, job: Job) -> Result<u64, HandlerError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        self.permits.acquire().await.expect("never closed").forget();
        Ok(job.n)
    }
}

/// Lane requests whose parts were all fed at their submit (every single-part one) stay listed
/// from their lanes while they run, in no sorted set of the index (docs/protocol.md §5); those
/// with parts fed later are listed in `ix:live` from their first hand-out. Run a few at a time,
/// `list` shows every queued and every running one once, in its state, newest first, at every
/// page size, and the unfinished count holds; once all finished, none is live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_lane_requests_list_once_each_while_they_run() {
    use sluicegate::{ListQuery, ListState};
    use std::collections::HashSet;
    let env = env_on(TOPOLOGY, "lanerun").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let mut listed = Vec::new();
    for n in 0..24 {
        listed.push(producer.request().submit([Job::new(n)]).await.unwrap());
    }
    for n in 0..4 {
        // Every part fed at the submit.
        let parts = (0..3).map(|i| Job::new(100 + n * 10 + i));
        listed.push(producer.request().concurrency(4).unwrap().submit(parts).await.unwrap());
        // Parts fed as others settle: in `ix:live` from its first hand-out.
        let parts = (0..6).map(|i| Job::new(200 + n * 10 + i));
        listed.push(producer.request().concurrency(2).unwrap().submit(parts).await.unwrap());
    }
    for n in 0..6 {
        producer.request().unlisted().submit([Job::new(300 + n)]).await.unwrap();
    }
    let held = Held { permits: Arc::new(tokio::sync::Semaphore::new(0)), started: Default::default() };
    let w = start_worker(&config, held.clone(), 8, Quantum::default()).await;
    let all = |q: ListQuery| list_all(&admin, q);
    let by_state = || async {
        let (mut queued, mut running) = (HashSet::new(), HashSet::new());
        for h in &listed {
            match admin.status(h.id()).await.unwrap().state {
                RequestState::Queued => queued.insert(h.id().to_string()),
                RequestState::Running => running.insert(h.id().to_string()),
                _ => false,
            };
        }
        (queued, running)
    };
    let once = |ids: Vec<String>, what: &str| {
        let n = ids.len();
        let got: HashSet<String> = ids.into_iter().collect();
        assert_eq!(got.len(), n, "{what}: a request listed twice");
        got
    };
    let mut checked_running = 0;
    loop {
        // Hold still: the runs let go have ended and the next ones wait (no new start for 150 ms).
        let mut seen = held.started.load(Ordering::SeqCst);
        loop {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let now = held.started.load(Ordering::SeqCst);
            if now == seen {
                break;
            }
            seen = now;
        }
        // The states can still move (an ack on its way): compare with a listing taken between two
        // equal readings of them.
        let mut attempt = 0;
        let after = loop {
            let before = by_state().await;
            let size = [1, 3, 64][attempt % 3];
            let queued = once(all(ListQuery::new().state(ListState::Queued).limit(size)).await, "queued");
            let running = once(all(ListQuery::new().state(ListState::Running).limit(size)).await, "running");
            let every = once(all(ListQuery::new().limit(size)).await, "every state");
            let unfinished = admin.stats().await.unwrap().requests.unfinished;
            let after = by_state().await;
            if before != after {
                attempt += 1;
                assert!(attempt < 50, "the states never held still");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            assert_eq!((&queued, &running), (&after.0, &after.1), "pages of {size}");
            assert_eq!(every.len(), listed.len(), "every state, pages of {size}");
            assert_eq!(unfinished, (after.0.len() + after.1.len()) as u64, "unfinished");
            break after;
        };
        checked_running += after.1.len();
        if after.0.is_empty() && after.1.is_empty() {
            break;
        }
        held.permits.add_permits(4);
    }
    assert!(checked_running > 0, "no request was seen running");
    held.permits.add_permits(1000);
    for h in &listed {
        h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    }
    w.stop().await;
    assert!(all(ListQuery::new().state(ListState::Running).limit(10)).await.is_empty());
    assert!(all(ListQuery::new().state(ListState::Queued).limit(10)).await.is_empty());
    let counts = admin.stats().await.unwrap().requests;
    assert_eq!((counts.unfinished, counts.completed), (0, listed.len() as u64), "{counts:?}");
}

/// Status and list show a single-part lane request, listed or not, queued before a worker takes
/// it, running (with its start time) from the moment its handler starts, and completed once it
/// acks: what a change to when a lane record is written must keep (a hand-out that wrote nothing
/// was built and measured on 2026-12-05; docs/benchmarks.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_request_reads_running_from_its_hand_out_to_its_ack() {
    use sluicegate::{ListQuery, ListState};
    let env = env_on(TOPOLOGY, "lanelook").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let listed = producer.request().submit([Job::new(1)]).await.unwrap();
    let unlisted = producer.request().unlisted().submit([Job::new(2)]).await.unwrap();
    for h in [&listed, &unlisted] {
        let status = admin.status(h.id()).await.unwrap();
        assert_eq!((status.state, status.started_ms), (RequestState::Queued, None));
    }
    let held = Held { permits: Arc::new(tokio::sync::Semaphore::new(0)), started: Default::default() };
    let before = now_ms();
    let w = start_worker(&config, held.clone(), 8, Quantum::default()).await;
    while held.started.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for h in [&listed, &unlisted] {
        let status = admin.status(h.id()).await.unwrap();
        assert_eq!(status.state, RequestState::Running, "{}", h.id());
        let started = status.started_ms.expect("a running request has its start time");
        assert!(started + 1000 >= before && started <= now_ms() + 1000, "started {started}, before {before}");
    }
    let running = list_all(&admin, ListQuery::new().state(ListState::Running).limit(10)).await;
    assert_eq!(running, vec![listed.id().to_string()]);
    assert!(list_all(&admin, ListQuery::new().state(ListState::Queued).limit(10)).await.is_empty());
    held.permits.add_permits(2);
    for h in [&listed, &unlisted] {
        h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        let status = admin.status(h.id()).await.unwrap();
        assert_eq!(status.state, RequestState::Completed);
        assert!(status.started_ms.is_some_and(|s| s <= status.finished_ms.unwrap_or(0)), "{status:?}");
    }
    w.stop().await;
}

/// A single-part lane request's first hand-out reads no record (docs/protocol.md §5, "Lanes"), so a
/// cancel of one still waiting in its lane is what keeps its part from starting: the lane keeps its
/// entry in its set of cancelled entries until a hand-out drops it. Two cancelled among six, one of
/// them purged and its id submitted again before any worker runs: the cancelled parts never start,
/// the others and the id's new request complete, and the set is gone once they have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_part_lane_request_cancelled_while_queued_never_starts() {
    use fred::interfaces::KeysInterface;
    let env = env_on(TOPOLOGY, "lanecx").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let mut handles = Vec::new();
    for n in 0..6u64 {
        handles.push(producer.request().id(format!("cx-{n}")).unwrap().submit([Job::new(n)]).await.unwrap());
    }
    for n in [1usize, 4] {
        admin.cancel(handles[n].id()).await.unwrap();
    }
    assert!(admin.purge(handles[4].id()).await.unwrap());
    let again = producer.request().id("cx-4").unwrap().submit([Job::new(40)]).await.unwrap();
    let probe = Probe::default();
    let w = start_worker(&config, probe.clone(), 4, Quantum::default()).await;
    for n in [0usize, 2, 3, 5] {
        assert_eq!(handles[n].wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap().results, vec![Ok(2 * n as u64)]);
    }
    assert_eq!(again.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap().results, vec![Ok(80)]);
    assert_eq!(admin.status(handles[1].id()).await.unwrap().state, RequestState::Cancelled);
    let starts = probe.starts();
    assert_eq!(starts.len(), 5, "only the live requests' parts start: {starts:?}");
    assert!(!starts.iter().any(|(id, _)| id == "cx-1"), "a cancelled part started: {starts:?}");
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let ns = config.namespace_str().to_owned();
    let lanes: Vec<String> = sluicegate_testkit::keys_in_namespace(env.redis.url(), &ns)
        .await
        .unwrap()
        .into_iter()
        .filter(|k| k.rsplit_once(":lane:").is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())))
        .collect();
    assert!(!lanes.is_empty());
    for lane in lanes {
        let left: i64 = redis.exists(format!("{lane}:err")).await.unwrap();
        assert_eq!(left, 0, "{lane} still holds cancelled entries after they were handed out");
    }
    w.stop().await;
}

/// This machine's clock, in ms since the Unix epoch (Redis's clock on this machine's server).
fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The small requests one lane call finishes that were submitted in one millisecond share one
/// member of their terminal set (docs/protocol.md §5, "Listing"). Listed by state at every page
/// size, each shows once, newest first, and the counts count each; a purged one leaves the list
/// and the count at once, a tracked one is listed once more only under `tracked`, and a failed
/// one whose dead letter is requeued leaves `failed` and is listed completed once it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_requests_grouped_in_their_terminal_sets_list_count_purge_track_and_reopen_one_by_one() {
    use fred::interfaces::SortedSetsInterface;
    use sluicegate::{ListQuery, ListState, RequestId};
    use std::collections::HashSet;
    let env = env_on(TOPOLOGY, "ixgroup").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let failing = Arc::new(AtomicBool::new(true));
    // Queued before the worker starts, fifty to a `submit_many` (one submit millisecond each), so
    // that a lane batch finishes many of one millisecond.
    let (mut completed, mut failed) = (HashSet::new(), HashSet::new());
    let mut handles = Vec::new();
    for b in 0..6u64 {
        for (i, h) in producer.submit_many((0..50).map(|i| (producer.request(), [Job::new(b * 100 + i)]))).await.into_iter().enumerate() {
            let h = h.unwrap();
            if i % 5 == 0 { failed.insert(h.id().to_string()) } else { completed.insert(h.id().to_string()) };
            handles.push(h);
        }
    }
    let w = start_worker(&config, Fragile { broken: failing.clone(), fails: |_, job| job.n % 5 == 0 }, 16, Quantum::default()).await;
    for h in &handles {
        let _ = h.wait_timeout::<u64>(Duration::from_secs(30)).await;
    }
    let ns = config.namespace_str().to_owned();
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for shard in 0..4 {
        for state in ["completed", "failed"] {
            let members: Vec<String> = redis
                .zrange(format!("{ns}:{{{ns}.q{shard}}}:ix:{state}"), 0, -1, None, false, None, false)
                .await
                .unwrap();
            for m in members.iter().filter_map(|m| m.strip_prefix('|')) {
                groups.push((state.to_owned(), m.split('|').map(str::to_owned).collect()));
            }
        }
    }
    assert!(groups.iter().any(|(s, _)| s == "completed"), "no group in ix:completed");
    assert!(groups.iter().any(|(s, _)| s == "failed"), "no group in ix:failed");
    let grouped = |state: &str| {
        let kid = &groups.iter().find(|(s, _)| s == state).unwrap().1[0];
        RequestId::from_key_id(kid).unwrap()
    };
    let check = |completed: HashSet<String>, failed: HashSet<String>, what: &'static str| {
        let admin = &admin;
        async move {
            for (state, expect) in [(ListState::Completed, &completed), (ListState::Failed, &failed)] {
                for size in [1, 7, 64] {
                    let ids = list_all(admin, ListQuery::new().state(state).limit(size)).await;
                    let got: HashSet<String> = ids.iter().cloned().collect();
                    assert_eq!(got.len(), ids.len(), "{what}: {state:?} in pages of {size}: listed twice");
                    assert!(got == *expect, "{what}: {state:?} in pages of {size}: {} listed, {} expected", got.len(), expect.len());
                }
            }
            let counts = admin.stats().await.unwrap().requests;
            assert_eq!((counts.completed, counts.failed), (completed.len() as u64, failed.len() as u64), "{what}");
        }
    };
    check(completed.clone(), failed.clone(), "after the drain").await;
    let purged = grouped("completed");
    assert!(admin.purge(&purged).await.unwrap());
    completed.remove(&purged.to_string());
    check(completed.clone(), failed.clone(), "after a purge").await;
    let tracked = groups.iter().find(|(s, k)| s == "completed" && !k.contains(&purged.key_id())).map(|(_, k)| k[0].clone()).unwrap();
    let tracked = RequestId::from_key_id(&tracked).unwrap();
    admin.track(&tracked, true).await.unwrap();
    assert_eq!(list_all(&admin, ListQuery::new().tracked().limit(10)).await, vec![tracked.to_string()]);
    check(completed.clone(), failed.clone(), "after a track").await;
    let reopened = grouped("failed");
    failing.store(false, Ordering::SeqCst);
    assert_eq!(admin.requeue_dead(&reopened).await.unwrap(), 1);
    let started = Instant::now();
    while admin.status(&reopened).await.unwrap().state != RequestState::Completed {
        assert!(started.elapsed() < Duration::from_secs(30), "the requeued request never completed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    failed.remove(&reopened.to_string());
    completed.insert(reopened.to_string());
    check(completed, failed, "after a requeue").await;
    w.stop().await;
}


/// A terminal set expires with its latest members' keys, before their batch is trimmed: the count
/// of what its groups held (`ix:gn`) goes with it, and is not added to the next finish into a set
/// made anew (while the shard stays busy, `gn` has no expiry of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_set_that_expired_with_its_groups_leaves_no_count_behind() {
    use fred::interfaces::{HashesInterface, KeysInterface};
    use sluicegate::{ListQuery, ListState};
    let env = env_on(TOPOLOGY, "gn-expired").await;
    let config = fast(&env.config).retention(Duration::from_secs(1));
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let ns = config.namespace_str().to_owned();
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    // Live requests on every shard for the whole test (scheduled an hour from now).
    for i in 0..24 {
        producer.request().delay(Duration::from_secs(3600)).tag("keep").unwrap().submit([Job::new(1000 + i)]).await.unwrap();
    }
    let handles: Vec<_> = producer
        .submit_many((0..60).map(|i| (producer.request(), [Job::new(i)])))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let w = start_worker(&config, Probe::default(), 16, Quantum::default()).await;
    for h in &handles {
        h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    }
    let mut gn_before = 0i64;
    for shard in 0..4 {
        let v: Option<i64> = redis.hget(format!("{ns}:{{{ns}.q{shard}}}:ix:gn"), "completed").await.unwrap();
        gn_before += v.unwrap_or(0);
    }
    assert!(gn_before > 0, "no group formed");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let mut sets = 0i64;
    let mut gn_after = 0i64;
    for shard in 0..4 {
        sets += redis.exists::<i64, _>(format!("{ns}:{{{ns}.q{shard}}}:ix:completed")).await.unwrap();
        let v: Option<i64> = redis.hget(format!("{ns}:{{{ns}.q{shard}}}:ix:gn"), "completed").await.unwrap();
        gn_after += v.unwrap_or(0);
    }
    // One more round, each request alone in its submit (its own millisecond).
    let mut more = Vec::new();
    for i in 0..8 {
        more.push(producer.request().submit([Job::new(100 + i)]).await.unwrap());
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    for h in &more {
        h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
    }
    let listed = list_all(&admin, ListQuery::new().state(ListState::Completed).limit(100)).await;
    let counts = admin.stats().await.unwrap().requests;
    w.stop().await;
    assert_eq!(listed.len(), 8, "listed {listed:?}");
    assert_eq!(
        counts.completed, 8,
        "stats count {} completed, list shows 8 ({gn_after} in gn, {sets} sets left after the retention)",
        counts.completed
    );
}

/// Requests of a failed group, reopened by requeues and failed again in one call, are grouped
/// again at the same submit ms. The trim of their first failure's batch leaves their new group
/// alone: they stay listed while their records are retained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_failed_again_stays_listed_past_its_first_failures_trim() {
    use fred::interfaces::SortedSetsInterface;
    use sluicegate::{ListQuery, ListState, RequestId};
    let env = env_on(TOPOLOGY, "refailed").await;
    let retention = Duration::from_secs(3);
    let config = fast(&env.config).retention(retention);
    let admin = Admin::connect(&config).await.unwrap();
    let producer = Producer::connect(&config).await.unwrap();
    let ns = config.namespace_str().to_owned();
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let broken = Arc::new(AtomicBool::new(true));
    let handles: Vec<_> = producer
        .submit_many((0..60).map(|i| (producer.request(), [Job::new(i)])))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let w = start_worker(&config, Fragile { broken: broken.clone(), fails: |_, _| true }, 16, Quantum::default()).await;
    for h in &handles {
        let _ = h.wait_timeout::<u64>(Duration::from_secs(20)).await;
    }
    let first_failed = Instant::now();
    w.stop().await;
    // A group of at least three in `failed`.
    let mut group = None;
    for shard in 0..4 {
        let members: Vec<String> =
            redis.zrange(format!("{ns}:{{{ns}.q{shard}}}:ix:failed"), 0, -1, None, false, None, false).await.unwrap();
        for m in members.iter().filter_map(|m| m.strip_prefix('|')) {
            let kids: Vec<String> = m.split('|').map(str::to_owned).collect();
            if kids.len() >= 3 && group.is_none() {
                group = Some(kids);
            }
        }
    }
    let group = group.expect("no failed group of three");
    let (a, b) = (RequestId::from_key_id(&group[0]).unwrap(), RequestId::from_key_id(&group[1]).unwrap());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Both reopened while no worker runs, so that one lane call fails both again.
    let c = RequestId::from_key_id(&group[2]).unwrap();
    assert_eq!(admin.requeue_dead(&c).await.unwrap(), 1);
    assert_eq!(admin.requeue_dead(&b).await.unwrap(), 1);
    assert_eq!(admin.requeue_dead(&a).await.unwrap(), 1);
    let w = start_worker(&config, Fragile { broken: broken.clone(), fails: |_, _| true }, 1, Quantum::default()).await;
    for id in [&a, &b, &c] {
        let started = Instant::now();
        while admin.status(id).await.unwrap().state != RequestState::Failed {
            assert!(started.elapsed() < Duration::from_secs(20));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let second_failed = Instant::now();
    let listed = list_all(&admin, ListQuery::new().state(ListState::Failed).limit(100)).await;
    assert!(listed.contains(&a.to_string()) && listed.contains(&b.to_string()), "before the trim: {listed:?}");
    // Past the first failure's retention (its batch trimmed by recovery's claims), before the second's.
    let at = first_failed + retention + Duration::from_millis(600);
    tokio::time::sleep(at.saturating_duration_since(Instant::now())).await;
    assert!(second_failed + retention > Instant::now() + Duration::from_millis(200), "too slow to tell");
    for id in [&a, &b] {
        assert_eq!(admin.status(id).await.unwrap().state, RequestState::Failed, "{id} still retained");
    }
    let listed = list_all(&admin, ListQuery::new().state(ListState::Failed).limit(100)).await;
    let counts = admin.stats().await.unwrap().requests;
    w.stop().await;
    assert!(
        listed.contains(&a.to_string()) && listed.contains(&b.to_string()),
        "after the first batch's trim: failed lists {listed:?} (a {a}, b {b}); stats count {}",
        counts.failed
    );
}
