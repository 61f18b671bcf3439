//! The chaos suite's harness: worker processes (`tests/bin/chaos_worker.rs`) that it SIGKILLs and
//! restarts, one scenario runner shared by every fault, and the checker that turns what happened
//! into the figures of the contract (lost, duplicates, max concurrency vs limit, terminal records,
//! tokens, keys left).
//!
//! The figures come from outside sluicegate wherever possible: results from `wait()`, completions
//! from two [`Listener`]s, concurrency and executions from the handlers' own counters (see the
//! example's docs), leaks from a SCAN of the namespace. Only the token census reads sluicegate's
//! keys directly, as documented in docs/protocol.md §3.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::{
    Builder, Client, ClientInterface, ClientLike, ClusterInterface, Config as FredConfig, HashesInterface,
    KeysInterface, ListInterface, LuaInterface, ReconnectPolicy, SetsInterface, SortedSetsInterface,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sluicegate::{Completion, Config, Listener, Producer, RequestId, RequestState};
use sluicegate_testkit::{keys_in_namespace, unique_namespace, RedisCluster, RedisServer};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::census::{spawn_listener, Heard};
use crate::logs::log_tail;
use sluicegate_testkit::proxy::{Proxy, ProxyChaos, ProxyStats};

/// Short timings, so that recovery (lease expiry plus one recovery interval, about 1.8 s) happens
/// many times within one bounded run.
pub const LEASE: Duration = Duration::from_millis(1500);
pub const HEARTBEAT: Duration = Duration::from_millis(300);
pub const RECOVERY: Duration = Duration::from_millis(300);
/// Short, so the leak check (everything gone once retention has passed) fits in the run. Results
/// are read as soon as each request completes, long before they expire, unless a fault keeps the
/// producer from Redis for that long ([`Scenario::retention`]).
pub const RETENTION: Duration = Duration::from_secs(5);
/// How often `wait()` re-reads a terminal record in case a doorbell message was lost.
pub const WAIT_POLL: Duration = Duration::from_millis(500);
/// A run in which nothing completes for this long has lost work: recovery brings a lost token back
/// within a lease plus a recovery interval (1.8 s), so this is many times the worst legitimate gap.
pub const STALL_LIMIT: Duration = Duration::from_secs(30);

/// A sub-request of the chaos suite: the same struct as in `tests/bin/chaos_worker.rs`, which
/// answers `n * 3`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy)]
pub struct Part {
    pub n: u64,
    pub sleep_ms: u64,
}

// ---------------------------------------------------------------------------------------------
// The worker binary

/// The path of the chaos worker (`tests/bin/chaos_worker.rs`), which `cargo test` builds with
/// the tests.
pub fn worker_binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_sluicegate-chaos-worker"))
}

// ---------------------------------------------------------------------------------------------
// Worker processes

/// How to start a worker process.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// Where sluicegate connects (the proxy, in the proxy run).
    pub redis_url: String,
    /// Where the handlers count themselves: always the server itself.
    pub counter_url: String,
    pub namespace: String,
    pub slots: usize,
    /// How long a request's results are kept once it finished (the worker that finishes it sets it).
    pub retention: Duration,
    /// stderr of every process goes to `<log_dir>/worker-<serial>.log`.
    pub log_dir: PathBuf,
}

struct WorkerProc {
    /// 0, 1, 2, ... in start order, over the whole run (a restarted worker gets a new serial).
    serial: usize,
    child: Child,
    pid: u32,
    /// The CLIENT SETNAME of the process's counting connection.
    counter_client: String,
    log: PathBuf,
    /// Held so the worker's stdout stays open (it prints only the READY line).
    _stdout: BufReader<ChildStdout>,
}

/// The worker processes of a run, and what was done to them.
pub struct WorkerPool {
    settings: WorkerSettings,
    procs: Vec<WorkerProc>,
    next_serial: usize,
    /// The harness's own connection to the server, for the clean-up after a kill.
    client: Client,
    pub kills: u64,
    pub restarts: u64,
    /// Handlers that were running in killed processes (their counters' members, removed).
    pub orphans_removed: u64,
    /// Processes that exited without being told to, and other harness trouble.
    pub problems: Vec<String>,
    rng: StdRng,
}

impl WorkerPool {
    /// Starts `n` processes and waits until each has connected.
    pub async fn start(settings: WorkerSettings, n: usize, seed: u64) -> Self {
        let client = connect_with_retry(&settings.counter_url).await;
        let mut pool = Self {
            settings,
            procs: Vec::new(),
            next_serial: 0,
            client,
            kills: 0,
            restarts: 0,
            orphans_removed: 0,
            problems: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
        };
        for _ in 0..n {
            let proc = pool.spawn().await;
            pool.procs.push(proc);
        }
        pool
    }

    async fn spawn(&mut self) -> WorkerProc {
        let serial = self.next_serial;
        self.next_serial += 1;
        let s = &self.settings;
        let log = s.log_dir.join(format!("worker-{serial}.log"));
        let stderr = std::fs::File::create(&log).expect("worker log file");
        let ms = |d: Duration| d.as_millis().to_string();
        let mut child = Command::new(worker_binary())
            .env("REDIS_URL", &s.redis_url)
            .env("CHAOS_COUNTER_URL", &s.counter_url)
            .env("CHAOS_NAMESPACE", &s.namespace)
            .env("CHAOS_SLOTS", s.slots.to_string())
            .env("CHAOS_LEASE_MS", ms(LEASE))
            .env("CHAOS_HEARTBEAT_MS", ms(HEARTBEAT))
            .env("CHAOS_RECOVERY_MS", ms(RECOVERY))
            .env("CHAOS_RETENTION_MS", ms(s.retention))
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            // A test that panics must not leave workers behind.
            .kill_on_drop(true)
            .spawn()
            .expect("chaos_worker starts");
        let pid = child.id().expect("a fresh child has a pid");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let mut line = String::new();
        let ready = tokio::time::timeout(Duration::from_secs(30), stdout.read_line(&mut line)).await;
        let counter_client = line
            .trim()
            .strip_prefix("READY ")
            .and_then(|rest| rest.split_whitespace().find_map(|kv| kv.strip_prefix("counter_client=")))
            .map(str::to_owned);
        match (ready, counter_client) {
            (Ok(Ok(_)), Some(name)) => {
                WorkerProc { serial, child, pid, counter_client: name, log, _stdout: stdout }
            }
            _ => {
                let _ = child.start_kill();
                panic!(
                    "worker {serial} (pid {pid}) did not get ready: stdout {line:?}\n{}",
                    log_tail(&log, 30)
                );
            }
        }
    }

