//! The core engine's promises, each against a real redis-server.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Single;

include!("suites/core.rs");
