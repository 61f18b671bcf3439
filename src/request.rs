//! What a request is: its id, its namespace, its priority, its concurrency limit, its lifecycle.
//!
//! The types here validate themselves and say what is wrong with an [`InvalidValue`], which `?`
//! turns into the crate's error; this module depends on nothing else in the crate.

use std::fmt;
use std::str::FromStr;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::Serialize;

/// A value that cannot be part of a request; the message names the value and what is allowed.
///
/// `?` converts it into the crate's error: `InvalidRequestId`, `InvalidRequest`, `Config` (a
/// namespace) or `Protocol` (text read back from Redis that no sluicegate wrote).
/// ```
/// use sluicegate::{InvalidValue, Priority};
/// let err = Priority::new(100).unwrap_err();
/// assert!(matches!(err, InvalidValue::Request(_)));
/// assert!(err.to_string().contains("0 (lowest) to 99"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidValue {
    /// A request id that is empty or too long.
    #[error("{0}")]
    RequestId(String),
    /// A priority or a concurrency limit out of range.
    #[error("{0}")]
    Request(String),
    /// A namespace with other characters than `A-Z a-z 0-9 _ . -`, or too long.
    #[error("{0}")]
    Namespace(String),
    /// A request id read back from Redis that is not the key form of one.
    #[error("{0}")]
    KeyId(String),
    /// A request state read back from Redis that is not one of [`RequestState`]'s names.
    #[error("{0}")]
    State(String),
}

/// Bytes of a request id, at most. Longer ids are refused rather than hashed, so that the id a
/// user gives is always the id they can read back.
pub const MAX_REQUEST_ID_BYTES: usize = 512;

/// Tags a request carries at most ([`check_tag`]).
pub const MAX_TAGS: usize = 16;

/// Bytes of a tag, at most.
pub const MAX_TAG_BYTES: usize = 64;

/// Checks a request tag: 1 to [`MAX_TAG_BYTES`] bytes of `A-Z a-z 0-9` and `_ . : / = @ + -`
/// (tags name sets of the listing index and are joined with commas there).
/// ```
/// use sluicegate::check_tag;
/// assert!(check_tag("customer:42").is_ok());
/// assert!(check_tag("two words").is_err());
/// ```
pub fn check_tag(tag: &str) -> Result<(), InvalidValue> {
    let allowed = |b: u8| b.is_ascii_alphanumeric() || b"_.:/=@+-".contains(&b);
    if tag.is_empty() || tag.len() > MAX_TAG_BYTES || !tag.bytes().all(allowed) {
        return Err(InvalidValue::Request(format!(
            "invalid tag {tag:?}: a tag is 1 to {MAX_TAG_BYTES} characters of A-Z a-z 0-9 _ . : / = @ + -"
        )));
    }
    Ok(())
}

/// Characters kept as they are in a key id; everything else (`{`, `}`, `:`, `|`, spaces, `%`,
/// non-ASCII) is percent-encoded, which is injective, so no two ids share keys.
const KEY_ID_SET: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.');

/// The id of a request, as its producer chose it or as sluicegate generated it.
///
/// Any non-empty UTF-8 string of at most [`MAX_REQUEST_ID_BYTES`] bytes is a valid id.
/// ```
/// use sluicegate::RequestId;
/// let id = RequestId::new("invoice {2024}: März").unwrap();
/// assert_eq!(id.as_str(), "invoice {2024}: März");
/// assert!(RequestId::new("").is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(String);