    /// SIGKILLs a random worker, cleans up after it, and starts a replacement.
    pub async fn kill_and_restart_random(&mut self) {
        let idx = self.rng.gen_range(0..self.procs.len());
        let victim = &mut self.procs[idx];
        let _ = victim.child.start_kill();
        let _ = victim.child.wait().await;
        self.kills += 1;
        let (pid, name) = (victim.pid, victim.counter_client.clone());
        self.forget_dead(pid, &name).await;
        self.procs[idx] = self.spawn().await;
        self.restarts += 1;
    }

    /// Removes a dead process's handlers from the running sets.
    ///
    /// A killed process never takes its members out, and it runs nothing any more, so they must
    /// go, or they would count as running forever. First wait until the server has dropped the
    /// process's counting connection: commands the process wrote just before it died may still sit
    /// in the server's input buffer, and only once the connection is gone is it certain that none
    /// of them will add a member after the clean-up.
    async fn forget_dead(&mut self, pid: u32, counter_client: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let needle = format!(" name={counter_client} ");
        loop {
            let list: String =
                self.client.client_list::<String, String>(None, None).await.unwrap_or_default();
            if !list.lines().any(|l| format!(" {l} ").contains(&needle)) {
                break;
            }
            if Instant::now() > deadline {
                self.problems.push(format!("the connection of killed pid {pid} stayed open for 5 s"));
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let keys = scan(&self.client, &format!("chaos:{}:running:*", self.settings.namespace)).await;
        if keys.is_empty() {
            return;
        }
        const FORGET: &str = r"
            local removed = 0
            for _, key in ipairs(KEYS) do
              for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
                if string.sub(m, 1, #ARGV[1]) == ARGV[1] then
                  removed = removed + redis.call('ZREM', key, m)
                end
              end
            end
            return removed";
        let removed: i64 =
            self.client.eval(FORGET, keys, vec![format!("{pid}:")]).await.expect("clean-up script");
        self.orphans_removed += removed as u64;
    }

    /// Records processes that exited on their own (crashed) and starts replacements.
    pub async fn check_alive(&mut self) {
        for idx in 0..self.procs.len() {
            if let Ok(Some(status)) = self.procs[idx].child.try_wait() {
                let p = &self.procs[idx];
                self.problems.push(format!(
                    "worker {} (pid {}) exited on its own with {status}\n{}",
                    p.serial,
                    p.pid,
                    log_tail(&p.log, 20)
                ));
                let (pid, name) = (p.pid, p.counter_client.clone());
                self.forget_dead(pid, &name).await;
                self.procs[idx] = self.spawn().await;
            }
        }
    }

    /// SIGTERMs every worker and waits for each to exit; a worker that does not exit cleanly
    /// within `limit` is a problem (and is killed).
    pub async fn stop_all(&mut self, limit: Duration) -> Duration {
        let started = Instant::now();
        for p in &self.procs {
            // std and tokio only send SIGKILL, and the crate forbids unsafe (no libc): `kill` does it.
            let _ = std::process::Command::new("kill").arg("-TERM").arg(p.pid.to_string()).status();
        }
        for p in &mut self.procs {
            match tokio::time::timeout(limit.saturating_sub(started.elapsed()), p.child.wait()).await {
                Ok(Ok(status)) if status.success() => {}
                Ok(Ok(status)) => self.problems.push(format!(
                    "worker {} (pid {}) exited with {status} on SIGTERM\n{}",
                    p.serial,
                    p.pid,
                    log_tail(&p.log, 20)
                )),
                Ok(Err(e)) => self.problems.push(format!("waiting for worker {}: {e}", p.serial)),
                Err(_) => {
                    let _ = p.child.start_kill();
                    self.problems.push(format!(
                        "worker {} (pid {}) still running {limit:?} after SIGTERM\n{}",
                        p.serial,
                        p.pid,
                        log_tail(&p.log, 20)
                    ));
                }
            }
        }
        started.elapsed()
    }
}

/// A fred client that reconnects by itself (the server may restart under it).
async fn connect_with_retry(url: &str) -> Client {
    let client = Builder::from_config(FredConfig::from_url(url).expect("valid url"))
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 1_000, 2))
        .build()
        .expect("client builds");
    client.init().await.expect("harness connects to redis");
    client
}

async fn scan(client: &Client, pattern: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor = String::from("0");
    loop {
        let (next, page): (String, Vec<Bytes>) =
            client.scan_page(cursor.clone(), pattern.to_owned(), Some(1000), None).await.expect("SCAN");
        keys.extend(page.iter().map(|k| String::from_utf8_lossy(k).into_owned()));
        if next == "0" {
            return keys;
        }
        cursor = next;
    }
}

fn random_duration(rng: &mut impl Rng, range: &RangeInclusive<Duration>) -> Duration {
    if range.start() >= range.end() {
        return *range.start();
    }
    rng.gen_range(range.clone())
}

// ---------------------------------------------------------------------------------------------
// Scenarios

/// The fault a run injects.
#[derive(Clone, Debug)]
pub enum Fault {
    /// None: the same workload through real worker processes (to check the harness itself).
    None,
    /// SIGKILL a random worker after each pause drawn from `every`, and start a new one.
    KillWorkers { every: RangeInclusive<Duration> },
    /// Workers (and one of the two listeners) reach Redis through a proxy doing this.
    Proxy(ProxyChaos),
    /// Crash Redis (SIGKILL) and restart it, AOF `appendfsync always`, each time the share of
    /// completed requests reaches one of `at` (ascending, each below 1.0).
    RedisRestart { at: Vec<f64> },
    /// Run against a 3-master Redis Cluster (AOF `appendfsync always` on every node) instead of a
    /// single Redis, and SIGKILL the master owning the token lists' slot (`{<ns>.q0}`) once the
    /// share `at` of the requests has completed; restart it after `down` and wait until the cluster
    /// is ok again. The handlers count themselves on a separate single Redis, untouched by the fault.
    ClusterMasterRestart { at: f64, down: Duration },
}

/// One chaos run: the workload and its fault.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Short name for the figures line: `chaos[<name>]`.
    pub name: String,
    pub fault: Fault,
    pub requests: u64,
    pub parts: u64,
    pub workers: usize,
    pub slots: usize,
    /// Each part sleeps 0 to this many ms.
    pub max_sleep_ms: u64,
    /// How long results are kept once a request finished ([`RETENTION`] unless a fault needs
    /// more): a waiter whose reads fail for longer than this finds its request gone, which the run
    /// reports as an expiry, not a loss.
    pub retention: Duration,
    /// From start to every request done; past it the run fails with a diagnosis.
    pub timeout: Duration,
    /// Seeds the workload and the harness's random choices (printed, to replay a workload; the
    /// timing of faults is not reproducible).
    pub seed: u64,
}

