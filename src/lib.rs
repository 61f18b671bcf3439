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

mod admin;
#[cfg(test)]
mod check;
pub mod codec;
mod config;
mod error;
mod events;
mod keys;
#[cfg(test)]
mod layering;
mod loader;
mod otel;
mod producer;
pub mod protocol;
mod reply;
mod request;
mod shards;
mod stats;
mod store;
#[cfg(feature = "tls")]
mod tls;
mod worker;

pub use admin::{
    Admin, DeadLetter, IndexedError, ListPage, ListQuery, ListState, ListedRequest, Paused, PriorityTokens,
    RateLimit, Reprioritized, RequestCounts, RequestStatus, RequestTokens, SlotWork, Stats, Tally,
    TokenAudit, TokenState, WorkerInfo, MAX_LIST_LIMIT, MAX_LIST_LOOK, MAX_TALLY, MAX_TOKEN_AUDIT,
    STATUS_ERRORS,
};
pub use async_trait::async_trait;
pub use config::{Config, DEFAULT_REDIS_URL};
pub use error::{Error, RedisError, Result};
pub use events::{CompletionEvent, Cursor, Listener};
pub use loader::Loader;
pub use producer::{Completion, OpenRequest, Producer, RequestBuilder, RequestHandle, ResultsPage};
pub use request::{
    check_tag, Cancelled, Concurrency, InvalidValue, Namespace, PartError, Priority, RequestId, RequestState,
    MAX_REQUEST_ID_BYTES, MAX_TAGS, MAX_TAG_BYTES,
};
pub use stats::{MinuteStats, PriorityStages, StageBucket, StageHistogram, StageStats};
pub use worker::{
    shutdown_signal, Context, Handler, HandlerError, Quantum, TimeHistogram, Worker, WorkerBuilder,
    WorkerMetrics,
};
