//! The core engine's promises, each against a real redis-server.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test --test integration core::cluster::` runs only those).

sluicegate_testkit::per_topology!(include!("../suites/core.rs"););
