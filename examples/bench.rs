//! sluicegate's benchmark: throughput, latency, Redis cost and memory, with leases and recovery on.
//!
//! ```text
//! cargo run --release --example bench                      # the default scenarios, own redis-server
//! cargo run --release --example bench -- recovery_idle      # only when named: 150 s of recovery alone
//! cargo run --release --example bench -- window             # only when named: 2 x 10,000,000 parts
//! cargo run --release --example bench -- loader             # only when named: 1,000,000 x 10 parts
//! cargo run --release --example bench -- cluster            # only when named: many_small, 3 masters
//! cargo run --release --example bench -- backlog_unlisted   # only when named: the 10-part backlog sweep, unlisted
//! cargo run --release --example bench -- stats_overhead     # only when named: metrics (stage stats, scrapes) off vs on
//! cargo run --release --example bench -- dashboard_overhead # only when named: many_small with a dashboard and a browser open, vs without
//! cargo run --release --example bench -- many_small memory  # some scenarios
//! cargo run --release --example bench -- --compare         # also BullMQ, 3 runs each, medians, ratios
//! BENCH_SCALE=0.1 cargo run --release --example bench      # a quick run at a tenth of the sizes
//! ```
//! It starts its own redis-server (no persistence) unless `REDIS_URL` names one, runs the worker
//! slots and the producer in this process, and prints a table plus one JSON line per result (the
//! shape bench/bullmq/bench.mjs prints too). docs/benchmarks.md explains the figures.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fred::prelude::*;
use futures::future::{try_join_all, Either};
use futures::{StreamExt, TryStreamExt};
use serde::de::IgnoredAny;
use sluicegate::{
    async_trait, Admin, Chunked, Config, Context, Handler, HandlerError, Listener, Loader, Producer, Quantum,
    Worker,
};
use sluicegate_testkit::{connect, RedisCluster, TestRedis};
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Slots of the one worker process, as BullMQ's worker concurrency.
const SLOTS: usize = 16;
const PAYLOAD: &str = "0123456789abcdef";

/// One line of the results table.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct Row {
    system: String,
    scenario: String,
    items: u64,
    throughput_per_s: Option<f64>,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    redis_cpu_us_per_item: Option<f64>,
    redis_cmds_per_item: Option<f64>,
    bytes_per_item: Option<f64>,
    /// On a cluster: Redis CPU µs per item of each master.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    redis_cpu_us_per_item_by_master: Option<Vec<f64>>,
    note: String,
}

/// Redis-side counters, read with INFO before and after a phase.
#[derive(Clone, Default)]
struct Stats {
    cpu_s: f64,
    calls: u64,
    memory: u64,
    /// Per command (functions by name too): calls and µs, for `BENCH_PROFILE=1`.
    commands: HashMap<String, (u64, u64)>,
    /// CPU seconds of each node, in the order of `Bench::nodes`.
    cpu_by_node: Vec<f64>,
}

/// The counters of every node (a single server, or a cluster's masters), summed.
async fn stats(nodes: &[Client]) -> Result<Stats, BoxError> {
    let mut sum = Stats::default();
    for node in nodes {
        let s = node_stats(node).await?;
        sum.cpu_s += s.cpu_s;
        sum.calls += s.calls;
        sum.memory += s.memory;
        sum.cpu_by_node.push(s.cpu_s);
        for (name, (calls, usec)) in s.commands {
            let entry = sum.commands.entry(name).or_default();
            (entry.0, entry.1) = (entry.0 + calls, entry.1 + usec);
        }
    }
    Ok(sum)
}

async fn node_stats(redis: &Client) -> Result<Stats, BoxError> {
    let info: String = redis.info(Some(fred::types::InfoKind::All)).await?;
    let mut s = Stats::default();
    for line in info.lines() {
        if let Some(v) = line.strip_prefix("used_cpu_sys:").or_else(|| line.strip_prefix("used_cpu_user:")) {
            s.cpu_s += v.trim().parse::<f64>().unwrap_or(0.0);
        } else if let Some(v) = line.strip_prefix("used_memory:") {
            s.memory = v.trim().parse().unwrap_or(0);
        } else if let Some(rest) = line.strip_prefix("cmdstat_") {
            let field = |name: &str| {
                rest.split(name).nth(1).and_then(|r| r.split(',').next()).and_then(|v| v.parse::<u64>().ok())
            };
            let calls = field("calls=").unwrap_or(0);
            s.calls += calls;
            let name = rest.split(':').next().unwrap_or_default().to_string();
            s.commands.insert(name, (calls, field("usec=").unwrap_or(0)));
        }
    }
    Ok(s)
}

/// With `BENCH_PROFILE=2`: every command from here on goes to the slow log (up to a million), so
/// that `slowlog_report` can tell functions apart.
/// Bytes of the listing index of namespace `ns` (every `ix:*` key of its shards, `MEMORY USAGE`
/// with all samples), found with SCAN.
async fn index_bytes(redis: &Client, ns: &str) -> Result<u64, BoxError> {
    let mut total = 0u64;
    let mut cursor = "0".to_owned();
    loop {
        let (next, keys): (String, Vec<String>) = redis
            .custom(
                fred::cmd!("SCAN"),
                vec![cursor, "MATCH".into(), format!("{ns}:{{{ns}.q*}}:ix:*"), "COUNT".into(), "1000".into()],
            )
            .await?;
        for key in keys {
            let bytes: Option<u64> = redis
                .custom(fred::cmd!("MEMORY"), vec!["USAGE".to_owned(), key, "SAMPLES".into(), "0".into()])
                .await?;
            total += bytes.unwrap_or(0);
        }
        if next == "0" {
            return Ok(total);
        }
        cursor = next;
    }
}

async fn slowlog_on(redis: &Client) -> Result<(), BoxError> {
    if std::env::var("BENCH_PROFILE").as_deref() != Ok("2") {
        return Ok(());
    }
    let _: () = redis.custom(fred::cmd!("CONFIG"), vec!["SET", "slowlog-max-len", "1000000"]).await?;
    let _: () = redis.custom(fred::cmd!("SLOWLOG"), vec!["RESET"]).await?;
    let _: () = redis.custom(fred::cmd!("CONFIG"), vec!["SET", "slowlog-log-slower-than", "0"]).await?;
    Ok(())
}

/// With `BENCH_PROFILE=2`: µs per item by command and function, from the slow log.
async fn slowlog_report(redis: &Client, label: &str, items: u64) -> Result<(), BoxError> {
    if std::env::var("BENCH_PROFILE").as_deref() != Ok("2") {
        return Ok(());
    }
    let _: () = redis.custom(fred::cmd!("CONFIG"), vec!["SET", "slowlog-log-slower-than", "10000"]).await?;
    let log: Value = redis.custom(fred::cmd!("SLOWLOG"), vec!["GET", "-1"]).await?;
    let mut by: HashMap<String, (u64, u64)> = HashMap::new();
    for entry in log.into_array() {
        let e = entry.into_array();
        let (Some(us), Some(args)) = (e.get(2).and_then(Value::as_i64), e.get(3)) else { continue };
        let args: Vec<String> = args.clone().into_array().iter().filter_map(Value::as_string).collect();
        let name = match args.first().map(|a| a.to_ascii_lowercase()) {
            Some(c) if c == "fcall" || c == "fcall_ro" => {
                format!("fcall {}", args.get(1).cloned().unwrap_or_default())
            }
            Some(c) => c,
            None => continue,
        };
        let slot = by.entry(name).or_default();
        slot.0 += 1;
        slot.1 += us as u64;
    }
    let mut rows: Vec<_> = by.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
    eprintln!("slow log {label}: per item, calls and µs by command and function");
    for (name, (calls, us)) in rows.iter().take(20) {
        eprintln!(
            "  {name:<28} {:>8.3} calls {:>8.2} µs {:>8.1} µs/call",
            *calls as f64 / items as f64,
            *us as f64 / items as f64,
            *us as f64 / *calls as f64
        );
    }
    Ok(())
}

/// How long Redis took to answer a PING from another client, every 10 ms while a phase ran: the
/// wait any one command has in the queue of a busy Redis (the floor under a submit call's time).
/// The prober has its own thread, runtime and connection, so a busy bench process does not
/// inflate it; bench/bullmq's probe is the same.
struct PingProbe {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Duration>>,
}

impl PingProbe {
    fn start(url: &str) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (url, flag) = (url.to_owned(), stop.clone());
        let thread = std::thread::spawn(move || {
            let runtime =
                tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            runtime.block_on(async move {
                let mut samples = Vec::new();
                let Ok(redis) = connect(&url).await else { return samples };
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = Instant::now();
                    if redis.ping::<()>(None).await.is_err() {
                        break;
                    }
                    samples.push(t.elapsed());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                samples
            })
        });
        PingProbe { stop, thread }
    }

    /// "PING p50 x ms, p99 y ms (n)" over the phase.
    fn finish(self) -> String {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut samples = self.thread.join().unwrap_or_default();
        if samples.is_empty() {
            return "no PING answered".to_owned();
        }
        samples.sort();
        let at = |q: usize| samples[(samples.len() * q / 100).min(samples.len() - 1)].as_secs_f64() * 1e3;
        format!(
            "PING from another client p50 {:.3} ms, p99 {:.3} ms ({} pings)",
            at(50),
            at(99),
            samples.len()
        )
    }
}

/// The worker of a `priority_under_load` row (`Bench::priority_under_load`).
#[derive(Clone, Copy)]
enum Slots {
    /// 16 slots and the urgent one for priorities 90 and up: the library's default.
    Urgent,
    /// n of the 16 slots kept for priorities p and up; no urgent slot.
    Reserve(usize, u8),
    /// 16 slots taking every priority; no urgent slot.
    Plain,
}

/// BENCH_RESERVE=N:P: N of the slots kept for priorities P and up (`WorkerBuilder::reserve`).
fn bench_reserve() -> Option<(usize, u8)> {
    let r = std::env::var("BENCH_RESERVE").ok()?;
    let (n, p) = r.split_once(':')?;
    Some((n.parse().ok()?, p.parse().ok()?))
}

/// BENCH_URGENT=P|off: the worker's urgent slot (`WorkerBuilder::urgent`; default 90, the
/// library's).
fn bench_urgent() -> Option<u8> {
    match std::env::var("BENCH_URGENT") {
        Ok(u) if u == "off" => None,
        Ok(u) => u.parse().ok(),
        Err(_) => Some(90),
    }
}

/// Runs a built worker until the returned token is cancelled.
fn start<H: Handler>(
    worker: Worker<H>,
) -> (CancellationToken, tokio::task::JoinHandle<sluicegate::Result<()>>) {
    let stop = CancellationToken::new();
    let signal = stop.clone();
    (stop, tokio::spawn(worker.run_until(async move { signal.cancelled().await })))
}

/// With `BENCH_PROFILE=1`: the commands Redis ran between two readings, most µs first, per item.
fn profile(label: &str, before: &Stats, after: &Stats, items: u64) {
    if std::env::var_os("BENCH_PROFILE").is_none() {
        return;
    }
    let mut rows: Vec<(String, f64, f64)> = after
        .commands
        .iter()
        .filter_map(|(name, (calls, usec))| {
            let (c0, u0) = before.commands.get(name).copied().unwrap_or_default();
            let calls = calls.saturating_sub(c0);
            (calls > 0).then(|| {
                (name.clone(), calls as f64 / items as f64, usec.saturating_sub(u0) as f64 / items as f64)
            })
        })
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    eprintln!("profile {label}: per item, calls and µs inside Redis (Lua's inner calls counted too)");
    for (name, calls, usec) in rows.iter().take(25) {
        eprintln!("  {name:<24} {calls:>8.3} calls {usec:>8.2} µs");
    }
}

