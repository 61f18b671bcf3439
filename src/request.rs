//! What a request is: its priority, its concurrency limit, its lifecycle.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

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
    pub fn new(p: u8) -> Result<Self> {
        if p <= Self::MAX.0 {
            Ok(Self(p))
        } else {
            Err(Error::InvalidRequest(format!(
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
    pub fn new(n: u32) -> Result<Self> {
        if (1..=Self::MAX).contains(&n) {
            Ok(Self(n))
        } else {
            Err(Error::InvalidRequest(format!("concurrency {n} is out of range: use 1 to {}", Self::MAX)))
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

/// Where a request is in its lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RequestState {
    /// Its parts are being written; workers cannot see it yet.
    Loading,
    /// Accepted and durable, waiting for its scheduled time; no worker can see it yet.
    Scheduled,
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
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

impl FromStr for RequestState {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "loading" => Self::Loading,
            "scheduled" => Self::Scheduled,
            "queued" => Self::Queued,
            "running" => Self::Running,
            "completed" => Self::Completed,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            other => return Err(Error::Protocol(format!("unknown request state {other:?}"))),
        })
    }
}

impl fmt::Display for RequestState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_and_concurrency_ranges_are_enforced_with_the_range_in_the_message() {
        assert!(Priority::new(99).is_ok());
        assert!(Priority::new(100).unwrap_err().to_string().contains("0 (lowest) to 99"));
        assert!(Concurrency::new(0).unwrap_err().to_string().contains("1 to"));
        assert_eq!(Priority::all_descending().next(), Some(Priority::MAX));
    }

    #[test]
    fn states_round_trip_through_their_stored_names() {
        for s in ["loading", "scheduled", "queued", "running", "completed", "failed", "cancelled"] {
            assert_eq!(s.parse::<RequestState>().unwrap().as_str(), s);
        }
    }
}
