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

/// The library's revisions (docs/operations.md, "Upgrades"): a connect loads the library only over
/// an older revision (or none), and leaves its own or a newer one as it is.
mod library {
    use fred::prelude::*;
    use sluicegate::protocol::{library_revision, library_source};
    use sluicegate::{Config, Producer};
    use sluicegate_testkit::{connect, RedisServer};

    async fn loaded(redis: &Client) -> Option<u64> {
        redis.custom(fred::cmd!("FCALL_RO"), vec!["sg2_revision", "0"]).await.ok()
    }

    async fn loads(redis: &Client) -> u64 {
        let info: String = redis.custom(fred::cmd!("INFO"), vec!["commandstats"]).await.unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_function|load:calls="))
            .and_then(|rest| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Our library under another revision.
    fn as_revision(revision: u64) -> String {
        let ours = format!("callback=function() return {} end", library_revision());
        let source = library_source();
        assert_eq!(source.matches(&ours).count(), 1, "the revision function is the library's last line");
        source.replace(&ours, &format!("callback=function() return {revision} end"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connect_loads_the_library_only_over_an_older_revision_or_none() {
        let server = RedisServer::start().await.unwrap();
        let redis = connect(&server.url()).await.unwrap();
        let config = Config::new(server.url()).namespace("revisions");
        let ours = library_revision();
        assert!(ours > 0, "lua/REVISION names a revision");

        // None loaded: loaded.
        Producer::connect(&config).await.unwrap();
        assert_eq!(loaded(&redis).await, Some(ours));
        // Its own revision loaded: nothing is loaded again, however many connect.
        let before = loads(&redis).await;
        for _ in 0..3 {
            Producer::connect(&config).await.unwrap();
        }
        assert_eq!(loads(&redis).await, before, "a connect finding its own revision loads nothing");

        // An older revision: replaced.
        let _: String = redis.function_load(true, as_revision(ours - 1)).await.unwrap();
        Producer::connect(&config).await.unwrap();
        assert_eq!(loaded(&redis).await, Some(ours));
        // A library from before revisions (no `sg2_revision`): replaced.
        let source = library_source();
        let cut = source.find("-- The library's revision").expect("the revision function");
        let _: String = redis.function_load(true, source[..cut].to_owned()).await.unwrap();
        assert_eq!(loaded(&redis).await, None);
        Producer::connect(&config).await.unwrap();
        assert_eq!(loaded(&redis).await, Some(ours));

        // A newer revision: kept, and it serves this build.
        let _: String = redis.function_load(true, as_revision(ours + 1)).await.unwrap();
        let producer = Producer::connect(&config).await.unwrap();
        assert_eq!(loaded(&redis).await, Some(ours + 1), "an older component does not downgrade the library");
        producer.request().submit([1u32]).await.unwrap();
    }
}
