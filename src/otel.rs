//! OpenTelemetry spans (cargo feature `otel`; docs/operations.md, "Tracing"), named as the
//! messaging semantic conventions name them: a `send <namespace>` span (kind producer) around each
//! submit, `open` and `add`, and a `process <namespace>` span (kind consumer) around each run of a
//! handler.
//!
//! A request's send span's context goes to Redis with the request, injected with the global
//! text-map propagator as a JSON object (field `trace` of its meta hash, or of its lane record:
//! docs/protocol.md §4, "Trace context"). Each run reads it back, extracts it, starts its process
//! span as its child (with a link to it too) and runs the handler with that span current, so that
//! spans the handler starts nest under it. Spans go to the global tracer provider: the program
//! installs whatever SDK, exporter and propagator it likes. Until it installs a propagator (the
//! default one is a no-op) nothing is written to Redis and no worker reads the field.
//!
//! Without the feature the same types are empty and their methods do nothing, so that the producer
//! and the slots call them without a `cfg` of their own.

#[cfg(feature = "otel")]
pub(crate) use on::{Carried, ProcessSpan, RequestSpan, SendSpan};

#[cfg(not(feature = "otel"))]
pub(crate) use off::{Carried, ProcessSpan, RequestSpan, SendSpan};

/// How a run of a handler ended, for its process span.
#[cfg_attr(not(feature = "otel"), allow(dead_code))]
pub(crate) enum Ended<'a> {
    /// Its result is stored.
    Ok,
    /// It did not run to an end of its own (stopping, cancelled): handed out again, no attempt spent.
    Skipped,
    /// It failed: `last` when it is dead-lettered (permanent, or out of attempts), else retried.
    Failed { message: &'a str, permanent: bool, last: bool },
}

#[cfg(feature = "otel")]
mod on {
    use std::collections::{BTreeMap, HashMap};
    use std::future::Future;

    use opentelemetry::context::FutureExt;
    use opentelemetry::trace::{Link, SpanContext, SpanKind, Status, TraceContextExt, Tracer};
    use opentelemetry::{global, Context as Cx, InstrumentationScope, KeyValue};

    use super::Ended;
    use crate::error::{Error, Result};
    use crate::protocol::tokens::Entry;
    use crate::request::{Priority, RequestId};
    use crate::store::Store;

    /// The field of a request's meta hash, or of a lane request's record, that carries its trace
    /// context.
    const FIELD: &str = "trace";

    /// The largest trace context carried (the functions refuse larger ones): a propagator that
    /// injects more (a large baggage, say) carries nothing.
    const MAX_BYTES: usize = 4096;

    fn tracer() -> global::BoxedTracer {
        let scope =
            InstrumentationScope::builder("sluicegate").with_version(env!("CARGO_PKG_VERSION")).build();
        global::tracer_with_scope(scope)
    }

    /// Whether the program installed a propagator: without one there is nothing to carry.
    fn propagating() -> bool {
        global::get_text_map_propagator(|p| p.fields().next().is_some())
    }

    /// The attributes a send and a process span share.
    fn attributes(
        operation: &'static str,
        namespace: &str,
        id: &RequestId,
        priority: Priority,
    ) -> Vec<KeyValue> {
        vec![
            KeyValue::new("messaging.system", "sluicegate"),
            KeyValue::new("messaging.operation.type", operation),
            KeyValue::new("messaging.operation.name", operation),
            KeyValue::new("messaging.destination.name", namespace.to_owned()),
            KeyValue::new("messaging.message.id", id.as_str().to_owned()),
            KeyValue::new("sluicegate.request.priority", i64::from(priority.get())),
        ]
    }

    /// A span started as a child of `parent`, in a context of its own.
    fn start(parent: &Cx, name: String, kind: SpanKind, attributes: Vec<KeyValue>, links: Vec<Link>) -> Cx {
        let tracer = tracer();
        let span = tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .with_links(links)
            .start_with_context(&tracer, parent);
        parent.with_span(span)
    }

