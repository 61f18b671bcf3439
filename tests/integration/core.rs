//! The core engine's promises, each against a real redis-server.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster (`cargo test --test integration core::cluster::` runs only those).

sluicegate_testkit::per_topology!(include!("../suites/core.rs"););

/// Dropping a worker's future (`Running::crash` aborts its task) is a crash, not a stop
/// (`Worker::run_until`): every task of the worker ends with it. Its subscription to the shard's
/// `up` channel, which a task of its own holds, closes; until that task was aborted with the
/// worker's future, it stayed subscribed, and the worker's release tasks ran on after it too.
mod dropped {
    use std::time::{Duration, Instant};

    use crate::support::{env_on, start_worker, Probe};
    use fred::prelude::PubsubInterface;
    use sluicegate::Quantum;
    use sluicegate_testkit::{connect, Topology};

    async fn subscribers(redis: &fred::prelude::Client, channel: &str) -> i64 {
        let reply: Vec<fred::types::Value> = redis.pubsub_numsub(channel).await.unwrap();
        reply.get(1).and_then(|v| v.as_i64()).unwrap_or(0)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_workers_tasks_end_with_it() {
        let env = env_on(Topology::Single, "dropped-worker").await;
        let ns = env.config.namespace_str().to_owned();
        let up = format!("{ns}:{{{ns}.q0}}:up");
        let redis = connect(env.redis.url()).await.unwrap();
        let worker = start_worker(&env.config, Probe::default(), 2, Quantum::default()).await;
        let began = Instant::now();
        while subscribers(&redis, &up).await == 0 {
            assert!(began.elapsed() < Duration::from_secs(10), "the worker never listened on {up}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        worker.crash();
        let began = Instant::now();
        while subscribers(&redis, &up).await > 0 {
            assert!(
                began.elapsed() < Duration::from_secs(5),
                "the dropped worker's listener is still subscribed to {up}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A worker's connections are closed when it ends: at a clean stop, and when its future is dropped
/// (`Running::crash` aborts its task), which is a crash, not a stop (`Worker::run_until`). fred
/// drives each connection in a task of its own that outlives the client's handles, so until the
/// worker closed them, a stop left its subscription to the `up` channels open, and a dropped
/// worker all its connections, its slots' pops still blocked for work. On a server of its own,
/// so that it can count every connection.
mod hangup {
    use std::time::{Duration, Instant};

    use crate::support::{start_worker, Job, Probe};
    use fred::interfaces::ClientInterface;
    use sluicegate::{Admin, Config, Listener, Producer, Quantum};
    use sluicegate_testkit::{connect, RedisServer};

    /// The connections the server has, with what each ran last.
    async fn connections(redis: &fred::prelude::Client) -> Vec<String> {
        let list: String = redis.client_list::<String, ()>(None, None).await.unwrap();
        list.lines().filter_map(|l| l.split(' ').find(|f| f.starts_with("cmd=")).map(str::to_owned)).collect()
    }

    async fn back_to(redis: &fred::prelude::Client, baseline: usize, after: &str) {
        let began = Instant::now();
        loop {
            let now = connections(redis).await;
            if now.len() == baseline {
                return;
            }
            assert!(
                began.elapsed() < Duration::from_secs(5),
                "after {after}, connections left open: {now:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until a worker listens for higher priorities (its last connection made at its start).
    async fn subscribed(redis: &fred::prelude::Client) {
        let began = Instant::now();
        while !connections(redis).await.iter().any(|c| c == "cmd=subscribe") {
            assert!(began.elapsed() < Duration::from_secs(10), "the worker never subscribed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_closes_its_connections_when_it_stops_and_when_it_is_dropped() {
        let server = RedisServer::start().await.unwrap();
        let config = Config::new(server.url()).namespace("hangup");
        let redis = connect(&server.url()).await.unwrap();
        let baseline = connections(&redis).await.len();
        let worker = start_worker(&config, Probe::default(), 3, Quantum::default()).await;
        subscribed(&redis).await;
        worker.stop().await;
        back_to(&redis, baseline, "a stop").await;

        let worker = start_worker(&config, Probe::default(), 3, Quantum::default()).await;
        subscribed(&redis).await;
        worker.crash();
        back_to(&redis, baseline, "a drop").await;
    }

    /// The same for the other components: a producer (its connection and its doorbell's
    /// subscriber, once a wait started it), an admin and a listener close theirs when dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn producers_admins_and_listeners_close_their_connections_when_dropped() {
        let server = RedisServer::start().await.unwrap();
        let config = Config::new(server.url()).namespace("hangup-clients");
        let redis = connect(&server.url()).await.unwrap();
        let baseline = connections(&redis).await.len();
        let producer = Producer::connect(&config).await.unwrap();
        let handle = producer.request().submit([Job::new(1)]).await.unwrap();
        assert!(handle.wait_timeout::<u64>(Duration::from_millis(50)).await.is_err(), "no worker runs it");
        let admin = Admin::connect(&config).await.unwrap();
        admin.status(handle.id()).await.unwrap();
        let listener = Listener::connect(&config).await.unwrap();
        assert!(connections(&redis).await.iter().any(|c| c == "cmd=subscribe"), "the doorbell subscribed");
        drop((producer, handle));
        back_to(&redis, baseline + 3, "a producer's drop").await;
        drop(admin);
        back_to(&redis, baseline + 2, "an admin's drop").await;
        drop(listener);
        back_to(&redis, baseline, "a listener's drop").await;
    }

    /// A program about to end awaits `dropped_connections_closed`: it returns once the closing
    /// tasks of everything dropped have ended, so a runtime shut down next cuts none short (the
    /// command line's error paths drop their components, and fred then warned on stderr). With
    /// Redis paused, a dropped producer's flush task waits for its last flush before its `QUIT`:
    /// the wait lasts as long.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_connections_closed_waits_for_a_dropped_producers_last_flush_and_close() {
        let server = RedisServer::start().await.unwrap();
        let config = Config::new(server.url()).namespace("hangup-wait");
        let redis = connect(&server.url()).await.unwrap();
        let pause = || async {
            let pause = vec!["PAUSE", "400", "ALL"];
            let _: () =
                fred::interfaces::ClientLike::custom(&redis, fred::cmd!("CLIENT"), pause).await.unwrap();
            Instant::now()
        };
        let producer = Producer::connect(&config).await.unwrap();
        producer.request().submit([Job::new(1)]).await.unwrap();
        let began = pause().await;
        drop(producer);
        sluicegate::dropped_connections_closed().await;
        let waited = began.elapsed();
        assert!(waited >= Duration::from_millis(250), "a producer's close was waited for {waited:?}");
    }

    /// A handler running when its worker is dropped ends with it, as with its process: before,
    /// its task ran on, detached, its connection closed under it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_worker_takes_its_running_handlers_with_it() {
        use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
        use std::sync::Arc;

        #[derive(Clone, Default)]
        struct Sleeper {
            started: Arc<AtomicU32>,
            ended: Arc<AtomicU32>,
        }

        #[sluicegate::async_trait]
        impl sluicegate::Handler for Sleeper {
            type Input = u64;
            type Output = u64;
            async fn handle(&self, _: sluicegate::Context, n: u64) -> Result<u64, sluicegate::HandlerError> {
                self.started.fetch_add(1, SeqCst);
                tokio::time::sleep(Duration::from_millis(500)).await;
                self.ended.fetch_add(1, SeqCst);
                Ok(n)
            }
        }

        let server = RedisServer::start().await.unwrap();
        let config = Config::new(server.url()).namespace("hangup-handlers");
        let sleeper = Sleeper::default();
        let worker = start_worker(&config, sleeper.clone(), 2, Quantum::default()).await;
        let producer = Producer::connect(&config).await.unwrap();
        producer.request().submit([1u64]).await.unwrap();
        let began = Instant::now();
        while sleeper.started.load(SeqCst) == 0 {
            assert!(began.elapsed() < Duration::from_secs(10), "the handler never started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        worker.crash();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(sleeper.ended.load(SeqCst), 0, "the dropped worker's handler ran to its end");
    }
}

/// Chunks (`sluicegate::chunks`, `Chunked`): several parts to a sub-request, each part run once
/// with its own index, the outputs flattening back to the parts' in order, on a lane and on a
/// stream of its own; a failing part fails its chunk, names itself, and the parts after it in the
/// chunk do not run.
mod chunks {
    use std::time::Duration;

    use crate::support::{env_on, start_worker, Job, Probe};
    use sluicegate::{chunks, Chunked, Producer, Quantum, RequestState};
    use sluicegate_testkit::Topology;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunks_run_each_part_once_with_its_own_index_and_flatten_to_the_parts_outputs() {
        let env = env_on(Topology::Single, "chunks").await;
        let producer = Producer::connect(&env.config).await.unwrap();
        let probe = Probe::default();
        let _worker = start_worker(&env.config, Chunked(probe.clone()), 4, Quantum::default()).await;
        for own in [false, true] {
            let parts = (0..10).map(Job::new);
            let request = producer.request().concurrency(2).unwrap().own_stream(own);
            let handle = request.submit(chunks(parts, 3).unwrap()).await.unwrap();
            let done = handle.wait_timeout::<Vec<u64>>(Duration::from_secs(20)).await.unwrap();
            assert_eq!(done.state, RequestState::Completed);
            assert_eq!(done.total, 4, "10 parts in chunks of 3 are 4 sub-requests");
            let outputs: Vec<u64> = done.into_outputs().unwrap().into_iter().flatten().collect();
            assert_eq!(outputs, (0..10).map(|n| n * 2).collect::<Vec<_>>(), "own stream: {own}");
            let mut ran: Vec<u64> = probe
                .starts()
                .into_iter()
                .filter(|(id, _)| *id == handle.id().to_string())
                .map(|(_, i)| i)
                .collect();
            ran.sort_unstable();
            assert_eq!(
                ran,
                (0..10).collect::<Vec<_>>(),
                "each part once, by its own index (own stream: {own})"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_part_fails_its_chunk_names_itself_and_stops_the_parts_after_it() {
        let env = env_on(Topology::Single, "chunk-fails").await;
        let producer = Producer::connect(&env.config).await.unwrap();
        let probe = Probe::default();
        let _worker = start_worker(&env.config, Chunked(probe.clone()), 2, Quantum::default()).await;
        let parts = (0..10).map(|n| Job { fail: n == 5, ..Job::new(n) });
        let handle = producer.request().submit(chunks(parts, 4).unwrap()).await.unwrap();
        let done = handle.wait_timeout::<Vec<u64>>(Duration::from_secs(20)).await.unwrap();
        assert_eq!(done.state, RequestState::Failed);
        assert_eq!(done.failed, 1, "one chunk is dead");
        let failure = done.results[1].as_ref().unwrap_err();
        assert_eq!(failure.message, "part 5: job 5 failed on purpose");
        assert!(!failure.permanent);
        assert_eq!(done.results[0].as_ref().unwrap(), &vec![0, 2, 4, 6]);
        assert_eq!(done.results[2].as_ref().unwrap(), &vec![16, 18]);
        let ran: Vec<u64> = probe.starts().into_iter().map(|(_, i)| i).collect();
        assert!(ran.contains(&5) && !ran.contains(&6) && !ran.contains(&7), "ran {ran:?}");
    }
}
