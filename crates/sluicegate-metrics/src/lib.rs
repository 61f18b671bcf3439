//! A sluicegate worker's metrics for Prometheus: OpenMetrics text at `/metrics`.
//!
//! Kept out of the `sluicegate` library so that a program embedding workers pulls in no HTTP
//! server or metrics crate unless it wants them. The counters are read from
//! [`WorkerMetrics`] at each scrape; nothing is recorded twice.
//!
//! ```no_run
//! # async fn demo(worker_metrics: std::sync::Arc<sluicegate::WorkerMetrics>) -> std::io::Result<()> {
//! let exporter = sluicegate_metrics::Exporter::new("sluicegate", worker_metrics);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9464").await?;
//! exporter.serve(listener).await
//! # }
//! ```

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use sluicegate::{Admin, Stats, WorkerMetrics};

/// The content type of OpenMetrics text.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves one worker's metrics, labelled with its namespace.
#[derive(Clone)]
pub struct Exporter {
    registry: Arc<Registry>,
}

impl Exporter {
    /// An exporter of `metrics` (from [`sluicegate::Worker::metrics`]), every series labelled
    /// `namespace`.
    pub fn new(namespace: &str, metrics: Arc<WorkerMetrics>) -> Self {
        let mut registry = Registry::with_prefix("sluicegate");
        registry.register_collector(Box::new(WorkerCollector { namespace: namespace.to_owned(), metrics }));
        Self { registry: Arc::new(registry) }
    }

    /// The metrics as OpenMetrics text, as a scrape gets them.
    pub fn text(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    /// Answers `GET /metrics` on `listener` until the task is dropped or aborted.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let app = Router::new().route(
            "/metrics",
            get(move || {
                let text = self.text();
                async move { ([(CONTENT_TYPE, OPENMETRICS)], text).into_response() }
            }),
        );
        axum::serve(listener, app).await
    }
}

/// Serves a namespace's gauges, read from Redis at each scrape by this one process (not by every
/// worker): what waits, what is active, who works, what is paused.
#[derive(Clone)]
pub struct NamespaceExporter {
    admin: Admin,
    namespace: String,
}

impl NamespaceExporter {
    /// Gauges of the namespace `admin` is connected to, labelled `namespace`.
    pub fn new(namespace: &str, admin: Admin) -> Self {
        Self { admin, namespace: namespace.to_owned() }
    }

    /// The gauges as OpenMetrics text; one `Admin::stats` read.
    pub async fn text(&self) -> sluicegate::Result<String> {
        let stats = self.admin.stats().await?;
        let mut registry = Registry::with_prefix("sluicegate");
        registry
            .register_collector(Box::new(NamespaceCollector { namespace: self.namespace.clone(), stats }));
        let mut text = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
        Ok(text)
    }

    /// Answers `GET /metrics` on `listener`; a scrape that cannot read Redis answers 503.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let app = Router::new().route(
            "/metrics",
            get(move || {
                let exporter = self.clone();
                async move {
                    match exporter.text().await {
                        Ok(text) => ([(CONTENT_TYPE, OPENMETRICS)], text).into_response(),
                        Err(e) => {
                            (axum::http::StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response()
                        }
                    }
                }
            }),
        );
        axum::serve(listener, app).await
    }
}

/// One scrape's reading of a namespace.
#[derive(Debug)]
struct NamespaceCollector {
    namespace: String,
    stats: Stats,
}

