// The body of tests/rate_limits.rs: written once, run against a single Redis and a 3-master
// Cluster (`per_topology!` runs it once for each). A binary of its own: its minute-long test
// measures a rate, which a machine busy with the other suites' tests would bend.

use std::time::{Duration, Instant};

use sluicegate::{Producer, Quantum};
use crate::support::{env_on, start_worker};

/// Logs when each run started, in ms since a common origin.
#[derive(Clone)]
struct Starts {
    origin: Instant,
    at: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
}

#[sluicegate::async_trait]
impl sluicegate::Handler for Starts {
    type Input = u64;
    type Output = u64;

    async fn handle(&self, _ctx: sluicegate::Context, n: u64) -> Result<u64, sluicegate::HandlerError> {
        self.at.lock().unwrap().push(self.origin.elapsed().as_millis() as u64);
        tokio::time::sleep(Duration::from_millis(1)).await;
        Ok(n)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_holds_within_five_percent_over_a_minute() {
    let env = env_on(TOPOLOGY, "rate").await;
    let handler = Starts { origin: Instant::now(), at: Default::default() };
    let a = start_worker(&env.config, handler.clone(), 8, Quantum::default()).await;
    let b = start_worker(&env.config, handler.clone(), 8, Quantum::default()).await;
    let producer = Producer::connect(&env.config).await.unwrap();
    for (n, per) in [(0, Duration::from_secs(1)), (5, Duration::ZERO), (5, Duration::from_secs(90_000))] {
        let Err(e) = producer.request().rate(n, per) else { panic!("rate {n} per {per:?} accepted") };
        assert!(e.to_string().contains("a rate is 1 to 1000000 parts per 1 ms to a day"), "{e}");
    }
    // Without the limit, 16 slots of 1 ms handlers start thousands of parts a second.
    let h = producer
        .request()
        .concurrency(16)
        .unwrap()
        .rate(100, Duration::from_secs(1))
        .unwrap()
        .submit(0..20_000u64)
        .await
        .unwrap();
    let first = loop {
        if let Some(first) = handler.at.lock().unwrap().first().copied() {
            break first;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    tokio::time::sleep(Duration::from_millis(first + 60_000).saturating_sub(handler.origin.elapsed())).await;
    let starts = handler.at.lock().unwrap().clone();
    let in_minute = starts.iter().filter(|t| **t < first + 60_000).count();
    if std::env::var("RATE_DEBUG").is_ok() {
        let mut per = vec![0; 61];
        for t in &starts { per[((t - first) / 1000).min(60) as usize] += 1; }
        eprintln!("per second: {per:?}");
    }
    // At most R * 60 + R (one burst); at least 95% of R * 60.
    assert!((5_700..=6_100).contains(&in_minute), "{in_minute} parts started in the first minute");
    // No one-second window above 2R (its rate and one burst).
    for (i, t) in starts.iter().enumerate() {
        let window = starts[i..].iter().take_while(|u| **u < t + 1_000).count();
        assert!(window <= 200, "{window} parts started within a second from {t} ms");
    }
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    let rate = admin.status(h.id()).await.unwrap().rate.unwrap();
    assert_eq!((rate.n, rate.per_ms), (100, 1_000));
    admin.cancel(h.id()).await.unwrap();
    a.stop().await;
    b.stop().await;
}
