//! rediss:// connections: a redis-server with a throwaway CA and server certificate
//! (`sluicegate_testkit::tls`), an ACL user, the happy path over TLS with the CA file, and mutual
//! TLS. Skipped, with a notice, where there is no `openssl` on PATH. The `sluicegate` command over
//! TLS is tested in crates/sluicegate-cli/tests/tls.rs.

#![cfg(feature = "tls")]

use std::time::Duration;

use crate::support::{start_worker, Job, Probe};
use sluicegate::{Admin, Config, Listener, Producer, Quantum, RequestState};
use sluicegate_testkit::tls::{have_openssl, tls_redis, Pki};
use sluicegate_testkit::unique_namespace;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_happy_path_runs_over_tls_as_an_acl_user_trusting_a_private_ca() {
    if !have_openssl() {
        return;
    }
    let pki = Pki::generate();
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
    let pki = Pki::generate();
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
