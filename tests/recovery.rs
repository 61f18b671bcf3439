//! Never lose work: each window in which the seed design loses a token or an entry, with the
//! fault placed exactly there, against a real redis-server.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Single;

include!("suites/recovery.rs");
