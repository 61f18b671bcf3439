//! Recovery at the default settings, measured: how soon a crashed worker's part runs again, how
//! close a retry comes to its backoff, how soon a requeued dead letter runs, the longest Redis call
//! around a request with 10,000 tokens, and what the liveness that makes this fast costs Redis.
//!
//! ```text
//! cargo run --release --example recovery                  # everything (about four minutes)
//! cargo run --release --example recovery -- kill retry    # some of it: kill retry requeue census cost
//! ```
//! It starts its own redis-server unless `REDIS_URL` names one. Workers run in this process; a
//! crash is the worker's task dropped without a clean stop (its slots stop where they are, its
//! heartbeat thread stops), which is what a SIGKILL does to the protocol.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use sluicegate::{async_trait, Admin, Config, Context, Handler, HandlerError, Producer, Quantum, Worker};
use sluicegate_testkit::{command_calls, connect, TestRedis};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Which worker ran an attempt, when it started, and when it ended.
type Mark = (usize, Instant, Option<Instant>);

/// When each (request, attempt) started and ended, and by which worker.
#[derive(Clone, Default)]
struct Marks(Arc<Mutex<BTreeMap<(String, u32), Mark>>>);

impl Marks {
    fn start(&self, ctx: &Context, worker: usize) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((ctx.request_id().to_string(), ctx.attempt()), (worker, Instant::now(), None));
    }
    fn end(&self, ctx: &Context) {
        if let Some(m) = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&(ctx.request_id().to_string(), ctx.attempt()))
        {
            m.2 = Some(Instant::now());
        }
    }
    fn get(&self, request: &str, attempt: u32) -> Option<Mark> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(&(request.to_owned(), attempt)).copied()
    }
    async fn wait(&self, request: &str, attempt: u32, limit: Duration) -> Option<Mark> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(m) = self.get(request, attempt) {
                return Some(m);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        None
    }
}

/// What a part does, by attempt: run for ever (until its context is cancelled), fail, or succeed.
#[derive(Clone, Copy)]
enum Plan {
    HangFirst,
    FailFirst,
    FailWhile,
    Hold(Duration),
}

#[derive(Clone)]
struct Probe {
    worker: usize,
    marks: Marks,
    plan: Plan,
    failing: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait]
impl Handler for Probe {
    type Input = u64;
    type Output = u64;
    async fn handle(&self, ctx: Context, n: u64) -> Result<u64, HandlerError> {
        self.marks.start(&ctx, self.worker);
        let out = match self.plan {
            Plan::HangFirst if ctx.attempt() == 1 => {
                ctx.cancelled().cancelled().await;
                Err(HandlerError::new("cancelled"))
            }
            Plan::FailFirst if ctx.attempt() == 1 => Err(HandlerError::new("first attempt fails")),
            Plan::FailWhile if self.failing.load(std::sync::atomic::Ordering::Relaxed) => {
                Err(HandlerError::permanent("broken until the fix"))
            }
            Plan::Hold(d) => {
                tokio::time::sleep(d).await;
                Ok(n)
            }
            _ => Ok(n),
        };
        self.marks.end(&ctx);
        out
    }
}

struct Running {
    stop: CancellationToken,
    task: JoinHandle<sluicegate::Result<()>>,
}

async fn start(config: &Config, probe: Probe, slots: usize) -> Result<Running, BoxError> {
    let worker = Worker::builder(config, probe).slots(slots).quantum(Quantum::default()).build().await?;
    let stop = CancellationToken::new();
    let signal = stop.clone();
    Ok(Running { stop, task: tokio::spawn(worker.run_until(async move { signal.cancelled().await })) })
}

