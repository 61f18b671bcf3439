//! OpenTelemetry spans (feature `otel`, which the tests build with: see the dev-dependencies in
//! Cargo.toml): a submit made inside a caller's span gets one `send` span, child of the caller's,
//! whose context the request carries in Redis to every run of its parts; each run gets a `process`
//! span, child of (and linked to) that send span, current while the handler runs.
//!
//! The spans go to an in-memory exporter installed as the global tracer provider, with the W3C
//! propagator, once for the whole binary; each test looks only at the spans of its own trace.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::Duration;

use fred::prelude::{HashesInterface, KeysInterface};
use opentelemetry::context::FutureExt;
use opentelemetry::trace::{SpanId, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{global, Context as Cx, Value};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sluicegate::{async_trait, Context, Handler, HandlerError, Producer, Quantum, RequestState};
use sluicegate_testkit::{connect, Topology};
use support::{env_on, env_streams, start_worker, Job};

/// The spans ended so far, of every test of this binary; installed on first use.
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        global::set_tracer_provider(
            SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build(),
        );
        global::set_text_map_propagator(TraceContextPropagator::new());
        exporter
    })
}

/// A context whose current span is a new root span, `caller`, as a program that submits inside a
/// span of its own has.
fn caller() -> Cx {
    exporter();
    Cx::current_with_span(global::tracer("test").start("caller"))
}

/// Ends the caller's span and returns every span of its trace that ended.
fn trace_of(caller: &Cx) -> Vec<SpanData> {
    caller.span().end();
    let trace = caller.span().span_context().trace_id();
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace)
        .collect()
}

/// Whether `span` links to the span of `to`.
fn links_to(span: &SpanData, to: &SpanData) -> bool {
    let to = &to.span_context;
    span.links
        .iter()
        .any(|l| l.span_context.trace_id() == to.trace_id() && l.span_context.span_id() == to.span_id())
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn attr(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.clone())
}

fn text(span: &SpanData, key: &str) -> String {
    attr(span, key).map(|v| v.as_str().into_owned()).unwrap_or_default()
}

fn int(span: &SpanData, key: &str) -> Option<i64> {
    match attr(span, key) {
        Some(Value::I64(n)) => Some(n),
        _ => None,
    }
}

/// What every span of the messaging conventions carries here.
fn assert_messaging(span: &SpanData, operation: &str, ns: &str, request: &str) {
    assert_eq!(text(span, "messaging.system"), "sluicegate", "{span:?}");
    assert_eq!(text(span, "messaging.operation.type"), operation, "{span:?}");
    assert_eq!(text(span, "messaging.operation.name"), operation, "{span:?}");
    assert_eq!(text(span, "messaging.destination.name"), ns, "{span:?}");
    assert_eq!(text(span, "messaging.message.id"), request, "{span:?}");
}

/// One run as its process span tells it.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Ran {
    index: i64,
    attempt: i64,
    outcome: String,
    /// Its status is an error.
    failed: bool,
}

fn ran(index: i64, attempt: i64, outcome: &str, failed: bool) -> Ran {
    Ran { index, attempt, outcome: outcome.to_owned(), failed }
}

/// The process spans: each a consumer span, child of `send` and linked to it, of `request`;
/// returned as runs, sorted, and the ids of the spans.
fn runs(spans: &[SpanData], ns: &str, request: &str, send: &SpanData) -> (Vec<Ran>, Vec<SpanId>) {
    let mut runs = Vec::new();
    let mut ids = Vec::new();
    for run in named(spans, &format!("process {ns}")) {
        assert_eq!(run.span_kind, SpanKind::Consumer);
        assert_messaging(run, "process", ns, request);
        assert_eq!(
            run.parent_span_id,
            send.span_context.span_id(),
            "a run is a child of its request's send span"
        );
        assert!(run.parent_span_is_remote, "its parent came through Redis");
        assert!(links_to(run, send), "a run links to its request's send span: {run:?}");
        let failed = match &run.status {
            Status::Error { description } => {
                assert!(description.contains("on purpose"), "{description}");
                assert!(matches!(text(run, "error.type").as_str(), "retryable" | "permanent"));
                true
            }
            Status::Unset => false,
            Status::Ok => panic!("the library leaves a success's status unset: {run:?}"),
        };
        let (index, attempt) =
            (int(run, "sluicegate.part.index").unwrap(), int(run, "sluicegate.part.attempt").unwrap());
        runs.push(ran(index, attempt, &text(run, "sluicegate.part.outcome"), failed));
        ids.push(run.span_context.span_id());
    }
    runs.sort();
    (runs, ids)
}

