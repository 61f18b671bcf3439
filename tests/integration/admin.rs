//! Operating a running system: status, cancel, requeue of dead letters, stats.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test --test integration admin::cluster::` runs only those).

sluicegate_testkit::per_topology!(include!("../suites/admin.rs"););

/// On a redis-server of its own: the test fills it to its `maxmemory`.
mod full {
    use fred::prelude::*;
    use sluicegate::{Admin, Config, Error, Listener, Producer};
    use sluicegate_testkit::{connect, RedisServer};

    use crate::support::Job;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_maxmemory_reads_keep_working_and_a_refused_write_says_redis_is_full() {
        let server = RedisServer::start().await.unwrap();
        let config = Config::new(server.url()).namespace("full");
        let producer = Producer::connect(&config).await.unwrap();
        let queued = producer.request().submit([Job::new(1), Job::new(2)]).await.unwrap();
        let redis = connect(&server.url()).await.unwrap();
        let set = fred::cmd!("CONFIG");
        let () = redis.custom(set, vec!["SET", "maxmemory", "1mb"]).await.unwrap();
        let filler = "x".repeat(100_000);
        for i in 0..40 {
            if redis.set::<(), _, _>(format!("filler{i}"), filler.as_str(), None, None, false).await.is_err()
            {
                break;
            }
        }
        let refused = redis.set::<(), _, _>("one-more", "x", None, None, false).await.unwrap_err();
        assert!(refused.details().starts_with("OOM"), "the server is not full: {refused}");
        // Connecting and reading work: the library already loaded is used.
        let admin = Admin::connect(&config).await.unwrap();
        let status = admin.status(queued.id()).await.unwrap();
        assert_eq!((status.total, status.done), (2, 0));
        admin.stats().await.unwrap();
        // The listing is a no-writes function, called with FCALL_RO.
        let listed = admin.list(&sluicegate::ListQuery::new()).await.unwrap();
        assert_eq!(listed.requests.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), [queued.id().as_str()]);
        admin.dead(queued.id()).await.unwrap();
        Listener::from_beginning(&config).await.unwrap();
        // A write is refused whole, and says why.
        let producer = Producer::connect(&config).await.unwrap();
        let err = producer.request().submit([Job::new(3)]).await.expect_err("refused at maxmemory");
        match &err {
            Error::Redis(e) => assert!(e.is_full(), "{err}"),
            other => panic!("not a Redis refusal: {other}"),
        }
        assert!(
            err.to_string()
                .contains("Redis is full (at its maxmemory) and refused a write: nothing was written"),
            "{err}"
        );
        let err = admin.cancel(queued.id()).await.unwrap_err();
        assert!(err.to_string().contains("Redis is full"), "{err}");
        assert_eq!(admin.status(queued.id()).await.unwrap().state, sluicegate::RequestState::Queued);
    }
}
