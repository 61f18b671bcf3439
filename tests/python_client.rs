//! The Python client's suite (clients/python/tests), run by `cargo test` so that CI runs it: the
//! Python producer and worker against their own redis-servers, the SIGKILL recovery test, a
//! cluster, and interop with the `sluicegate` command. It needs the virtual environment that
//! `./test.sh` makes at `target/py-venv` (with the package installed editable and pytest); without
//! it this test fails and says so, it never passes silently.

#![allow(unreachable_pub, clippy::unwrap_used)]

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The suite takes about 20 s; past this it hangs, and is killed (with the redis-servers it
/// started: they share its process group).
const LIMIT: Duration = Duration::from_secs(300);

#[test]
fn the_python_client_suite_passes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/py-venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run ./test.sh, which makes the virtual environment and installs the Python \
         client into it (or by hand: python3 -m venv target/py-venv && target/py-venv/bin/pip install -e \
         'clients/python[test]'; Debian needs python3-venv)",
        python.display()
    );
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
        "the Python client's tests failed ({status}); output above. If pytest or the package is \
         missing, run ./test.sh (it installs clients/python[test] into target/py-venv)"
    );
}
