// The body of the DAG tests in tests/integration/workflows.rs: written once, run against a single Redis and a 3-master Redis Cluster
// (`per_topology!` runs it once for each). Requests submitted after others (a DAG): their gates,
// their results flowing, failures cascading, and releases whose finisher died.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sluicegate::{
    async_trait, Context, Error, Handler, HandlerError, Listener, OnUpstreamFailure, Producer, Quantum,
    RequestHandle, RequestId, RequestState,
};

use crate::support::{env_on, fast, start_worker};

/// A part of a step: its own number, and the upstreams whose results it adds to it (every part
/// of each). It fails permanently while `fail` is set and the step's switch is on.
#[derive(Serialize, Deserialize, Clone, Debug)]
struct Step {
    n: u64,
    upstreams: Vec<String>,
    fail: bool,
}

/// When each request's parts started and ended, by this handler's clock.
#[derive(Default)]
struct Times {
    first_start: HashMap<String, Instant>,
    last_end: HashMap<String, Instant>,
}

#[derive(Clone, Default)]
struct Steps {
    times: Arc<Mutex<Times>>,
    /// While on, a part with `fail` fails permanently.
    failing: Arc<AtomicBool>,
}

#[async_trait]
impl Handler for Steps {
    type Input = Step;
    type Output = u64;

    async fn handle(&self, ctx: Context, step: Step) -> Result<u64, HandlerError> {
        let id = ctx.request_id().to_string();
        self.times.lock().unwrap().first_start.entry(id.clone()).or_insert_with(Instant::now);
        let mut sum = step.n;
        for up in &step.upstreams {
            let up = RequestId::new(up.clone()).map_err(|e| HandlerError::permanent(e.to_string()))?;
            for r in ctx.upstream::<u64>(&up, 0..u64::MAX).await.map_err(|e| HandlerError::new(e.to_string()))? {
                sum += r.map_err(|e| HandlerError::permanent(format!("upstream part failed: {e}")))?;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.times.lock().unwrap().last_end.insert(id, Instant::now());
        if step.fail && self.failing.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent("a step chosen to fail"));
        }
        Ok(sum)
    }
}

impl Steps {
    fn first_start(&self, h: &RequestHandle) -> Instant {
        self.times.lock().unwrap().first_start[h.id().as_str()]
    }
    fn last_end(&self, h: &RequestHandle) -> Instant {
        self.times.lock().unwrap().last_end[h.id().as_str()]
    }
    fn started(&self, h: &RequestHandle) -> bool {
        self.times.lock().unwrap().first_start.contains_key(h.id().as_str())
    }
}

fn parts(ns: std::ops::Range<u64>, upstreams: &[&RequestHandle], fail: bool) -> Vec<Step> {
    let upstreams: Vec<String> = upstreams.iter().map(|h| h.id().to_string()).collect();
    ns.map(|n| Step { n, upstreams: upstreams.clone(), fail }).collect()
}

fn ids(hs: &[&RequestHandle]) -> Vec<RequestId> {
    hs.iter().map(|h| h.id().clone()).collect()
}