impl Row {
    fn new(scenario: &str, items: u64) -> Self {
        Row { system: "sluicegate".into(), scenario: scenario.into(), items, ..Row::default() }
    }
    fn cost(mut self, before: &Stats, after: &Stats) -> Self {
        let n = self.items.max(1) as f64;
        self.redis_cpu_us_per_item = Some((after.cpu_s - before.cpu_s) * 1e6 / n);
        self.redis_cmds_per_item = Some(after.calls.saturating_sub(before.calls) as f64 / n);
        if after.cpu_by_node.len() > 1 {
            let by = after.cpu_by_node.iter().zip(&before.cpu_by_node).map(|(a, b)| (a - b) * 1e6 / n);
            self.redis_cpu_us_per_item_by_master = Some(by.collect());
        }
        self
    }
    fn rate(mut self, elapsed: Duration) -> Self {
        self.throughput_per_s = Some(self.items as f64 / elapsed.as_secs_f64());
        self
    }
    fn latencies(mut self, mut samples: Vec<Duration>) -> Self {
        samples.sort();
        let at =
            |q: f64| samples.get(((samples.len() as f64 * q) as usize).min(samples.len().saturating_sub(1)));
        self.p50_ms = at(0.50).map(|d| d.as_secs_f64() * 1e3);
        self.p99_ms = at(0.99).map(|d| d.as_secs_f64() * 1e3);
        self
    }
    fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }
    /// What `Bench::sample_memory` saw: min and max in the note, the peak above `baseline` per
    /// part of `window` as the bytes, and every sample on stderr.
    fn memory_seen(mut self, baseline: u64, samples: &[u64], window: u64) -> Self {
        let mb = |b: u64| b as f64 / (1 << 20) as f64;
        let peak = samples.iter().copied().max().unwrap_or(0);
        self.note = format!(
            "{}; used_memory every 1 s: baseline {:.1} MB, min {:.1} MB, max {:.1} MB over {} samples; \
             bytes: peak used_memory above the baseline per part of the window",
            self.note,
            mb(baseline),
            mb(samples.iter().copied().min().unwrap_or(0)),
            mb(peak),
            samples.len(),
        );
        self.bytes_per_item = Some(peak.saturating_sub(baseline) as f64 / window as f64);
        let each: Vec<String> = samples.iter().map(|m| format!("{:.1}", mb(*m))).collect();
        eprintln!("{}: used_memory MB each second: {}", self.scenario, each.join(" "));
        self
    }
}

/// The handler: does nothing but note when it started and ended, for the latency scenarios.
#[derive(Clone, Default)]
struct Noop {
    marks: Arc<Mutex<HashMap<String, (Instant, Instant)>>>,
    track: bool,
    /// When set, the handler does not return until this is cancelled (`recovery_idle`).
    hold: Option<CancellationToken>,
    /// Parts run, all requests together.
    ran: Arc<std::sync::atomic::AtomicU64>,
    /// `dag_release`: a part whose payload is "hold" says it started (`.0`) and waits for `.1`
    /// before it ends.
    gate: Option<Arc<(tokio::sync::Notify, tokio::sync::Notify)>>,
    /// `priority_busy`: how long each part's handler takes (a sleep, as an I/O-bound handler).
    work: Option<Duration>,
}

#[async_trait]
impl Handler for Noop {
    type Input = String;
    type Output = ();
    async fn handle(&self, ctx: Context, input: String) -> Result<(), HandlerError> {
        self.ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let started = Instant::now();
        if self.track {
            self.marks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(ctx.request_id().to_string(), (started, started));
        }
        if let Some(hold) = &self.hold {
            hold.cancelled().await;
        }
        if let Some(gate) = self.gate.as_ref().filter(|_| input == "hold") {
            gate.0.notify_one();
            gate.1.notified().await;
            let ended = Instant::now();
            self.marks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(ctx.request_id().to_string(), (started, ended));
        }
        if let Some(work) = self.work {
            tokio::time::sleep(work).await;
        }
        Ok(())
    }
}

struct Bench {
    url: String,
    scale: f64,
    redis: Client,
    /// Where Redis's counters are read: the server, or each master of a cluster.
    nodes: Vec<Client>,
    /// `Config::token_shards` of every scenario.
    shards: u32,
}

impl Bench {
    fn scaled(&self, n: u64) -> u64 {
        ((n as f64 * self.scale).round() as u64).max(1)
    }

    /// A scenario's settings, in a namespace of its own about as long as the default `sluicegate`
    /// (bytes per queued request count the namespace twice, in each key's prefix and hash tag,
    /// as BullMQ's count its `bull:<queue>:` prefix).
    fn config(&self, _scenario: &str) -> Config {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Config::new(&self.url)
            .namespace(format!("b{}.{n}", std::process::id()))
            .lease(Duration::from_secs(30))
            .retention(Duration::from_secs(60))
            .token_shards(self.shards)
    }

    /// One worker of `slots` slots over `config`, running until the token is cancelled.
    async fn worker(
        &self,
        config: &Config,
        handler: Noop,
        slots: usize,
    ) -> Result<(CancellationToken, tokio::task::JoinHandle<sluicegate::Result<()>>), BoxError> {
        Ok(start(self.ready_worker(config, handler, slots, true, bench_reserve(), bench_urgent()).await?))
    }

    /// A worker as [`worker`](Self::worker) makes, counting the stats by stage or not.
    async fn worker_with(
        &self,
        config: &Config,
        handler: Noop,
        slots: usize,
        stage_stats: bool,
    ) -> Result<(CancellationToken, tokio::task::JoinHandle<sluicegate::Result<()>>), BoxError> {
        Ok(start(
            self.ready_worker(config, handler, slots, stage_stats, bench_reserve(), bench_urgent()).await?,
        ))
    }

    /// A worker built (connected) but not running yet ([`start`] runs it), with `reserve` =
    /// (n, p): n of its slots kept for priorities p and up (`WorkerBuilder::reserve`). The
    /// throughput rows start their clock after this, as bench.mjs starts BullMQ's after its
    /// worker's `waitUntilReady()`.
    async fn ready_worker<H: Handler>(
        &self,
        config: &Config,
        handler: H,
        slots: usize,
        stage_stats: bool,
        reserve: Option<(usize, u8)>,
        urgent: Option<u8>,
    ) -> Result<Worker<H>, BoxError> {
        // BENCH_MAX_BATCH: the most parts a slot is handed per call (default 32, the worker's).
        let max_batch = std::env::var("BENCH_MAX_BATCH").ok().and_then(|b| b.parse().ok()).unwrap_or(32);
        let mut builder = Worker::builder(config, handler).slots(slots).urgent(urgent);
        if let Some((n, p)) = reserve {
            builder = builder.reserve(n, p);
        }
        Ok(builder
            .quantum(Quantum {
                parts: std::env::var("BENCH_QUANTUM")
                    .ok()
                    .and_then(|q| q.parse().ok())
                    .unwrap_or(Quantum::default().parts),
                ..Quantum::default()
            })
            .max_batch(max_batch)
            .stage_stats(stage_stats)
            .build()
            .await?)
    }

    /// Runs `requests` requests of `parts` each through 16 slots: submission, then processing.
    async fn throughput(
        &self,
        scenario: &str,
        requests: u64,
        parts: u64,
        limit: u32,
    ) -> Result<Vec<Row>, BoxError> {
        self.throughput_in(scenario, requests, parts, limit, 0, 1).await
    }

    /// [`throughput`](Self::throughput) with the requests spread over `groups` tenant groups
    /// (none: 0), each group's limit the slots' number, so that groups add their cost and not a
    /// cap: the cost of a part of a request in a group against one in none. With `pack` above 1,
    /// each sub-request is a chunk of up to `pack` of the `parts` (`sluicegate::chunks`, run by
    /// `Chunked`; rows count parts).
    async fn throughput_in(
        &self,
        scenario: &str,
        requests: u64,
        parts: u64,
        limit: u32,
        groups: u32,
        pack: u64,
    ) -> Result<Vec<Row>, BoxError> {
        let config = self.config(scenario);
        let producer = Producer::connect(&config).await?;
        if groups > 0 {
            let admin = sluicegate::Admin::connect(&config).await?;
            for g in 0..groups {
                admin.set_group(&format!("tenant-{g}"), SLOTS as u32).await?;
            }
        }
        let items = requests * parts;
        let before = stats(&self.nodes).await?;
        let started = Instant::now();
        let mut handles = Vec::new();
        for i in 0..requests {
            // `_own`: a stream of its own even when a lane would take it (`own_stream`);
            // `_discarded`: its results not stored (`discard_results`), as BullMQ's plain queue's.
            let request = producer
                .request()
                .concurrency(limit)?
                .own_stream(scenario.ends_with("_own"))
                .discard_results(scenario.ends_with("_discarded"));
            let request = if groups > 0 {
                request.group(&format!("tenant-{}", i % u64::from(groups)))?
            } else {
                request
            };
            let payloads = (0..parts).map(|_| PAYLOAD);
            handles.push(if pack > 1 {
                request.submit(sluicegate::chunks(payloads, pack as usize)?).await?
            } else {
                request.submit(payloads).await?
            });
        }
        let packed = if pack > 1 { format!(" in chunks of {pack}") } else { String::new() };
        let submit = Row::new(&format!("{scenario}_submit"), items)
            .rate(started.elapsed())
            .cost(&before, &stats(&self.nodes).await?)
            .note(format!("{requests} x {parts} parts{packed}, submitted one request after another"));
        let building = Instant::now();
        let worker = if pack > 1 {
            Either::Left(
                self.ready_worker(
                    &config,
                    Chunked(Noop::default()),
                    SLOTS,
                    true,
                    bench_reserve(),
                    bench_urgent(),
                )
                .await?,
            )
        } else {
            Either::Right(
                self.ready_worker(&config, Noop::default(), SLOTS, true, bench_reserve(), bench_urgent())
                    .await?,
            )
        };
        let built = building.elapsed();
        slowlog_on(&self.redis).await?;
        let before = stats(&self.nodes).await?;
        let started = Instant::now();
        let (stop, task) = match worker {
            Either::Left(worker) => start(worker),
            Either::Right(worker) => start(worker),
        };
        try_join_all(handles.iter().map(|h| h.wait::<IgnoredAny>())).await?;
        let elapsed = started.elapsed();
        let after = stats(&self.nodes).await?;
        stop.cancel();
        task.await??;
        profile(scenario, &before, &after, items);
        slowlog_report(&self.redis, scenario, items).await?;
        let grouped =
            if groups > 0 { format!(", in {groups} groups of limit {SLOTS}") } else { String::new() };
        let run = Row::new(scenario, items).rate(elapsed).cost(&before, &after).note(format!(
            "{requests} x {parts}{packed}, limit {limit} per request{grouped}, {SLOTS} slots, lease 30 s, recovery on; \
             worker built (connected) in {:.1} ms before the clock starts",
            built.as_secs_f64() * 1e3
        ));
        self.drop_namespace(&config).await?;
        Ok(vec![submit, run])
    }

