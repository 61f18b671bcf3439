//! Operating a running system: status, cancel, requeue of dead letters, stats, on a 3-master Redis Cluster.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Cluster;

include!("suites/admin.rs");