/// The outputs of `h` once it has completed, for a request that is failed until a release
/// reopens it (its wait returns its failure until then).
async fn outputs_once_reopened(h: &RequestHandle) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        if done.state == RequestState::Completed || Instant::now() > deadline {
            assert_eq!(done.state, RequestState::Completed, "{} never reopened: {:?}", h.id(), done.reason);
            return done.into_outputs().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn outputs(h: &RequestHandle) -> Vec<u64> {
    let done = h.wait_timeout::<u64>(Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.state, RequestState::Completed, "{}: {:?}", h.id(), done.reason);
    done.into_outputs().unwrap()
}

/// A diamond, A → B, A → C, B + C → D, twice: once with A small enough for its lane, once with
/// a stream of its own. B and C start only after A's last part ended, D only after B's and C's;
/// each step adds its upstreams' results (read with `Context::upstream`), so D's results are
/// right only if every result flowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diamond_runs_each_request_after_its_upstreams_and_their_results_flow() {
    let env = env_on(TOPOLOGY, "diamond").await;
    let steps = Steps::default();
    let w = start_worker(&env.config, steps.clone(), 8, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    for own_stream in [false, true] {
        // A runs long enough for B, C and D to be submitted while it runs.
        let a = producer
            .request()
            .own_stream(own_stream)
            .concurrency(2)
            .unwrap()
            .submit((0..3).map(|n| Step { n, upstreams: Vec::new(), fail: false }))
            .await
            .unwrap();
        let b = producer.request().after(ids(&[&a])).concurrency(2).unwrap().submit(parts(10..12, &[&a], false));
        let b = b.await.unwrap();
        let c = producer.request().after(ids(&[&a])).submit(parts(20..21, &[&a], false)).await.unwrap();
        let d = producer
            .request()
            .after(ids(&[&b, &c]))
            .concurrency(3)
            .unwrap()
            .submit(parts(100..103, &[&b, &c], false))
            .await
            .unwrap();
        let a_sum: u64 = outputs(&a).await.iter().sum();
        assert_eq!(a_sum, 3);
        let b_out = outputs(&b).await;
        assert_eq!(b_out, vec![10 + a_sum, 11 + a_sum]);
        let c_out = outputs(&c).await;
        assert_eq!(c_out, vec![20 + a_sum]);
        let bc: u64 = b_out.iter().chain(&c_out).sum();
        assert_eq!(outputs(&d).await, vec![100 + bc, 101 + bc, 102 + bc]);
        for (down, ups) in [(&b, vec![&a]), (&c, vec![&a]), (&d, vec![&b, &c])] {
            for up in ups {
                assert!(
                    steps.first_start(down) >= steps.last_end(up),
                    "{} started before its upstream {} ended (own_stream A: {own_stream})",
                    down.id(),
                    up.id()
                );
            }
        }
    }
    w.stop().await;
}

/// A downstream waits (state `waiting`) while its upstream runs, and cancelling it then ends it
/// at once, without running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_waits_visibly_and_can_be_cancelled() {
    let env = env_on(TOPOLOGY, "waiting").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    // No worker yet: the upstream stays queued.
    let a = producer.request().submit(parts(0..1, &[], false)).await.unwrap();
    let b = producer.request().after(ids(&[&a])).submit(parts(0..1, &[&a], false)).await.unwrap();
    let status = admin.status(b.id()).await.unwrap();
    assert_eq!(status.state, RequestState::Waiting);
    let ups: Vec<(String, Option<String>)> = status.upstreams.iter().map(|u| (u.id.clone(), u.ended.clone())).collect();
    assert_eq!(ups, vec![(a.id().to_string(), None)]);
    assert_eq!(admin.status(a.id()).await.unwrap().downstreams, vec![b.id().to_string()]);
    b.cancel().await.unwrap();
    let steps = Steps::default();
    let w = start_worker(&env.config, steps.clone(), 2, Quantum::default()).await;
    outputs(&a).await;
    let done = b.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.state, RequestState::Cancelled);
    assert!(!steps.started(&b), "a cancelled downstream ran");
    w.stop().await;
}

/// A → B → C with B and C failing with their upstream, and D after A running anyway: B and C end
/// failed, naming their upstream, with exactly one event each, and never run; D runs. Then A is
/// requeued and completes: B reopens and runs, and so does C after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upstream_fails_its_downstreams_once_and_a_requeued_one_releases_them() {
    let env = env_on(TOPOLOGY, "cascade").await;
    let mut listener = Listener::connect(&env.config).await.unwrap();
    let steps = Steps::default();
    steps.failing.store(true, Ordering::SeqCst);
    let producer = Producer::connect(&env.config).await.unwrap();
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    // An id whose key id differs (percent-encoded): the reason names the id.
    let a_id = format!("a stream:{}", sluicegate::RequestId::generate());
    let a = producer.request().id(a_id).unwrap().own_stream(true).submit(parts(0..2, &[], true)).await.unwrap();
    let b = producer.request().after(ids(&[&a])).submit(parts(10..11, &[&a], false)).await.unwrap();
    let c = producer.request().after(ids(&[&b])).submit(parts(20..21, &[&b], false)).await.unwrap();
    let d = producer
        .request()
        .after(ids(&[&a]))
        .on_upstream_failure(OnUpstreamFailure::Run)
        .submit(parts(30..31, &[], false))
        .await
        .unwrap();
    let w = start_worker(&env.config, steps.clone(), 4, Quantum::default()).await;
    for (h, upstream) in [(&a, None), (&b, Some(&a)), (&c, Some(&b))] {
        let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.state, RequestState::Failed, "{}", h.id());
        let why = upstream.map(|u| format!("upstream:{}", u.id()));
        assert_eq!(done.reason, why, "{}", h.id());
    }
    assert_eq!(outputs(&d).await, vec![30]);
    assert!(!steps.started(&b) && !steps.started(&c), "a downstream of a failed upstream ran");
    let c_done = c.wait::<u64>().await.unwrap();
    let part = c_done.results[0].as_ref().unwrap_err();
    assert_eq!(part.message, format!("not run: its upstream {} did not complete", b.id()));
    let status = admin.status(b.id()).await.unwrap();
    assert_eq!(status.on_upstream_failure, Some(OnUpstreamFailure::Fail));
    assert_eq!(status.done, 0, "none of its parts ran");
    // One event per request: a, b, c failed and d completed.
    let mut events: HashMap<RequestId, Vec<RequestState>> = HashMap::new();
    while let Ok(Ok(e)) = tokio::time::timeout(Duration::from_millis(1500), listener.next()).await {
        events.entry(e.id).or_default().push(e.state);
    }
    for (h, state) in [(&a, RequestState::Failed), (&b, RequestState::Failed), (&c, RequestState::Failed), (&d, RequestState::Completed)] {
        assert_eq!(events.get(h.id()), Some(&vec![state]), "{}'s events", h.id());
    }
    // Requeued, A completes this time: B and C reopen, run and complete, in order.
    steps.failing.store(false, Ordering::SeqCst);
    assert_eq!(admin.requeue_dead(a.id()).await.unwrap(), 2);
    let a_sum: u64 = outputs(&a).await.iter().sum();
    assert_eq!(a_sum, 1);
    assert_eq!(outputs_once_reopened(&b).await, vec![10 + a_sum]);
    assert_eq!(outputs_once_reopened(&c).await, vec![20 + 10 + a_sum]);
    assert!(steps.first_start(&b) >= steps.last_end(&a));
    assert!(steps.first_start(&c) >= steps.last_end(&b));
    w.stop().await;
}