    /// `requests` requests of `parts` each, queued before the worker starts (64 submits in flight,
    /// as a loader would), then drained by one worker of 16 slots; the drain ends at the last
    /// completion event. Rows: the submit (with Redis bytes per queued part), the drain (with the
    /// bytes still held per part once every request has finished, i.e. the results kept).
    async fn backlog(
        &self,
        scenario: &str,
        requests: u64,
        parts: u64,
        limit: u32,
    ) -> Result<Vec<Row>, BoxError> {
        let config = self.config(scenario);
        let producer = Producer::connect(&config).await?;
        let mut events = Listener::connect(&config).await?;
        let items = requests * parts;
        let empty = stats(&self.nodes).await?;
        let started = Instant::now();
        if scenario.ends_with("_bulk") {
            queue_bulk(&producer, requests, parts, limit).await?;
        } else {
            let (listed, discard) = (!scenario.ends_with("_unlisted"), scenario.ends_with("_discarded"));
            queue_as(&producer, requests, parts, limit, listed, discard).await?;
        }
        let submitted = started.elapsed();
        let queued = stats(&self.nodes).await?;
        // Measuring the index walks every key of the namespace and every member of its sets: that
        // cost is the benchmark's, so the drain's window starts after it (`ready`).
        let ns = config.namespace_str().to_owned();
        let index_queued = index_bytes(&self.redis, &ns).await? as f64 / requests as f64;
        let building = Instant::now();
        let worker =
            self.ready_worker(&config, Noop::default(), SLOTS, true, bench_reserve(), bench_urgent()).await?;
        let built = building.elapsed();
        slowlog_on(&self.redis).await?;
        let ready = stats(&self.nodes).await?;
        let how = if scenario.ends_with("_bulk") {
            format!("submit_many of {BULK} requests at a time")
        } else {
            "64 submits in flight".to_owned()
        };
        let mut submit = Row::new(&format!("{scenario}_submit"), items)
            .rate(submitted)
            .cost(&empty, &queued)
            .note(format!(
                "{requests} x {parts} parts, {how}; bytes: Redis memory per queued part \
                 (of which the listing index: {index_queued:.0} B per queued request)"
            ));
        submit.bytes_per_item = Some(queued.memory.saturating_sub(empty.memory) as f64 / items as f64);
        let started = Instant::now();
        let (stop, task) = start(worker);
        for _ in 0..requests {
            events.next().await?;
        }
        let elapsed = started.elapsed();
        let drained = stats(&self.nodes).await?;
        let index_done = index_bytes(&self.redis, &ns).await? as f64 / requests as f64;
        profile(&format!("{scenario}_submit"), &empty, &queued, items);
        profile(scenario, &ready, &drained, items);
        slowlog_report(&self.redis, scenario, items).await?;
        stop.cancel();
        task.await??;
        let mut run = Row::new(scenario, items).rate(elapsed).cost(&ready, &drained).note(format!(
            "{requests} x {parts} queued, limit {limit} per request, {SLOTS} slots: worker start -> last completion event; bytes: results kept per part \
             (listing index: {index_done:.0} B per finished request, until its retention ends); \
             worker built (connected) in {:.1} ms before the clock starts",
            built.as_secs_f64() * 1e3
        ));
        run.bytes_per_item = Some(drained.memory.saturating_sub(empty.memory) as f64 / items as f64);
        self.drop_namespace(&config).await?;
        Ok(vec![submit, run])
    }

    /// Recovery's own cost at the default settings (lease 2 s, census interval 60 s):
    /// `requests` 10-part requests queued, and one worker of one slot whose handler does not
    /// return, so nothing finishes. What Redis does meanwhile is the worker's heartbeats and
    /// recovery: a first look at each request one grace (two leases) after its registration, then
    /// one census look per census interval. The row gives Redis CPU µs and commands per second
    /// over 120 s, from 30 s after the worker started, and how many looks were overdue every 10 s
    /// of that window (a number that does not fall back to near 0 means recovery is behind).
    async fn recovery_idle(&self, requests: u64) -> Result<Vec<Row>, BoxError> {
        let config = Config::new(&self.url)
            .namespace(format!("bench-recovery_idle-{}", std::process::id()))
            .retention(Duration::from_secs(60));
        let producer = Producer::connect(&config).await?;
        queue(&producer, requests, 10, 4).await?;
        let hold = CancellationToken::new();
        let handler = Noop { hold: Some(hold.clone()), ..Noop::default() };
        let (stop, task) = self.worker(&config, handler, 1).await?;
        let active = {
            let ns = config.namespace_str();
            format!("{ns}:{{{ns}.q0}}:active")
        };
        let overdue = || async {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis();
            let n: i64 = self.redis.zcount(&active, f64::NEG_INFINITY, now as f64).await?;
            Ok::<i64, BoxError>(n)
        };
        tokio::time::sleep(Duration::from_secs(30)).await;
        let window = Duration::from_secs(120);
        let before = stats(&self.nodes).await?;
        let mut samples = Vec::new();
        for _ in 0..12 {
            samples.push(overdue().await?.to_string());
            tokio::time::sleep(window / 12).await;
        }
        samples.push(overdue().await?.to_string());
        let after = stats(&self.nodes).await?;
        hold.cancel();
        stop.cancel();
        task.await??;
        let secs = window.as_secs_f64();
        let mut row = Row::new("recovery_idle", requests).note(format!(
            "{requests} active 10-part requests, one worker of one busy slot, default settings: \
             Redis CPU µs and commands per second over {secs:.0} s (not per item); \
             looks overdue every 10 s: {}",
            samples.join(" ")
        ));
        row.redis_cpu_us_per_item = Some((after.cpu_s - before.cpu_s) * 1e6 / secs);
        row.redis_cmds_per_item = Some(after.calls.saturating_sub(before.calls) as f64 / secs);
        self.drop_namespace(&config).await?;
        Ok(vec![row])
    }

