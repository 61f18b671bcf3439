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
/// stream of its own; a failing or panicking part fails its chunk, names itself, keeps its
/// permanence, and the parts after it in the chunk do not run; a retry runs the whole chunk; a
/// part that outlives the attempt's timeout stops the chunk before the next part.
mod chunks {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use crate::support::{env_on, start_worker, Env, Job, Probe, Running};
    use serde::{Deserialize, Serialize};
    use sluicegate::{
        async_trait, chunks, Chunked, Context, Handler, HandlerError, Producer, Quantum, RequestState,
    };
    use sluicegate_testkit::Topology;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunks_run_each_part_once_with_its_own_index_and_flatten_to_the_parts_outputs() {
        let probe = Probe::default();
        let (_env, producer, _worker) = on_redis("chunks", Chunked(probe.clone()), 4).await;
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
        let probe = Probe::default();
        let (_env, producer, _worker) = on_redis("chunk-fails", Chunked(probe.clone()), 2).await;
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

    /// A part's input for [`Steps`]: what the part does.
    #[derive(Serialize, Deserialize, Clone, Debug, Default)]
    struct Step {
        n: u64,
        /// Blocks its thread this long (a handler that ignores its cancellation; an abort cannot
        /// stop it).
        block_ms: u64,
        panic: bool,
        permanent: bool,
        /// Fails on attempts before this one.
        fail_before: u32,
    }

    /// Records (index, attempt) of each part it starts, at once (before any await), then does
    /// what the part says.
    #[derive(Clone, Default)]
    struct Steps(Arc<Mutex<Vec<(u64, u32)>>>);

    #[async_trait]
    impl Handler for Steps {
        type Input = Step;
        type Output = u64;

        async fn handle(&self, ctx: Context, step: Step) -> Result<u64, HandlerError> {
            self.0.lock().unwrap().push((ctx.index(), ctx.attempt()));
            if step.block_ms > 0 {
                // Blocking, but off the runtime's core, so that the worker's timers still run.
                tokio::task::block_in_place(|| std::thread::sleep(Duration::from_millis(step.block_ms)));
            }
            if step.panic {
                panic!("step {} panics", step.n);
            }
            if step.permanent {
                return Err(HandlerError::permanent(format!("step {} is refused", step.n)));
            }
            if ctx.attempt() < step.fail_before {
                return Err(HandlerError::new(format!("step {} not yet", step.n)));
            }
            Ok(step.n)
        }
    }

    fn steps(n: u64) -> Vec<Step> {
        (0..n).map(|n| Step { n, ..Step::default() }).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_permanent_part_or_a_panic_fails_its_chunk_named_by_the_part() {
        let env = env_on(Topology::Single, "chunk-permanent").await;
        let producer = Producer::connect(&env.config).await.unwrap();
        let _worker = start_worker(&env.config, Chunked(Steps::default()), 2, Quantum::default()).await;
        let mut parts = steps(6);
        parts[1].permanent = true;
        parts[4].panic = true;
        let request = producer.request().max_attempts(3).unwrap().backoff(ms(10), ms(20)).unwrap();
        let done = request.submit(chunks(parts, 3).unwrap()).await.unwrap();
        let done = done.wait_timeout::<Vec<u64>>(Duration::from_secs(20)).await.unwrap();
        assert_eq!(done.state, RequestState::Failed);
        let refused = done.results[0].as_ref().unwrap_err();
        assert_eq!(
            (refused.message.as_str(), refused.permanent, refused.attempts),
            ("part 1: step 1 is refused", true, 1)
        );
        let panicked = done.results[1].as_ref().unwrap_err();
        assert_eq!(
            (panicked.message.as_str(), panicked.permanent, panicked.attempts),
            ("part 4: handler panicked: step 4 panics", false, 3),
            "a panic is retried, as a handler's panic is"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retried_chunk_runs_all_its_parts_again_and_keeps_the_last_outputs() {
        let seen = Steps::default();
        let (_env, producer, _worker) = on_redis("chunk-retry", Chunked(seen.clone()), 2).await;
        let mut parts = steps(3);
        parts[2].fail_before = 2;
        let request = producer.request().max_attempts(2).unwrap().backoff(ms(10), ms(20)).unwrap();
        let done = request.submit(chunks(parts, 3).unwrap()).await.unwrap();
        let done = done.wait_timeout::<Vec<u64>>(Duration::from_secs(20)).await.unwrap();
        assert_eq!(done.state, RequestState::Completed);
        assert_eq!(done.results[0].as_ref().unwrap(), &vec![0, 1, 2]);
        let ran = seen.0.lock().unwrap().clone();
        assert_eq!(ran, vec![(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)], "the whole chunk, twice");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_part_that_outlives_the_attempts_timeout_stops_its_chunk_before_the_next_part() {
        let seen = Steps::default();
        let (_env, producer, _worker) = on_redis("chunk-timeout", Chunked(seen.clone()), 1).await;
        let mut parts = steps(3);
        // It blocks its thread, so that the abort cannot stop it; only the chunk's own look at
        // the cancellation keeps part 1 from starting.
        parts[0].block_ms = 800;
        let request = producer.request().timeout(ms(200)).unwrap();
        let done = request.submit(chunks(parts, 3).unwrap()).await.unwrap();
        let done = done.wait_timeout::<Vec<u64>>(Duration::from_secs(20)).await.unwrap();
        assert_eq!(done.state, RequestState::Failed);
        assert!(done.results[0].as_ref().unwrap_err().message.contains("timed out"), "{:?}", done.results[0]);
        assert_eq!(seen.0.lock().unwrap().clone(), vec![(0, 1)], "part 1 started after the timeout");
    }

    /// A redis-server of its own, a producer, and a worker of `slots` running `handler`.
    async fn on_redis<H: Handler>(name: &str, handler: H, slots: usize) -> (Env, Producer, Running) {
        let env = env_on(Topology::Single, name).await;
        let producer = Producer::connect(&env.config).await.unwrap();
        let worker = start_worker(&env.config, handler, slots, Quantum::default()).await;
        (env, producer, worker)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }
}
