//! Rate limits held across workers, against a real redis-server.
//!
//! One binary, two topologies: `single::` on one redis-server, `cluster::` on a 3-master Redis
//! Cluster.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

sluicegate_testkit::per_topology!(include!("suites/rate_limits.rs"););