    /// One windowed streamed request of 10,000,000 parts (scaled) with a window of 100,000
    /// (scaled, at least 1,000), limit 16, fed by one producer in chunks of 1,000 and run by one
    /// worker of 16 slots, its results taken with `results_from` while it runs (pages of 10,000)
    /// or discarded. Redis's `used_memory` is sampled every second: bounded memory means those
    /// samples stay flat whatever the number of parts.
    async fn window(&self, discard: bool) -> Result<Vec<Row>, BoxError> {
        let scenario = if discard { "window_discarded" } else { "window_taken" };
        let config = self.config(scenario);
        let producer = Producer::connect(&config).await?;
        let parts = self.scaled(10_000_000);
        let window = self.scaled(100_000).max(1_000);
        let baseline = stats(&self.nodes).await?;
        let (stop, task) = self.worker(&config, Noop::default(), SLOTS).await?;
        let (sampling, sampler) = self.sample_memory();
        let before = stats(&self.nodes).await?;
        let started = Instant::now();
        let mut open =
            producer.request().concurrency(16)?.window(window)?.discard_results(discard).open().await?;
        let handle = open.handle().clone();
        let reader = (!discard).then(|| {
            let handle = handle.clone();
            tokio::spawn(async move {
                let (mut next, mut taken) = (0, 0u64);
                loop {
                    let page = handle.results_from::<()>(next, 10_000).await?;
                    taken += page.results.len() as u64;
                    next = page.next_index();
                    if page.is_last() {
                        return Ok::<u64, sluicegate::Error>(taken);
                    }
                    if page.results.is_empty() {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            })
        });
        let mut fed = 0;
        while fed < parts {
            let n = (parts - fed).min(1_000);
            open.add((0..n).map(|_| PAYLOAD)).await?;
            fed += n;
        }
        open.finalize().await?;
        let taken = match reader {
            Some(reader) => reader.await??,
            None => 0,
        };
        let done = handle.wait::<()>().await?;
        let elapsed = started.elapsed();
        let after = stats(&self.nodes).await?;
        sampling.cancel();
        let samples = sampler.await?;
        stop.cancel();
        task.await??;
        let row = Row::new(scenario, parts)
            .rate(elapsed)
            .cost(&before, &after)
            .note(format!(
                "one streamed request, window {window}, limit 16, {SLOTS} slots; results {}; {} failed",
                if discard { "discarded".to_owned() } else { format!("taken with results_from ({taken})") },
                done.failed,
            ))
            .memory_seen(baseline.memory, &samples, window);
        self.drop_namespace(&config).await?;
        Ok(vec![row])
    }

    /// many_small on this server, then on a local 3-master Redis Cluster with 3 token shards,
    /// in the same run: throughput, and Redis CPU per part summed over the masters and by master.
    async fn cluster(&self) -> Result<Vec<Row>, BoxError> {
        let mut rows = self.throughput("many_small", self.scaled(1_000), 100, 4).await?;
        let cluster = RedisCluster::start().await?;
        let mut nodes = Vec::new();
        for url in cluster.urls() {
            nodes.push(connect(&url).await?);
        }
        let url = cluster.url();
        let on = Bench { redis: connect(&url).await?, url, scale: self.scale, nodes, shards: 3 };
        for mut row in on.throughput("many_small", self.scaled(1_000), 100, 4).await? {
            row.scenario = format!("{}_cluster3", row.scenario);
            if let Some(by) = &row.redis_cpu_us_per_item_by_master {
                let by: Vec<String> = by.iter().map(|us| format!("{us:.2}")).collect();
                row.note = format!(
                    "{}; 3 masters, 3 token shards; Redis CPU µs per part by master: {}",
                    row.note,
                    by.join(" / ")
                );
            }
            rows.push(row);
        }
        Ok(rows)
    }

    /// Samples Redis's `used_memory` every second until the token is cancelled.
    fn sample_memory(&self) -> (CancellationToken, tokio::task::JoinHandle<Vec<u64>>) {
        let sampling = CancellationToken::new();
        let (redis, stop) = (self.nodes.clone(), sampling.clone());
        let sampler = tokio::spawn(async move {
            let mut samples = Vec::new();
            while !stop.is_cancelled() {
                if let Ok(s) = stats(&redis).await {
                    samples.push(s.memory);
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            samples
        });
        (sampling, sampler)
    }

    /// Many small requests through a [`Loader`]: `requests` of 10 parts, at most `window` parts
    /// unfinished, 64 submits in flight, one worker of 16 slots running meanwhile. Retention 5 s,
    /// so that what Redis holds is the window plus 5 s of finished requests' records.
    async fn loader(&self) -> Result<Vec<Row>, BoxError> {
        let config = self.config("loader").retention(Duration::from_secs(5));
        let producer = Producer::connect(&config).await?;
        let requests = self.scaled(1_000_000);
        let window = self.scaled(100_000).max(1_000);
        let baseline = stats(&self.nodes).await?;
        let (stop, task) = self.worker(&config, Noop::default(), SLOTS).await?;
        let (sampling, sampler) = self.sample_memory();
        let loader = Loader::connect(&producer, window).await?;
        let before = stats(&self.nodes).await?;
        let started = Instant::now();
        futures::stream::iter(0..requests)
            .map(|_| async {
                let spec = producer.request().concurrency(4)?;
                loader.submit(spec, (0..10).map(|_| PAYLOAD)).await.map(drop)
            })
            .buffer_unordered(64)
            .try_collect::<()>()
            .await?;
        loader.drain().await?;
        let elapsed = started.elapsed();
        let after = stats(&self.nodes).await?;
        sampling.cancel();
        let samples = sampler.await?;
        stop.cancel();
        task.await??;
        let row = Row::new("loader", requests * 10)
            .rate(elapsed)
            .cost(&before, &after)
            .note(format!(
                "{requests} requests x 10 parts through a Loader of window {window}, limit 4, {SLOTS} slots, \
                 retention 5 s"
            ))
            .memory_seen(baseline.memory, &samples, window);
        self.drop_namespace(&config).await?;
        Ok(vec![row])
    }

    async fn submit_rate(&self) -> Result<Vec<Row>, BoxError> {
        let config = self.config("submit");
        let producer = Producer::connect(&config).await?;
        let parts = self.scaled(1_000_000);
        let before = stats(&self.nodes).await?;
        let started = Instant::now();
        producer.request().submit((0..parts).map(|_| PAYLOAD)).await?;
        let elapsed = started.elapsed();
        let row = Row::new("submit_large", parts)
            .rate(elapsed)
            .cost(&before, &stats(&self.nodes).await?)
            .note(format!(
                "one request, 16-byte parts, parts made lazily; bench process peak RSS {}",
                peak_rss()
            ));
        self.drop_namespace(&config).await?;
        Ok(vec![row])
    }

    async fn memory(&self) -> Result<Vec<Row>, BoxError> {
        let config = self.config("memory");
        let producer = Producer::connect(&config).await?;
        let parts = self.scaled(100_000);
        let before = stats(&self.nodes).await?;
        producer.request().concurrency(16)?.submit((0..parts).map(|_| PAYLOAD)).await?;
        let after = stats(&self.nodes).await?;
        let mut row =
            Row::new("memory", parts).note("queued, 16-byte payload, one request (INFO used_memory delta)");
        row.bytes_per_item = Some(after.memory.saturating_sub(before.memory) as f64 / parts as f64);
        self.drop_namespace(&config).await?;
        Ok(vec![row])
    }

    async fn idle_latency(&self) -> Result<Vec<Row>, BoxError> {
        let config = self.config("idle");
        // BENCH_IDLE_WORK_MS=M: each handler sleeps M ms (a handler that does some I/O), not none.
        let work =
            std::env::var("BENCH_IDLE_WORK_MS").ok().and_then(|v| v.parse().ok()).map(Duration::from_millis);
        let handler = Noop { track: true, work, ..Noop::default() };
        let marks = handler.marks.clone();
        let (stop, task) = self.worker(&config, handler, SLOTS).await?;
        let producer = Producer::connect(&config).await?;
        let samples = self.scaled(1_000);
        // As many warm-up rounds as bench.mjs's idle_latency runs before its samples (2,000, for
        // V8's JIT): neither system is measured cold.
        let warm_up = self.scaled(2_000);
        let (mut start, mut finish, mut whole) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..warm_up + samples {
            if round < warm_up {
                producer.request().submit([PAYLOAD]).await?.wait::<()>().await?;
                continue;
            }
            let t0 = Instant::now();
            let h = producer.request().submit([PAYLOAD]).await?;
            h.wait::<()>().await?;
            let t1 = Instant::now();
            let (began, ended) = marks.lock().unwrap_or_else(|p| p.into_inner())[h.id().as_str()];
            start.push(began - t0);
            finish.push(t1 - ended);
            whole.push(t1 - t0);
        }
        stop.cancel();
        task.await??;
        self.drop_namespace(&config).await?;
        Ok(vec![
            Row::new("idle_latency", samples)
                .latencies(start)
                .note("submit() called -> handler starts, idle worker"),
            Row::new("idle_completion_latency", samples)
                .latencies(finish)
                .note("handler returns -> wait() returns (ack, finish, pub/sub, results read)"),
            Row::new("idle_round_trip", samples)
                .latencies(whole)
                .note("submit() called -> wait() returns, idle worker, no-op handler"),
        ])
    }

    /// Dependencies: an upstream's end to its downstream's start. Each of `samples` rounds, on an
    /// idle worker: an upstream of one part (in its lane) starts and holds; a downstream of one
    /// part is submitted after it (so it waits, and the upstream's finish releases it); the
    /// upstream's part is let go. Then the same with one upstream of its own stream and 100
    /// downstreams (a fan-out: each downstream's start counts).
    async fn dag_release(&self) -> Result<Vec<Row>, BoxError> {
        let config = self.config("dag");
        let gate = Arc::new((tokio::sync::Notify::new(), tokio::sync::Notify::new()));
        let handler = Noop { track: true, gate: Some(gate.clone()), ..Noop::default() };
        let marks = handler.marks.clone();
        let (stop, task) = self.worker(&config, handler, SLOTS).await?;
        let producer = Producer::connect(&config).await?;
        let samples = self.scaled(1_000);
        let rounds = self.scaled(20).max(2);
        let fan = 100;
        let mut rows = Vec::new();
        for (scenario, n, downstreams) in [("dag_release", samples, 1), ("dag_fanout_100", rounds, fan)] {
            // The first 20 rounds warm up (connections, the library's first calls): neither their
            // latencies nor their cost count.
            const WARM_UP: u64 = 20;
            let mut lat = Vec::new();
            let mut s0 = stats(&self.nodes).await?;
            for round in 0..n + WARM_UP {
                if round == WARM_UP {
                    s0 = stats(&self.nodes).await?;
                }
                let up = producer.request().own_stream(downstreams > 1).submit(["hold"]).await?;
                gate.0.notified().await;
                let mut downs = Vec::new();
                for _ in 0..downstreams {
                    downs.push(producer.request().after([up.id().clone()]).submit([PAYLOAD]).await?);
                }
                gate.1.notify_one();
                for d in &downs {
                    d.wait::<()>().await?;
                }
                if round >= WARM_UP {
                    let m = marks.lock().unwrap_or_else(|p| p.into_inner());
                    let ended = m[up.id().as_str()].1;
                    lat.extend(downs.iter().map(|d| m[d.id().as_str()].0 - ended));
                }
            }
            let s1 = stats(&self.nodes).await?;
            let row = Row::new(scenario, n * downstreams).latencies(lat).cost(&s0, &s1);
            rows.push(row.note(if downstreams == 1 {
                "1 upstream (its lane) + 1 downstream, one pair at a time, idle worker: upstream's handler end -> \
                 downstream's handler start; cost per pair (both submits, runs, the release)"
                    .to_owned()
            } else {
                format!(
                    "1 upstream (own stream) + {downstreams} downstreams, one set at a time, idle worker of \
                     {SLOTS} slots: upstream's handler end -> each downstream's handler start; cost per downstream"
                )
            }));
        }
        stop.cancel();
        task.await??;
        self.drop_namespace(&config).await?;
        Ok(rows)
    }

    /// A priority-99 request every 50 ms during a low-priority flood, submit call to handler
    /// start: `priority_under_load` with no-op handlers (the flood as fast as Redis goes), and
    /// `priority_busy` with handlers that take `work` each (1 ms, as an I/O-bound handler: the
    /// flood then runs at what 16 slots do, about as fast as BullMQ's, and Redis has room).
    /// The worker has its urgent slot for priorities 90 and up (the library's default), or
    /// `slots`: `Slots::Reserve(n, p)`, n of its 16 slots kept for priorities p and up (`_reserved`
    /// rows, no urgent slot), or `Slots::Plain`, every slot taking every priority (`_plain` rows:
    /// the urgent request waits for a busy slot to give way).
    async fn priority_under_load(
        &self,
        scenario: &str,
        work: Option<Duration>,
        slots: Slots,
    ) -> Result<Vec<Row>, BoxError> {
        let config = self.config("prio");
        let handler = Noop { track: true, work, ..Noop::default() };
        let marks = handler.marks.clone();
        let producer = Producer::connect(&config).await?;
        let flood = self.scaled(if work.is_some() { 200_000 } else { 1_000_000 });
        // BENCH_FLOOD_LIMIT: the flood request's concurrency limit (default 64, four times the slots).
        let limit = std::env::var("BENCH_FLOOD_LIMIT").ok().and_then(|l| l.parse().ok()).unwrap_or(64);
        let low =
            producer.request().priority(1)?.concurrency(limit)?.submit((0..flood).map(|_| PAYLOAD)).await?;
        let ran = handler.ran.clone();
        let (reserve, urgent) = match slots {
            Slots::Urgent => (None, Some(90)),
            Slots::Reserve(n, p) => (Some((n, p)), None),
            Slots::Plain => (None, None),
        };
        let (stop, task) = start(self.ready_worker(&config, handler, SLOTS, true, reserve, urgent).await?);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (ran_before, started) = (ran.load(std::sync::atomic::Ordering::Relaxed), Instant::now());
        let probe = PingProbe::start(&self.url);
        let (mut samples, mut submits, mut after) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..100 {
            let t0 = Instant::now();
            let h = producer.request().priority(99)?.submit([PAYLOAD]).await?;
            let submitted = t0.elapsed();
            submits.push(submitted);
            h.wait::<()>().await?;
            let (began, _) = marks.lock().unwrap_or_else(|p| p.into_inner())[h.id().as_str()];
            samples.push(began - t0);
            after.push((began - t0).saturating_sub(submitted));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pings = probe.finish();
        if std::env::var("BENCH_DEBUG_SUBMITS").is_ok() {
            let slow: Vec<_> = submits.iter().enumerate().filter(|(_, d)| d.as_millis() >= 3).collect();
            eprintln!("{scenario}: submits of 3 ms or more (sample, time): {slow:?}");
        }
        submits.sort();
        after.sort();
        eprintln!(
            "{scenario}: the submit call alone took p50 {:.3} ms, p99 {:.3} ms; its return -> start p50 {:.3} ms, p99 {:.3} ms; {pings}",
            submits[submits.len() / 2].as_secs_f64() * 1e3,
            submits[submits.len() * 99 / 100].as_secs_f64() * 1e3,
            after[after.len() / 2].as_secs_f64() * 1e3,
            after[after.len() * 99 / 100].as_secs_f64() * 1e3
        );
        let flood_rate = (ran.load(std::sync::atomic::Ordering::Relaxed) - ran_before) as f64
            / started.elapsed().as_secs_f64();
        stop.cancel();
        task.await??;
        drop(low);
        self.drop_namespace(&config).await?;
        let mut handlers = match work {
            Some(work) => format!("handlers of {} ms", work.as_secs_f64() * 1e3),
            None => "no-op handlers".to_owned(),
        };
        handlers += &match slots {
            Slots::Urgent => format!(", {SLOTS} slots and the urgent one for priorities 90 and up"),
            Slots::Reserve(n, p) => format!(", {n} of the {SLOTS} slots kept for priorities {p} and up"),
            Slots::Plain => format!(", {SLOTS} slots taking every priority (no urgent slot)"),
        };
        Ok(vec![Row::new(scenario, 100).latencies(samples).note(format!(
            "priority-99 request submitted every 50 ms during a {flood}-part flood, {handlers}: submit -> start; \
             the flood ran {flood_rate:.0} parts/s meanwhile; {pings}"
        ))])
    }

    /// The cost of the stats by stage: the same drain of `requests` one-part requests (each in
    /// its priority's lane: per part a start, a run, a success and a finish to count, the most
    /// stats work per part of any workload), queued before one worker of 16 slots starts, with
    /// the worker's metrics off and on, alternately, `BENCH_STATS_ROUNDS` times each (default
    /// 5). On: the worker's stage stats, and `Admin::stats` read once a second as a `sluicegate
    /// metrics` process does at each scrape (Prometheus's default is every 15 s). Rows: the median throughput of each, and the memory the minutes' hashes took.
    async fn stats_overhead(&self) -> Result<Vec<Row>, BoxError> {
        let requests = self.scaled(30_000);
        let rounds: usize =
            std::env::var("BENCH_STATS_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
        let (mut off, mut on) = (Vec::new(), Vec::new());
        let (mut cpu_off, mut cpu_on) = (Vec::new(), Vec::new());
        // This process's CPU per part (the worker's slots, the producer idle, the listener), and
        // each round's on/off throughput ratio (the two drains of a round run back to back, so a
        // drift in the machine's load affects both alike).
        let (mut own_off, mut own_on, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let mut memory = None;
        for round in 0..rounds {
            // Alternate which goes first, so that a drift in the machine's load favours neither.
            let order = if round % 2 == 0 { [false, true] } else { [true, false] };
            let mut pair = [0.0; 2];
            for stage_stats in order {
                let config = self.config("stats").stats_flush_interval(Duration::from_secs(1));
                let producer = Producer::connect(&config).await?;
                let mut events = Listener::connect(&config).await?;
                queue(&producer, requests, 1, 1).await?;
                producer.flush_stats().await?;
                let before = stats(&self.nodes).await?;
                let own_before = process_cpu_s().unwrap_or(0.0);
                let started = Instant::now();
                let (stop, task) = self.worker_with(&config, Noop::default(), SLOTS, stage_stats).await?;
                // Metrics on: also what `sluicegate metrics` does at each scrape (one
                // `Admin::stats`: lists, counters, the tally of records, INFO), once a second.
                let scraper = match stage_stats {
                    true => Some(scrape_every(Admin::connect(&config).await?, Duration::from_secs(1))),
                    false => None,
                };
                for _ in 0..requests {
                    events.next().await?;
                }
                if let Some((scraper, scrapes)) = scraper {
                    scraper.abort();
                    let n = scrapes.load(std::sync::atomic::Ordering::Relaxed);
                    eprintln!("stats_overhead round {round}: {n} scrapes during the drain");
                }
                let rate = requests as f64 / started.elapsed().as_secs_f64();
                let own = (process_cpu_s().unwrap_or(0.0) - own_before) * 1e6 / requests as f64;
                let after = stats(&self.nodes).await?;
                stop.cancel();
                task.await??;
                let cpu = (after.cpu_s - before.cpu_s) * 1e6 / requests as f64;
                eprintln!(
                    "stats_overhead round {round}: metrics {}: {rate:.0} parts/s, Redis {cpu:.2} µs/part, \
                     this process {own:.2} µs/part",
                    if stage_stats { "on" } else { "off" }
                );
                pair[usize::from(stage_stats)] = rate;
                if stage_stats {
                    on.push(rate);
                    cpu_on.push(cpu);
                    own_on.push(own);
                    if memory.is_none() {
                        memory = Some(self.minute_memory(&config).await?);
                    }
                } else {
                    off.push(rate);
                    cpu_off.push(cpu);
                    own_off.push(own);
                }
                self.drop_namespace(&config).await?;
            }
            ratios.push(pair[1] / pair[0]);
        }
        let (off, on) = (median(&mut off), median(&mut on));
        let (cpu_off, cpu_on) = (median(&mut cpu_off), median(&mut cpu_on));
        let (own_off, own_on) = (median(&mut own_off), median(&mut own_on));
        let change = (on / off - 1.0) * 100.0;
        let paired = (median(&mut ratios) - 1.0) * 100.0;
        eprintln!(
            "stats_overhead: medians of {rounds} rounds: off {off:.0} parts/s, on {on:.0} parts/s ({change:+.1}%; \
             median of the rounds' on/off ratios {paired:+.1}%); Redis µs/part off {cpu_off:.2}, on {cpu_on:.2}; \
             this process µs/part off {own_off:.2}, on {own_on:.2} ({:+.1}%)",
            (own_on / own_off - 1.0) * 100.0
        );
        let mut rows = Vec::new();
        for (name, rate, cpu, what) in [("stats_off", off, cpu_off, "off"), ("stats_on", on, cpu_on, "on")] {
            let mut row = Row::new(name, requests).note(format!(
                "{requests} x 1 part queued (lanes), {SLOTS} slots, metrics {what} (stage stats, a namespace scrape per second): median of {rounds} rounds; on/off throughput {change:+.1}% (paired {paired:+.1}%), bench process CPU µs/part off {own_off:.2}, on {own_on:.2}"
            ));
            row.throughput_per_s = Some(rate);
            row.redis_cpu_us_per_item = Some(cpu);
            rows.push(row);
        }
        if let Some((keys, bytes, fields)) = memory {
            let mut row = Row::new("stats_memory", keys).note(format!(
                "MEMORY USAGE of the {keys} minute hashes of one stats_on round: {fields} fields in all; bytes: per minute hash (x 1440 = per namespace-day at this load)"
            ));
            row.bytes_per_item = Some(bytes as f64 / keys.max(1) as f64);
            rows.push(row);
        }
        rows.push(self.full_minute_memory().await?);
        Ok(rows)
    }

    /// What a dashboard with one browser open on its overview costs: the many_small shape (100-part
    /// requests, limit 4, 16 slots) scaled up so that a drain lasts several dashboard readings
    /// (`BENCH_DASHBOARD_REQUESTS`, default 5,000 requests), drained `BENCH_DASHBOARD_ROUNDS`
    /// times (default 3) without and with `sluicegate dashboard` (the release CLI, default
    /// interval) and a headless chromium on its overview (at nice 19, see [`Watching::start`]),
    /// alternately. The dashboard connects
    /// through a counting proxy, so its own Redis calls are counted apart from the worker's. Rows:
    /// the median throughput of each, and the dashboard's calls per second while the backlog waits
    /// and while it drains.
    async fn dashboard_overhead(&self) -> Result<Vec<Row>, BoxError> {
        let requests: u64 =
            std::env::var("BENCH_DASHBOARD_REQUESTS").ok().and_then(|r| r.parse().ok()).unwrap_or(5_000);
        let requests = self.scaled(requests);
        let rounds: usize =
            std::env::var("BENCH_DASHBOARD_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(3);
        let (parts, limit) = (100, 4);
        let items = requests * parts;
        let cli = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/sluicegate");
        if !cli.exists() {
            return Err(format!("dashboard_overhead needs the release CLI: cargo build --release -p sluicegate-cli ({} is missing)", cli.display()).into());
        }
        let upstream = self.url.strip_prefix("redis://").and_then(|a| a.parse::<std::net::SocketAddr>().ok());
        let Some(upstream) = upstream else {
            return Err(format!(
                "dashboard_overhead needs a single redis-server at redis://<ip>:<port>, not {}",
                self.url
            )
            .into());
        };
        let proxy = sluicegate_testkit::proxy::Proxy::start(upstream).await?;
        let (mut off, mut on, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut idle_rates, mut drain_rates) = (Vec::new(), Vec::new());
        let (mut cpu_off, mut cpu_on) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let order = if round % 2 == 0 { [false, true] } else { [true, false] };
            let mut pair = [0.0; 2];
            for open in order {
                let config = self.config("dashboard");
                let producer = Producer::connect(&config).await?;
                let mut handles = Vec::with_capacity(requests as usize);
                for _ in 0..requests {
                    handles.push(
                        producer.request().concurrency(limit)?.submit((0..parts).map(|_| PAYLOAD)).await?,
                    );
                }
                let watching = match open {
                    true => {
                        let watching = Watching::start(&cli, &proxy.url(), config.namespace_str()).await?;
                        // The backlog waits while the browser watches: the dashboard's idle cost.
                        let (c0, t0) = (proxy.stats().commands, Instant::now());
                        tokio::time::sleep(Duration::from_secs(6)).await;
                        idle_rates.push((proxy.stats().commands - c0) as f64 / t0.elapsed().as_secs_f64());
                        Some(watching)
                    }
                    false => None,
                };
                let commands = proxy.stats().commands;
                let watchers_cpu = watching.as_ref().map(Watching::cpu_s);
                let before = stats(&self.nodes).await?;
                let started = Instant::now();
                let (stop, task) = self.worker(&config, Noop::default(), SLOTS).await?;
                try_join_all(handles.iter().map(|h| h.wait::<()>())).await?;
                let elapsed = started.elapsed().as_secs_f64();
                let rate = items as f64 / elapsed;
                let cpu = (stats(&self.nodes).await?.cpu_s - before.cpu_s) * 1e6 / items as f64;
                stop.cancel();
                task.await??;
                if let Some(watching) = watching {
                    let calls = (proxy.stats().commands - commands) as f64 / elapsed;
                    let ((d0, b0), (d1, b1)) = (watchers_cpu.unwrap_or_default(), watching.cpu_s());
                    eprintln!(
                        "dashboard_overhead round {round}: CPU during the drain: the dashboard {:.0}%, the browser {:.0}% of a core",
                        (d1 - d0) * 100.0 / elapsed,
                        (b1 - b0) * 100.0 / elapsed
                    );
                    drain_rates.push(calls);
                    drop(watching);
                    eprintln!("dashboard_overhead round {round}: dashboard open: {rate:.0} parts/s, Redis {cpu:.2} µs/part, the dashboard's Redis calls {calls:.1}/s during the drain");
                    on.push(rate);
                    cpu_on.push(cpu);
                } else {
                    eprintln!("dashboard_overhead round {round}: no dashboard: {rate:.0} parts/s, Redis {cpu:.2} µs/part");
                    off.push(rate);
                    cpu_off.push(cpu);
                }
                pair[usize::from(open)] = rate;
                self.drop_namespace(&config).await?;
            }
            ratios.push(pair[1] / pair[0]);
        }
        let (off, on) = (median(&mut off), median(&mut on));
        let (idle, drain) = (median(&mut idle_rates), median(&mut drain_rates));
        let (cpu_off, cpu_on) = (median(&mut cpu_off), median(&mut cpu_on));
        let change = (on / off - 1.0) * 100.0;
        let paired = (median(&mut ratios) - 1.0) * 100.0;
        eprintln!(
            "dashboard_overhead: medians of {rounds} rounds: without {off:.0} parts/s, with the dashboard open {on:.0} parts/s \
             ({change:+.1}%; median of the rounds' ratios {paired:+.1}%); Redis µs/part without {cpu_off:.2}, with {cpu_on:.2}; \
             the dashboard's Redis calls/s: {idle:.1} while the backlog waits, {drain:.1} while it drains"
        );
        let mut rows = Vec::new();
        for (name, rate, cpu) in [("dashboard_closed", off, cpu_off), ("dashboard_open", on, cpu_on)] {
            let mut row = Row::new(name, items).note(format!(
                "{requests} x {parts} parts, limit {limit}, {SLOTS} slots, median of {rounds} rounds; with/without {change:+.1}% (paired {paired:+.1}%); the dashboard's own Redis calls/s {drain:.1} draining, {idle:.1} waiting"
            ));
            row.throughput_per_s = Some(rate);
            row.redis_cpu_us_per_item = Some(cpu);
            rows.push(row);
        }
        Ok(rows)
    }

    /// The minutes' hashes of a namespace: how many, their `MEMORY USAGE` in all, their fields.
    async fn minute_memory(&self, config: &Config) -> Result<(u64, u64, u64), BoxError> {
        let keys = sluicegate_testkit::keys_in_namespace(&self.url, config.namespace_str()).await?;
        let (mut n, mut bytes, mut fields) = (0, 0, 0);
        for key in keys.iter().filter(|k| k.contains(":st:")) {
            let used: Option<u64> =
                self.redis.custom(fred::cmd!("MEMORY"), vec!["USAGE", key.as_str(), "SAMPLES", "0"]).await?;
            let len: u64 = self.redis.hlen(key.as_str()).await?;
            n += 1;
            bytes += used.unwrap_or(0);
            fields += len;
        }
        Ok((n, bytes, fields))
    }

    /// A minute's hash with every field one priority can have (8 counters, 3 histograms of 23
    /// buckets: docs/protocol.md §3, "Stats by stage"), for 1 and for 10 priorities: the most a
    /// minute can take, whatever the load.
    async fn full_minute_memory(&self) -> Result<Row, BoxError> {
        const COUNTERS: [&str; 8] = [
            "submitted",
            "started",
            "completed",
            "failed",
            "succeeded",
            "retried",
            "dead_lettered",
            "fenced",
        ];
        const BOUNDS: [&str; 23] = [
            "1", "2", "5", "10", "20", "50", "100", "200", "500", "1000", "2000", "5000", "10000", "20000",
            "50000", "100000", "200000", "500000", "1000000", "2000000", "5000000", "10000000", "inf",
        ];
        let mut sizes = Vec::new();
        for priorities in [1u8, 10] {
            let key = format!("bench-stats-full-{}:{{x}}:st:29000000", std::process::id());
            let mut fields: Vec<(String, u64)> = Vec::new();
            for p in 0..priorities {
                let p = 90 - p;
                fields.extend(COUNTERS.iter().map(|c| (format!("{p}|{c}"), 123_456)));
                for h in ["wait", "run", "duration"] {
                    fields.extend(BOUNDS.iter().map(|b| (format!("{p}|{h}|{b}"), 1_234)));
                }
            }
            let n = fields.len();
            let _: () = self.redis.hset(key.as_str(), fields).await?;
            let used: u64 =
                self.redis.custom(fred::cmd!("MEMORY"), vec!["USAGE", key.as_str(), "SAMPLES", "0"]).await?;
            let _: i64 = self.redis.del(key.as_str()).await?;
            sizes.push(format!(
                "{priorities} priorit{}: {n} fields, {used} B",
                if priorities == 1 { "y" } else { "ies" }
            ));
        }
        Ok(Row::new("stats_memory_full", 1).note(format!(
            "MEMORY USAGE of a minute's hash with every field: {} (x 1440 = per namespace-day)",
            sizes.join("; ")
        )))
    }

    /// Deletes what a scenario left. Every scenario ends with it: keys left to their retention
    /// expire a minute later, in the middle of another scenario, whose latencies then meet Redis's
    /// expiry of tens of thousands of keys (25-54 ms pauses in its latency monitor).
    async fn drop_namespace(&self, config: &Config) -> Result<(), BoxError> {
        let keys = sluicegate_testkit::keys_in_namespace(&self.url, config.namespace_str()).await?;
        for chunk in keys.chunks(500) {
            if self.redis.is_clustered() {
                // (A cluster refuses a DEL of keys in several slots.)
                try_join_all(chunk.iter().map(|key| self.redis.del::<i64, _>(key.as_str()))).await?;
            } else {
                let _: i64 = self.redis.del(chunk.to_vec()).await?;
            }
        }
        Ok(())
    }
}

/// Parts to an entry in `floor_packed` (a divisor of the batch of 16).
const FLOOR_PACK: usize = 8;

/// The library `floor` loads: the three stream commands of a batch's ack, in one function call
/// and nothing else (no token check, no counters, no record).
const FLOOR_LIBRARY: &str = r#"#!lua name=sgfloor
redis.register_function('sgfloor_ack', function(keys, args)
  local per, n = tonumber(args[2]), tonumber(args[3])
  if n > 0 then
    local ids, results, at = {}, {}, 4 + n
    for i = 1, n do
      ids[i] = args[3 + i]
      for j = 1, per do
        results[#results + 1] = string.format('%d', (i - 1) * per + j)
        results[#results + 1] = args[at]
        at = at + 1
      end
    end
    redis.call('HSET', keys[2], unpack(results))
    redis.call('XACK', keys[1], 'g', unpack(ids))
  end
  local got = redis.call('XREADGROUP', 'GROUP', 'g', args[1], 'COUNT', 16 / per, 'STREAMS', keys[1], '>')
  if not got then return {} end
  local reply = {}
  for _, e in ipairs(got[1][2]) do
    reply[#reply + 1] = e[1]
    reply[#reply + 1] = e[2][2]
  end
  return reply
end)
redis.register_function('sgfloor_shaped', function(keys, args)
  local m = redis.call('HMGET', keys[3], 't1', 'extra', 'window', 'discard', 'taken', 'xdel', 'prio', 'dl', 'rate', 'tat')
  local ids, results, cleared = {}, {}, {}
  for i = 3, #args, 5 do
    ids[#ids + 1] = args[i]
    local name = string.format('%d', tonumber(string.match(args[i], '%-(%d+)$')))
    results[#results + 1] = name
    results[#results + 1] = args[i + 2]
    cleared[#cleared + 1] = name
  end
  if #ids > 0 then
    redis.call('HSET', keys[2], unpack(results))
    redis.call('HDEL', keys[4], unpack(cleared))
    redis.call('XACK', keys[1], 'g', unpack(ids))
    redis.call('HINCRBY', keys[3], 'left', -#ids)
  end
  local got = redis.call('XREADGROUP', 'GROUP', 'g', args[1], 'COUNT', 16, 'STREAMS', keys[1], '>')
  if not got then return {} end
  local reply, next = {'run'}, {}
  for i, e in ipairs(got[1][2]) do
    next[i] = e[1]
    reply[#reply + 1] = {e[1], tonumber(string.match(e[1], '%-(%d+)$')), e[2][2], 1}
  end
  redis.call('HSET', keys[3], 't1', 'h|1|w/1|' .. args[2] .. '|' .. table.concat(next, ','))
  return reply
end)
redis.register_function('sgfloor_shaped_packed', function(keys, args)
  local m = redis.call('HMGET', keys[3], 't1', 'extra', 'window', 'discard', 'taken', 'xdel', 'prio', 'dl', 'rate', 'tat')
  local per = tonumber(args[3])
  local ids, results, cleared, parts = {}, {}, {}, 0
  local i = 4
  while i <= #args do
    local n = tonumber(args[i + 1])
    ids[#ids + 1] = args[i]
    local first = (tonumber(string.match(args[i], '%-(%d+)$')) - 1) * per
    for j = 0, n - 1 do
      local name = string.format('%d', first + j)
      results[#results + 1] = name
      results[#results + 1] = args[i + 3 + 4 * j]
      cleared[#cleared + 1] = name
    end
    parts = parts + n
    i = i + 2 + 4 * n
  end
  if #ids > 0 then
    redis.call('HSET', keys[2], unpack(results))
    redis.call('HDEL', keys[4], unpack(cleared))
    redis.call('XACK', keys[1], 'g', unpack(ids))
    redis.call('HINCRBY', keys[3], 'left', -parts)
  end
  local got = redis.call('XREADGROUP', 'GROUP', 'g', args[1], 'COUNT', 16 / per, 'STREAMS', keys[1], '>')
  if not got then return {} end
  local reply, next = {'run'}, {}
  for k, e in ipairs(got[1][2]) do
    next[k] = e[1]
    local seq = tonumber(string.match(e[1], '%-(%d+)$'))
    reply[#reply + 1] = {e[1], (seq - 1) * per, e[2][2], tonumber(e[2][4]), 1}
  end
  redis.call('HSET', keys[3], 't1', 'h|1|w/1|' .. args[2] .. '|' .. table.concat(next, ','))
  return reply
end)
"#;

impl Bench {
    /// What the stream primitives alone cost Redis per part, without sluicegate's protocol: one
    /// stream of `parts` 16-byte entries and a consumer group, drained by 16 consumers in batches
    /// of 16 (each batch: its results written to a hash with one HSET, its ids acked with one
    /// XACK, the next batch read with one XREADGROUP), twice: as three plain commands per batch
    /// (`floor_commands`), and as one function call per batch doing the same three
    /// (`floor_function`). A part in sluicegate costs this plus its token check, counters and
    /// reply: the floor under `one_huge` and `many_small`. `floor_packed` is `floor_function`
    /// with `FLOOR_PACK` parts to an entry (results still one field a part), and
    /// `floor_shaped_packed` is `floor_shaped` so packed (its arguments per part, its reply and
    /// writes per entry): what a protocol that packs a small request's parts into fewer entries
    /// could save (docs/design/packed-entries.md).
    async fn floor(&self) -> Result<Vec<Row>, BoxError> {
        let parts = self.scaled(200_000);
        let (stream, results) = ("sgfloor:{f}:s".to_owned(), "sgfloor:{f}:res".to_owned());
        let load = vec!["LOAD".to_owned(), "REPLACE".into(), FLOOR_LIBRARY.into()];
        let _: Value = self.redis.custom(fred::cmd!("FUNCTION"), load).await?;
        let mut rows = Vec::new();
        let scenarios =
            ["floor_commands", "floor_function", "floor_packed", "floor_shaped", "floor_shaped_packed"];
        for scenario in scenarios {
            // The packed rows: the same parts, FLOOR_PACK to an entry.
            let per = if scenario.ends_with("_packed") { FLOOR_PACK } else { 1 };
            let entries = parts / per as u64;
            let _: i64 = self.redis.del(vec![stream.clone(), results.clone()]).await?;
            let create = vec!["CREATE".to_owned(), stream.clone(), "g".into(), "0".into(), "MKSTREAM".into()];
            let _: Value = self.redis.custom(fred::cmd!("XGROUP"), create).await?;
            for chunk in 0..entries.div_ceil(2_000) {
                let pipe = self.redis.pipeline();
                for _ in 0..2_000.min(entries - chunk * 2_000) {
                    let mut add = vec![stream.clone(), "*".into(), "p".into(), PAYLOAD.repeat(per)];
                    if scenario == "floor_shaped_packed" {
                        add.extend(["n".into(), per.to_string()]);
                    }
                    let _: () = pipe.custom(fred::cmd!("XADD"), add).await?;
                }
                let _: Vec<Value> = pipe.all().await?;
            }
            let before = stats(&self.nodes).await?;
            let started = Instant::now();
            let consumers = (0..SLOTS).map(|c| {
                let (redis, stream, results) = (self.redis.clone(), stream.clone(), results.clone());
                async move {
                    let consumer = format!("c{c}");
                    let mut batch: Vec<String> = Vec::new();
                    loop {
                        batch = if scenario == "floor_commands" {
                            if !batch.is_empty() {
                                let mut hset = vec![results.clone()];
                                for i in 0..batch.len() {
                                    hset.extend([i.to_string(), String::new()]);
                                }
                                let _: i64 = redis.custom(fred::cmd!("HSET"), hset).await?;
                                let xack = [vec![stream.clone(), "g".into()], batch.clone()].concat();
                                let _: i64 = redis.custom(fred::cmd!("XACK"), xack).await?;
                            }
                            let read = ["GROUP", "g", &consumer, "COUNT", "16", "STREAMS", &stream, ">"];
                            let read: Vec<String> = read.iter().map(|a| a.to_string()).collect();
                            floor_ids(redis.custom(fred::cmd!("XREADGROUP"), read).await?)
                        } else if scenario.starts_with("floor_shaped") {
                            let keys = [
                                stream.clone(),
                                results.clone(),
                                "sgfloor:{f}:m".into(),
                                "sgfloor:{f}:err".into(),
                            ];
                            let mut call = vec![format!("sg{scenario}"), "4".into()];
                            call.extend(keys);
                            call.extend([consumer.clone(), "1700000000000".into()]);
                            if per == 1 {
                                for id in &batch {
                                    call.extend([
                                        id.clone(),
                                        "ok".into(),
                                        String::new(),
                                        "0".into(),
                                        "1".into(),
                                    ]);
                                }
                            } else {
                                // Per entry its id and part count, then per part outcome, body,
                                // delay and attempt.
                                call.push(per.to_string());
                                for id in &batch {
                                    call.extend([id.clone(), per.to_string()]);
                                    for _ in 0..per {
                                        call.extend(["ok".into(), String::new(), "0".into(), "1".into()]);
                                    }
                                }
                            }
                            let got: Value = redis.custom(fred::cmd!("FCALL"), call).await?;
                            got.into_array()
                                .into_iter()
                                .skip(1)
                                .filter_map(|e| e.into_array().into_iter().next()?.as_string())
                                .collect()
                        } else {
                            // floor_function and floor_packed: `per` parts to an entry.
                            let mut call =
                                vec!["sgfloor_ack".to_owned(), "2".into(), stream.clone(), results.clone()];
                            call.extend([consumer.clone(), per.to_string(), batch.len().to_string()]);
                            call.extend(batch.iter().cloned());
                            call.extend((0..batch.len() * per).map(|_| String::new()));
                            let got: Value = redis.custom(fred::cmd!("FCALL"), call).await?;
                            got.into_array().chunks(2).filter_map(|e| e[0].as_string()).collect()
                        };
                        if batch.is_empty() {
                            return Ok::<_, BoxError>(());
                        }
                    }
                }
            });
            try_join_all(consumers).await?;
            let row = Row::new(scenario, entries * per as u64)
                .rate(started.elapsed())
                .cost(&before, &stats(&self.nodes).await?);
            let how = match scenario {
                "floor_commands" => "as three commands".to_owned(),
                "floor_function" => "in one function call".to_owned(),
                "floor_packed" => format!(
                    "in one function call, {FLOOR_PACK} parts to an entry (its payload theirs, its results \
                     {FLOOR_PACK} fields)"
                ),
                "floor_shaped_packed" => format!(
                    "in one function call shaped as ack's, {FLOOR_PACK} parts to an entry (an outcome, body, \
                     delay and attempt a part; a result field and an HDEL field a part)"
                ),
                _ => "in one function call shaped as ack's (its arguments, reply, meta read, token write, HDEL and \
                      HINCRBY)"
                    .to_owned(),
            };
            rows.push(row.note(format!(
                "no sluicegate: {} parts in {entries} stream entries, 16 consumers, batches of 16 parts, per \
                 batch HSET + XACK + XREADGROUP {how}",
                entries * per as u64
            )));
        }
        let _: i64 = self.redis.del(vec![stream, results, "sgfloor:{f}:m".into()]).await?;
        let _: Value =
            self.redis.custom(fred::cmd!("FUNCTION"), vec!["DELETE".to_owned(), "sgfloor".into()]).await?;
        Ok(rows)
    }
}

/// The entry ids in an XREADGROUP reply (none: nil, or no entries).
fn floor_ids(got: Value) -> Vec<String> {
    let Some(stream) = got.into_array().into_iter().next() else { return Vec::new() };
    let Some(entries) = stream.into_array().into_iter().nth(1) else { return Vec::new() };
    entries.into_array().into_iter().filter_map(|e| e.into_array().into_iter().next()?.as_string()).collect()
}

/// A `sluicegate dashboard` process and a headless chromium showing its overview; both are
/// killed on drop.
struct Watching {
    dashboard: std::process::Child,
    browser: std::process::Child,
    profile: std::path::PathBuf,
}

impl Watching {
    /// Starts the dashboard on a free port, waits until it answers, opens the overview in
    /// chromium, and waits until the browser's live stream is connected (the dashboard reads only
    /// while someone watches).
    async fn start(cli: &std::path::Path, redis: &str, namespace: &str) -> Result<Self, BoxError> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dashboard = std::process::Command::new(cli)
            .args(["--redis", redis, "--namespace", namespace, "dashboard", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .process_group(0)
            .spawn()?;
        let profile =
            std::env::temp_dir().join(format!("sluicegate-bench-chromium-{}-{port}", std::process::id()));
        let mut watching = Self { dashboard, browser: std::process::Command::new("true").spawn()?, profile };
        let deadline = Instant::now() + Duration::from_secs(15);
        while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            if Instant::now() > deadline {
                return Err("the dashboard did not listen within 15 s".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let chromium = std::env::var("CHROME_BIN").unwrap_or_else(|_| "chromium".into());
        // The browser stands for an operator's machine: at nice 19 (BENCH_DASHBOARD_BROWSER_NICE)
        // it gets only idle CPU, so that a 2-core host measures what the dashboard costs Redis and
        // the workers, not what rendering a page costs the host. The dashboard runs at normal
        // priority, as it would beside the workers.
        let nice = std::env::var("BENCH_DASHBOARD_BROWSER_NICE").unwrap_or_else(|_| "19".into());
        watching.browser = std::process::Command::new("nice")
            .args(["-n", &nice, &chromium])
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", watching.profile.display()))
            .arg(format!("http://127.0.0.1:{port}/"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("cannot start {chromium} (apt-get install chromium, or set CHROME_BIN): {e}")
            })?;
        // The page's first reading: give it the time to load and open its stream.
        tokio::time::sleep(Duration::from_secs(3)).await;
        Ok(watching)
    }

    /// CPU seconds the dashboard process and the browser's processes have used so far.
    fn cpu_s(&self) -> (f64, f64) {
        (group_cpu_s(self.dashboard.id()), chromium_cpu_s())
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        // The browser's helper processes share its process group.
        let _ = std::process::Command::new("kill").arg("--").arg(format!("-{}", self.browser.id())).status();
        let _ = self.browser.kill();
        let _ = self.dashboard.kill();
        let _ = self.browser.wait();
        let _ = self.dashboard.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Submits `requests` requests of `parts` parts each (limit `limit`), 64 submits in flight, as a
/// loader would; returns once every one is accepted.
/// Reads `Admin::stats` every `every` until aborted, as one `sluicegate metrics` process scraped
/// that often would; counts the reads.
fn scrape_every(
    admin: Admin,
    every: Duration,
) -> (tokio::task::JoinHandle<()>, Arc<std::sync::atomic::AtomicU64>) {
    let scrapes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = scrapes.clone();
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            if admin.stats().await.is_ok() {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    (task, scrapes)
}

async fn queue(producer: &Producer, requests: u64, parts: u64, limit: u32) -> Result<(), BoxError> {
    queue_as(producer, requests, parts, limit, true, false).await
}

/// Requests per `submit_many` in the `_bulk` scenarios: as many as BullMQ's `addBulk` batches.
const BULK: u64 = 1_000;

/// `requests` requests of `parts` parts each, `BULK` per `Producer::submit_many`, one after another.
async fn queue_bulk(producer: &Producer, requests: u64, parts: u64, limit: u32) -> Result<(), BoxError> {
    let mut left = requests;
    while left > 0 {
        let n = left.min(BULK);
        let mut batch = Vec::with_capacity(n as usize);
        for _ in 0..n {
            batch.push((producer.request().concurrency(limit)?, vec![PAYLOAD; parts as usize]));
        }
        for answer in producer.submit_many(batch).await {
            answer?;
        }
        left -= n;
    }
    Ok(())
}

/// `queue`, the requests listed or not (`RequestBuilder::unlisted`), their results kept or not
/// (`RequestBuilder::discard_results`).
async fn queue_as(
    producer: &Producer,
    requests: u64,
    parts: u64,
    limit: u32,
    listed: bool,
    discard: bool,
) -> Result<(), BoxError> {
    futures::stream::iter(0..requests)
        .map(|_| async {
            let request = producer.request().concurrency(limit)?.discard_results(discard);
            let request = if listed { request } else { request.unlisted() };
            request.submit((0..parts).map(|_| PAYLOAD)).await.map(drop)
        })
        .buffer_unordered(64)
        .try_collect::<()>()
        .await?;
    Ok(())
}

fn print_table(rows: &[Row]) {
    let f = |v: Option<f64>, p: usize| v.map_or("-".to_owned(), |v| format!("{v:.p$}"));
    println!(
        "{:<12} {:<26} {:>9} {:>12} {:>8} {:>8} {:>9} {:>9} {:>8}",
        "system", "scenario", "items", "items/s", "p50 ms", "p99 ms", "µs Redis", "cmds", "bytes"
    );
    for r in rows {
        println!(
            "{:<12} {:<26} {:>9} {:>12} {:>8} {:>8} {:>9} {:>9} {:>8}",
            r.system,
            r.scenario,
            r.items,
            f(r.throughput_per_s, 0),
            f(r.p50_ms, 3),
            f(r.p99_ms, 3),
            f(r.redis_cpu_us_per_item, 2),
            f(r.redis_cmds_per_item, 2),
            f(r.bytes_per_item, 1),
        );
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale: f64 = std::env::var("BENCH_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let chosen: Vec<&str> = args.iter().map(String::as_str).filter(|a| !a.starts_with("--")).collect();

    // REDIS_URL, or a redis-server of its own (kept alive until the end).
    let redis_env = TestRedis::start().await?;
    let url = redis_env.url().to_owned();
    let redis = connect(&url).await?;
    let bench = Bench { redis: redis.clone(), nodes: vec![redis], url: url.clone(), scale, shards: 1 };
    let compare = args.iter().any(|a| a == "--compare");
    let runs = if compare { 3 } else { 1 };
    let mut all: Vec<Row> = Vec::new();
    for run in 1..=runs {
        let load = loadavg();
        eprintln!("run {run}/{runs} against {url} (scale {scale}; load average {load})");
        if load.split(' ').next().and_then(|l| l.parse::<f64>().ok()).is_some_and(|l| l > 1.5) {
            eprintln!(
                "note: the machine is busy with something else (load average {load}); figures will be lower"
            );
        }
        all.extend(bench.run_all(&chosen).await?);
        if compare {
            all.extend(run_bullmq(&url, scale)?);
        }
    }
    let rows = medians(&all);
    print_table(&rows);
    if compare {
        print_ratios(&rows);
    }
    for r in &rows {
        println!("{}", serde_json::to_string(r)?);
    }
    Ok(())
}

impl Bench {
    /// Runs the `chosen` scenarios, or the default set when none is chosen.
    async fn run_all(&self, chosen: &[&str]) -> Result<Vec<Row>, BoxError> {
        let wants = |name: &str| chosen.is_empty() || chosen.contains(&name);
        let mut rows = Vec::new();
        if wants("many_small") {
            rows.extend(self.throughput("many_small", self.scaled(1_000), 100, 4).await?);
        }
        if wants("many_small_discarded") {
            rows.extend(self.throughput("many_small_discarded", self.scaled(1_000), 100, 4).await?);
        }
        if wants("many_small_grouped") {
            rows.extend(self.throughput_in("many_small_grouped", self.scaled(1_000), 100, 4, 8, 1).await?);
        }
        if wants("many_small_packed") {
            // Six parts to a sub-request: the most that docs/design/packed-entries.md's rule
            // (k <= parts / (4 * limit)) gives a request of 100 parts at limit 4.
            rows.extend(self.throughput_in("many_small_packed", self.scaled(1_000), 100, 4, 0, 6).await?);
        }
        if chosen.contains(&"many_small_packed_own") {
            // The same on streams of their own (17 sub-requests would take the lane): what
            // packing saves on the path a request of 100 single parts takes.
            rows.extend(self.throughput_in("many_small_packed_own", self.scaled(1_000), 100, 4, 0, 6).await?);
        }
        if wants("small_10_grouped") {
            rows.extend(self.throughput_in("small_10_grouped", self.scaled(10_000), 10, 4, 8, 1).await?);
        }
        if wants("small_10") {
            rows.extend(self.throughput("small_10", self.scaled(10_000), 10, 4).await?);
        }
        if wants("one_huge") {
            rows.extend(self.throughput("one_huge", 1, self.scaled(200_000), 16).await?);
        }
        if wants("small_1") {
            rows.extend(self.backlog("small_1", self.scaled(100_000), 1, 1).await?);
        }
        if wants("small_1_bulk") {
            rows.extend(self.backlog("small_1_bulk", self.scaled(100_000), 1, 1).await?);
        }
        if wants("small_1_unlisted") {
            rows.extend(self.backlog("small_1_unlisted", self.scaled(100_000), 1, 1).await?);
        }
        if wants("small_1_discarded") {
            rows.extend(self.backlog("small_1_discarded", self.scaled(100_000), 1, 1).await?);
        }
        for backlog in [1_000, 10_000, 100_000] {
            let name = format!("small_10_backlog_{}k", backlog / 1_000);
            if wants(&name) || wants("backlog") {
                rows.extend(self.backlog(&name, self.scaled(backlog), 10, 4).await?);
            }
            // Only when named: the same sweep with the requests unlisted (no listing index).
            let unlisted = format!("{name}_unlisted");
            if chosen.contains(&unlisted.as_str()) || chosen.contains(&"backlog_unlisted") {
                rows.extend(self.backlog(&unlisted, self.scaled(backlog), 10, 4).await?);
            }
        }
        // Only when named: it watches Redis for a whole census interval.
        if chosen.contains(&"recovery_idle") {
            rows.extend(self.recovery_idle(self.scaled(100_000)).await?);
        }
        // Only when named: 2 x 10,000,000 parts take minutes.
        if chosen.contains(&"window") {
            rows.extend(self.window(false).await?);
            rows.extend(self.window(true).await?);
        }
        // Only when named: it starts a local 3-master cluster.
        if chosen.contains(&"cluster") {
            rows.extend(self.cluster().await?);
        }
        // Only when named: 10,000,000 parts in 1,000,000 requests take minutes.
        if chosen.contains(&"loader") {
            rows.extend(self.loader().await?);
        }
        if wants("medium_1000") {
            rows.extend(self.backlog("medium_1000", self.scaled(100), 1_000, 4).await?);
        }
        if wants("submit_large") {
            rows.extend(self.submit_rate().await?);
        }
        if wants("memory") {
            rows.extend(self.memory().await?);
        }
        if wants("idle_latency") {
            rows.extend(self.idle_latency().await?);
        }
        // With the worker's urgent slot (the default), which the urgent request's submit hands its
        // token to (docs/protocol.md, "Hand-offs"); then without it, every slot taking every
        // priority; then with one of the 16 slots kept for priorities 90 and up instead.
        if wants("priority_under_load") {
            rows.extend(self.priority_under_load("priority_under_load", None, Slots::Urgent).await?);
        }
        if wants("priority_under_load_plain") {
            rows.extend(self.priority_under_load("priority_under_load_plain", None, Slots::Plain).await?);
        }
        if wants("priority_under_load_reserved") {
            let reserved = Slots::Reserve(1, 90);
            rows.extend(self.priority_under_load("priority_under_load_reserved", None, reserved).await?);
        }
        if wants("floor") {
            rows.extend(self.floor().await?);
        }
        let work = Some(Duration::from_millis(1));
        if wants("priority_busy") {
            rows.extend(self.priority_under_load("priority_busy", work, Slots::Urgent).await?);
        }
        if wants("priority_busy_plain") {
            rows.extend(self.priority_under_load("priority_busy_plain", work, Slots::Plain).await?);
        }
        if wants("priority_busy_reserved") {
            rows.extend(
                self.priority_under_load("priority_busy_reserved", work, Slots::Reserve(1, 90)).await?,
            );
        }
        if wants("dag_release") || wants("dag_fanout_100") {
            rows.extend(self.dag_release().await?);
        }
        // Only when named: several rounds of the same drain, with the stats by stage off and on.
        if chosen.contains(&"stats_overhead") {
            rows.extend(self.stats_overhead().await?);
        }
        // Only when named: it needs the release CLI and Debian's chromium.
        if chosen.contains(&"dashboard_overhead") {
            rows.extend(self.dashboard_overhead().await?);
        }
        Ok(rows)
    }
}

/// Runs bench/bullmq/bench.mjs against the same server (installing its packages the first time).
fn run_bullmq(url: &str, scale: f64) -> Result<Vec<Row>, BoxError> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/bullmq");
    if !dir.join("node_modules").exists() {
        let ok = std::process::Command::new("npm").arg("ci").current_dir(&dir).status()?.success();
        if !ok {
            return Err("npm ci failed in bench/bullmq".into());
        }
    }
    let out = std::process::Command::new("node")
        .arg("bench.mjs")
        .current_dir(&dir)
        .env("REDIS_URL", url)
        .env("BENCH_SCALE", scale.to_string())
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(format!("the BullMQ benchmark failed ({})", out.status).into());
    }
    let rows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Row>(l).ok())
        .filter(|r| r.scenario != "meta")
        .collect();
    Ok(rows)
}

/// One row per (system, scenario): the median of each figure over the runs.
fn medians(all: &[Row]) -> Vec<Row> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in all {
        let k = (r.system.clone(), r.scenario.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(system, scenario)| {
            let runs: Vec<&Row> =
                all.iter().filter(|r| r.system == system && r.scenario == scenario).collect();
            let med = |f: &dyn Fn(&Row) -> Option<f64>| {
                let mut v: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
                v.sort_by(|a, b| a.total_cmp(b));
                (!v.is_empty()).then(|| v[v.len() / 2])
            };
            Row {
                system: system.clone(),
                scenario: scenario.clone(),
                items: runs[0].items,
                throughput_per_s: med(&|r| r.throughput_per_s),
                p50_ms: med(&|r| r.p50_ms),
                p99_ms: med(&|r| r.p99_ms),
                redis_cpu_us_per_item: med(&|r| r.redis_cpu_us_per_item),
                redis_cmds_per_item: med(&|r| r.redis_cmds_per_item),
                bytes_per_item: med(&|r| r.bytes_per_item),
                // The first run's, as its note says.
                redis_cpu_us_per_item_by_master: runs[0].redis_cpu_us_per_item_by_master.clone(),
                note: format!("{} (median of {})", runs[0].note, runs.len()),
            }
        })
        .collect()
}

/// sluicegate's figure over BullMQ's for the matching scenarios (>1 is better for sluicegate on
/// throughput; on latency, CPU and bytes the ratio is BullMQ's over sluicegate's, so >1 is better
/// there too).
fn print_ratios(rows: &[Row]) {
    let find =
        |system: &str, scenario: &str| rows.iter().find(|r| r.system == system && r.scenario == scenario);
    let pairs = [
        ("many_small", "flow_small"),
        ("many_small", "plain_queue"),
        ("many_small", "plain_queue_kept"),
        ("many_small_discarded", "plain_queue"),
        ("many_small_packed", "plain_queue_chunked"),
        ("one_huge", "flow_huge"),
        ("one_huge", "plain_queue"),
        ("small_1", "plain_queue"),
        ("small_1", "plain_queue_kept"),
        ("small_1_unlisted", "plain_queue"),
        ("small_1_discarded", "plain_queue"),
        ("small_10_backlog_1k", "plain_queue"),
        ("small_10_backlog_10k", "plain_queue"),
        ("small_10_backlog_100k", "plain_queue"),
        ("medium_1000", "plain_queue"),
        ("small_1_submit", "plain_add"),
        ("small_1_unlisted_submit", "plain_add"),
        ("small_1_bulk_submit", "plain_add"),
        ("many_small_submit", "flow_small_add"),
        ("submit_large", "plain_add"),
        ("memory", "memory"),
        ("idle_latency", "idle_latency"),
        ("idle_completion_latency", "idle_completion_latency"),
        ("idle_round_trip", "idle_round_trip"),
        ("priority_under_load", "priority_under_load"),
        ("priority_under_load_plain", "priority_under_load"),
        ("priority_under_load_reserved", "priority_under_load"),
        ("priority_busy", "priority_busy"),
        ("priority_busy_plain", "priority_busy"),
        ("priority_busy_reserved", "priority_busy"),
        ("dag_release", "flow_release"),
    ];
    println!("\nsluicegate vs BullMQ (each ratio > 1 means sluicegate is better)");
    println!(
        "{:<26} {:<26} {:>11} {:>9} {:>9} {:>11} {:>9}",
        "sluicegate", "BullMQ", "throughput", "p50", "p99", "Redis CPU", "bytes"
    );
    let r = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".to_owned(),
    };
    for (ours, theirs) in pairs {
        let (Some(o), Some(t)) = (find("sluicegate", ours), find("bullmq", theirs)) else { continue };
        println!(
            "{:<26} {:<26} {:>11} {:>9} {:>9} {:>11} {:>9}",
            ours,
            theirs,
            r(o.throughput_per_s, t.throughput_per_s),
            r(t.p50_ms, o.p50_ms),
            r(t.p99_ms, o.p99_ms),
            r(t.redis_cpu_us_per_item, o.redis_cpu_us_per_item),
            r(t.bytes_per_item, o.bytes_per_item),
        );
    }
}

/// This process's peak resident memory (Linux), for the producer-memory claim of bulk submits.
fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).map(|l| l["VmHWM:".len()..].trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// CPU seconds this process has used (user + system; Linux `/proc/self/stat`, at the clock tick's
/// resolution, 10 ms), or `None` elsewhere.
/// The median of `v` (the upper one of an even count); sorts `v`.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn process_cpu_s() -> Option<f64> {
    stat_cpu_s(&std::fs::read_to_string("/proc/self/stat").ok()?).map(|(_, cpu)| cpu)
}

/// A `/proc/<pid>/stat` line's process group and CPU seconds (user + system).
fn stat_cpu_s(stat: &str) -> Option<(u32, f64)> {
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some((fields.get(2)?.parse().ok()?, ticks / 100.0))
}

/// CPU seconds the live processes of process group `group` have used.
fn group_cpu_s(group: u32) -> f64 {
    live_cpu_s(|g, _| g == group)
}

/// CPU seconds the live processes named `chrom…` have used (a browser's processes are not all in
/// one process group).
fn chromium_cpu_s() -> f64 {
    live_cpu_s(|_, name| name.starts_with("chrom"))
}

fn live_cpu_s(pick: impl Fn(u32, &str) -> bool) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0.0 };
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
        .filter_map(|stat| {
            let name = stat.split_once('(')?.1.rsplit_once(')')?.0.to_owned();
            let (group, cpu) = stat_cpu_s(&stat)?;
            pick(group, &name).then_some(cpu)
        })
        .sum()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
