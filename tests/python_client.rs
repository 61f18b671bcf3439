//! The Python client's suite (clients/python/tests), run by `cargo test` so that CI runs it: the
//! Python producer and worker against their own redis-servers, the SIGKILL recovery test, a
//! cluster, and interop with the `sluicegate` command. It needs the virtual environment that
//! `./test.sh` makes at `target/py-venv` (with the package installed editable, pytest and
//! pytest-xdist); without it this test fails and says so, it never passes silently.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde::Serialize;
use sluicegate::{Producer, RequestState};

/// The suite takes about 20 s (in 4 test processes: pytest-xdist, clients/python/pyproject.toml's
/// addopts); past this it hangs, and is killed (with the test processes and the redis-servers they
/// started: they share its process group).
const LIMIT: Duration = Duration::from_secs(300);

/// The venv's Python; fails (never passes silently) when the venv is missing.
fn venv_python(root: &Path) -> PathBuf {
    let python = root.join("target/py-venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run ./test.sh, which makes the virtual environment and installs the Python \
         client into it (or by hand: python3 -m venv target/py-venv && target/py-venv/bin/pip install -e \
         'clients/python[test]'; Debian needs python3-venv)",
        python.display()
    );
    python
}

#[test]
fn the_python_client_suite_passes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = venv_python(root);
    let mut child = Command::new(&python)
        .args(["-m", "pytest", "clients/python/tests", "-q", "-p", "no:cacheprovider"])
        .current_dir(root)
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
            let _ = child.wait();
            panic!("the Python client's tests ran longer than {LIMIT:?}: killed (output above)");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        status.success(),
        "the Python client's tests failed ({status}); output above. If pytest, pytest-xdist (\"unrecognized \
         arguments: -n\") or the package is missing, run ./test.sh (it installs clients/python[test] into \
         target/py-venv)"
    );
}

/// A part of the DAG below, as clients/python/tests/dag_worker.py reads it: its own number, the
/// upstreams whose results it adds to it, and whether it fails permanently.
#[derive(Serialize)]
struct Step {
    n: u64,
    upstreams: Vec<String>,
    fail: bool,
}

fn step(n: u64, upstreams: &[&sluicegate::RequestHandle], fail: bool) -> Step {
    Step { n, upstreams: upstreams.iter().map(|h| h.id().to_string()).collect(), fail }
}

/// Kills the worker's process group when the test ends, passed or not.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", self.0.id())]).status();
        let _ = self.0.wait();
    }
}

/// Requests submitted after others by the Rust producer, run by a Python worker only: the gates
/// open on the Python worker's releases (a lane upstream and one of its own stream), the results
/// flow through its `ctx.upstream`, and a failed upstream fails its downstream, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_producers_dag_is_run_by_a_python_worker() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = venv_python(root);
    let env = support::env_on(sluicegate_testkit::Topology::Single, "py-dag").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let a =
        producer.request().concurrency(3).unwrap().submit((0..3).map(|n| step(n, &[], false))).await.unwrap();
    let b = producer.request().own_stream(true).submit([step(10, &[], false)]).await.unwrap();
    let c = producer.request().after([a.id().clone(), b.id().clone()]).submit([step(20, &[&a, &b], false)]);
    let c = c.await.unwrap();
    let d = producer.request().after([c.id().clone()]).submit([step(30, &[&c], false)]).await.unwrap();
    let e = producer.request().submit([step(0, &[], true)]).await.unwrap();
    let f = producer.request().after([e.id().clone()]).submit([step(1, &[], false)]).await.unwrap();
    let _worker = Killed(
        Command::new(&python)
            .arg(root.join("clients/python/tests/dag_worker.py"))
            .args([env.config.url(), env.config.namespace_str()])
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display())),
    );
    for (h, expected) in [(&c, 20 + 3 + 10), (&d, 30 + 33)] {
        let done = h.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.state, RequestState::Completed, "{}: {:?}", h.id(), done.reason);
        assert_eq!(done.into_outputs().unwrap(), vec![expected]);
    }
    let done = f.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.state, RequestState::Failed);
    assert_eq!(done.reason, Some(format!("upstream:{}", e.id())));
}
