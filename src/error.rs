//! The one error type of sluicegate.

use crate::request::{InvalidValue, RequestId};

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
    /// A request was submitted `after` a request that cannot be waited for: unknown (never
    /// submitted, or its retention ran out), or still being submitted (its submit has not
    /// returned). Nothing of the new request is kept.
    #[error("upstream request \"{id}\" {why}; nothing of the request submitted after it is kept")]
    UnknownUpstream {
        /// The upstream named.
        id: RequestId,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A part's result asked for is not there: the part has not ended, or its request's results
    /// were taken (`results_from`), discarded, or went with its retention.
    #[error("request \"{id}\" has no result for part {index}: {why}")]
    NoResult {
        /// The request.
        id: RequestId,
        /// The part.
        index: u64,
        /// Why, as far as can be told.
        why: &'static str,
    },
    /// An events cursor is not one (see `Cursor`'s text form).
    #[error("invalid cursor: {0}")]
    InvalidCursor(String),
    /// A payload or result could not be encoded or decoded.
    #[error("codec: {0}")]
    Codec(String),
    /// Redis answered with an error, or could not be reached.
    #[error("redis: {0}")]
    Redis(#[source] RedisError),
    /// A request was not created because its loading time ran out before its producer had
    /// written it whole (a producer that stalled, or lost Redis for that long); nothing of it is
    /// kept: submit it again.
    #[error("request \"{0}\" was not created: its loading time ran out before its producer had written it; nothing of it is kept, submit it again")]
    Expired(RequestId),
    /// A streamed request takes no more parts (finalized, cancelled, or unknown).
    #[error("request \"{0}\" is not open for parts (finalized already, cancelled, or unknown)")]
    NotOpen(RequestId),
    /// A request has no dead letters that can be requeued (only a failed, running or queued
    /// request has).
    #[error("request \"{0}\" has no dead letters that can be requeued (only a failed, running or queued request has)")]
    NoDeadLetters(RequestId),
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
    /// An operator's action was refused as it stands (workers still registered for a purge of
    /// their namespace, say); the message says what to do.
    #[error("refused: {0}")]
    Refused(String),
    /// A schedule is malformed: its name, cron pattern, time zone, missed-ticks policy or
    /// request template (the message names which, and what is allowed).
    #[error("invalid schedule: {0}")]
    InvalidSchedule(String),
    /// No schedule has this name.
    #[error("no schedule named \"{0}\"")]
    UnknownSchedule(String),
    /// A schedule of this name exists with another spec.
    #[error("schedule \"{0}\" exists with another spec: remove it first, or replace it")]
    ScheduleExists(String),
    /// The component was shut down.
    #[error("shut down")]
    Shutdown,
}

impl From<InvalidValue> for Error {
    fn from(invalid: InvalidValue) -> Self {
        match invalid {
            InvalidValue::RequestId(m) => Self::InvalidRequestId(m),
            InvalidValue::Request(m) => Self::InvalidRequest(m),
            InvalidValue::Namespace(m) => Self::Config(m),
            InvalidValue::KeyId(m) | InvalidValue::State(m) => Self::Protocol(m),
        }
    }
}

impl From<fred::error::Error> for Error {
    fn from(e: fred::error::Error) -> Self {
        Error::Redis(RedisError(e))
    }
}

impl Error {
    /// The same failure again, for each of several requests that one failed call carried
    /// (`Producer::submit_many`): the variants such a call ends with, as they are; any other as
    /// its words.
    pub(crate) fn again(&self) -> Error {
        match self {
            Error::Redis(RedisError(e)) => Error::Redis(RedisError(e.clone())),
            Error::InvalidRequest(why) => Error::InvalidRequest(why.clone()),
            Error::Protocol(why) => Error::Protocol(why.clone()),
            other => Error::Protocol(other.to_string()),
        }
    }
}

/// An error reply from Redis, or a fault of the connection to it. It wraps the error of the Redis
/// client sluicegate is built on (fred), so that the client's types stay out of sluicegate's API.
#[derive(Debug)]
pub struct RedisError(pub(crate) fred::error::Error);

impl RedisError {
    /// Redis's words, or the client's for a connection fault: `NOPERM this user has no
    /// permissions to run the 'fcall' command`, say.
    pub fn message(&self) -> &str {
        self.0.details()
    }

    /// The error code Redis put first in its reply (`NOPERM`, `WRONGPASS`, `OOM`, `BUSY`, ...),
    /// if the reply had one.
    pub fn code(&self) -> Option<&str> {
        let word = self.message().split(' ').next()?;
        (!word.is_empty() && word.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')).then_some(word)
    }

    /// An answer of the functions library refusing a call (`SG<CODE> ...`; recognised one by
    /// one in `protocol::refusal`): not a failure of Redis or of the connection.
    pub(crate) fn is_library_refusal(&self) -> bool {
        self.code().is_some_and(|c| c.starts_with("SG"))
    }

    /// Redis refused a write because it is at its memory limit (`OOM`, `maxmemory`): the command
    /// did not run. Reads (status, stats, events, results) still work.
    pub fn is_full(&self) -> bool {
        self.code() == Some("OOM")
    }

    /// The connection could not be made or broke (refused, unreachable, TLS refused): nothing
    /// Redis said.
    pub fn is_connection(&self) -> bool {
        *self.0.kind() == fred::error::ErrorKind::IO
    }

    /// For a connection fault, the reason inside the I/O error's text (`Os { .., message:
    /// "Connection refused" }`, a TLS error's `Custom { .., error: InvalidCertificate(..) }`):
    /// what a person needs, not the struct around it. Otherwise the whole message.
    pub fn reason(&self) -> &str {
        io_reason(self.message())
    }
}

fn io_reason(details: &str) -> &str {
    for field in ["message: \"", "error: \""] {
        if let Some(start) = details.find(field).map(|i| i + field.len()) {
            if let Some(len) = details[start..].find('"') {
                return &details[start..start + len];
            }
        }
    }
    if let Some(start) =
        details.find("Custom { kind: ").and_then(|i| details[i..].find("error: ").map(|j| i + j + 7))
    {
        if let Some(reason) = details[start..].strip_suffix(" }") {
            return reason;
        }
    }
    details
}

impl std::fmt::Display for RedisError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_full() {
            return write!(
                f,
                "Redis is full (at its maxmemory) and refused a write: nothing was written; free memory, \
                 raise maxmemory, or shorten the retention, then try again (Redis said: {})",
                self.message()
            );
        }
        self.0.fmt(f)
    }
}

