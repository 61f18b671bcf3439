// The body of tests/integration/window.rs: written once, run against a single Redis and a 3-master Redis
// Cluster (`per_topology!` runs it once for each).

use std::time::Duration;

use fred::prelude::*;
use sluicegate::{Admin, Error, Producer, Quantum, RequestId, RequestState};
use crate::support::{env_on, fast, start_worker, Job, Probe};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_of_zero_and_a_window_on_submit_are_refused_with_what_to_do() {
    let env = env_on(TOPOLOGY, "window-refuse").await;
    let producer = Producer::connect(&env.config).await.unwrap();
    let err = producer.request().window(0).err().expect("window(0) is refused");
    assert!(matches!(err, Error::InvalidRequest(_)) && err.to_string().contains("window"), "{err}");
    let err = producer.request().window(10).unwrap().submit([Job::new(1)]).await.expect_err("refused");
    assert!(err.to_string().contains("open()"), "{err}");
    // A whole submit (here a lane request) has no pages to read.
    let h = producer.request().submit([Job::new(1)]).await.unwrap();
    let err = h.results_from::<u64>(0, 10).await.unwrap_err();
    assert!(err.to_string().contains("results_from is for streamed requests"), "{err}");
    let h = producer.request().own_stream(true).submit([Job::new(1)]).await.unwrap();
    let err = h.results_from::<u64>(0, 10).await.unwrap_err();
    assert!(err.to_string().contains("results_from is for streamed requests"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_from_pages_every_part_once_in_order_and_wait_returns_only_the_rest() {
    let env = env_on(TOPOLOGY, "window-pages").await;
    let config = fast(&env.config).window_poll(Duration::from_millis(10));
    let w = start_worker(&config, Probe::default(), 4, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let mut open = producer.request().concurrency(4).unwrap().window(100).unwrap().open().await.unwrap();
    let handle = open.handle().clone();
    let status = admin.status(handle.id()).await.unwrap();
    assert_eq!((status.window, status.discard_results), (Some(100), false), "{status:?}");
    let reader = {
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut got = Vec::new();
            let mut next = 0;
            // Read up to part 1,500 only; the rest is left to wait().
            while next < 1_500 {
                let page = handle.results_from::<u64>(next, 64).await.unwrap();
                assert_eq!(page.first, next);
                assert!(page.results.len() <= 64);
                got.extend(page.results.iter().map(|r| *r.as_ref().unwrap()));
                next = page.next_index();
                if page.results.is_empty() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            got
        })
    };
    for chunk in 0..20u64 {
        open.add((chunk * 100..(chunk + 1) * 100).map(Job::new)).await.unwrap();
    }
    let handle = open.finalize().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(60), reader).await.unwrap().unwrap();
    assert_eq!(got, (0..got.len() as u64).map(|n| n * 2).collect::<Vec<_>>(), "no gap, no repeat");
    let done = handle.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.state, RequestState::Completed);
    assert_eq!((done.first, done.total), (got.len() as u64, 2_000));
    assert_eq!(done.into_outputs().unwrap(), (got.len() as u64..2_000).map(|n| n * 2).collect::<Vec<_>>());
    // A page asked for below what was deleted already is refused, with why.
    let page = handle.results_from::<u64>(got.len() as u64, 1_000).await.unwrap();
    assert!(page.is_last() && page.results.len() == 2_000 - got.len());
    let err = handle.results_from::<u64>(0, 10).await.unwrap_err();
    assert!(err.to_string().contains("taken and deleted already"), "{err}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discarded_results_are_never_stored_and_the_completion_counts_the_parts() {
    let env = env_on(TOPOLOGY, "window-discard").await;
    let config = fast(&env.config).window_poll(Duration::from_millis(10));
    let w = start_worker(&config, Probe::default(), 4, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let mut open = producer
        .request()
        .concurrency(4)
        .unwrap()
        .window(50)
        .unwrap()
        .discard_results(true)
        .open()
        .await
        .unwrap();
    let handle = open.handle().clone();
    let res = format!("{}:r:{{{}}}:res", config.namespace_str(), handle.id().key_id());
    for chunk in 0..10u64 {
        open.add((chunk * 100..(chunk + 1) * 100).map(Job::new)).await.unwrap();
        let kept: u64 = redis.hlen(&res).await.unwrap();
        assert_eq!(kept, 0, "a discarded result was stored");
    }
    let err = handle.results_from::<u64>(0, 10).await.unwrap_err();
    assert!(err.to_string().contains("discard"), "{err}");
    let handle = open.finalize().await.unwrap();
    let done = handle.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!((done.state, done.first, done.total, done.failed), (RequestState::Completed, 1_000, 1_000, 0));
    assert!(done.results.is_empty());
    let status = admin.status(handle.id()).await.unwrap();
    assert_eq!((status.window, status.discard_results, status.done), (Some(50), true, 1_000), "{status:?}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_survive_the_trimming_and_can_be_requeued() {
    let env = env_on(TOPOLOGY, "window-dead").await;
    let config = fast(&env.config).window_poll(Duration::from_millis(10));
    let w = start_worker(&config, Probe::default(), 4, Quantum::default()).await;
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    const W: u64 = 40;
    let mut open = producer
        .request()
        .concurrency(4)
        .unwrap()
        .window(W)
        .unwrap()
        .max_attempts(2)
        .unwrap()
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .unwrap()
        .open()
        .await
        .unwrap();
    let handle = open.handle().clone();
    let stream = format!("{}:r:{{{}}}:s", config.namespace_str(), handle.id().key_id());
    // Every 50th part fails at both attempts: 12 dead letters, pending below everything else,
    // which hold back the trim by MINID while 588 parts succeed.
    let fails = |n: u64| n % 50 == 7;
    let mut longest = 0u64;
    for chunk in 0..30u64 {
        open.add((chunk * 20..(chunk + 1) * 20).map(|n| Job { n, sleep_ms: 0, fail: fails(n) })).await.unwrap();
        longest = longest.max(redis.xlen(&stream).await.unwrap());
    }
    let handle = open.finalize().await.unwrap();
    let done = handle.wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
    assert_eq!((done.state, done.total, done.failed), (RequestState::Failed, 600, 12));
    for (i, r) in done.results.iter().enumerate() {
        assert_eq!(r.is_err(), fails(i as u64), "part {i}: {r:?}");
    }
    assert!(longest <= 2 * W + 12, "the stream held {longest} entries with a window of {W}");
    // Every dead letter is still in the stream, with its payload: none was trimmed.
    let entries: Vec<(String, std::collections::HashMap<String, Vec<u8>>)> =
        redis.xrange(&stream, "-", "+", None).await.unwrap();
    let ids: Vec<&str> = entries.iter().map(|(id, _)| id.as_str()).collect();
    for n in (0..600u64).filter(|n| fails(*n)) {
        assert!(ids.contains(&format!("0-{}", n + 1).as_str()), "dead letter {n} was trimmed: {ids:?}");
    }
    assert_eq!(admin.requeue_dead(handle.id()).await.unwrap(), 12);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_keeps_at_most_its_window_of_parts_unfinished_across_requests() {
    use sluicegate::Loader;
    let env = env_on(TOPOLOGY, "window-loader").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let err = Loader::connect(&producer, 0).await.err().expect("a window of 0 is refused");
    assert!(err.to_string().contains("window of 0 parts"), "{err}");
    let loader = Loader::connect(&producer, 10).await.unwrap();
    // No worker yet: five requests of two parts fill the window.
    let mut handles = Vec::new();
    for r in 0..5u64 {
        let spec = producer.request().id(format!("load-{r}")).unwrap().concurrency(2).unwrap();
        handles.push(loader.submit(spec, [Job::new(r * 10), Job::new(r * 10 + 1)]).await.unwrap());
    }
    assert_eq!(loader.unfinished(), 10);
    // A sixth waits for room, and is not in Redis meanwhile.
    let sixth = loader.submit(producer.request().id("load-5").unwrap(), [Job::new(50)]);
    let waited = tokio::time::timeout(Duration::from_millis(500), sixth).await;
    assert!(waited.is_err(), "a request beyond the window was submitted");
    let unknown = admin.status(&RequestId::new("load-5").unwrap()).await.unwrap_err();
    assert!(matches!(unknown, Error::UnknownRequest(_)), "{unknown}");
    // A worker frees room as requests end; one larger than the window goes alone.
    let w = start_worker(&config, Probe::default(), 4, Quantum::default()).await;
    handles.push(loader.submit(producer.request().id("load-5").unwrap(), [Job::new(50)]).await.unwrap());
    let big = (0..15u64).map(|n| Job::new(600 + n));
    handles.push(loader.submit(producer.request().id("load-6").unwrap().concurrency(4).unwrap(), big).await.unwrap());
    // A refused submit gives its room back.
    let before = loader.unfinished();
    let dup = loader.submit(producer.request().id("load-6").unwrap(), [Job::new(1)]).await.expect_err("refused");
    assert!(matches!(dup, Error::DuplicateRequestId(_)), "{dup}");
    assert!(loader.unfinished() <= before, "{} > {before}", loader.unfinished());
    tokio::time::timeout(Duration::from_secs(60), loader.drain()).await.expect("drained").unwrap();
    assert_eq!(loader.unfinished(), 0);
    let mut got = Vec::new();
    for h in &handles {
        let done = h.wait_timeout::<u64>(Duration::from_secs(10)).await.unwrap();
        assert_eq!(done.state, RequestState::Completed);
        got.push(done.into_outputs().unwrap());
    }
    let expected: Vec<Vec<u64>> = (0..5u64)
        .map(|r| vec![r * 20, r * 20 + 2])
        .chain([vec![100], (0..15u64).map(|n| (600 + n) * 2).collect()])
        .collect();
    assert_eq!(got, expected);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaders_submit_many_sends_what_fits_and_waits_for_room_for_the_rest() {
    use sluicegate::Loader;
    let env = env_on(TOPOLOGY, "window-loader-many").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let loader = Loader::connect(&producer, 20).await.unwrap();
    // No worker yet: of 15 requests of two parts, the first ten fill the window and are sent; the
    // rest wait. Among them an id used twice (the second refused alone) and a request with no
    // parts (refused, holding no room).
    let batch = |range: std::ops::Range<u64>| {
        let producer = &producer;
        range.map(move |r| {
            let id = if r == 3 { "many-1".to_owned() } else { format!("many-{r}") };
            let parts = if r == 5 { vec![] } else { vec![Job::new(r * 10), Job::new(r * 10 + 1)] };
            (producer.request().id(id).unwrap().concurrency(2).unwrap(), parts)
        })
    };
    let loading = loader.submit_many(batch(0..15));
    tokio::pin!(loading);
    assert!(tokio::time::timeout(Duration::from_millis(500), &mut loading).await.is_err(), "all fitted");
    assert_eq!(loader.unfinished(), 20);
    let queued = admin.status(&RequestId::new("many-9").unwrap()).await.unwrap();
    assert_eq!(queued.state, RequestState::Queued);
    let waiting = admin.status(&RequestId::new("many-14").unwrap()).await.unwrap_err();
    assert!(matches!(waiting, Error::UnknownRequest(_)), "{waiting}");
    // A worker frees room; every request gets its answer in order.
    let w = start_worker(&config, Probe::default(), 4, Quantum::default()).await;
    let answers = tokio::time::timeout(Duration::from_secs(60), loading).await.expect("loaded");
    assert_eq!(answers.len(), 15);
    for (r, answer) in answers.iter().enumerate() {
        match r {
            3 => assert!(matches!(answer, Err(Error::DuplicateRequestId(_))), "{answer:?}"),
            5 => assert!(matches!(answer, Err(Error::InvalidRequest(_))), "{answer:?}"),
            _ => {
                let done = answer.as_ref().unwrap().wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
                let r = r as u64;
                assert_eq!(done.into_outputs().unwrap(), [r * 20, r * 20 + 2], "request {r}");
            }
        }
    }
    tokio::time::timeout(Duration::from_secs(60), loader.drain()).await.expect("drained").unwrap();
    assert_eq!(loader.unfinished(), 0);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_frees_the_room_of_a_request_whose_completion_it_never_hears() {
    use sluicegate::Loader;
    let env = env_on(TOPOLOGY, "window-loader-lost").await;
    let config = fast(&env.config);
    let producer = Producer::connect(&config).await.unwrap();
    let loader = Loader::connect(&producer, 4).await.unwrap();
    loader.submit(producer.request().id("lost").unwrap(), (0..4).map(Job::new)).await.unwrap();
    assert_eq!(loader.unfinished(), 4);
    // A retried submit of the same id is refused without touching the first one's room.
    let dup = loader.submit(producer.request().id("lost").unwrap(), [Job::new(1)]).await.expect_err("refused");
    assert!(matches!(dup, Error::DuplicateRequestId(_)), "{dup}");
    assert_eq!(loader.unfinished(), 4);
    // The request vanishes without an event (its namespace purged): its status says so, and the
    // loader's periodic look frees its room.
    Admin::connect(&config).await.unwrap().purge_namespace(true).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), loader.drain()).await.expect("the room came back").unwrap();
    assert_eq!(loader.unfinished(), 0);
}