impl Running {
    fn crash(self) {
        self.task.abort();
    }
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn summary(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    format!(
        "n={} p50={:.0} ms p99={:.0} ms max={:.0} ms",
        v.len(),
        percentile(&v, 0.5),
        percentile(&v, 0.99),
        v.last().copied().unwrap_or(f64::NAN)
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn config(url: &str, name: &str) -> Config {
    // The defaults, but for the namespace: lease 2 s, heartbeat 500 ms, recovery interval 200 ms.
    Config::new(url).namespace(format!("recovery-{name}-{}", std::process::id()))
}

/// Kill to restart: a part runs on one of two workers; the worker running it crashes; how long
/// until the part starts again on the other. The crashed worker is replaced after each trial.
async fn kill_to_restart(url: &str, trials: usize) -> Result<(), BoxError> {
    let config = config(url, "kill");
    let producer = Producer::connect(&config).await?;
    let marks = Marks::default();
    let probe =
        |worker| Probe { worker, marks: marks.clone(), plan: Plan::HangFirst, failing: Default::default() };
    let mut workers = vec![(0, start(&config, probe(0), 2).await?), (1, start(&config, probe(1), 2).await?)];
    let mut took = Vec::new();
    for next in 2..2 + trials {
        let h = producer.request().submit([1u64]).await?;
        let id = h.id().to_string();
        let Some((who, _, _)) = marks.wait(&id, 1, Duration::from_secs(10)).await else {
            return Err("never started".into());
        };
        let index = workers.iter().position(|(n, _)| *n == who).ok_or("the part ran on an unknown worker")?;
        let (_, crashed) = workers.remove(index);
        crashed.crash();
        let crashed_at = Instant::now();
        let Some((_, restarted, _)) = marks.wait(&id, 2, Duration::from_secs(30)).await else {
            return Err("the part never ran again".into());
        };
        took.push(ms(restarted - crashed_at));
        h.wait_timeout::<u64>(Duration::from_secs(10)).await?;
        workers.push((next, start(&config, probe(next), 2).await?));
    }
    for (_, w) in workers {
        w.stop().await;
    }
    println!(
        "kill_to_restart: {}  (crash of the worker running the part -> its next attempt starts)",
        summary(took)
    );
    Ok(())
}

/// Retry latency: a part fails at once on its first attempt, its token parks (no other part),
/// and its retry is due after the backoff: how long after the failure the retry starts, against
/// the backoff (the delay drawn is in [X/2, X], "equal jitter").
async fn retry_latency(url: &str, trials: usize) -> Result<(), BoxError> {
    for backoff in
        [Duration::ZERO, Duration::from_millis(100), Duration::from_millis(500), Duration::from_secs(2)]
    {
        let config = config(url, &format!("retry{}", backoff.as_millis()));
        let producer = Producer::connect(&config).await?;
        let marks = Marks::default();
        let probe =
            Probe { worker: 0, marks: marks.clone(), plan: Plan::FailFirst, failing: Default::default() };
        let w = start(&config, probe, 2).await?;
        let (mut gap, mut over) = (Vec::new(), Vec::new());
        for _ in 0..trials {
            let h = producer.request().max_attempts(2)?.backoff(backoff, backoff)?.submit([1u64]).await?;
            h.wait_timeout::<u64>(Duration::from_secs(30)).await?;
            let id = h.id().to_string();
            let (Some((_, _, Some(failed))), Some((_, retried, _))) = (marks.get(&id, 1), marks.get(&id, 2))
            else {
                return Err("missing marks".into());
            };
            gap.push(ms(retried - failed));
            over.push(ms(retried - failed) - ms(backoff));
        }
        w.stop().await;
        println!(
            "retry_latency backoff={:?}: failure -> retry {}; beyond the backoff: p99 {:+.0} ms",
            backoff,
            summary(gap),
            percentile(
                &{
                    let mut o = over;
                    o.sort_by(f64::total_cmp);
                    o
                },
                0.99
            )
        );
    }
    Ok(())
}

/// Requeue latency: a failed request's dead letter is requeued; how long until it runs.
async fn requeue_latency(url: &str, trials: usize) -> Result<(), BoxError> {
    let config = config(url, "requeue");
    let producer = Producer::connect(&config).await?;
    let admin = Admin::connect(&config).await?;
    let marks = Marks::default();
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let probe = Probe { worker: 0, marks: marks.clone(), plan: Plan::FailWhile, failing: failing.clone() };
    let w = start(&config, probe, 2).await?;
    let mut took = Vec::new();
    for _ in 0..trials {
        failing.store(true, std::sync::atomic::Ordering::Relaxed);
        let h = producer.request().submit([1u64]).await?;
        h.wait_timeout::<u64>(Duration::from_secs(10)).await?;
        failing.store(false, std::sync::atomic::Ordering::Relaxed);
        marks.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let asked = Instant::now();
        admin.requeue_dead(h.id()).await?;
        let id = h.id().to_string();
        let Some((_, ran, _)) = marks.wait(&id, 1, Duration::from_secs(30)).await else {
            return Err("never ran".into());
        };
        took.push(ms(ran - asked));
        h.wait_timeout::<u64>(Duration::from_secs(10)).await?;
    }
    w.stop().await;
    println!("requeue_latency: {}  (requeue_dead called -> the dead letter runs again)", summary(took));
    Ok(())
}

/// The longest Redis calls while a request with 10,000 tokens is submitted, looked at by recovery
/// (its census) and cancelled: every call over 1 ms, from SLOWLOG.
async fn census(url: &str, redis: &Client) -> Result<(), BoxError> {
    let config = config(url, "census").census_interval(Duration::from_millis(500));
    let producer = Producer::connect(&config).await?;
    let set = CustomCommand::new_static("CONFIG", ClusterHash::Random, false);
    let _: Value = redis.custom(set, vec!["SET", "slowlog-log-slower-than", "1000"]).await?;
    let slowlog = CustomCommand::new_static("SLOWLOG", ClusterHash::Random, false);
    let _: Value = redis.custom(slowlog.clone(), vec!["RESET"]).await?;
    let h = producer.request().concurrency(10_000)?.submit(0..10_000u64).await?;
    let marks = Marks::default();
    let probe =
        Probe { worker: 0, marks, plan: Plan::Hold(Duration::from_millis(200)), failing: Default::default() };
    let w = start(&config, probe, 1).await?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    h.cancel().await?;
    w.stop().await;
    let logged: Value = redis.custom(slowlog, vec![Value::from("GET"), 1000.into()]).await?;
    let mut longest: BTreeMap<String, u64> = BTreeMap::new();
    for entry in logged.into_array() {
        let f = entry.into_array();
        let (Some(us), Some(cmd)) = (f.get(2).and_then(Value::as_u64), f.get(3)) else { continue };
        let args = cmd.clone().into_array();
        let name = match args.first().and_then(Value::as_string).as_deref() {
            Some("FCALL") => args.get(1).and_then(Value::as_string).unwrap_or_default(),
            Some(other) => other.to_owned(),
            None => continue,
        };
        let e = longest.entry(name).or_default();
        *e = (*e).max(us);
    }
    let _: Value = redis
        .custom(
            CustomCommand::new_static("CONFIG", ClusterHash::Random, false),
            vec!["SET", "slowlog-log-slower-than", "10000"],
        )
        .await?;
    let mut by: Vec<(String, u64)> = longest.into_iter().collect();
    by.sort_by_key(|b| std::cmp::Reverse(b.1));
    let listed: Vec<String> =
        by.iter().take(6).map(|(n, us)| format!("{n} {:.1} ms", *us as f64 / 1000.0)).collect();
    println!(
        "census_10000_tokens: longest call {} (calls over 1 ms: {})",
        by.first()
            .map_or("none over 1 ms".to_owned(), |(n, us)| format!("{n} {:.1} ms", *us as f64 / 1000.0)),
        if listed.is_empty() { "none".to_owned() } else { listed.join(", ") }
    );
    Ok(())
}

/// What liveness costs Redis at the defaults: calls per second of an idle worker of 4 slots, and
/// per token held by a slot running a long handler.
async fn cost(url: &str, redis: &Client) -> Result<(), BoxError> {
    let window = Duration::from_secs(10);
    let calls = |before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>| -> BTreeMap<String, u64> {
        after
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "info" | "config|resetstat" | "hello" | "client|setname"))
            .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect()
    };
    let config = config(url, "cost");
    let marks = Marks::default();
    let probe = Probe {
        worker: 0,
        marks: marks.clone(),
        plan: Plan::Hold(Duration::from_secs(30)),
        failing: Default::default(),
    };
    let w = start(&config, probe, 4).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = command_calls(url).await?;
    tokio::time::sleep(window).await;
    let idle = calls(&before, &command_calls(url).await?);
    let idle_total: u64 = idle
        .iter()
        .filter(|(k, _)| k.as_str() == "fcall" || k.as_str() == "brpop" || k.as_str() == "rpop")
        .map(|(_, v)| v)
        .sum();
    // Four tokens held by four slots running 30 s handlers.
    let producer = Producer::connect(&config).await?;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(producer.request().submit([1u64]).await?);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = command_calls(url).await?;
    tokio::time::sleep(window).await;
    let busy = calls(&before, &command_calls(url).await?);
    let busy_total: u64 = busy
        .iter()
        .filter(|(k, _)| k.as_str() == "fcall" || k.as_str() == "brpop" || k.as_str() == "rpop")
        .map(|(_, v)| v)
        .sum();
    for h in &held {
        h.cancel().await?;
    }
    w.stop().await;
    let _ = redis;
    let secs = window.as_secs_f64();
    println!(
        "cost: idle worker (4 slots) {:.1} calls/s {:?}; with 4 tokens held {:.1} calls/s, so {:.2} calls/s per held token",
        idle_total as f64 / secs,
        idle.iter().map(|(k, v)| format!("{k}={:.1}/s", *v as f64 / secs)).collect::<Vec<_>>(),
        busy_total as f64 / secs,
        (busy_total as f64 - idle_total as f64) / secs / 4.0
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let wants = |name: &str| args.is_empty() || args.iter().any(|a| a == name);
    // REDIS_URL, or a redis-server of its own (kept alive until the end).
    let redis_env = TestRedis::start().await?;
    let url = redis_env.url().to_owned();
    let redis = connect(&url).await?;
    eprintln!("recovery figures against {url}, default settings (lease 2 s, heartbeat 500 ms, recovery interval 200 ms)");
    if wants("kill") {
        kill_to_restart(&url, 40).await?;
    }
    if wants("retry") {
        retry_latency(&url, 20).await?;
    }
    if wants("requeue") {
        requeue_latency(&url, 20).await?;
    }
    if wants("census") {
        census(&url, &redis).await?;
    }
    if wants("cost") {
        cost(&url, &redis).await?;
    }
    Ok(())
}