impl Scenario {
    /// The issue's acceptance run: 200 requests of 50 parts, limits 1 to 4, 4 workers of 4 slots.
    /// `SLUICEGATE_SOAK=1` scales it up (`SLUICEGATE_SOAK_REQUESTS`, default 1000) and allows more
    /// time; `SLUICEGATE_CHAOS_SEED` fixes the seed.
    pub fn acceptance(name: &str, fault: Fault) -> Self {
        let requests = if soak() {
            std::env::var("SLUICEGATE_SOAK_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
        } else {
            200
        };
        let seed = std::env::var("SLUICEGATE_CHAOS_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| rand::thread_rng().gen());
        Self {
            name: name.to_owned(),
            fault,
            requests,
            parts: 50,
            workers: 4,
            slots: 4,
            max_sleep_ms: 3,
            retention: RETENTION,
            // About 0.3 s per request (proxy stalls are the slowest fault), and never less than
            // the 150 s of the acceptance run.
            timeout: Duration::from_secs(150.max(requests * 3 / 10)),
            seed,
        }
    }

    /// The concurrency limit of request `r`: 1 to 4.
    pub fn limit(r: u64) -> u32 {
        (r % 4) as u32 + 1
    }

    /// The priority of request `r`: three levels, so several token lists are in play.
    pub fn priority(r: u64) -> u8 {
        [10, 50, 90][(r % 3) as usize]
    }
}

/// Whether this is a soak run (`SLUICEGATE_SOAK=1`): more requests, and more faults where a run
/// has a fixed number of them.
pub fn soak() -> bool {
    std::env::var("SLUICEGATE_SOAK").is_ok_and(|v| v == "1")
}

/// Which faults `SLUICEGATE_CHAOS_SKIP` (comma-separated: `kill`, `cut`, `restart`) leaves out.
/// For checking the harness while a fault is known to break the system: e.g. kills before token
/// recovery exists.
pub fn skipped(fault: &str) -> bool {
    std::env::var("SLUICEGATE_CHAOS_SKIP").is_ok_and(|v| v.split(',').any(|f| f.trim() == fault))
}

/// What a run measured. [`Figures::problems`] lists every broken promise.
#[derive(Debug, Default)]
pub struct Figures {
    pub name: String,
    pub seed: u64,
    pub requests: u64,
    pub sub_requests: u64,
    pub worker_kills: u64,
    pub worker_restarts: u64,
    pub orphans_removed: u64,
    pub redis_restarts: u64,
    /// Requests completed at each Redis restart.
    pub completed_at_restart: Vec<usize>,
    /// What was done to the cluster, in words (cluster runs only).
    pub cluster_faults: Vec<String>,
    pub proxy: Option<ProxyStats>,
    /// Parts with no correct result (missing, an error, or a wrong value).
    pub lost: u64,
    /// Of the lost parts, those that ended with an error: message → parts.
    pub part_errors: BTreeMap<String, u64>,
    /// Executions beyond the first, summed over parts.
    pub duplicates: u64,
    /// Parts with a result but no recorded execution (the counting itself failed).
    pub uncounted: u64,
    /// limit → (highest max concurrency seen among requests of that limit, requests of that limit).
    pub max_by_limit: BTreeMap<u32, (u32, u64)>,
    /// Requests whose handlers ran more at once than the limit.
    pub over_limit: Vec<String>,
    /// Requests `wait()` returned as completed.
    pub completed: u64,
    /// Requests that ended in another terminal state.
    pub not_completed: Vec<String>,
    /// Per listener: (name, requests seen exactly once, requests seen more than once, requests never
    /// seen, events for unknown requests, errors it recovered from).
    pub listeners: Vec<ListenerFigures>,
    /// `wait()` errors that were retried.
    pub wait_errors: u64,
    /// Token fields, list elements and `active` entries left once every request finished.
    pub tokens_outstanding: Vec<String>,
    /// Keys of the namespace left once retention had passed.
    pub keys_left: Vec<String>,
    /// Handlers still registered as running once every worker had stopped: the counting itself
    /// went wrong (say, a killed process's members were not removed), so its maxima are suspect.
    pub running_left: u64,
    /// Harness and process trouble: crashes, unclean exits.
    pub worker_problems: Vec<String>,
    /// From the last completion until the namespace was empty (retention plus expiry lag).
    pub keys_gone_after: Duration,
    /// How long the graceful stop of all workers took.
    pub stop_took: Duration,
    /// From the end of the run until recovery had taken every finished request out of the index.
    pub index_settled_after: Duration,
    /// Submit of the first request to completion of the last.
    pub run_took: Duration,
    /// The whole test, set-up and leak check included.
    pub total_took: Duration,
    /// Where the worker logs are.
    pub log_dir: PathBuf,
}

#[derive(Debug, Default, Clone)]
pub struct ListenerFigures {
    pub name: String,
    pub exactly_once: u64,
    pub repeated: u64,
    pub missing: u64,
    pub unknown: u64,
    pub errors: u64,
}

impl Figures {
    /// Every broken promise, in words; empty when the run passed.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.lost > 0 {
            p.push(format!(
                "{} sub-requests have no correct result; of them, errors: {:?}",
                self.lost, self.part_errors
            ));
        }
        if !self.over_limit.is_empty() {
            let shown = &self.over_limit[..self.over_limit.len().min(10)];
            p.push(format!(
                "concurrency limit exceeded by {} requests, first: {}",
                self.over_limit.len(),
                shown.join("; ")
            ));
        }
        if self.completed != self.requests {
            p.push(format!(
                "{} of {} requests completed; others: {}",
                self.completed,
                self.requests,
                self.not_completed[..self.not_completed.len().min(10)].join("; ")
            ));
        }
        for l in &self.listeners {
            if l.exactly_once != self.requests || l.unknown > 0 {
                p.push(format!(
                    "listener {} saw {} requests exactly once (want {}), {} more than once, {} never, {} unknown",
                    l.name, l.exactly_once, self.requests, l.repeated, l.missing, l.unknown
                ));
            }
        }
        for (limit, (max, _)) in &self.max_by_limit {
            if max < limit {
                p.push(format!(
                    "no request of limit {limit} ever ran {limit} handlers at once (at most {max}): \
                     this run could not have seen a violation of that limit"
                ));
            }
        }
        if self.running_left > 0 {
            p.push(format!(
                "{} handlers still counted as running after every worker stopped",
                self.running_left
            ));
        }
        if self.uncounted > 0 {
            p.push(format!("{} parts have a result but no recorded execution", self.uncounted));
        }
        if !self.tokens_outstanding.is_empty() {
            let shown = &self.tokens_outstanding[..self.tokens_outstanding.len().min(10)];
            p.push(format!("{} tokens not accounted for, first: {shown:?}", self.tokens_outstanding.len()));
        }
        if !self.keys_left.is_empty() {
            let shown = &self.keys_left[..self.keys_left.len().min(10)];
            p.push(format!("{} keys left after retention, first: {shown:?}", self.keys_left.len()));
        }
        p.extend(self.worker_problems.iter().cloned());
        p
    }

