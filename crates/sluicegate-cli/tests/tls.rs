//! The `sluicegate` command over rediss://: with `--tls-ca-file` it connects, without it the
//! error names the certificate problem in one line. Skipped, with a notice, where there is no
//! `openssl` on PATH.

#![cfg(feature = "tls")]
#![allow(unreachable_pub, clippy::unwrap_used)]

use std::process::{Command, Stdio};

use sluicegate_testkit::tls::{have_openssl, tls_redis, Pki, PASSWORD};
use sluicegate_testkit::unique_namespace;

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

#[test]
fn the_command_line_connects_with_tls_ca_file_and_names_the_certificate_problem_without() {
    if !have_openssl() {
        return;
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let pki = Pki::generate();
    let (_server, url) = runtime.block_on(tls_redis(&pki, "no"));
    let ns = unique_namespace("tlscli");
    let run = |extra: &[&str]| {
        Command::new(BIN)
            .env_remove("REDIS_URL")
            .env_remove("SLUICEGATE_NAMESPACE")
            .env_remove("SLUICEGATE_TLS_CA_FILE")
            .args(["--redis", &url, "--namespace", &ns, "--connect-timeout", "5s"])
            .args(extra)
            .arg("stats")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let ok = run(&["--tls-ca-file", &pki.arg("ca.pem")]);
    assert!(ok.status.success(), "stats over TLS: {}", String::from_utf8_lossy(&ok.stderr));

    let refused = run(&[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "connected to a server whose CA is not trusted");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.to_lowercase().contains("certificate"), "names the certificate problem: {stderr}");
    assert!(!stderr.contains(PASSWORD), "the password stays out of stderr: {stderr}");

    let missing = run(&["--tls-ca-file", "/nonexistent/ca.pem"]);
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success());
    assert!(stderr.contains("/nonexistent/ca.pem") && stderr.trim_end().lines().count() == 1, "{stderr}");
}