impl RequestId {
    /// Validates a caller-chosen id.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidValue> {
        let id = id.into();
        if id.is_empty() {
            return Err(InvalidValue::RequestId("a request id cannot be empty".into()));
        }
        if id.len() > MAX_REQUEST_ID_BYTES {
            return Err(InvalidValue::RequestId(format!(
                "a request id is at most {MAX_REQUEST_ID_BYTES} bytes; this one has {}",
                id.len()
            )));
        }
        Ok(Self(id))
    }

    /// A new unique id: a UUIDv7's 128 bits in 22 base-62 digits (`0-9A-Za-z`, most significant
    /// first), so ids sort by creation time, as text too, and cost little in keys and entries.
    pub fn generate() -> Self {
        const DIGITS: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
        let mut n = uuid::Uuid::now_v7().as_u128();
        let mut id = [b'0'; 22];
        for digit in id.iter_mut().rev() {
            *digit = DIGITS[(n % 62) as usize];
            n /= 62;
        }
        Self(id.iter().map(|&d| char::from(d)).collect())
    }

    /// The id as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as it appears inside keys and token elements (percent-encoded).
    pub fn key_id(&self) -> String {
        utf8_percent_encode(&self.0, KEY_ID_SET).to_string()
    }

    /// Reads back an id from its key form.
    pub fn from_key_id(key_id: &str) -> Result<Self, InvalidValue> {
        let decoded = percent_decode_str(key_id)
            .decode_utf8()
            .map_err(|_| InvalidValue::KeyId(format!("key id {key_id:?} is not valid UTF-8")))?;
        Self::new(decoded.into_owned())
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for RequestId {
    type Error = InvalidValue;
    fn try_from(value: &str) -> Result<Self, InvalidValue> {
        Self::new(value)
    }
}

impl TryFrom<String> for RequestId {
    type Error = InvalidValue;
    fn try_from(value: String) -> Result<Self, InvalidValue> {
        Self::new(value)
    }
}

/// A validated namespace: 1 to 64 characters from `A-Z a-z 0-9 _ . -`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Namespace(String);

impl Namespace {
    /// Validates a namespace.
    pub fn new(ns: impl Into<String>) -> Result<Self, InvalidValue> {
        let ns = ns.into();
        let ok = !ns.is_empty()
            && ns.len() <= 64
            && ns.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if ok {
            Ok(Self(ns))
        } else {
            Err(InvalidValue::Namespace(format!(
                "namespace {ns:?} is invalid: use 1 to 64 characters from A-Z a-z 0-9 _ . -"
            )))
        }
    }

    /// The namespace as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Namespace {
    fn default() -> Self {
        Self("sluicegate".into())
    }
}

/// How urgent a request is: 0 (least) to 99 (most). Free slots always take a token of the highest
/// priority that has one waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(u8);

impl Priority {
    /// The lowest priority.
    pub const MIN: Priority = Priority(0);
    /// The highest priority.
    pub const MAX: Priority = Priority(99);
    /// The priority of a request that does not say.
    pub const DEFAULT: Priority = Priority(50);

    /// A priority from 0 to 99.
    pub fn new(p: u8) -> Result<Self, InvalidValue> {
        if p <= Self::MAX.0 {
            Ok(Self(p))
        } else {
            Err(InvalidValue::Request(format!(
                "priority {p} is out of range: use 0 (lowest) to 99 (highest)"
            )))
        }
    }

    /// The number, 0 to 99.
    pub fn get(self) -> u8 {
        self.0
    }

    /// Every priority, highest first.
    pub(crate) fn all_descending() -> impl Iterator<Item = Priority> {
        (Self::MIN.0..=Self::MAX.0).rev().map(Priority)
    }
}

impl Default for Priority {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The most sub-requests of one request that may run at the same time, across all workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Concurrency(u32);

impl Concurrency {
    /// The largest limit accepted: one token per permit lives in Redis.
    pub const MAX: u32 = 10_000;

    /// A limit from 1 to [`Concurrency::MAX`].
    pub fn new(n: u32) -> Result<Self, InvalidValue> {
        if (1..=Self::MAX).contains(&n) {
            Ok(Self(n))
        } else {
            Err(InvalidValue::Request(format!("concurrency {n} is out of range: use 1 to {}", Self::MAX)))
        }
    }

    /// The limit.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for Concurrency {
    fn default() -> Self {
        Self(1)
    }
}

/// What a request submitted after others (`RequestBuilder::after`) does when one of them ends
/// without completing (failed, cancelled, or gone).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum OnUpstreamFailure {
    /// It ends `failed` too, without running, with `Completion::reason` `upstream:<id>`
    /// (naming the upstream); so do its own downstreams that fail the same way. If that upstream
    /// is requeued and then completes, it reopens and runs.
    #[default]
    Fail,
    /// It runs once every upstream has ended, however.
    Run,
}

/// A terminal record's reason as users read it: `upstream:<key id>` (as stored) names the upstream
/// by its id.
pub(crate) fn reason_shown(why: &str) -> String {
    match why.strip_prefix("upstream:").map(RequestId::from_key_id) {
        Some(Ok(id)) => format!("upstream:{id}"),
        _ => why.to_owned(),
    }
}

/// Where a request is in its lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RequestState {
    /// Its parts are being written; workers cannot see it yet.
    Loading,
    /// Accepted and durable, waiting for its scheduled time; no worker can see it yet.
    Scheduled,
    /// Accepted and durable, waiting for the requests it was submitted after (its upstreams) to
    /// complete; no worker can see it yet.
    Waiting,
    /// Accepted, durable, waiting for a worker.
    Queued,
    /// At least one sub-request has started.
    Running,
    /// Every sub-request succeeded.
    Completed,
    /// Every sub-request ended, and at least one failed.
    Failed,
    /// Cancelled before it finished.
    Cancelled,
}

