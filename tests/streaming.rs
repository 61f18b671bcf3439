//! Streamed requests (parts added over time), delayed requests, and their edges.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Single;

include!("suites/streaming.rs");
