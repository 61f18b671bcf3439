//! The test kit's binaries (`crates/sluicegate-testkit/src/bin/`), built on demand for the test
//! that runs them: the chaos worker (tests/chaos.rs) and the conformance driver
//! (tests/conformance.rs).

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Builds the test kit's binary `bin` (with its feature `feature`) for this test's profile and
/// returns its path.
///
/// Cargo is asked to build it on every call, even when the binary exists: `cargo test --test
/// <name>` does not build another package's binaries, and a stale one would silently test old
/// code. When it is up to date the build is a no-op of a fraction of a second. Call it once per
/// test process (behind a `OnceLock`); it blocks while cargo runs.
pub fn build(bin: &str, feature: &str) -> PathBuf {
    // target/<profile>/deps/<test>-<hash>  →  target/<profile>/<bin>
    let exe = std::env::current_exe().expect("the test knows its own path");
    let profile_dir =
        exe.parent().and_then(Path::parent).expect("test binary lives in target/<profile>/deps");
    let target_dir = profile_dir.parent().expect("target/<profile> has a parent");
    let profile = profile_dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    build
        .args(["build", "-p", "sluicegate-testkit", "--features", feature, "--bin", bin])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    // Cargo sets these for the test it runs; a build script that watches one (ring's watches
    // CARGO_MANIFEST_DIR) would see it change between this build and `cargo test`'s own, and
    // rebuild ring, rustls, fred and everything above them on every test run.
    for (var, _) in std::env::vars_os() {
        let name = var.to_string_lossy();
        let set_for_tests = name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_MANIFEST_")
            || [
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref());
        if set_for_tests {
            build.env_remove(&var);
        }
    }
    match profile {
        "debug" => {}
        "release" => {
            build.arg("--release");
        }
        other => {
            build.args(["--profile", other]);
        }
    }
    // Bounded, and its output kept: a build that waits on a lock or fails says so rather than
    // hang the suite or fail in silence.
    let out_path = std::env::temp_dir().join(format!("sluicegate-{bin}-build-{}.log", std::process::id()));
    let out = std::fs::File::create(&out_path).expect("build log file");
    let mut child =
        build.stdout(out.try_clone().expect("build log file")).stderr(out).spawn().expect("cargo runs");
    let limit = Duration::from_secs(900);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for cargo") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("cargo build --bin {bin} still running after {limit:?}:\n{}", log_tail(&out_path, 30));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "cargo build --bin {bin} failed ({status}):\n{}", log_tail(&out_path, 30));
    let _ = std::fs::remove_file(&out_path);
    let path = profile_dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX));
    assert!(path.is_file(), "{} missing after the build", path.display());
    path
}

/// The last `lines` lines of a log file, for a failure message.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()));
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
