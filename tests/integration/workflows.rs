//! Workflows between requests, against a real redis-server: requests submitted after others (a
//! DAG of requests, `dag::`) and tenant groups (`groups::`).
//!
//! One binary, two topologies: `single::` on one redis-server, `cluster::` on a 3-master Redis
//! Cluster, where upstreams and downstreams, and groups and their requests, live on different
//! slots and masters.

sluicegate_testkit::per_topology!(
    mod dag {
        use super::*;
        include!("../suites/dag.rs");
    }
    mod groups {
        use super::*;
        include!("../suites/groups.rs");
    }
);
