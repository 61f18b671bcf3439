//! The stats by stage (`Admin::stats_since`) and the worker's metrics beyond the work counters:
//! queue wait, leases lost, Redis errors.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test --test integration stats::cluster::` runs only those).

sluicegate_testkit::per_topology!(include!("../suites/stats.rs"););

/// On a redis-server of its own: the test makes it refuse writes.
mod refused {
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::{Duration, Instant};

    use fred::prelude::*;
    use sluicegate::{Config, Quantum};
    use sluicegate_testkit::{connect, unique_namespace, RedisServer};

    use crate::support::{start_worker, Probe};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_redis_refuses_count_as_redis_errors_and_none_before() {
        let server = RedisServer::start().await.unwrap();
        let config = Config::new(server.url()).namespace(unique_namespace("redis-errors"));
        let w = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
        let metrics = w.metrics();
        // Idle: slots take and wait on their bells, the liveness thread beats; nothing fails.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(metrics.redis_errors.load(Relaxed), 0);
        // At its maxmemory Redis refuses every write (`OOM`): the slots' takes, the beats.
        let redis = connect(&server.url()).await.unwrap();
        let () = redis.custom(fred::cmd!("CONFIG"), vec!["SET", "maxmemory", "1"]).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while metrics.redis_errors.load(Relaxed) < 2 {
            assert!(Instant::now() < deadline, "failed calls were not counted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let () = redis.custom(fred::cmd!("CONFIG"), vec!["SET", "maxmemory", "0"]).await.unwrap();
        w.stop().await;
    }
}
