//! Windowed streamed requests (issue 13): a request of any size in bounded Redis memory.
//!
//! The suite in `suites/window.rs` runs on a single Redis and a 3-master Redis Cluster
//! (`single::`, `cluster::`); the two heavier tests below (a 20,000-part request sampled for its
//! memory, a worker killed mid-window) run on a single Redis only.

sluicegate_testkit::per_topology!(include!("../suites/window.rs"););

mod heavy {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use fred::prelude::*;
    use sluicegate::{Producer, Quantum, RequestHandle, RequestState};
    use sluicegate_testkit::Topology;

    use crate::support::{env_on, fast, start_worker, Job, Probe};

    /// Reads every outcome of `handle` with `results_from` in pages of `page`, checking that the
    /// pages follow each other with no gap and no repeat; returns them (n doubled, or failed).
    async fn read_all(handle: RequestHandle, page: usize) -> Vec<Option<u64>> {
        let mut out = Vec::new();
        let mut next = 0;
        loop {
            let p = handle.results_from::<u64>(next, page).await.unwrap();
            assert_eq!(p.first, next, "a page starts where the last one ended");
            out.extend(p.results.iter().map(|r| r.as_ref().ok().copied()));
            next = p.next_index();
            if p.is_last() {
                return out;
            }
            if p.results.is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_20k_part_request_with_a_window_of_500_never_holds_more_than_the_window_in_redis() {
        let env = env_on(Topology::Single, "window-mem").await;
        let config = fast(&env.config).window_poll(Duration::from_millis(10));
        let w = start_worker(&config, Probe::default(), 8, Quantum::default()).await;
        let producer = Producer::connect(&config).await.unwrap();
        const W: u64 = 500;
        const N: u64 = 20_000;
        let mut open = producer.request().concurrency(8).unwrap().window(W).unwrap().open().await.unwrap();
        let handle = open.handle().clone();
        let kid = handle.id().key_id();
        let ns = config.namespace_str().to_owned();
        let (meta, stream, res) =
            (format!("{ns}:r:{{{kid}}}"), format!("{ns}:r:{{{kid}}}:s"), format!("{ns}:r:{{{kid}}}:res"));
        // A sampler: the stream's length, the results kept and the outstanding parts, every 2 ms.
        let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (max_len, max_res, max_left) =
            (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let sampler = {
            let (stop, max_len, max_res, max_left) =
                (stop.clone(), max_len.clone(), max_res.clone(), max_left.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let len: u64 = redis.xlen(&stream).await.unwrap_or(0);
                    let kept: u64 = redis.hlen(&res).await.unwrap_or(0);
                    let left: Option<u64> = redis.hget(&meta, "left").await.unwrap_or(None);
                    max_len.fetch_max(len, Ordering::Relaxed);
                    max_res.fetch_max(kept, Ordering::Relaxed);
                    max_left.fetch_max(left.unwrap_or(0), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        };
        let reader = tokio::spawn(read_all(handle.clone(), 1_000));
        // Each part sleeps 1 ms: 8 slots run about 8,000 parts/s, slower than the producer adds.
        for chunk in 0..N / 1_000 {
            open.add((chunk * 1_000..(chunk + 1) * 1_000).map(|n| Job::sleeping(n, 1))).await.unwrap();
        }
        open.finalize().await.unwrap();
        let results = tokio::time::timeout(Duration::from_secs(120), reader).await.unwrap().unwrap();
        stop.store(true, Ordering::Relaxed);
        sampler.await.unwrap();
        assert_eq!(results, (0..N).map(|n| Some(n * 2)).collect::<Vec<_>>(), "every part once, in order");
        let (len, kept, left) = (
            max_len.load(Ordering::Relaxed),
            max_res.load(Ordering::Relaxed),
            max_left.load(Ordering::Relaxed),
        );
        eprintln!("window {W}: max stream length {len}, max results kept {kept}, max outstanding {left}");
        assert!(left <= W, "{left} parts outstanding, above the window {W}");
        assert!(left >= W / 2, "the window never filled ({left}): the test did not make add wait");
        assert!(len <= 2 * W, "the stream held {len} entries with a window of {W}");
        // The reader keeps up to within a few pages; without it the results would reach N.
        assert!(kept <= W + 3_000, "{kept} results kept in Redis");
        let done = handle.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
        assert_eq!((done.state, done.first, done.total, done.failed), (RequestState::Completed, N, N, 0));
        assert!(done.results.is_empty(), "wait() returns only the results not taken");
        w.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_worker_killed_mid_window_loses_no_part() {
        let env = env_on(Topology::Single, "window-kill").await;
        let config = fast(&env.config).window_poll(Duration::from_millis(10));
        let probe = Probe::default();
        let doomed = start_worker(&config, probe.clone(), 4, Quantum::default()).await;
        let producer = Producer::connect(&config).await.unwrap();
        const N: u64 = 1_500;
        let mut open = producer.request().concurrency(8).unwrap().window(60).unwrap().open().await.unwrap();
        let handle = open.handle().clone();
        let reader = tokio::spawn(read_all(handle.clone(), 100));
        let feeder = tokio::spawn(async move {
            for chunk in 0..N / 100 {
                open.add((chunk * 100..(chunk + 1) * 100).map(|n| Job::sleeping(n, 3))).await.unwrap();
            }
            open.finalize().await.unwrap();
        });
        while probe.starts().len() < 300 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Killed while it holds tokens and batches: the survivor reclaims them after the lease.
        doomed.crash();
        let survivor = start_worker(&config, probe.clone(), 4, Quantum::default()).await;
        let results = tokio::time::timeout(Duration::from_secs(120), reader).await.unwrap().unwrap();
        feeder.await.unwrap();
        assert_eq!(results, (0..N).map(|n| Some(n * 2)).collect::<Vec<_>>(), "every part once, in order");
        let done = handle.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
        assert_eq!((done.state, done.total, done.failed), (RequestState::Completed, N, 0));
        survivor.stop().await;
    }
}
