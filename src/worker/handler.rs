//! What users implement: a [`Handler`] runs one sub-request, told about it by a [`Context`].

use std::fmt;
use std::ops::Range;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::request::{PartError, Priority, RequestId};
use crate::store::Store;

/// Runs one sub-request. Workers call it concurrently from many slots, so it takes `&self`.
///
/// ```
/// use sluicegate::{async_trait, Context, Handler, HandlerError};
///
/// struct Upper;
///
/// #[async_trait]
/// impl Handler for Upper {
///     type Input = String;
///     type Output = String;
///     async fn handle(&self, _ctx: Context, input: String) -> Result<String, HandlerError> {
///         Ok(input.to_uppercase())
///     }
/// }
/// ```
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// A sub-request's payload, decoded from MessagePack.
    type Input: DeserializeOwned + Send + 'static;
    /// What the handler returns; stored as MessagePack and handed back in order by `wait()`.
    type Output: Serialize + Send + 'static;

    /// Processes one sub-request. An `Err` (or a panic) is recorded for this sub-request; it never
    /// stops the worker. A sub-request may run more than once (at-least-once): use
    /// [`Context::idempotency_key`] to make side effects safe to repeat.
    async fn handle(&self, ctx: Context, input: Self::Input) -> Result<Self::Output, HandlerError>;
}

/// What a handler knows about the sub-request it runs.
#[derive(Clone)]
pub struct Context {
    pub(crate) request_id: RequestId,
    pub(crate) index: u64,
    pub(crate) attempt: u32,
    pub(crate) priority: Priority,
    pub(crate) cancelled: CancellationToken,
    /// The worker's connection, for reading upstreams' results.
    pub(crate) store: Store,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("request_id", &self.request_id)
            .field("index", &self.index)
            .field("attempt", &self.attempt)
            .field("priority", &self.priority)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// The request this sub-request belongs to.
    pub fn request_id(&self) -> &RequestId {
        &self.request_id
    }

    /// The sub-request's position in its request, from 0; under `Chunked`, the
    /// part's position (the chunk's first part's index plus the part's place in the chunk).
    pub fn index(&self) -> u64 {
        self.index
    }

    /// 1 on the first run, 2 on the second, and so on.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The request's priority.
    pub fn priority(&self) -> Priority {
        self.priority
    }

    /// A key that is the same for every attempt of this sub-request: `<request id>/<index>`.
    pub fn idempotency_key(&self) -> String {
        format!("{}/{}", self.request_id, self.index)
    }

    /// Completes when this run's hold is lost (this worker was declared dead, the request
    /// finished or was cancelled), the attempt timed out, the request's deadline passed
    /// (`RequestBuilder::deadline`), or the worker shuts down hard: a long
    /// handler should stop, its result will be dropped (after a lost hold, a failure it returns
    /// spends no attempt).
    pub fn cancelled(&self) -> &CancellationToken {
        &self.cancelled
    }

    /// The results of parts `range` (indexes from 0, clamped to the request's parts) of request
    /// `id`, in part order: typically an upstream this request was submitted
    /// [`after`](crate::RequestBuilder::after), whose results are then final, read on demand
    /// (nothing is copied into this request's parts). A part that was dead-lettered reads as its
    /// [`PartError`]. Results live for their request's retention; a part without one (not ended,
    /// its results taken with `results_from` or discarded, or expired) is
    /// [`Error::NoResult`](crate::Error::NoResult), an unknown request
    /// [`Error::UnknownRequest`](crate::Error::UnknownRequest).
    ///
    /// ```no_run
    /// # use sluicegate::{Context, RequestId};
    /// # async fn demo(ctx: Context, split: RequestId) -> sluicegate::Result<()> {
    /// let pieces: Vec<Result<String, _>> = ctx.upstream(&split, 0..100).await?;
    /// # Ok(()) }
    /// ```
    pub async fn upstream<O: DeserializeOwned>(
        &self,
        id: &RequestId,
        range: Range<u64>,
    ) -> crate::Result<Vec<Result<O, PartError>>> {
        super::upstream::results(&self.store, id, range).await
    }
}

/// A handler's failure: retryable (the default) or permanent.
///
/// Any `std::error::Error` converts into a retryable one, so `?` works in handlers. A retryable
/// failure runs again after a backoff while the request's `max_attempts` allows; a permanent one
/// goes to the dead letters at once.
pub struct HandlerError {
    message: String,
    permanent: bool,
}

impl HandlerError {
    /// A retryable failure with this message.
    pub fn new(message: impl Into<String>) -> Self {
        Self { message: message.into(), permanent: false }
    }

    /// A failure that retrying cannot fix (bad input, say): dead-lettered without retry.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self { message: message.into(), permanent: true }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether it is permanent.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(e: E) -> Self {
        Self::new(e.to_string())
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HandlerError({:?}, permanent: {})", self.message, self.permanent)
    }
}

/// The text of a handler's panic (its `&str` or `String` payload), as failures record it.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}
