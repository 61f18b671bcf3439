//! Schedules: cron-driven requests, fired by the workers' recovery exactly once per tick.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test --test integration schedules::cluster::` runs only those).

sluicegate_testkit::per_topology!(include!("../suites/schedules.rs"););
