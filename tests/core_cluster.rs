//! The core engine's promises, each against a real redis-server, on a 3-master Redis Cluster.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Cluster;

include!("suites/core.rs");
