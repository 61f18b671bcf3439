//! Reading the logs of the processes a suite starts (tests/chaos.rs, tests/conformance.rs).

#![allow(dead_code, unreachable_pub)]

use std::path::Path;

/// The last `lines` lines of a log file, for a failure message.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()));
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