    /// Panics with every problem (and the figures) unless the run passed.
    pub fn assert_passed(&self) {
        let problems = self.problems();
        assert!(
            problems.is_empty(),
            "chaos[{}] failed (seed {}; worker logs in {}):\n- {}\n{self}",
            self.name,
            self.seed,
            self.log_dir.display(),
            problems.join("\n- ")
        );
    }
}

impl fmt::Display for Figures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "chaos[{}]: sub-requests={} kills={} restarts={}",
            self.name, self.sub_requests, self.worker_kills, self.worker_restarts
        )?;
        if self.redis_restarts > 0 {
            let at: Vec<String> =
                self.completed_at_restart.iter().map(|c| format!("{c}/{}", self.requests)).collect();
            write!(f, " redis_restarts={} (at {} completed)", self.redis_restarts, at.join(", "))?;
        }
        for fault in &self.cluster_faults {
            write!(f, " [{fault}]")?;
        }
        if let Some(p) = &self.proxy {
            write!(
                f,
                " proxy_cuts={} (connections cut {}) proxy_stalls={} connections={}",
                p.cuts, p.connections_cut, p.stalls, p.accepted
            )?;
        }
        let classes: Vec<String> =
            self.max_by_limit.iter().map(|(limit, (max, _))| format!("{max}/{limit}")).collect();
        write!(
            f,
            " lost={} duplicates={} max_concurrency_over_limit={} (max seen/limit: {}) terminal_records={}/{}",
            self.lost,
            self.duplicates,
            self.over_limit.len(),
            classes.join(" "),
            self.completed,
            self.requests
        )?;
        let listeners: Vec<String> = self
            .listeners
            .iter()
            .map(|l| format!("{}={}/{}", l.name, l.exactly_once, self.requests))
            .collect();
        let read_errors: Vec<String> = self.listeners.iter().map(|l| l.errors.to_string()).collect();
        write!(
            f,
            " listeners[{}] (read errors {}) tokens_outstanding={} keys_left={} orphaned_handlers={} \
             wait_errors={} elapsed={:.1?} (run {:.1?}, index settled after {:.1?}, stop {:.1?}, keys gone \
             after {:.1?}) seed={}",
            listeners.join(" "),
            read_errors.join("/"),
            self.tokens_outstanding.len(),
            self.keys_left.len(),
            self.orphans_removed,
            self.wait_errors,
            self.total_took,
            self.run_took,
            self.index_settled_after,
            self.stop_took,
            self.keys_gone_after,
            self.seed
        )
    }
}

/// One submitted request, as the checker needs it.
#[derive(Clone, Debug)]
struct Submitted {
    id: RequestId,
    r: u64,
    limit: u32,
}

/// Runs `scenario` and returns its figures; panics (with a diagnosis) only when the run does not
/// finish within its timeout or the set-up fails.
pub async fn run(scenario: Scenario) -> Figures {
    // Every step of a run is bounded on its own, but a bound can be missed (an await with none, a
    // blocking call): a run that outlives its scenario's timeout by far says where it was rather
    // than hang the suite. The run goes in a task of its own, so this clock keeps going even if
    // that task blocks its thread.
    // Built (or found up to date) first, bounded on its own: a build is not part of the run.
    worker_binary();
    let limit = scenario.timeout + Duration::from_secs(180);
    let (name, seed) = (scenario.name.clone(), scenario.seed);
    let phase = Phase::default();
    let mut task = tokio::spawn(run_phased(scenario, phase.clone()));
    match tokio::time::timeout(limit, &mut task).await {
        Ok(Ok(figures)) => figures,
        Ok(Err(e)) => std::panic::resume_unwind(e.into_panic()),
        Err(_) => {
            let (step, since) = phase.now();
            let why = format!(
                "chaos[{name}] hung: not done {limit:?} after it began, in step \"{step}\" for {since:?} (seed {seed})"
            );
            // Past the test harness's capture, so that it shows even if the panic cannot unwind.
            let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{why}\n").as_bytes());
            task.abort();
            panic!("{why}");
        }
    }
}

/// The step a run is in and since when; `SLUICEGATE_CHAOS_TRACE=1` also prints each step.
#[derive(Clone)]
struct Phase(Arc<Mutex<(&'static str, Instant)>>);

impl Default for Phase {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(("starting", Instant::now()))))
    }
}