impl RequestState {
    /// Completed, failed or cancelled: nothing will change any more.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Cancelled)
    }

    /// The name stored in Redis.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Loading => "loading",
            Self::Scheduled => "scheduled",
            Self::Waiting => "waiting",
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

impl FromStr for RequestState {
    type Err = InvalidValue;
    fn from_str(s: &str) -> Result<Self, InvalidValue> {
        Ok(match s {
            "loading" => Self::Loading,
            "scheduled" => Self::Scheduled,
            "waiting" => Self::Waiting,
            "queued" => Self::Queued,
            "running" => Self::Running,
            "completed" => Self::Completed,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            other => return Err(InvalidValue::State(format!("unknown request state {other:?}"))),
        })
    }
}

impl fmt::Display for RequestState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why one sub-request has no result: it was dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("{message} (after {attempts} attempt(s))")]
#[non_exhaustive]
pub struct PartError {
    /// The handler's last error, or why the part did not run.
    #[serde(rename = "error")]
    pub message: String,
    /// How many times it ran.
    pub attempts: u32,
    /// Whether the handler called the failure permanent (not retried).
    pub permanent: bool,
}

impl PartError {
    pub(crate) fn from_record(record: &[u8]) -> Self {
        serde_json::from_slice(record).unwrap_or_else(|_| Self {
            message: String::from_utf8_lossy(record).into_owned(),
            attempts: 0,
            permanent: false,
        })
    }
}

/// What a cancel did (`Admin::cancel`, `RequestHandle::cancel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum Cancelled {
    /// This call cancelled the request.
    Now,
    /// The request had ended before (or was still loading, and was discarded).
    AlreadyFinished(RequestState),
}

/// Checks a tenant group's name: 1 to 64 ASCII letters, digits, `.`, `_` or `-`. The error says
/// what is wrong, for `Error::InvalidRequest`.
pub(crate) fn check_group(name: &str) -> std::result::Result<(), String> {
    let ok = (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!("a group name is 1 to 64 ASCII letters, digits, '.', '_' or '-', not {name:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_short_key_safe_and_sort_by_creation() {
        let ids: Vec<RequestId> = (0..200)
            .map(|_| {
                std::thread::sleep(std::time::Duration::from_micros(50));
                RequestId::generate()
            })
            .collect();
        for id in &ids {
            assert_eq!(id.as_str().len(), 22, "{id}");
            assert_eq!(id.key_id(), id.as_str(), "a generated id needs no escaping");
        }
        let mut sorted = ids.clone();
        sorted.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        assert_eq!(sorted, ids, "generated ids sort by creation time");
    }

    #[test]
    fn priority_and_concurrency_ranges_are_enforced_with_the_range_in_the_message() {
        assert!(Priority::new(99).is_ok());
        assert!(Priority::new(100).unwrap_err().to_string().contains("0 (lowest) to 99"));
        assert!(Concurrency::new(0).unwrap_err().to_string().contains("1 to"));
        assert_eq!(Priority::all_descending().next(), Some(Priority::MAX));
    }

    #[test]
    fn states_round_trip_through_their_stored_names() {
        for s in ["loading", "scheduled", "waiting", "queued", "running", "completed", "failed", "cancelled"]
        {
            assert_eq!(s.parse::<RequestState>().unwrap().as_str(), s);
        }
    }

    #[test]
    fn awkward_ids_encode_without_braces_colons_or_bars_and_round_trip() {
        for raw in ["a{b}c", "x:y", "with space", "März ✓", "%41", "a|b", "}{"] {
            let id = RequestId::new(raw).unwrap();
            let key_id = id.key_id();
            assert!(!key_id.contains(['{', '}', ':', '|', ' ']), "{key_id}");
            assert_eq!(RequestId::from_key_id(&key_id).unwrap(), id);
        }
        // "%41" must not collide with "A".
        assert_ne!(RequestId::new("%41").unwrap().key_id(), RequestId::new("A").unwrap().key_id());
    }

    #[test]
    fn overlong_and_empty_ids_are_refused_with_the_reason() {
        let err = RequestId::new("x".repeat(10 * 1024)).unwrap_err().to_string();
        assert!(err.contains("at most 512 bytes") && err.contains("10240"), "{err}");
        assert!(RequestId::new("").unwrap_err().to_string().contains("empty"));
    }

    #[test]
    fn namespaces_with_key_syntax_are_refused() {
        assert!(Namespace::new("good-ns_1.x").is_ok());
        for bad in ["", "a:b", "a{b", "a b", "a*", &"n".repeat(65)] {
            assert!(Namespace::new(bad).is_err(), "{bad:?}");
        }
    }
}