impl std::error::Error for RedisError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl Error {
    /// Redis Cluster refused the command unexecuted because its slot is moving ([`not_executed`]).
    pub(crate) fn is_not_executed(&self) -> bool {
        matches!(self, Error::Redis(e) if not_executed(&e.0))
    }

    /// A fault of the connection (dropped, timed out, being re-established) rather than of the
    /// request: the same call may succeed once the client has reconnected.
    pub fn is_transient(&self) -> bool {
        use fred::error::ErrorKind as K;
        match self {
            Error::Redis(RedisError(e)) => {
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
        // fred 10.1 had no connection to write the command to (it was reconnecting after a cut)
        // and gave up on it unwritten; the kind is `Unknown` on a non-replica route
        // (router/commands.rs), so only the text tells.
        || e.details().starts_with("Failed to route command")
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
            Err(Error::Redis(RedisError(e)))
                if not_executed(&e) && tokio::time::Instant::now() < deadline =>
            {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_are_reduced_to_their_reason() {
        let refused = r#"cannot connect to redis://h:1: Os { code: 111, kind: ConnectionRefused, message: "Connection refused" }"#;
        assert_eq!(io_reason(refused), "Connection refused");
        let dns = r#"cannot connect to x: Custom { kind: Uncategorized, error: "failed to lookup address information: Name or service not known" }"#;
        assert_eq!(io_reason(dns), "failed to lookup address information: Name or service not known");
        assert_eq!(io_reason("plain words"), "plain words");
        let tls = "cannot connect to rediss://h:1: Custom { kind: InvalidData, error: InvalidCertificate(UnknownIssuer) }";
        assert_eq!(io_reason(tls), "InvalidCertificate(UnknownIssuer)");
    }

    #[test]
    fn redis_error_codes_are_the_first_word_when_it_is_one() {
        let e = |text: &str| {
            RedisError(fred::error::Error::new(fred::error::ErrorKind::Unknown, text.to_owned()))
        };
        assert_eq!(e("NOPERM no permissions").code(), Some("NOPERM"));
        assert_eq!(e("OOM command not allowed").code(), Some("OOM"));
        assert_eq!(e("connection refused").code(), None);
    }

    /// fred gives up on a command it had no connection to write to (while it reconnects after a
    /// cut) with kind `Unknown`: it never ran, so it is re-sent, whatever it was. A chaos run
    /// once stalled on it: a fenced slot's `reclaim` failed with it and left a token held, with
    /// its batch, under a live worker.
    #[test]
    fn a_command_fred_could_not_route_did_not_run_and_is_retried() {
        use fred::error::{Error as Fred, ErrorKind as K};
        let unrouted = Error::Redis(RedisError(Fred::new(K::Unknown, "Failed to route command.")));
        assert!(unrouted.is_not_executed() && unrouted.is_transient());
        let to_replica = Error::Redis(RedisError(Fred::new(K::Routing, "Failed to route command.")));
        assert!(to_replica.is_not_executed() && to_replica.is_transient());
        let other = Error::Redis(RedisError(Fred::new(K::Unknown, "ERR something else")));
        assert!(!other.is_not_executed() && !other.is_transient());
    }
}
