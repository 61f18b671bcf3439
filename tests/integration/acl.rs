//! The happy path as a least-privilege ACL user (docs/operations.md): only the namespace's keys
//! and channels, only the commands sluicegate sends, no EVAL, no FUNCTION LOAD, no FLUSHALL.

const TOPOLOGY: sluicegate_testkit::Topology = sluicegate_testkit::Topology::Single;

use std::time::Duration;

use crate::support::{env_on, start_worker, Job, Probe};
use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use sluicegate::protocol::acl_rules;
use sluicegate::{Admin, Config, Listener, Producer, Quantum, RequestState};
use sluicegate_testkit::connect;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_happy_path_runs_as_a_least_privilege_user() {
    let env = env_on(TOPOLOGY, "acl").await;
    let ns = env.config.namespace_str().to_owned();
    let admin_conn = connect(env.redis.url()).await.unwrap();
    // The operator's one-time step: load the library (any component with the right does it).
    Producer::connect(&env.config).await.unwrap();
    let user = format!("sg-app-{}", &ns[ns.len() - 8..]);
    let mut setuser = vec![Value::from("SETUSER"), user.as_str().into(), "on".into(), ">s3cret".into()];
    setuser.extend(acl_rules(&ns, false).split(' ').map(|r| Value::from(r.to_owned())));
    let acl = CustomCommand::new_static("ACL", ClusterHash::Random, false);
    let _: Value = admin_conn.custom(acl.clone(), setuser).await.unwrap();

    let url = env.redis.url().replacen("redis://", &format!("redis://{user}:s3cret@"), 1);
    let config = Config::new(url.clone())
        .namespace(ns.clone())
        .lease(Duration::from_secs(2))
        .heartbeat(Duration::from_millis(200))
        .recovery_interval(Duration::from_millis(200));
    let mut listener = Listener::connect(&config).await.unwrap();
    let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let h = producer
        .request()
        .concurrency(2)
        .unwrap()
        .max_attempts(2)
        .unwrap()
        .submit((0..20).map(Job::new))
        .await
        .unwrap();
    assert_eq!(h.wait::<u64>().await.unwrap().into_outputs().unwrap().len(), 20);
    assert_eq!(listener.next().await.unwrap().state, RequestState::Completed);
    assert_eq!(admin.status(h.id()).await.unwrap().state, RequestState::Completed);
    let mut open = producer.request().open().await.unwrap();
    open.add([Job::new(1)]).await.unwrap();
    open.finalize().await.unwrap().wait::<u64>().await.unwrap();
    let slow = producer.request().delay(Duration::from_secs(60)).submit([Job::new(1)]).await.unwrap();
    slow.cancel().await.unwrap();
    assert!(admin.stats().await.unwrap().workers.len() == 1);
    // Every command the worker sends is allowed: its standby's wait on its hand list (`BLPOP`)
    // among them.
    assert_eq!(w.metrics().redis_errors.load(std::sync::atomic::Ordering::Relaxed), 0, "a call was refused");
    w.stop().await;

    // What the user may not do.
    let app = connect(&url).await.unwrap();
    let eval = CustomCommand::new_static("EVAL", ClusterHash::Random, false);
    let denied = app.custom::<Value, Value>(eval, vec!["return 1".into(), 0.into()]).await.unwrap_err();
    assert!(denied.details().contains("NOPERM"), "{denied:?}");
    let flush = CustomCommand::new_static("FLUSHALL", ClusterHash::Random, false);
    assert!(app.custom::<Value, Value>(flush, vec![]).await.is_err());
    let foreign: Result<Value, _> = app.get("someone-else:key").await;
    assert!(foreign.unwrap_err().details().contains("NOPERM"));

    let _: Value =
        admin_conn.custom::<Value, Value>(acl, vec!["DELUSER".into(), user.as_str().into()]).await.unwrap();
}