impl Collector for NamespaceCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let ns = self.namespace.as_str();
        let s = &self.stats;
        let mut waiting = encoder.encode_descriptor(
            "tokens_waiting",
            "Token elements waiting in the priority lists, by priority (a request's tokens, or a lane's)",
            None,
            MetricType::Gauge,
        )?;
        for p in &s.tokens_waiting {
            let priority = p.priority.to_string();
            let labels = [("namespace", ns), ("priority", priority.as_str())];
            ConstGauge::new(i64::try_from(p.tokens).unwrap_or(i64::MAX))
                .encode(waiting.encode_family(&labels)?)?;
        }
        let mut oldest = encoder.encode_descriptor(
            "oldest_waiting_seconds",
            "How long the token next in line at each priority has waited since it was queued",
            None,
            MetricType::Gauge,
        )?;
        for p in &s.tokens_waiting {
            let priority = p.priority.to_string();
            let labels = [("namespace", ns), ("priority", priority.as_str())];
            ConstGauge::new(p.oldest_waiting_ms as f64 / 1000.0).encode(oldest.encode_family(&labels)?)?;
        }
        let mut requests = encoder.encode_descriptor(
            "requests",
            "Requests by state (listing index; finished ones until their retention ends)",
            None,
            MetricType::Gauge,
        )?;
        let r = &s.requests;
        for (state, n) in [
            ("unfinished", r.unfinished),
            ("completed", r.completed),
            ("failed", r.failed),
            ("cancelled", r.cancelled),
        ] {
            let labels = [("namespace", ns), ("state", state)];
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX)).encode(requests.encode_family(&labels)?)?;
        }
        let labels = [("namespace", ns)];
        let slots: usize = s.workers.iter().map(|w| w.slots).sum();
        for (name, help, value) in [
            ("tokens_held", "Tokens held by worker slots now (their take records)", s.tokens_held),
            ("requests_active", "Requests not yet done with (recovery's index)", s.active_requests),
            ("workers", "Workers whose registration is fresh", s.workers.len() as u64),
            ("worker_slots", "Slots of those workers", slots as u64),
            (
                "token_capacity",
                "Tokens the unfinished requests own (each one's min(limit, parts), each lane's limit): waiting + held + parked, once recovery has repaired any drift",
                s.tally.token_capacity,
            ),
            (
                "tokens_parked",
                "Tokens parked: their request had nothing to hand out (parts running or backing off, a streamed request waiting for parts, a scheduled one for its time)",
                s.tally.tokens_parked,
            ),
            (
                "dead_letters",
                "Dead letters held by failed requests within their retention and by unfinished requests with keys of their own",
                s.tally.dead_letters,
            ),
            ("tally_complete", "1 when token_capacity, tokens_parked and dead_letters cover every request (0: they cover the first sluicegate::MAX_TALLY records only)", u64::from(s.tally.complete)),
            ("redis_memory_bytes", "Memory Redis uses (used_memory), summed over a cluster's primaries", s.redis_memory_bytes),
        ] {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            let mut family = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            gauge.encode(family.encode_family(&labels)?)?;
        }
        let mut paused = encoder.encode_descriptor(
            "paused",
            "1 for what an operator paused: scope \"all\" (the namespace) or a priority",
            None,
            MetricType::Gauge,
        )?;
        let scopes = s.paused.all.then(|| "all".to_owned()).into_iter();
        for scope in scopes.chain(s.paused.priorities.iter().map(u8::to_string)) {
            let labels = [("namespace", ns), ("scope", scope.as_str())];
            ConstGauge::new(1i64).encode(paused.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// Reads a worker's counters at each scrape.
#[derive(Debug)]
struct WorkerCollector {
    namespace: String,
    metrics: Arc<WorkerMetrics>,
}

impl Collector for WorkerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = &self.metrics;
        let ns = self.namespace.as_str();
        let mut outcomes = encoder.encode_descriptor(
            "subrequests",
            "Sub-request attempts this worker ended, by outcome: succeeded (result stored), retried (failed, to run again), dead_lettered (failed for good)",
            None,
            MetricType::Counter,
        )?;
        for (outcome, count) in
            [("succeeded", &m.succeeded), ("retried", &m.retried), ("dead_lettered", &m.dead_lettered)]
        {
            let labels = [("namespace", ns), ("outcome", outcome)];
            ConstCounter::new(count.load(Relaxed)).encode(outcomes.encode_family(&labels)?)?;
        }
        let labels = [("namespace", ns)];
        for (name, help, count) in [
            (
                "fenced_acks",
                "Acks refused because this slot no longer held the token as it was (the request was cancelled, or this worker declared dead); their results were dropped",
                &m.fenced,
            ),
            (
                "tokens_restored",
                "Tokens this worker's recovery put back in circulation (reclaimed from dead workers, lost elements restored, parked tokens woken)",
                &m.tokens_restored,
            ),
            (
                "holds_reclaimed",
                "Tokens this worker's recovery took back from dead workers' slots (their batches run again)",
                &m.holds_reclaimed,
            ),
            (
                "leases_lost",
                "Holds this worker's slots lost while their handlers ran (the token or a lane entry's request moved on, or this worker was declared dead); the handlers were told to stop",
                &m.leases_lost,
            ),
            (
                "redis_errors",
                "Calls to Redis by this worker that failed: unreachable, timed out, or an error reply (not the library's refusals)",
                &m.redis_errors,
            ),
            (
                "hand_offs",
                "Tokens handed to this worker's waiting slots (a reserved slot, or an idle worker's standby) by a small request's submit or another request's push: run without a take",
                &m.handed_off,
            ),
            (
                "handed_back",
                "Sub-requests this worker's slots reported unrun in their acks (the rest of a first batch past its budget or of a batch at a stop, runs stopped as their hold ended or at their request's deadline); those whose request goes on run again first, with no attempt spent",
                &m.handed_back,
            ),
            (
                "schedule_submits",
                "Schedule ticks whose request this worker's recovery created",
                &m.schedule_submits,
            ),
            (
                "schedule_duplicates",
                "Schedule ticks whose submit here found the tick's request there already (another worker created it): refused, as meant",
                &m.schedule_duplicates,
            ),
            (
                "schedule_conflicts",
                "Schedule firings refused because the schedule changed after this worker read it (another worker fired it, or an operator changed it)",
                &m.schedule_conflicts,
            ),
        ] {
            let counter = ConstCounter::new(count.load(Relaxed));
            let mut family = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(family.encode_family(&labels)?)?;
        }
        let busy = ConstGauge::new(i64::try_from(m.busy_slots.load(Relaxed)).unwrap_or(i64::MAX));
        let mut family = encoder.encode_descriptor(
            "slots_busy",
            "Slots running a handler now",
            None,
            busy.metric_type(),
        )?;
        busy.encode(family.encode_family(&labels)?)?;
        let (sum, count, buckets) = m.run_time.snapshot();
        let mut family = encoder.encode_descriptor(
            "run",
            "How long handler runs took (every attempt)",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        family
            .encode_family(&labels)?
            .encode_histogram::<Vec<(String, String)>>(sum, count, &buckets, None)?;
        let (sum, count, buckets) = m.queue_wait.snapshot();
        let mut family = encoder.encode_descriptor(
            "queue_wait",
            "How long the requests this worker started had waited from their submit to their first part's start",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        family
            .encode_family(&labels)?
            .encode_histogram::<Vec<(String, String)>>(sum, count, &buckets, None)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_names_every_series_with_its_namespace_and_ends_with_eof() {
        let metrics = Arc::new(WorkerMetrics::default());
        metrics.succeeded.fetch_add(3, Relaxed);
        metrics.dead_lettered.fetch_add(1, Relaxed);
        let text = Exporter::new("ns1", metrics).text();
        assert!(
            text.contains("sluicegate_subrequests_total{namespace=\"ns1\",outcome=\"succeeded\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("sluicegate_subrequests_total{namespace=\"ns1\",outcome=\"dead_lettered\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("sluicegate_run_seconds_count{namespace=\"ns1\"} 0\n"), "{text}");
        assert!(text.contains("sluicegate_queue_wait_seconds_count{namespace=\"ns1\"} 0\n"), "{text}");
        assert!(
            text.contains("sluicegate_queue_wait_seconds_bucket{le=\"3600.0\",namespace=\"ns1\"} 0\n"),
            "{text}"
        );
        assert!(text.contains("sluicegate_leases_lost_total{namespace=\"ns1\"} 0\n"), "{text}");
        assert!(text.contains("sluicegate_redis_errors_total{namespace=\"ns1\"} 0\n"), "{text}");
        assert!(text.contains("sluicegate_schedule_submits_total{namespace=\"ns1\"} 0\n"), "{text}");
        assert!(text.contains("# TYPE sluicegate_slots_busy gauge\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
