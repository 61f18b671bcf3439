//! rediss:// connections: a redis-server with a throwaway CA and server certificate (made with the
//! `openssl` command), an ACL user, the happy path over TLS with the CA file, mutual TLS, and the
//! `sluicegate` command with and without `--tls-ca-file`. Skipped, with a notice, where there is
//! no `openssl` on PATH.

#![cfg(feature = "tls")]
#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

const TOPOLOGY: sluicegate::testing::Topology = sluicegate::testing::Topology::Single;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use sluicegate::testing::{connect, unique_namespace, RedisServer};
use sluicegate::{Admin, Config, Listener, Producer, Quantum, RequestState};
use support::{start_worker, Job, Probe};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");
const USER: &str = "sg-tls";
const PASSWORD: &str = "tls-s3cret";

fn have_openssl() -> bool {
    let found = Command::new("openssl").arg("version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !matches!(found, Ok(s) if s.success()) {
        eprintln!("SKIPPED: no `openssl` command on PATH to make the test certificates");
        return false;
    }
    true
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().unwrap();
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, all signed
/// by the CA, in a directory of their own (removed on drop).
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("sluicegate-tls-{}", unique_namespace("pki")));
        std::fs::create_dir_all(&dir).unwrap();
        openssl(
            &dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=sluicegate-test-ca",
            ],
        );
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        for (name, cn) in [("server", "localhost"), ("client", "sluicegate-client")] {
            let (key, csr, pem, ext) =
                (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"), format!("{name}.ext"));
            openssl(
                &dir,
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    &key,
                    "-out",
                    &csr,
                    "-subj",
                    &format!("/CN={cn}"),
                ],
            );
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "2",
                    "-extfile",
                    &ext,
                ],
            );
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A redis-server with a TLS port beside its plain one (the harness waits for readiness on the
/// plain port, and the test sets up its ACL user there), and the rediss:// URL of the ACL user.
async fn tls_redis(pki: &Pki, auth_clients: &str) -> (RedisServer, String) {
    let tls_port = free_port();
    let server = RedisServer::builder()
        .extra_arg("tls-port", tls_port.to_string())
        .extra_arg("tls-cert-file", pki.arg("server.pem"))
        .extra_arg("tls-key-file", pki.arg("server.key"))
        .extra_arg("tls-ca-cert-file", pki.arg("ca.pem"))
        .extra_arg("tls-auth-clients", auth_clients)
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let admin = connect(&server.url()).await.unwrap();
    let acl = CustomCommand::new_static("ACL", ClusterHash::Random, false);
    let setuser: Vec<Value> = ["SETUSER", USER, "on", &format!(">{PASSWORD}"), "~*", "&*", "+@all"]
        .into_iter()
        .map(|a| Value::from(a.to_owned()))
        .collect();
    let _: Value = admin.custom(acl, setuser).await.unwrap();
    (server, format!("rediss://{USER}:{PASSWORD}@127.0.0.1:{tls_port}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_happy_path_runs_over_tls_as_an_acl_user_trusting_a_private_ca() {
    if !have_openssl() {
        return;
    }
    let pki = Pki::new();
    let (_server, url) = tls_redis(&pki, "no").await;
    let config = Config::new(url)
        .namespace(unique_namespace("tls"))
        .tls_ca_file(pki.path("ca.pem"))
        .lease(Duration::from_secs(2))
        .heartbeat(Duration::from_millis(200))
        .recovery_interval(Duration::from_millis(200));

    let mut listener = Listener::connect(&config).await.unwrap();
    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let h = producer.request().concurrency(2).unwrap().submit((0..20).map(Job::new)).await.unwrap();
    let outputs = tokio::time::timeout(Duration::from_secs(30), h.wait::<u64>())
        .await
        .expect("the request completes over TLS")
        .unwrap()
        .into_outputs()
        .unwrap();
    assert_eq!(outputs, (0..20).map(|n| n * 2).collect::<Vec<u64>>());
    let event = tokio::time::timeout(Duration::from_secs(10), listener.next()).await.unwrap().unwrap();
    assert_eq!((event.id.as_str(), event.state), (h.id().as_str(), RequestState::Completed));
    let admin = Admin::connect(&config).await.unwrap();
    assert_eq!(admin.status(h.id()).await.unwrap().state, RequestState::Completed);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_presents_the_client_certificate() {
    if !have_openssl() {
        return;
    }
    let pki = Pki::new();
    let (_server, url) = tls_redis(&pki, "yes").await;
    let config = Config::new(url).namespace(unique_namespace("mtls")).tls_ca_file(pki.path("ca.pem"));
    let with_cert = config.clone().tls_client_cert(pki.path("client.pem"), pki.path("client.key"));
    let admin = Admin::connect(&with_cert).await.unwrap();
    admin.stats().await.unwrap();
    // Without the certificate the server hangs up at the handshake: the client keeps retrying.
    let refused = tokio::time::timeout(Duration::from_secs(2), Admin::connect(&config)).await;
    assert!(!matches!(refused, Ok(Ok(_))), "connected without a client certificate");
}

#[tokio::test]
async fn a_missing_ca_file_is_a_config_error_naming_it() {
    let config = Config::new("rediss://127.0.0.1:1").tls_ca_file("/nonexistent/ca.pem");
    let err = Producer::connect(&config).await.err().expect("no CA file, no connection");
    let text = err.to_string();
    assert!(matches!(err, sluicegate::Error::Config(_)), "{err:?}");
    assert!(text.contains("/nonexistent/ca.pem") && !text.contains('\n'), "{text}");

    let not_tls = Config::new("redis://127.0.0.1:1").tls_ca_file("/nonexistent/ca.pem");
    let err = Producer::connect(&not_tls).await.err().expect("a CA file needs rediss://");
    assert!(err.to_string().contains("rediss://"), "{err}");
}

#[test]
fn the_command_line_connects_with_tls_ca_file_and_names_the_certificate_problem_without() {
    if !have_openssl() {
        return;
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let pki = Pki::new();
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