    /// The context of `cx`'s span as the global propagator writes it, as a JSON object of its
    /// fields (W3C Trace Context: `traceparent`, and `tracestate` when there is one); empty when
    /// there is nothing to carry.
    fn inject(cx: &Cx) -> String {
        if !cx.span().span_context().is_valid() {
            return String::new();
        }
        let mut fields: HashMap<String, String> = HashMap::new();
        global::get_text_map_propagator(|p| p.inject_context(cx, &mut fields));
        // The W3C propagator writes an empty `tracestate` when there is none.
        fields.retain(|_, value| !value.is_empty());
        if fields.is_empty() {
            return String::new();
        }
        let fields: BTreeMap<String, String> = fields.into_iter().collect();
        match serde_json::to_string(&fields) {
            Ok(json) if json.len() <= MAX_BYTES => json,
            _ => {
                tracing::debug!("the trace context is larger than {MAX_BYTES} bytes; not carried");
                String::new()
            }
        }
    }

    /// The context a carried trace context stands for; a fresh one (no parent) when it is empty,
    /// malformed, or not the installed propagator's.
    fn extract(carried: &str) -> Cx {
        if carried.is_empty() {
            return Cx::new();
        }
        match serde_json::from_str::<HashMap<String, String>>(carried) {
            Ok(fields) => global::get_text_map_propagator(|p| p.extract_with_context(&Cx::new(), &fields)),
            Err(_) => Cx::new(),
        }
    }

