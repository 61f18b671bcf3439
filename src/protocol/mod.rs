//! The Rust side of the protocol with Redis: the Functions library (assembled from `lua/`), one
//! typed Rust function per function of the library, the values that cross between Rust and Lua
//! as text (token elements, take records), and the errors the library answers with.
//!
//! Everything here follows docs/protocol.md, which other languages' clients are written against;
//! the library text itself is checked in as `lua/dist/sluicegate_v2.lua` for them. This module is
//! the only place that builds FCALL arguments and reads the replies: producers, slots, recovery
//! and operators call the typed functions, grouped as docs/protocol.md §5 groups the transitions
//! (`submit`, `index`, `tokens`, `finish`, `recovery`, `operators`, `registry`, `stats`,
//! `schedules`, `dag`). Each
//! function computes its keys from `Keys` where they follow from its arguments, takes durations
//! as `Duration`, and returns its reply decoded into a type named for what the Lua returns; a
//! refusal (`SG*`) comes back as the error it is, for the caller to read with `Refusal`.
//!
//! To add a transition, or an argument to one: write (or change) `lua/<name>.lua`, whose header
//! lists its exact KEYS, ARGV and Returns; add its `Func` variant (and its place in `Func::ALL`,
//! `local_name` and `source`); write its typed function in the file of its group here, with its reply type;
//! document it in its section of docs/protocol.md §5; then run
//! `SLUICEGATE_BLESS=1 cargo test --lib protocol::` to update `lua/dist/`.

use std::time::Duration;

use fred::types::Value;

use crate::config::millis;
use crate::error::{Error, Result};
use crate::reply;
use crate::request::Priority;

mod call;
pub(crate) mod dag;
mod element;
pub(crate) mod finish;
pub(crate) mod groups;
pub(crate) mod index;
pub(crate) mod lane;
mod library;
pub(crate) mod listing;
pub(crate) mod operators;
pub(crate) mod recovery;
mod refusal;
pub(crate) mod registry;
#[cfg(feature = "schedules")]
pub(crate) mod schedules;
pub(crate) mod stats;
pub(crate) mod submit;
pub(crate) mod tokens;

pub(crate) use call::connect;
pub(crate) use element::{doorbell_key_ids, TakeRecord, TokenElement};
pub(crate) use finish::Finished;
#[cfg(test)]
pub(crate) use library::checker_library_source;
pub(crate) use library::Func;
pub use library::{acl_rules, library_revision, library_source, LIBRARY_NAME, PROTOCOL_VERSION};
use refusal::{Code, Refusal};

/// Whether `error` is the library's `SGLATE`: a step called with its arm's deadline ran past it
/// and wrote nothing, so its caller arms again and retries (`shards::armed`).
pub(crate) fn ran_past_deadline(error: &crate::error::Error) -> bool {
    Refusal::is(error, Code::Late).is_some()
}

/// An optional priority item of a reply (absent, or nil for a request without `prio`: `None`).
pub(crate) fn priority_item(item: Option<Value>) -> Result<Option<Priority>> {
    match item {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let p = reply::int(&v)?;
            let p = u8::try_from(p).map_err(|_| Error::Protocol(format!("priority {p} out of range")))?;
            Ok(Some(Priority::new(p).map_err(|e| Error::Protocol(e.to_string()))?))
        }
    }
}

/// A duration as the functions take it: whole milliseconds.
fn ms(d: Duration) -> Value {
    (millis(d) as i64).into()
}
