//! The Rust side of the protocol with Redis: the Functions library (assembled from `lua/`), the
//! values that cross between Rust and Lua as text (token elements, take records), and the errors
//! the library answers with.
//!
//! Everything here follows docs/protocol.md, which other languages' clients are written against;
//! the library text itself is checked in as `lua/dist/sluicegate_v2.lua` for them.

mod element;
mod library;
mod refusal;

pub(crate) use element::{doorbell_key_id, TakeRecord, TokenElement};
#[cfg(test)]
pub(crate) use library::checker_library_source;
pub(crate) use library::Func;
pub use library::{acl_rules, library_source, LIBRARY_NAME, PROTOCOL_VERSION};
pub(crate) use refusal::{Code, Refusal};
