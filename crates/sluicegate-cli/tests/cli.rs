//! The `sluicegate` command, run as a user runs it: real processes against a Redis of the test's
//! own. Workers run the shell scripts in tests/fixtures.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test -p sluicegate-cli --test cli cluster::` runs only those).

#![allow(unreachable_pub, clippy::unwrap_used)]

sluicegate_testkit::per_topology!(include!("suites/cli.rs"););