    /// A low-cardinality name of a failed send (`error.type`).
    fn error_type(e: &Error) -> &'static str {
        match e {
            Error::Config(_) => "config",
            Error::InvalidRequestId(_) | Error::InvalidRequest(_) => "invalid_request",
            Error::DuplicateRequestId(_) => "duplicate_request_id",
            Error::UnknownRequest(_) => "unknown_request",
            Error::UnknownUpstream { .. } => "unknown_upstream",
            Error::NoResult { .. } => "no_result",
            Error::InvalidCursor(_) => "invalid_cursor",
            Error::Codec(_) => "codec",
            Error::Redis(_) => "redis",
            Error::Expired(_) => "expired",
            Error::NotOpen(_) => "not_open",
            Error::NoDeadLetters(_) => "no_dead_letters",
            Error::UnsupportedRedis { .. } => "unsupported_redis",
            Error::Protocol(_) => "protocol",
            Error::Timeout(_) => "timeout",
            Error::Refused(_) => "refused",
            Error::Shutdown => "shutdown",
            Error::InvalidSchedule(_) => "invalid_schedule",
            Error::UnknownSchedule(_) => "unknown_schedule",
            Error::ScheduleExists(_) => "schedule_exists",
        }
    }

    /// A send span: a submit, an `open`, or an `add` of parts to a streamed request.
    pub(crate) struct SendSpan {
        cx: Cx,
    }

    impl SendSpan {
        /// The send span of request `id`, started now as a child of the caller's current context:
        /// the one whose context the request carries (`carried`).
        pub(crate) fn request(namespace: &str, id: &RequestId, priority: Priority) -> Self {
            let attributes = attributes("send", namespace, id, priority);
            Self {
                cx: start(
                    &Cx::current(),
                    format!("send {namespace}"),
                    SpanKind::Producer,
                    attributes,
                    Vec::new(),
                ),
            }
        }

        /// The send span of parts added to streamed request `id`, child of the caller's current
        /// context and linked to the request's own send span (`request`), whose context the parts
        /// carry.
        pub(crate) fn parts(
            namespace: &str,
            id: &RequestId,
            priority: Priority,
            request: &RequestSpan,
        ) -> Self {
            let links =
                if request.0.is_valid() { vec![Link::with_context(request.0.clone())] } else { Vec::new() };
            let attributes = attributes("send", namespace, id, priority);
            Self {
                cx: start(&Cx::current(), format!("send {namespace}"), SpanKind::Producer, attributes, links),
            }
        }

        /// The trace context to store with the request (empty: none).
        pub(crate) fn carried(&self) -> String {
            if propagating() {
                inject(&self.cx)
            } else {
                String::new()
            }
        }

        /// The span, for the send spans of parts added later to link to.
        pub(crate) fn link(&self) -> RequestSpan {
            RequestSpan(self.cx.span().span_context().clone())
        }

        /// How many parts were sent (`messaging.batch.message_count`).
        pub(crate) fn count(&self, parts: u64) {
            let parts = i64::try_from(parts).unwrap_or(i64::MAX);
            self.cx.span().set_attribute(KeyValue::new("messaging.batch.message_count", parts));
        }

        /// Ends the span, with an error status if the send failed.
        pub(crate) fn end<T>(self, result: &Result<T>) {
            let span = self.cx.span();
            if let Err(e) = result {
                span.set_attribute(KeyValue::new("error.type", error_type(e)));
                span.set_status(Status::error(e.to_string()));
            }
            span.end();
        }
    }

    /// A request's send span, as the sends of its later parts link to it.
    #[derive(Clone, Debug)]
    pub(crate) struct RequestSpan(SpanContext);

    /// The trace contexts of the requests a slot runs parts of during one hold of a token: its
    /// request's, or, for a lane's token, each lane request's.
    #[derive(Default)]
    pub(crate) struct Carried {
        /// The request's (read at most once per hold).
        request: Option<String>,
        /// Each lane request's: key id, lifecycle, trace context.
        lanes: Vec<(String, String, String)>,
    }

    impl Carried {
        /// Nothing read yet.
        pub(crate) fn new() -> Self {
            Self::default()
        }

        /// Reads the trace contexts of the requests of `entries` this hold has not read yet: that
        /// of the request whose meta hash is `meta`, or, for lane entries, those of their records
        /// (on `shard`). One round trip when there is something new (lane records are read
        /// together), none otherwise, nor while no propagator is installed. A failed read only
        /// leaves those runs without a parent.
        pub(crate) async fn learn(&mut self, store: &Store, meta: &str, shard: u32, entries: &[Entry]) {
            use fred::interfaces::HashesInterface;
            if !propagating() {
                return;
            }
            let mut new: Vec<(&str, &str)> = Vec::new();
            let mut request = false;
            for entry in entries {
                match &entry.lane {
                    Some(lane) => {
                        let (kid, lc) = (lane.key_id.as_str(), lane.lifecycle.as_str());
                        let known = self.lanes.iter().any(|(k, l, _)| k == kid && l == lc);
                        if !known && !new.contains(&(kid, lc)) {
                            new.push((kid, lc));
                        }
                    }
                    None => request = self.request.is_none(),
                }
            }
            if request {
                let read = store.client.hget::<Option<String>, _, _>(meta, FIELD).await;
                self.request = Some(
                    read.unwrap_or_else(|e| {
                        tracing::debug!(error = %e, "could not read the request's trace context");
                        None
                    })
                    .unwrap_or_default(),
                );
            }
            if new.is_empty() {
                return;
            }
            // Sent together: the client pipelines them, one round trip for the batch.
            let reads = new.iter().map(|(kid, _)| {
                let record = store.keys.record(shard, kid);
                async move { store.client.hget::<Option<String>, _, _>(record, FIELD).await }
            });
            for ((kid, lc), read) in new.iter().zip(futures::future::join_all(reads).await) {
                let carried = read.unwrap_or_else(|e| {
                    tracing::debug!(error = %e, "could not read a lane request's trace context");
                    None
                });
                self.lanes.push(((*kid).to_owned(), (*lc).to_owned(), carried.unwrap_or_default()));
            }
        }

        /// The trace context `entry`'s request carries (empty: none, or not read).
        pub(crate) fn of(&self, entry: &Entry) -> &str {
            match &entry.lane {
                Some(lane) => self
                    .lanes
                    .iter()
                    .find(|(k, l, _)| *k == lane.key_id && *l == lane.lifecycle)
                    .map_or("", |(_, _, carried)| carried.as_str()),
                None => self.request.as_deref().unwrap_or(""),
            }
        }
    }

    /// The process span of one run of a handler.
    pub(crate) struct ProcessSpan {
        cx: Cx,
    }

    impl ProcessSpan {
        /// Starts the span of a run of part `index` of request `id`, child of (and linked to) the
        /// send span whose context the request carries (`carried`; none: a span with no parent).
        pub(crate) fn start(
            namespace: &str,
            id: &RequestId,
            priority: Priority,
            index: u64,
            attempt: u32,
            carried: &str,
        ) -> Self {
            let parent = extract(carried);
            let sent = parent.span().span_context().clone();
            let links = if sent.is_valid() { vec![Link::with_context(sent)] } else { Vec::new() };
            let mut attributes = attributes("process", namespace, id, priority);
            attributes.extend([
                KeyValue::new("sluicegate.part.index", i64::try_from(index).unwrap_or(i64::MAX)),
                KeyValue::new("sluicegate.part.attempt", i64::from(attempt)),
            ]);
            Self { cx: start(&parent, format!("process {namespace}"), SpanKind::Consumer, attributes, links) }
        }

        /// `handler` run with the span current, so that spans it starts are children of it.
        pub(crate) fn attach<F: Future>(&self, handler: F) -> impl Future<Output = F::Output> {
            handler.with_context(self.cx.clone())
        }

        /// Ends the span with the run's outcome (`sluicegate.part.outcome`: `ok`, `retry`, `dead`
        /// or `skipped`), and an error status if it failed.
        pub(crate) fn end(self, ended: Ended<'_>) {
            let span = self.cx.span();
            let outcome = match ended {
                Ended::Ok => "ok",
                Ended::Skipped => "skipped",
                Ended::Failed { message, permanent, last } => {
                    span.set_attribute(KeyValue::new(
                        "error.type",
                        if permanent { "permanent" } else { "retryable" },
                    ));
                    span.set_status(Status::error(message.to_owned()));
                    if last {
                        "dead"
                    } else {
                        "retry"
                    }
                }
            };
            span.set_attribute(KeyValue::new("sluicegate.part.outcome", outcome));
            span.end();
        }
    }
}

