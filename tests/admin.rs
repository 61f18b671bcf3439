//! Operating a running system: status, cancel, requeue of dead letters, stats.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test --test admin cluster::` runs only those).

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

sluicegate_testkit::per_topology!(include!("suites/admin.rs"););
