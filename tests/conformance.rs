//! The conformance suite (issue 16, docs/conformance.md): every scenario of `tests/conformance/`
//! run with a producer of one language and workers of another, on a single Redis (`single::`) and
//! on a 3-master Cluster (`cluster::`), checking results and their order, errors, attempts, the
//! concurrency limit (never exceeded, and reached) and the terminal record.
//!
//! ```text
//! cargo test --test conformance                                    # Rust and Python, both ways
//! SLUICEGATE_CONFORMANCE_LANGS=rust cargo test --test conformance  # Rust against itself only
//! cargo test --test conformance single::python_producer_rust_workers
//! SLUICEGATE_CONFORMANCE_LANGS=rust,go SLUICEGATE_CONFORMANCE_DRIVER_GO="/path/to/driver" \
//!     cargo test --test conformance other_language_pairs           # a third language's driver
//! ```
//!
//! The Python pairs need the venv and the Python client: `./test.sh` creates `target/py-venv`.
//! When either is missing they fail (they never pass without running).

#![allow(unreachable_pub, clippy::unwrap_used)]

#[path = "support/conformance.rs"]
mod conformance;
#[path = "support/logs.rs"]
mod logs;

sluicegate_testkit::per_topology!(
    use crate::conformance::run_pair;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rust_producer_rust_workers() {
        run_pair(TOPOLOGY, "rust", "rust").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rust_producer_python_workers() {
        run_pair(TOPOLOGY, "rust", "python").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn python_producer_rust_workers() {
        run_pair(TOPOLOGY, "python", "rust").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn python_producer_python_workers() {
        run_pair(TOPOLOGY, "python", "python").await;
    }

    /// Every pair of the selected languages with one beside Rust and Python (a third-party
    /// client's driver, named by `SLUICEGATE_CONFORMANCE_DRIVER_<LANG>`); none by default.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn other_language_pairs() {
        crate::conformance::run_other_pairs(TOPOLOGY).await;
    }
);
