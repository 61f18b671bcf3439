//! Streamed requests (parts added over time), delayed requests, and their edges, on a 3-master Redis Cluster.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Cluster;

include!("suites/streaming.rs");
