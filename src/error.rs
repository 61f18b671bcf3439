//! The one error type of sluicegate.

use crate::keys::RequestId;

/// Everything that can go wrong, named so that a caller can match on it and a person can act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is unusable (bad URL, bad namespace, a zero where a duration is needed).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A request id is empty or too long.
    #[error("invalid request id: {0}")]
    InvalidRequestId(String),
    /// A request is malformed (no parts, priority or concurrency out of range, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A request with this id exists already (running, or finished and still retained).
    #[error("request id \"{0}\" is already in use; choose another id or wait until its retention ends")]
    DuplicateRequestId(RequestId),
    /// No request with this id exists (never submitted, or its retention ran out).
    #[error("no request with id \"{0}\" (never submitted, or its results expired)")]
    UnknownRequest(RequestId),
    /// A payload or result could not be encoded or decoded.
    #[error("codec: {0}")]
    Codec(String),
    /// Redis answered with an error, or could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] fred::error::Error),
    /// The Redis server is older than sluicegate needs.
    #[error("redis server {found} is too old: sluicegate needs Redis {needed} or newer (it runs as a Redis Functions library)")]
    UnsupportedRedis {
        /// The version the server reported.
        found: String,
        /// The oldest version sluicegate supports.
        needed: &'static str,
    },
    /// Redis state does not follow sluicegate's protocol (a foreign key, a newer protocol version).
    #[error("protocol: {0}")]
    Protocol(String),
    /// A wait ran out of time before the request finished.
    #[error("timed out waiting for request \"{0}\"")]
    Timeout(RequestId),
    /// The component was shut down.
    #[error("shut down")]
    Shutdown,
}

impl Error {
    /// A fault of the connection (dropped, timed out, being re-established) rather than of the
    /// request: the same call may succeed once the client has reconnected.
    pub fn is_transient(&self) -> bool {
        use fred::error::ErrorKind as K;
        match self {
            Error::Redis(e) => {
                matches!(e.kind(), K::IO | K::Timeout | K::Canceled | K::Routing | K::Backpressure)
                    || e.details().starts_with("LOADING")
                    || e.details().contains("Connection closed")
            }
            _ => false,
        }
    }
}

/// Retries `op` while it fails with a transient error, backing off from 50 ms to 2 s.
pub(crate) async fn retry_transient<T, F, Fut>(what: &str, mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut backoff = std::time::Duration::from_millis(50);
    loop {
        match op().await {
            Err(e) if e.is_transient() => {
                tracing::debug!(error = %e, "{what}: transient error; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(std::time::Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

/// `Result` with sluicegate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