impl Phase {
    fn set(&self, step: &'static str) {
        *self.0.lock().unwrap() = (step, Instant::now());
        if std::env::var("SLUICEGATE_CHAOS_TRACE").is_ok_and(|v| v == "1") {
            let _ =
                std::io::Write::write_all(&mut std::io::stderr(), format!("chaos step: {step}\n").as_bytes());
        }
    }

    fn now(&self) -> (&'static str, Duration) {
        let (step, since) = *self.0.lock().unwrap();
        (step, since.elapsed())
    }
}

async fn run_phased(scenario: Scenario, phase: Phase) -> Figures {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            // fred warns about every connection a fault closes: expected here, so quiet by default.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,fred=error".into()),
        )
        .with_test_writer()
        .try_init();
    let began = Instant::now();
    let s = scenario;
    let mut rng = StdRng::seed_from_u64(s.seed);
    let restart_at = match &s.fault {
        Fault::RedisRestart { at } => at.clone(),
        _ => Vec::new(),
    };
    let cluster_fault = match &s.fault {
        Fault::ClusterMasterRestart { at, down } => Some((*at, *down)),
        _ => None,
    };
    // Sluicegate's Redis in a single-Redis run; in a cluster run only the handlers' counters.
    phase.set("starting redis");
    let mut server = RedisServer::builder()
        .aof_always(!restart_at.is_empty())
        .start()
        .await
        .unwrap_or_else(|e| panic!("the chaos suite needs a redis-server of its own: {e}"));
    let mut cluster = match cluster_fault {
        Some(_) => Some(
            RedisCluster::builder()
                .aof_always(true)
                .start()
                .await
                .unwrap_or_else(|e| panic!("the cluster chaos run needs a local cluster: {e}")),
        ),
        None => None,
    };
    // The same across restarts: the server keeps its port. The counters live there.
    let server_url = server.url();
    // Where sluicegate's keys live: the server, or the cluster.
    let sg_url = cluster.as_ref().map_or_else(|| server_url.clone(), RedisCluster::url);
    let slug: String = s.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    let namespace = unique_namespace(&format!("chaos-{}", slug.trim_matches('-')));
    let proxy = match &s.fault {
        Fault::Proxy(_) => {
            let upstream: SocketAddr = format!("{}:{}", server.host(), server.port()).parse().unwrap();
            Some(Proxy::start(upstream).await.expect("proxy starts"))
        }
        _ => None,
    };
    let config = Config::new(sg_url.clone())
        .namespace(namespace.clone())
        .lease(LEASE)
        .heartbeat(HEARTBEAT)
        .recovery_interval(RECOVERY)
        .retention(s.retention)
        .wait_poll(WAIT_POLL);
    // Workers and the second listener go through the proxy when there is one. The producer
    // always connects directly: what is under test is the workers' side of the connection.
    let faulty_config = match &proxy {
        Some(p) => Config::new(p.url())
            .namespace(namespace.clone())
            .lease(LEASE)
            .heartbeat(HEARTBEAT)
            .recovery_interval(RECOVERY)
            .retention(s.retention)
            .wait_poll(WAIT_POLL),
        None => config.clone(),
    };
    let log_dir = std::env::temp_dir().join(format!("sluicegate-{namespace}"));
    std::fs::create_dir_all(&log_dir).expect("log dir");
    let settings = WorkerSettings {
        redis_url: faulty_config.url().to_owned(),
        counter_url: server_url.clone(),
        namespace: namespace.clone(),
        slots: s.slots,
        retention: s.retention,
        log_dir: log_dir.clone(),
    };

    phase.set("starting the workers");
    let pool = WorkerPool::start(settings, s.workers, rng.gen()).await;
    phase.set("connecting listeners and the producer");
    // Listening starts before the first submit, so each must see every completion.
    let stop_listening = CancellationToken::new();
    let (heard_direct, listen_direct) =
        spawn_listener(Listener::connect(&config).await.expect("listener"), stop_listening.clone());
    let second_name = if proxy.is_some() { "proxied" } else { "second" };
    let (heard_second, listen_second) =
        spawn_listener(Listener::connect(&faulty_config).await.expect("listener"), stop_listening.clone());
    let producer = Producer::connect(&config).await.expect("producer connects");

    // The fault. Kills run in the task that owns the workers; the proxy runs its own chaos.
    let stop_faults = CancellationToken::new();
    let pool_task = drive_workers(pool, &s.fault, stop_faults.clone(), rng.gen());
    if let (Some(p), Fault::Proxy(plan)) = (&proxy, &s.fault) {
        p.start_chaos(plan.clone());
    }

    let run_began = Instant::now();
    let progress = Progress::default();
    let completed = || progress.finished.lock().unwrap().len();
    phase.set("submitting");
    let (submitted, waiters) = submit_all(&producer, &s, &mut rng, &progress).await;

    // Until every request is done and both listeners heard of each; a watchdog fails the run early
    // when nothing completes for STALL_LIMIT (a lost token starves its request for good), and at
    // the scenario's timeout in any case.
    let mut completed_at_restart = Vec::new();
    let mut cluster_faults = Vec::new();
    let everything_done = async {
        if let (Some((share, down)), Some(cluster)) = (cluster_fault, cluster.as_mut()) {
            let due = ((s.requests as f64) * share).ceil() as usize;
            while completed() < due {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            completed_at_restart.push(completed());
            cluster_faults.push(restart_token_master(cluster, &sg_url, &namespace, down).await);
        }
        for share in &restart_at {
            let due = ((s.requests as f64) * share).ceil() as usize;
            while completed() < due {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            completed_at_restart.push(completed());
            // SIGKILL, like a crash: only what appendfsync=always made durable survives.
            server.kill().expect("kill redis");
            server.restart().await.expect("redis restarts");
        }
        let mut done = Vec::with_capacity(waiters.len());
        for w in waiters {
            done.push(w.await.expect("waiter task"));
        }
        while heard_direct.lock().unwrap().total < s.requests
            || heard_second.lock().unwrap().total < s.requests
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        done
    };
    let unknown_requests = progress.unknown.clone();
    let watchdog = async {
        let progress =
            || (completed(), heard_direct.lock().unwrap().total, heard_second.lock().unwrap().total);
        let (mut seen, mut since) = (progress(), Instant::now());
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let unknown = unknown_requests.lock().unwrap().clone();
            if !unknown.is_empty() {
                return format!(
                    "wait() found requests {unknown:?} unknown: lost, or their results expired before \
                     the producer could read them (retention {:?})",
                    s.retention
                );
            }
            if progress() != seen {
                (seen, since) = (progress(), Instant::now());
            } else if since.elapsed() > STALL_LIMIT {
                return format!("nothing completed for {STALL_LIMIT:?}");
            }
            if run_began.elapsed() > s.timeout {
                return format!("not done within {:?}", s.timeout);
            }
        }
    };
    phase.set("running (the watchdog is on)");
    let completions: Vec<Completion<u64>> = tokio::select! {
        done = everything_done => done,
        why = watchdog => {
            phase.set("diagnosing a stalled run");
            let unfinished: Vec<&Submitted> =
                submitted.iter().filter(|x| !progress.finished.lock().unwrap().contains(&x.r)).collect();
            let diagnosis =
                diagnose(&sg_url, &namespace, &unfinished, &submitted, s.requests, [&heard_direct, &heard_second]).await;
            panic!("chaos[{}] failed: {why} (seed {}):\n{diagnosis}\nworker logs in {}", s.name, s.seed, log_dir.display());
        }
    };
    let run_took = run_began.elapsed();
    let last_completion = Instant::now();

    // Faults off; give late duplicates (a second completion event, say) a moment to show.
    phase.set("stopping the faults");
    stop_faults.cancel();
    let mut pool = pool_task.await.expect("fault task");
    if let Some(p) = &proxy {
        p.stop_chaos().await;
        p.wait_unstalled().await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    phase.set("checking the workers are alive");
    pool.check_alive().await;

    phase.set("connecting the census");
    let client = connect_with_retry(&server_url).await;
    let sg_client = if sg_url == server_url { client.clone() } else { connect_with_retry(&sg_url).await };
    // With the workers still running: a worker killed while it finished a request leaves the last
    // steps of that finish (the request leaving the index) to recovery, which does them once the
    // dead worker is reaped, a lease and a beat later. Only then is the count final.
    phase.set("waiting for recovery to settle the index");
    let index_settled_after = wait_for_settled_index(&sg_client, &namespace).await;
    phase.set("counting tokens");
    let labelled: Vec<(u64, RequestId)> = submitted.iter().map(|s| (s.r, s.id.clone())).collect();
    let tokens_outstanding = crate::census::tokens_outstanding(&sg_client, &namespace, &labelled).await;
    phase.set("stopping the workers");
    let stop_took = pool.stop_all(Duration::from_secs(20)).await;
    let mut running_left = 0;
    for key in scan(&client, &format!("chaos:{namespace}:running:*")).await {
        running_left += client.zcard::<u64, _>(key).await.expect("ZCARD");
    }
    phase.set("stopping the listeners");
    stop_listening.cancel();
    let _ = listen_direct.await;
    let _ = listen_second.await;

    let mut f = Figures {
        name: s.name.clone(),
        seed: s.seed,
        requests: s.requests,
        sub_requests: s.requests * s.parts,
        worker_kills: pool.kills,
        worker_restarts: pool.restarts,
        orphans_removed: pool.orphans_removed,
        redis_restarts: completed_at_restart.len() as u64,
        completed_at_restart,
        cluster_faults,
        proxy: proxy.as_ref().map(Proxy::stats),
        wait_errors: progress.wait_errors.load(Ordering::Relaxed),
        tokens_outstanding,
        running_left,
        worker_problems: pool.problems.clone(),
        stop_took,
        index_settled_after,
        run_took,
        log_dir: log_dir.clone(),
        ..Figures::default()
    };
    phase.set("checking results and counters");
    check_results(&mut f, &s, &submitted, &completions);
    check_counters(&mut f, &client, &namespace, &s, &submitted, &completions).await;
    let ids: HashSet<String> = submitted.iter().map(|x| x.id.as_str().to_owned()).collect();
    for (name, heard) in [("direct", &heard_direct), (second_name, &heard_second)] {
        f.listeners.push(listener_figures(name, &heard.lock().unwrap(), &ids));
    }

    phase.set("waiting for the namespace to empty");
    (f.keys_left, f.keys_gone_after) =
        wait_for_empty_namespace(&sg_url, &namespace, last_completion, s.retention).await;
    let _ = client.quit().await;
    let _ = sg_client.quit().await;
    phase.set("stopping redis");
    drop(cluster);
    f.total_took = began.elapsed();
    if f.problems().is_empty() {
        let _ = std::fs::remove_dir_all(&log_dir);
    }
    f
}

/// SIGKILLs the master that owns the slot of the token lists (`{<ns>.q0}`), restarts it (same port,
/// directory, AOF and nodes.conf) after `down`, and waits until every node reports the cluster ok.
/// Returns what it did, for the figures.
async fn restart_token_master(cluster: &mut RedisCluster, sg_url: &str, ns: &str, down: Duration) -> String {
    let list = format!("{ns}:{{{ns}.q0}}:p:0");
    let slot = fred::util::redis_keyslot(list.as_bytes());
    let client = connect_with_retry(sg_url).await;
    let owner = client
        .cached_cluster_state()
        .and_then(|routing| routing.get_server(slot).map(|s| format!("redis://{}:{}", s.host, s.port)))
        .expect("the cluster client knows the owner of every slot");
    let _ = client.quit().await;
    let masters = cluster.masters().await.expect("CLUSTER NODES");
    assert!(masters.contains(&owner), "slot {slot} owner {owner} is not among the masters {masters:?}");
    let i = cluster.urls().iter().position(|u| *u == owner).expect("the owner is a node of ours");
    let began = Instant::now();
    cluster.node_mut(i).expect("a local node").kill().expect("kill the master");
    tokio::time::sleep(down).await;
    cluster.node_mut(i).expect("a local node").restart().await.expect("the master restarts");
    let restarted = began.elapsed();
    cluster.wait_until_ok(Duration::from_secs(30)).await.expect("the cluster is ok again");
    let after = cluster.masters().await.expect("CLUSTER NODES");
    assert_eq!(after, masters, "the restarted node kept its slots");
    format!(
        "master {owner} (slot {slot}, {{{ns}.q0}}) SIGKILLed, up again after {restarted:.1?}, cluster ok after {:.1?}",
        began.elapsed()
    )
}

/// Runs the fault on the worker processes (kills, when that is the fault) and checks on them, until
/// `stop`; then hands the pool back.
fn drive_workers(
    mut pool: WorkerPool,
    fault: &Fault,
    stop: CancellationToken,
    seed: u64,
) -> JoinHandle<WorkerPool> {
    let kill_every = match fault {
        Fault::KillWorkers { every } => Some(every.clone()),
        _ => None,
    };
    let mut rng = StdRng::seed_from_u64(seed);
    tokio::spawn(async move {
        loop {
            let pause = match &kill_every {
                Some(every) => random_duration(&mut rng, every),
                None => Duration::from_millis(500),
            };
            tokio::select! {
                () = stop.cancelled() => return pool,
                () = tokio::time::sleep(pause) => {}
            }
            pool.check_alive().await;
            if kill_every.is_some() {
                pool.kill_and_restart_random().await;
            }
        }
    })
}

/// What the waiters report while the run goes on.
#[derive(Default)]
struct Progress {
    /// Requests (by number) whose `wait()` returned.
    finished: Arc<Mutex<HashSet<u64>>>,
    /// `wait()` errors, each retried.
    wait_errors: Arc<AtomicU64>,
    /// Requests (by number) `wait()` found unknown: lost, or their results expired unread.
    unknown: Arc<Mutex<Vec<u64>>>,
}

/// Submits the workload, one request after the other, and waits for each in a task of its own.
async fn submit_all(
    producer: &Producer,
    s: &Scenario,
    rng: &mut StdRng,
    progress: &Progress,
) -> (Vec<Submitted>, Vec<JoinHandle<Completion<u64>>>) {
    let mut submitted = Vec::new();
    let mut waiters = Vec::new();
    for r in 0..s.requests {
        let parts: Vec<Part> = (0..s.parts)
            .map(|i| Part { n: r * s.parts + i, sleep_ms: rng.gen_range(0..=s.max_sleep_ms) })
            .collect();
        let limit = Scenario::limit(r);
        let handle = producer
            .request()
            .priority(Scenario::priority(r))
            .unwrap()
            .concurrency(limit)
            .unwrap()
            .submit(parts)
            .await
            .unwrap_or_else(|e| panic!("submit of request {r} failed: {e}"));
        submitted.push(Submitted { id: handle.id().clone(), r, limit });
        let (finished, wait_errors, unknown) =
            (progress.finished.clone(), progress.wait_errors.clone(), progress.unknown.clone());
        waiters.push(tokio::spawn(async move {
            loop {
                match handle.wait::<u64>().await {
                    Ok(done) => {
                        finished.lock().unwrap().insert(r);
                        return done;
                    }
                    Err(sluicegate::Error::UnknownRequest(_)) => {
                        // Final: the run fails, and its diagnosis says whether the listeners heard
                        // the request finish (its results expired unread) or not (it was lost).
                        unknown.lock().unwrap().push(r);
                        return std::future::pending().await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "wait failed; retrying");
                        wait_errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }));
    }
    (submitted, waiters)
}

/// Polls the index of active requests (token shard 0) until it is empty, for at most ten leases;
/// returns how long that took. What is still there after it is reported by the token census.
async fn wait_for_settled_index(client: &Client, ns: &str) -> Duration {
    let started = Instant::now();
    let active = format!("{ns}:{{{ns}.q0}}:active");
    while started.elapsed() < LEASE * 10 {
        if client.zcard::<u64, _>(&active).await.unwrap_or(1) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// Polls the namespace until it is empty or a retention (plus 10 s of slack for expiry) has passed
/// since `last_completion`. Returns what is left and when it was looked at.
async fn wait_for_empty_namespace(
    url: &str,
    ns: &str,
    last_completion: Instant,
    retention: Duration,
) -> (Vec<String>, Duration) {
    let deadline = last_completion + retention + Duration::from_secs(10);
    loop {
        let keys = keys_in_namespace(url, ns).await.expect("scan namespace");
        if keys.is_empty() || Instant::now() > deadline {
            return (keys, last_completion.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Lost parts and terminal states, from what `wait()` returned.
fn check_results(f: &mut Figures, s: &Scenario, submitted: &[Submitted], completions: &[Completion<u64>]) {
    for (sub, done) in submitted.iter().zip(completions) {
        if done.state == RequestState::Completed {
            f.completed += 1;
        } else {
            f.not_completed.push(format!("request {} ({}) ended {}", sub.r, sub.id, done.state));
        }
        for i in 0..s.parts {
            let expected = (sub.r * s.parts + i) * 3;
            match done.results.get(i as usize) {
                Some(Ok(v)) if *v == expected => {}
                Some(Err(e)) => {
                    f.lost += 1;
                    *f.part_errors.entry(e.message.chars().take(120).collect()).or_default() += 1;
                }
                _ => f.lost += 1,
            }
        }
    }
}

/// Duplicates and concurrency, from the handlers' own counters.
async fn check_counters(
    f: &mut Figures,
    client: &Client,
    namespace: &str,
    s: &Scenario,
    submitted: &[Submitted],
    completions: &[Completion<u64>],
) {
    for (sub, done) in submitted.iter().zip(completions) {
        let kid = sub.id.key_id();
        let max: Option<u32> = client.get(format!("chaos:{namespace}:max:{kid}")).await.expect("GET max");
        let max = max.unwrap_or(0);
        let executions: Vec<String> =
            client.smembers(format!("chaos:{namespace}:exec:{kid}")).await.expect("SMEMBERS exec");
        let mut per_index: HashMap<u64, u64> = HashMap::new();
        for e in &executions {
            if let Some(index) = e.split(':').next().and_then(|i| i.parse().ok()) {
                *per_index.entry(index).or_default() += 1;
            }
        }
        for i in 0..s.parts {
            let runs = per_index.get(&i).copied().unwrap_or(0);
            f.duplicates += runs.saturating_sub(1);
            if runs == 0 && matches!(done.results.get(i as usize), Some(Ok(_))) {
                f.uncounted += 1;
            }
        }
        let class = f.max_by_limit.entry(sub.limit).or_default();
        class.0 = class.0.max(max);
        class.1 += 1;
        if max > sub.limit {
            f.over_limit
                .push(format!("request {} ({}) ran {max} at once, limit {}", sub.r, sub.id, sub.limit));
        }
    }
}

fn listener_figures(name: &str, heard: &Heard, ids: &HashSet<String>) -> ListenerFigures {
    let mut l = ListenerFigures { name: name.to_owned(), errors: heard.errors, ..ListenerFigures::default() };
    for id in ids {
        match heard.by_request.get(id).copied().unwrap_or(0) {
            0 => l.missing += 1,
            1 => l.exactly_once += 1,
            _ => l.repeated += 1,
        }
    }
    l.unknown = heard.by_request.keys().filter(|id| !ids.contains(*id)).count() as u64;
    l
}

/// What a run that did not finish looks like: progress, and the state of the first unfinished
/// requests (their token fields say who holds what).
async fn diagnose(
    url: &str,
    ns: &str,
    unfinished: &[&Submitted],
    submitted: &[Submitted],
    requests: u64,
    heard: [&Arc<Mutex<Heard>>; 2],
) -> String {
    let mut out = format!(
        "{}/{requests} requests completed; the listeners heard {} and {}\n",
        requests - unfinished.len() as u64,
        heard[0].lock().unwrap().total,
        heard[1].lock().unwrap().total
    );
    let Ok(client) = tokio::time::timeout(Duration::from_secs(5), connect_with_retry(url)).await else {
        out.push_str("(redis unreachable for the diagnosis)");
        return out;
    };
    for sub in unfinished.iter().take(8) {
        let fields = sorted_hash(&client, &format!("{ns}:r:{{{}}}", sub.id.key_id())).await;
        let heard_by = heard.map(|h| h.lock().unwrap().by_request.get(sub.id.as_str()).copied().unwrap_or(0));
        out.push_str(&format!(
            "unfinished request {} ({}), limit {}, completion heard {heard_by:?} times: {fields:?}\n",
            sub.r, sub.id, sub.limit
        ));
    }
    // Completions a listener never heard: is the event in the stream, the request still active?
    const EVENTS_OF: &str = r"
        local out = {}
        for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
          local f = e[2]
          for i = 1, #f, 2 do
            if f[i] == 'rid' and f[i + 1] == ARGV[1] then table.insert(out, e[1]) end
            if f[i] == 'done' then
              for line in string.gmatch(f[i + 1], '[^\n]+') do
                if string.match(line, '^(.*)|') == ARGV[1] then table.insert(out, e[1]) end
              end
            end
          end
        end
        return out";
    let unheard = submitted
        .iter()
        .filter(|x| heard.iter().any(|h| !h.lock().unwrap().by_request.contains_key(x.id.as_str())));
    for sub in unheard.take(8) {
        let kid = sub.id.key_id();
        let events: Vec<String> = client
            .eval(EVENTS_OF, vec![format!("{ns}:{{{ns}.q0}}:events")], vec![kid.to_string()])
            .await
            .unwrap_or_default();
        let active: Option<f64> =
            client.zscore(format!("{ns}:{{{ns}.q0}}:active"), kid.to_string()).await.unwrap_or_default();
        let meta = sorted_hash(&client, &format!("{ns}:r:{{{kid}}}")).await;
        out.push_str(&format!(
            "unheard request {} ({}): events stream entries {events:?}, active score {active:?}, meta {meta:?}\n",
            sub.r, sub.id
        ));
    }
    for p in 0..100 {
        let len: i64 = client.llen(format!("{ns}:{{{ns}.q0}}:p:{p}")).await.unwrap_or(0);
        if len > 0 {
            out.push_str(&format!("list p:{p} holds {len} elements\n"));
        }
    }
    // Requests that took a lane: their records, and the lanes they are in (meta, the entries
    // naming them, the group's pending summary, the retry set).
    let mut lanes = std::collections::BTreeSet::new();
    for sub in unfinished.iter().take(8) {
        let kid = sub.id.key_id();
        let mut record = sorted_hash(&client, &format!("{ns}:{{{ns}.q0}}:s:{kid}")).await;
        record.retain(|(k, _)| !k.starts_with('o') && !k.starts_with('w'));
        out.push_str(&format!(
            "lane record of request {} (results and payloads left out): {record:?}\n",
            sub.r
        ));
        lanes.insert(Scenario::priority(sub.r));
    }
    const LANE_OF: &str = r"
        local out = {}
        for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
          local f = e[2]
          for i = 1, #f, 2 do
            if f[i] == 'r' then
              for _, kid in ipairs(ARGV) do
                if f[i + 1] == kid then table.insert(out, e[1] .. ' ' .. table.concat(f, ' ', 3)) end
              end
            end
          end
        end
        local pending = redis.call('XPENDING', KEYS[1], 'g')
        table.insert(out, 'pending ' .. tostring(pending[1]))
        for _, c in ipairs(pending[4] or {}) do table.insert(out, 'consumer ' .. c[1] .. ' ' .. c[2]) end
        local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
        for _, g in ipairs(groups) do
          for i = 1, #g, 2 do table.insert(out, 'group ' .. tostring(g[i]) .. '=' .. tostring(g[i + 1])) end
        end
        return out";
    let kids: Vec<String> = unfinished.iter().take(8).map(|s| s.id.key_id().to_string()).collect();
    for p in lanes {
        let lane = format!("{ns}:{{{ns}.q0}}:lane:{p}");
        let meta = sorted_hash(&client, &lane).await;
        let entries: Vec<String> =
            client.eval(LANE_OF, vec![format!("{lane}:s")], kids.clone()).await.unwrap_or_default();
        let retry: Vec<(String, f64)> =
            client.zrange(format!("{lane}:retry"), 0, -1, None, false, None, true).await.unwrap_or_default();
        out.push_str(&format!("lane {p}: meta {meta:?}\n  entries of those requests and the group: {entries:?}\n  retry set {retry:?}\n"));
    }
    out
}

/// A hash's fields and values, sorted by field (none if it cannot be read), for a diagnosis.
async fn sorted_hash(client: &Client, key: &str) -> Vec<(String, String)> {
    let mut fields: Vec<(String, String)> =
        client.hgetall::<HashMap<String, String>, _>(key).await.unwrap_or_default().into_iter().collect();
    fields.sort();
    fields
}
