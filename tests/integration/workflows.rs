//! Workflows between requests, against a real redis-server: requests submitted after others (a
//! DAG of requests, `dag::`) and tenant groups (`groups::`).
//!
//! One binary, two topologies: `single::` on one redis-server, `cluster::` on a 3-master Redis
//! Cluster, where upstreams and downstreams, and groups and their requests, live on different
//! slots and masters.

sluicegate_testkit::per_topology!(
    mod dag {
        use super::*;
        include!("../suites/dag.rs");
    }
    mod groups {
        use super::*;
        include!("../suites/groups.rs");
    }
);

/// An id used again: what an earlier request under it leaves behind is not taken for the end of
/// the request that took the id. On one redis-server (the steps are timed by the retention).
mod reuse {
    use std::time::{Duration, Instant};

    use fred::prelude::HashesInterface;
    use sluicegate::{Admin, Error, Producer, Quantum, RequestId, RequestState};
    use sluicegate_testkit::{connect, keys_in_namespace, Topology};

    use crate::support::{env_streams, fast, start_worker, Job, Probe};

    /// A request's finish marks (the end a downstream links to) go with its keys. A submit of its
    /// id refused as a duplicate while it is retained makes recovery run its unindex again, which
    /// used to keep the marks a retention from then, past its keys; a later request of the id was
    /// then taken for ended by a downstream submitted after it, which ran at once. And marks
    /// left by an earlier request (as a purge whose unlist finds the id registered again leaves
    /// them) do not end the request that took the id either: its downstream waits for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_downstream_of_an_id_used_again_waits_for_the_request_that_took_it() {
        let env = env_streams(Topology::Single, "reuse-marks").await;
        let config = fast(&env.config).retention(Duration::from_secs(5));
        let ns = config.namespace_str().to_owned();
        let url = env.redis.url().to_owned();
        let redis = connect(&url).await.unwrap();
        let w = start_worker(&config, Probe::default(), 4, Quantum::default()).await;
        let producer = Producer::connect(&config).await.unwrap();
        let admin = Admin::connect(&config).await.unwrap();
        let u = RequestId::new("u").unwrap();

        let u1 = producer.request().id("u").unwrap().submit(vec![Job::new(1)]).await.unwrap();
        let done = u1.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
        assert_eq!(done.state, RequestState::Completed);
        let marks = (0..4).map(|s| format!("{ns}:{{{ns}.q{s}}}:f:{}", u.key_id()));
        let mut found = None;
        for key in marks {
            let e: Option<String> = redis.hget(&key, "e").await.unwrap();
            if let Some(e) = e {
                found = Some((key, e));
            }
        }
        let (marks, ended) = found.expect("the finished request's marks");

        // Half a second in, the id is submitted again and refused: recovery looks at that
        // registration and runs the finished request's unindex again.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let again = producer.request().id("u").unwrap().submit(vec![Job::new(2)]).await;
        assert!(matches!(again, Err(Error::DuplicateRequestId(_))), "{again:?}");

        // The retention ends: the request's keys go, and its marks with them.
        let meta = format!("{ns}:r:{{u}}");
        let began = Instant::now();
        while keys_in_namespace(&url, &ns).await.unwrap().contains(&meta) {
            assert!(began.elapsed() < Duration::from_secs(15), "the meta never expired");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let gone = Instant::now();
        while keys_in_namespace(&url, &ns).await.unwrap().contains(&marks) {
            assert!(gone.elapsed() < Duration::from_millis(300), "the marks outlived the request's keys");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // The id is taken again, by a request that runs for 2 s; a downstream of it waits.
        let u2 = producer.request().id("u").unwrap().submit(vec![Job::sleeping(3, 2000)]).await.unwrap();
        let d = producer
            .request()
            .id("d")
            .unwrap()
            .after(vec![u.clone()])
            .submit(vec![Job::new(4)])
            .await
            .unwrap();
        // Marks of the earlier request, as a purge racing the new registration leaves them.
        let _: () = redis.hset(&marks, [("e", ended.as_str()), ("s", "completed")]).await.unwrap();
        let d2 = producer
            .request()
            .id("d2")
            .unwrap()
            .after(vec![u.clone()])
            .submit(vec![Job::new(5)])
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!admin.status(u2.id()).await.unwrap().state.is_terminal(), "u's second request ended early");
        for h in [&d, &d2] {
            let state = admin.status(h.id()).await.unwrap().state;
            assert_eq!(state, RequestState::Waiting, "{} did not wait for the request that took u", h.id());
        }
        for h in [&u2, &d, &d2] {
            let done = h.wait_timeout::<u64>(Duration::from_secs(20)).await.unwrap();
            assert_eq!(done.state, RequestState::Completed, "{}", h.id());
        }
        w.stop().await;
    }
}
