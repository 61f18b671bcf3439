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
    /// Redis Cluster refused the command unexecuted because its slot is moving ([`not_executed`]).
    pub(crate) fn is_not_executed(&self) -> bool {
        matches!(self, Error::Redis(e) if not_executed(e))
    }

    /// A fault of the connection (dropped, timed out, being re-established) rather than of the
    /// request: the same call may succeed once the client has reconnected.
    pub fn is_transient(&self) -> bool {
        use fred::error::ErrorKind as K;
        match self {
            Error::Redis(e) => {
                matches!(e.kind(), K::IO | K::Timeout | K::Canceled | K::Routing | K::Backpressure)
                    || e.details().starts_with("LOADING")
                    || e.details().contains("Connection closed")
                    || not_executed(e)
                    // A blocked BRPOP/XREAD woken because its master became a replica (a
                    // failover): it took nothing, and the slot's new master will serve it.
                    || e.details().starts_with("UNBLOCKED")
            }
            _ => false,
        }
    }
}

/// Redis Cluster refused the command without running it, because its slot is moving: `TRYAGAIN`
/// (a command naming several keys of a slot mid-migration, some of which have moved), or a
/// `MOVED`/`ASK` redirection, which sluicegate's clients hand back instead of following (fred 10.1
/// follows `ASK` wrongly, see `store::new_client`); fred reports those as `Routing` "Too many
/// redirections." after it has refreshed its slot map. Unlike a dropped connection, where the
/// command may or may not have run, re-sending such a command is safe even when it is not
/// idempotent (an `ack`, a token pop).
pub(crate) fn not_executed(e: &fred::error::Error) -> bool {
    e.details().starts_with("TRYAGAIN")
        || (*e.kind() == fred::error::ErrorKind::Routing && e.details().starts_with("Too many redirections"))
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

/// Re-sends `op` while Redis refuses it unexecuted because its slot is moving ([`not_executed`]),
/// backing off from 10 ms to 500 ms, for at most `limit`; then returns what `op` last returned.
/// Safe for any command, idempotent or not, since a refused command did not run.
pub(crate) async fn retry_not_executed<T, F, Fut>(
    what: &str,
    limit: std::time::Duration,
    mut op: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    let mut backoff = std::time::Duration::from_millis(10);
    loop {
        match op().await {
            Err(Error::Redis(e)) if not_executed(&e) && tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "{what}: its slot is moving; sending it again in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(std::time::Duration::from_millis(500));
            }
            other => return other,
        }
    }
}

/// `Result` with sluicegate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