/// An upstream whose finisher does not live to release it (the test build leaves every release
/// to recovery, as if each finisher died right after its finish): recovery's claim of the
/// outbox releases its downstream, a request on another cluster slot, and its own downstream in
/// turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_finisher_died_is_run_by_recovery() {
    let env = env_on(TOPOLOGY, "orphaned-release").await;
    let config = fast(&env.config).test_no_inline_release(true);
    let steps = Steps::default();
    let w = start_worker(&config, steps.clone(), 4, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    // One of each kind of upstream: a lane request, and one of its own stream.
    let a = producer.request().submit(parts(0..1, &[], false)).await.unwrap();
    let b = producer.request().own_stream(true).submit(parts(1..2, &[], false)).await.unwrap();
    let c = producer.request().after(ids(&[&a, &b])).submit(parts(10..11, &[&a, &b], false)).await.unwrap();
    let d = producer.request().after(ids(&[&c])).submit(parts(20..21, &[&c], false)).await.unwrap();
    let started = Instant::now();
    assert_eq!(outputs(&c).await, vec![11]);
    assert_eq!(outputs(&d).await, vec![31]);
    // Two hops, each waiting for its outbox entry to fall due (10 s) and a recovery pass.
    assert!(started.elapsed() < Duration::from_secs(40), "took {:?}", started.elapsed());
    w.stop().await;
}

/// What cannot be waited for is refused at the submit, with an error that names it, and nothing
/// of the refused request is kept: its id can be used again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_after_an_unknown_one_itself_or_with_a_delay_is_refused_and_leaves_nothing() {
    let env = env_on(TOPOLOGY, "dag-refusals").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let unknown = RequestId::new("never-submitted").unwrap();
    let err = producer
        .request()
        .id("d1")
        .unwrap()
        .after([unknown.clone()])
        .submit(parts(0..1, &[], false))
        .await
        .err()
        .unwrap();
    assert!(matches!(&err, Error::UnknownUpstream { id, .. } if *id == unknown), "{err}");
    assert!(err.to_string().contains("never-submitted"), "{err}");
    let itself = RequestId::new("d2").unwrap();
    let err =
        producer.request().id("d2").unwrap().after([itself]).submit(parts(0..1, &[], false)).await.err().unwrap();
    assert!(matches!(err, Error::InvalidRequest(_)), "{err}");
    let a = producer.request().submit(parts(0..1, &[], false)).await.unwrap();
    let err = producer
        .request()
        .after(ids(&[&a]))
        .delay(Duration::from_secs(1))
        .submit(parts(0..1, &[], false))
        .await
        .err()
        .unwrap();
    assert!(matches!(err, Error::InvalidRequest(_)), "{err}");
    let err = producer.request().after(ids(&[&a])).open().await.err().unwrap();
    assert!(matches!(err, Error::InvalidRequest(_)), "{err}");
    // The refused id is free again, and runs as any request.
    let w = start_worker(&env.config, Steps::default(), 2, Quantum::default()).await;
    let d1 = producer.request().id("d1").unwrap().after(ids(&[&a])).submit(parts(5..6, &[&a], false)).await.unwrap();
    assert_eq!(outputs(&d1).await, vec![5]);
    w.stop().await;
}

/// A downstream that reads the results of an upstream that discards them is told so, whether the
/// upstream ran on its lane or on a stream of its own: `Context::upstream` fails with `NoResult`,
/// "its results are discarded", not as if the part had not ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downstream_is_told_that_its_upstream_discards_its_results() {
    let env = env_on(TOPOLOGY, "dag-discarded").await;
    let config = fast(&env.config);
    let steps = Steps::default();
    let w = start_worker(&config, steps.clone(), 4, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    for own in [false, true] {
        let up = producer
            .request()
            .own_stream(own)
            .discard_results(true)
            .submit(parts(0..2, &[], false))
            .await
            .unwrap();
        let done = up.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        assert_eq!((done.state, done.total, done.results.len()), (RequestState::Completed, 2, 0));
        let down = producer.request().after(ids(&[&up])).submit(parts(0..1, &[&up], false)).await.unwrap();
        let done = down.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.state, RequestState::Failed, "own stream {own}: {done:?}");
        let err = done.results[0].as_ref().unwrap_err();
        assert!(err.message.contains("its results are discarded"), "own stream {own}: {err:?}");
    }
    w.stop().await;
}