/// The shims without the feature: nothing is started, carried or read.
#[cfg(not(feature = "otel"))]
mod off {
    use std::future::Future;

    use super::Ended;
    use crate::error::Result;
    use crate::protocol::tokens::Entry;
    use crate::request::{Priority, RequestId};
    use crate::store::Store;

    pub(crate) struct SendSpan;

    impl SendSpan {
        pub(crate) fn request(_: &str, _: &RequestId, _: Priority) -> Self {
            Self
        }

        pub(crate) fn parts(_: &str, _: &RequestId, _: Priority, _: &RequestSpan) -> Self {
            Self
        }

        pub(crate) fn carried(&self) -> String {
            String::new()
        }

        pub(crate) fn link(&self) -> RequestSpan {
            RequestSpan
        }

        pub(crate) fn count(&self, _: u64) {}

        pub(crate) fn end<T>(self, _: &Result<T>) {}
    }

    #[derive(Clone, Debug)]
    pub(crate) struct RequestSpan;

    pub(crate) struct Carried;

    impl Carried {
        pub(crate) fn new() -> Self {
            Self
        }

        pub(crate) async fn learn(&mut self, _: &Store, _: &str, _: u32, _: &[Entry]) {}

        pub(crate) fn of(&self, _: &Entry) -> &str {
            ""
        }
    }

    pub(crate) struct ProcessSpan;

    impl ProcessSpan {
        pub(crate) fn start(_: &str, _: &RequestId, _: Priority, _: u64, _: u32, _: &str) -> Self {
            Self
        }

        pub(crate) fn attach<F: Future>(&self, handler: F) -> F {
            handler
        }

        pub(crate) fn end(self, _: Ended<'_>) {}
    }
}
