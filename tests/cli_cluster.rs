//! The `sluicegate` command, run as a user runs it: real processes against a 3-master Redis Cluster
//! of the test's own. Workers run the shell scripts in tests/fixtures.

#![allow(unreachable_pub, clippy::unwrap_used)]

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Cluster;

include!("suites/cli.rs");
