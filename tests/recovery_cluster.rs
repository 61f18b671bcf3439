//! Never lose work, on a 3-master Redis Cluster: each window in which the seed design loses a token or an entry, with the
//! fault placed exactly there, against a real redis-server.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Cluster;

include!("suites/recovery.rs");