/// Doubles `n`, or fails when told; starts a span of its own, which must nest under the run's.
struct Traced;

#[async_trait]
impl Handler for Traced {
    type Input = Job;
    type Output = u64;

    async fn handle(&self, _ctx: Context, job: Job) -> Result<u64, HandlerError> {
        drop(global::tracer("handler").start("work"));
        if job.fail {
            return Err(HandlerError::new(format!("job {} failed on purpose", job.n)));
        }
        Ok(job.n * 2)
    }
}

fn failing(n: u64) -> Job {
    Job { n, fail: true, ..Job::default() }
}

/// The user's spans inside the handler are children of a run's process span.
fn assert_work_nests_under(spans: &[SpanData], runs: &[SpanId]) {
    let work = named(spans, "work");
    assert_eq!(work.len(), runs.len(), "one handler span per run");
    for w in work {
        assert!(runs.contains(&w.parent_span_id), "a handler's span is not a child of its run's: {w:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_request_carries_its_send_span_to_every_run_of_its_parts() {
    let env = env_streams(Topology::Single, "otel-stream").await;
    let ns = env.config.namespace_str().to_owned();
    let cx = caller();
    let w = start_worker(&env.config, Traced, 2, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();

    let parts = [Job::new(1), Job::new(2), failing(3)];
    let spec = producer.request().priority(70).unwrap().concurrency(2).unwrap();
    let handle = spec.submit(parts).with_context(cx.clone()).await.unwrap();
    let done = handle.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.state, RequestState::Failed);
    let redis = connect(env.redis.url()).await.unwrap();
    let meta = format!("{ns}:r:{{{}}}", handle.id().key_id());
    let carried: Option<String> = redis.hget(&meta, "trace").await.unwrap();
    w.stop().await;

    let spans = trace_of(&cx);
    let id = handle.id().as_str();
    let sends = named(&spans, &format!("send {ns}"));
    assert_eq!(sends.len(), 1, "one send span per submit: {sends:?}");
    let send = sends[0];
    assert_eq!(send.span_kind, SpanKind::Producer);
    assert_eq!(
        send.parent_span_id,
        cx.span().span_context().span_id(),
        "the send is a child of the caller's span"
    );
    assert_messaging(send, "send", &ns, id);
    assert_eq!(int(send, "messaging.batch.message_count"), Some(3));
    assert_eq!(int(send, "sluicegate.request.priority"), Some(70));
    assert_eq!(send.status, Status::Unset);
    let carried = carried.expect("the meta hash carries the trace context");
    let traceparent = format!("00-{}-{}-01", send.span_context.trace_id(), send.span_context.span_id());
    assert_eq!(carried, format!(r#"{{"traceparent":"{traceparent}"}}"#), "W3C trace context, as JSON");

    let (runs, ids) = runs(&spans, &ns, id, send);
    let expected = [ran(0, 1, "ok", false), ran(1, 1, "ok", false), ran(2, 1, "dead", true)];
    assert_eq!(runs, expected, "one process span per part, the failed one in error");
    for run in named(&spans, &format!("process {ns}")) {
        assert_eq!(int(run, "sluicegate.request.priority"), Some(70));
    }
    assert_work_nests_under(&spans, &ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_request_carries_it_in_its_lane_record_and_each_attempt_has_its_span() {
    let env = env_on(Topology::Single, "otel-lane").await;
    let ns = env.config.namespace_str().to_owned();
    let cx = caller();
    let w = start_worker(&env.config, Traced, 2, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();

    let spec = producer.request().concurrency(2).unwrap().max_attempts(2).unwrap();
    let spec = spec.backoff(Duration::from_millis(10), Duration::from_millis(10)).unwrap();
    let handle = spec.submit([Job::new(1), failing(2)]).with_context(cx.clone()).await.unwrap();
    let done = handle.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.state, RequestState::Failed);
    let redis = connect(env.redis.url()).await.unwrap();
    let kid = handle.id().key_id();
    let own: i64 = redis.exists(format!("{ns}:r:{{{kid}}}")).await.unwrap();
    assert_eq!(own, 0, "a small request takes its priority's lane");
    let carried: Option<String> = redis.hget(format!("{ns}:{{{ns}.q0}}:s:{kid}"), "trace").await.unwrap();
    w.stop().await;

    let spans = trace_of(&cx);
    let id = handle.id().as_str();
    let sends = named(&spans, &format!("send {ns}"));
    assert_eq!(sends.len(), 1, "{sends:?}");
    let send = sends[0];
    assert_eq!(send.span_kind, SpanKind::Producer);
    assert_eq!(send.parent_span_id, cx.span().span_context().span_id());
    assert_messaging(send, "send", &ns, id);
    assert_eq!(int(send, "messaging.batch.message_count"), Some(2));
    let carried = carried.expect("the lane record carries the trace context");
    assert!(carried.contains(&send.span_context.span_id().to_string()), "{carried}");

    let (runs, ids) = runs(&spans, &ns, id, send);
    let expected = [ran(0, 1, "ok", false), ran(1, 1, "retry", true), ran(1, 2, "dead", true)];
    assert_eq!(runs, expected, "one process span per run, a retried attempt's in error too");
    assert_work_nests_under(&spans, &ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_request_carries_the_span_of_its_open_and_each_add_has_a_send_span() {
    let env = env_on(Topology::Single, "otel-open").await;
    let ns = env.config.namespace_str().to_owned();
    let cx = caller();
    let w = start_worker(&env.config, Traced, 2, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();

    let mut open = producer.request().concurrency(2).unwrap().open().with_context(cx.clone()).await.unwrap();
    open.add([Job::new(1), Job::new(2)]).with_context(cx.clone()).await.unwrap();
    open.add([Job::new(3)]).with_context(cx.clone()).await.unwrap();
    let handle = open.finalize().await.unwrap();
    let done = handle.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.into_outputs().unwrap(), [2, 4, 6]);
    w.stop().await;

    let spans = trace_of(&cx);
    let id = handle.id().as_str();
    let sends = named(&spans, &format!("send {ns}"));
    assert_eq!(sends.len(), 3, "the open's, and one per add: {sends:?}");
    let caller_id = cx.span().span_context().span_id();
    for send in &sends {
        assert_eq!(send.span_kind, SpanKind::Producer);
        assert_eq!(send.parent_span_id, caller_id);
        assert_messaging(send, "send", &ns, id);
    }
    let opened: Vec<_> = sends.iter().filter(|s| s.links.is_empty()).collect();
    assert_eq!(opened.len(), 1, "the open's send span links to nothing");
    let opened = *opened[0];
    let mut added: Vec<i64> = Vec::new();
    for add in sends.iter().filter(|s| !s.links.is_empty()) {
        assert!(
            add.links.iter().any(|l| l.span_context == opened.span_context),
            "an add links to the open's span"
        );
        added.push(int(add, "messaging.batch.message_count").unwrap());
    }
    added.sort_unstable();
    assert_eq!(added, [1, 2], "each add counts its parts");

    let (runs, ids) = runs(&spans, &ns, id, opened);
    let indexes: BTreeSet<i64> = runs.iter().map(|r| r.index).collect();
    assert_eq!(indexes, BTreeSet::from([0, 1, 2]), "every part's run is a child of the open's send span");
    assert!(runs.iter().all(|r| r.outcome == "ok" && !r.failed), "{runs:?}");
    assert_work_nests_under(&spans, &ids);
}
