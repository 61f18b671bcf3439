//! Streamed requests (parts added over time), delayed requests, and their edges.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test --test integration streaming::cluster::` runs only those).

sluicegate_testkit::per_topology!(include!("../suites/streaming.rs"););
