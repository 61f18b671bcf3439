//! The library's integration suites that share the test support (`tests/support/`), one test
//! binary for all of them: one build of the support code and one link instead of thirteen, which
//! saves minutes of a clean CI build. Each suite is a module named after it
//! (`cargo test --test integration core::` runs one; `cargo test --test integration cluster::`
//! is the cluster suite, `-- ::cluster::` the suites' cluster halves). The suites whose tests
//! need a process of their own stay binaries of their own: the chaos suite, the conformance
//! drivers, the cluster topology tests, the OpenTelemetry globals, the minute-long rate
//! measurement and the Python client's suite.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

#[path = "integration/acl.rs"]
mod acl;
#[path = "integration/admin.rs"]
mod admin;
#[path = "integration/cluster.rs"]
mod cluster;
#[path = "integration/core.rs"]
mod core;
#[path = "integration/lanes.rs"]
mod lanes;
#[path = "integration/recovery.rs"]
mod recovery;
#[path = "integration/schedules.rs"]
mod schedules;
#[path = "integration/shards.rs"]
mod shards;
#[path = "integration/stats.rs"]
mod stats;
#[path = "integration/streaming.rs"]
mod streaming;
#[path = "integration/tls.rs"]
mod tls;
#[path = "integration/window.rs"]
mod window;
#[path = "integration/workflows.rs"]
mod workflows;
