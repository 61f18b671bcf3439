// The body of tests/rate_limits.rs: written once, run against a single Redis and a 3-master
// Cluster (`per_topology!` runs it once for each). A binary of its own: its minute-long test, of a
// request's rate limit and a tenant group's side by side, measures rates, which a machine busy
// with the other suites' tests would bend.

use std::time::{Duration, Instant};

use sluicegate::{Producer, Quantum};
use crate::support::{env_on, start_worker};

/// Logs when each run started, in ms since a common origin: the request's runs in `at`, the
/// group's (requests whose id starts with "g-") in `group`.
#[derive(Clone)]
struct Starts {
    origin: Instant,
    at: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
    group: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
}

#[sluicegate::async_trait]
impl sluicegate::Handler for Starts {
    type Input = u64;
    type Output = u64;

    async fn handle(&self, ctx: sluicegate::Context, n: u64) -> Result<u64, sluicegate::HandlerError> {
        let log = if ctx.request_id().as_str().starts_with("g-") { &self.group } else { &self.at };
        log.lock().unwrap().push(self.origin.elapsed().as_millis() as u64);
        tokio::time::sleep(Duration::from_millis(1)).await;
        Ok(n)
    }
}

/// Counts the starts in `starts` within the minute from `from` (taken just before the limit could
/// first grant a start, so every start counted was granted within that minute), and checks them
/// against a limit of `r` per second: at least 95% of R * 60, at most R * 60 + R (one burst), and
/// no one-second window above 2R (its rate and one burst). Counted from the first start, the
/// minute took in the grants made while that start came late (a loaded machine), over a minute's
/// worth: 6,128 and 6,129 of at most 6,100 were seen once.
fn assert_rate(what: &str, starts: &[u64], from: u64, r: usize) {
    let in_minute = starts.iter().filter(|t| **t < from + 60_000).count();
    if std::env::var("RATE_DEBUG").is_ok() {
        let mut per = vec![0; 61];
        for t in starts {
            per[((t - from) / 1000).min(60) as usize] += 1;
        }
        eprintln!("{what} per second: {per:?}");
    }
    assert!((r * 57..=r * 61).contains(&in_minute), "{what}: {in_minute} parts started in the first minute");
    for (i, t) in starts.iter().enumerate() {
        let window = starts[i..].iter().take_while(|u| **u < t + 1_000).count();
        assert!(window <= 2 * r, "{what}: {window} parts started within a second from {t} ms");
    }
}

/// The minute is shared: a rate-limited request (100/s) and a rate-limited tenant group (50/s)
/// of two requests without limits of their own run side by side on two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_of_a_request_and_a_group_hold_within_five_percent_over_a_minute() {
    let env = env_on(TOPOLOGY, "rate").await;
    let handler = Starts { origin: Instant::now(), at: Default::default(), group: Default::default() };
    let a = start_worker(&env.config, handler.clone(), 8, Quantum::default()).await;
    let b = start_worker(&env.config, handler.clone(), 8, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    for (n, per) in [(0, Duration::from_secs(1)), (5, Duration::ZERO), (5, Duration::from_secs(90_000))] {
        let Err(e) = producer.request().rate(n, per) else { panic!("rate {n} per {per:?} accepted") };
        assert!(e.to_string().contains("a rate is 1 to 1000000 parts per 1 ms to a day"), "{e}");
    }
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    let since = |handler: &Starts| handler.origin.elapsed().as_millis() as u64;
    let group_from = since(&handler);
    admin.set_group_rate("g", Some((50, Duration::from_secs(1)))).await.unwrap();
    for (n, per) in [(0, Duration::from_secs(1)), (5, Duration::ZERO)] {
        let e = admin.set_group_rate("g", Some((n, per))).await.unwrap_err();
        assert!(e.to_string().contains("a rate is 1 to 1000000 parts per 1 ms to a day"), "{e}");
    }
    let mut grouped = Vec::new();
    for i in 0..2 {
        let r = producer.request().id(format!("g-{i}")).unwrap().group("g").unwrap().concurrency(16).unwrap();
        grouped.push(r.submit(0..20_000u64).await.unwrap());
    }
    // Without the limit, 16 slots of 1 ms handlers start thousands of parts a second.
    let request_from = since(&handler);
    let h = producer
        .request()
        .concurrency(16)
        .unwrap()
        .rate(100, Duration::from_secs(1))
        .unwrap()
        .submit(0..20_000u64)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(request_from + 60_000).saturating_sub(handler.origin.elapsed())).await;
    assert_rate("the request", &handler.at.lock().unwrap().clone(), request_from, 100);
    assert_rate("the group", &handler.group.lock().unwrap().clone(), group_from, 50);
    let rate = admin.status(h.id()).await.unwrap().rate.unwrap();
    assert_eq!((rate.n, rate.per_ms), (100, 1_000));
    let g = admin.group("g").await.unwrap();
    assert_eq!(g.rate.map(|r| (r.n, r.per_ms)), Some((50, 1_000)));
    admin.cancel(h.id()).await.unwrap();
    for g in &grouped {
        admin.cancel(g.id()).await.unwrap();
    }
    a.stop().await;
    b.stop().await;
}
