//! Requests submitted after others (a DAG of requests), against a real redis-server.
//!
//! One binary, two topologies: `single::` on one redis-server, `cluster::` on a 3-master Redis
//! Cluster, where upstreams and downstreams live on different slots and masters.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

sluicegate_testkit::per_topology!(include!("suites/dag.rs"););
