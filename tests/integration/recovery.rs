//! Never lose work: each window in which the seed design loses a token or an entry, with the
//! fault placed exactly there, against a real redis-server.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test --test integration recovery::cluster::` runs only those).

sluicegate_testkit::per_topology!(include!("../suites/recovery.rs"););
