//! Operating a running system: status, cancel, requeue of dead letters, stats.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Single;

include!("suites/admin.rs");
