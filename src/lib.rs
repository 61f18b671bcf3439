//! # sluicegate
//!
//! Distributed batch processing on Redis. A producer submits a **request** split into many
//! **sub-requests**; workers anywhere run them through your async [`Handler`]; the producer gets
//! the results back in order. Each request has a **priority** (0-99) and a **concurrency limit**
//! N: at most N of its sub-requests run at once across all workers, so one huge request cannot
//! starve the others, and urgent requests go first.
//!
//! ## The model in five minutes
//! - A request's sub-requests live in their own Redis stream, read through a consumer group.
//! - The request has N **tokens**. Tokens wait in one Redis list per priority; a worker **slot**
//!   takes one with `BRPOP` across all lists, highest priority first, and runs sub-requests of
//!   that request while it holds the token. After a bounded **quantum** it gives the token back,
//!   so higher priorities get through.
//! - Each state change is one atomic function of a Redis Functions library (`lua/`); the ack that
//!   stores a result also hands out the next sub-request, so a busy slot needs one round trip per
//!   sub-request.
//! - When the last sub-request is acked the request turns terminal in the same step: a durable
//!   record, a pub/sub doorbell, an entry in the events stream that [`Listener`]s read.
//!
//! ```no_run
//! use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Producer, Worker};
//!
//! struct Shout;
//!
//! #[async_trait]
//! impl Handler for Shout {
//!     type Input = String;
//!     type Output = String;
//!     async fn handle(&self, _ctx: Context, line: String) -> Result<String, HandlerError> {
//!         Ok(line.to_uppercase())
//!     }
//! }
//!
//! # async fn demo() -> sluicegate::Result<()> {
//! let config = Config::from_env().namespace("demo");
//! let worker = Worker::builder(&config, Shout).slots(8).build().await?;
//! tokio::spawn(worker.run());
//!
//! let producer = Producer::connect(&config).await?;
//! let handle = producer.request().concurrency(3)?.submit(["a", "b", "c"]).await?;
//! let outputs = handle.wait::<String>().await?.into_outputs().expect("no part failed");
//! assert_eq!(outputs, ["A", "B", "C"]);
//! # Ok(()) }
//! ```
//!
//! docs/architecture.md argues the invariants; docs/protocol.md documents the Redis keys and
//! functions precisely enough to write a client in another language.
//!
//! ## Cargo features
//! - `tls` (default): `rediss://` connections, through rustls.
//! - `otel`: OpenTelemetry spans, `send <namespace>` around each submit and `process <namespace>`
//!   around each handler run, with the trace context carried in Redis from one to the other; they
//!   go to the global tracer provider and propagator of the `opentelemetry` crate
//!   (docs/operations.md, "Tracing").
//! - `schedules` (default): cron-driven requests (`ScheduleSpec`, `Admin::schedule_add`),
//!   fired by every worker's recovery, exactly once per tick (docs/operations.md, "Schedules").
//!   It brings the `croner` and `chrono-tz` crates (the time zone database, about 1 MB); a worker
//!   built without it fires no schedule (the others still do).

mod admin;
#[cfg(test)]
mod check;
mod chunk;
pub mod codec;
mod config;
mod error;
mod events;
mod hangup;
mod keys;
#[cfg(test)]
mod layering;
mod loader;
mod otel;
mod producer;
pub mod protocol;
mod reply;
mod request;
#[cfg(feature = "schedules")]
mod schedule;
mod shards;
mod stats;
mod store;
#[cfg(feature = "tls")]
mod tls;
mod worker;

pub use admin::{
    Admin, DeadLetter, GroupStatus, IndexedError, ListPage, ListQuery, ListState, ListedRequest, Paused,
    PriorityTokens, RateLimit, Reprioritized, RequestCounts, RequestStatus, RequestTokens, SlotWork, Stats,
    Tally, TokenAudit, TokenState, Upstream, WorkerInfo, DEFAULT_GROUP_LIMIT, MAX_GROUPS_LISTED,
    MAX_GROUP_LIMIT, MAX_LIST_LIMIT, MAX_LIST_LOOK, MAX_TALLY, MAX_TOKEN_AUDIT, STATUS_DOWNSTREAMS,
    STATUS_ERRORS,
};
pub use async_trait::async_trait;
pub use chunk::{chunks, Chunk, Chunked, Chunks, MAX_CHUNK};
pub use config::{Config, DEFAULT_REDIS_URL};
pub use error::{Error, RedisError, Result};
pub use events::{CompletionEvent, Cursor, Listener};
pub use hangup::dropped_connections_closed;
pub use loader::Loader;
pub use producer::{
    Completion, OpenRequest, Producer, RequestBuilder, RequestHandle, ResultsPage, MAX_UPSTREAMS,
};
pub use request::{
    check_tag, Cancelled, Concurrency, InvalidValue, Namespace, OnUpstreamFailure, PartError, Priority,
    RequestId, RequestState, MAX_REQUEST_ID_BYTES, MAX_TAGS, MAX_TAG_BYTES,
};
#[cfg(feature = "schedules")]
pub use schedule::{
    check_schedule_name, Missed, Schedule, ScheduleSpec, MAX_CATCH_UP, MAX_SCHEDULE_NAME_BYTES,
    MAX_SPEC_BYTES,
};
pub use stats::{MinuteStats, PriorityStages, StageBucket, StageHistogram, StageStats};
/// Tests only (`test-clock` feature): sets the clock of the functions library that components
/// of a [`Config::test_clock`] configuration load, on every master of `config`'s Redis: from now
/// on Redis time runs `speed` times as fast as real time, after a jump forward of `jump`. Returns
/// the Redis time (ms) after the change. Loads that library first if none is loaded.
#[cfg(feature = "test-clock")]
#[doc(hidden)]
pub async fn set_test_clock(config: &Config, speed: f64, jump: std::time::Duration) -> Result<i64> {
    let store = protocol::connect(&config.clone().test_clock(true)).await?;
    store.set_test_clock(speed, i64::try_from(jump.as_millis()).unwrap_or(i64::MAX)).await
}

pub use worker::{
    shutdown_signal, Context, Handler, HandlerError, Quantum, TimeHistogram, Worker, WorkerBuilder,
    WorkerMetrics,
};
