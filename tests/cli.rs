//! The `sluicegate` command, run as a user runs it: real processes against a redis-server of the
//! test's own. Workers run the shell scripts in tests/fixtures.

#![allow(unreachable_pub, clippy::unwrap_used)]

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Single;

include!("suites/cli.rs");
