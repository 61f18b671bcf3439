//! A storm of SIGKILLs at the default settings (issue 11, point 3): three `sluicegate worker --exec`
//! processes of four slots, with no timing flags at all, one of them SIGKILLed (and started again)
//! every 0.3 to 0.7 s, while 20 requests of 50 parts (limits 1 to 3) run. Every request must finish
//! with exact results, well within the bound, and at no instant may more handlers of a request run
//! under live workers than its limit.
//!
//! ```text
//! cargo test -p sluicegate-cli --test storm -- --nocapture
//! ```

#![allow(unreachable_pub, clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::Rng;
use sluicegate::{Config, Producer};
use sluicegate_testkit::{unique_namespace, RedisServer};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");
const WORKERS: usize = 3;
const REQUESTS: u64 = 20;
const PARTS: u64 = 50;
/// The bound of the issue: every request finished within this, from the first submit.
const BOUND: Duration = Duration::from_secs(120);

struct Workers {
    url: String,
    ns: String,
    log: String,
    procs: Vec<Child>,
    /// Every worker pid, with when it was started and (if it was) SIGKILLed.
    lives: HashMap<u32, (Instant, Option<Instant>)>,
    kills: u32,
}

impl Workers {
    fn spawn(&mut self) -> Child {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/triple.sh");
        let child = Command::new(BIN)
            .env_remove("REDIS_URL")
            .env("STORM_LOG", &self.log)
            .args(["--redis", &self.url, "--namespace", &self.ns, "worker", "--slots", "4", "--exec"])
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.lives.insert(child.id(), (Instant::now(), None));
        child
    }

    fn kill_one(&mut self, rng: &mut impl Rng) {
        let i = rng.gen_range(0..self.procs.len());
        let _ = self.procs[i].kill();
        let _ = self.procs[i].wait();
        if let Some(life) = self.lives.get_mut(&self.procs[i].id()) {
            life.1 = Some(Instant::now());
        }
        self.kills += 1;
        self.procs[i] = self.spawn();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.kill();
            let _ = p.wait();
        }
    }
}

/// One handler run, from the script's log: its request, its worker's pid, when it started and
/// ended (ns since the Unix epoch; a run SIGKILLed with its worker has no end).
struct Run {
    request: String,
    pid: u32,
    start: u128,
    end: Option<u128>,
}

fn runs(log: &str) -> Vec<Run> {
    let mut open: HashMap<(String, String, String, u32), u128> = HashMap::new();
    let mut out = Vec::new();
    for line in log.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [what, request, index, attempt, pid, at] = f[..] else { continue };
        let key = (request.to_owned(), index.to_owned(), attempt.to_owned(), pid.parse().unwrap_or(0));
        let at: u128 = at.parse().unwrap_or(0);
        match what {
            "start" => {
                open.insert(key, at);
            }
            "end" => {
                if let Some(start) = open.remove(&key) {
                    out.push(Run { request: key.0, pid: key.3, start, end: Some(at) });
                }
            }
            _ => {}
        }
    }
    out.extend(open.into_iter().map(|(k, start)| Run { request: k.0, pid: k.3, start, end: None }));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_sigkills_at_the_default_settings_loses_nothing_and_keeps_every_limit() {
    let redis = RedisServer::start().await.unwrap();
    let ns = unique_namespace("storm");
    let dir = std::env::temp_dir().join(format!("sluicegate-{ns}"));
    fs::create_dir_all(&dir).unwrap();
    let log = dir.join("runs.log").display().to_string();
    let mut workers = Workers {
        url: redis.url(),
        ns: ns.clone(),
        log: log.clone(),
        procs: Vec::new(),
        lives: HashMap::new(),
        kills: 0,
    };
    for _ in 0..WORKERS {
        let child = workers.spawn();
        workers.procs.push(child);
    }
    // The default settings: lease 2 s, heartbeat 500 ms, recovery interval 200 ms.
    let config = Config::new(redis.url()).namespace(&ns);
    let producer = Producer::connect(&config).await.unwrap();
    let started = Instant::now();
    let mut handles = Vec::new();
    let mut limits = BTreeMap::new();
    for r in 0..REQUESTS {
        let limit = 1 + (r % 3) as u32;
        let parts: Vec<u64> = (0..PARTS).map(|i| r * 1000 + i).collect();
        let h = producer.request().concurrency(limit).unwrap().submit(parts).await.unwrap();
        limits.insert(h.id().to_string(), limit);
        handles.push((r, h));
    }
    let waits = tokio::spawn(async move {
        let mut done = Vec::new();
        for (r, h) in handles {
            let completion = h.wait_timeout::<u64>(BOUND).await;
            done.push((r, h.id().to_string(), completion));
        }
        done
    });
    let mut rng = rand::thread_rng();
    while !waits.is_finished() && started.elapsed() < BOUND + Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..=700))).await;
        workers.kill_one(&mut rng);
    }
    let done = waits.await.unwrap();
    let elapsed = started.elapsed();
    let mut wrong = Vec::new();
    for (r, id, completion) in &done {
        match completion {
            Ok(c) => {
                let outputs: Vec<u64> = c.results.iter().map(|o| *o.as_ref().unwrap_or(&u64::MAX)).collect();
                let want: Vec<u64> = (0..PARTS).map(|i| (r * 1000 + i) * 3).collect();
                if outputs != want {
                    wrong.push(format!("request {r} ({id}): {:?}", c.state));
                }
            }
            Err(e) => wrong.push(format!("request {r} ({id}): {e}")),
        }
    }
    // The limit, among handlers whose worker was alive: a run counts from its start to its end, or
    // to its worker's death (a SIGKILLed worker's running commands are orphaned, and their leases
    // gone: they are the at-least-once window of the contract).
    let lives = workers.lives.clone();
    let kills = workers.kills;
    drop(workers);
    let text = fs::read_to_string(&log).unwrap();
    let mut over = Vec::new();
    let mut events: HashMap<String, Vec<(u128, i32)>> = HashMap::new();
    let epoch = |t: Instant| -> u128 {
        let now_ns = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        now_ns - Instant::now().duration_since(t).as_nanos()
    };
    for run in runs(&text) {
        let died = lives.get(&run.pid).and_then(|l| l.1).map(epoch);
        let end = match (run.end, died) {
            (Some(e), Some(d)) => e.min(d),
            (Some(e), None) => e,
            (None, Some(d)) => d,
            (None, None) => continue,
        };
        if end <= run.start {
            continue;
        }
        events.entry(run.request.clone()).or_default().extend([(run.start, 1), (end, -1)]);
    }
    for (request, mut ev) in events {
        ev.sort();
        let (mut now, mut max) = (0, 0);
        for (_, d) in ev {
            now += d;
            max = max.max(now);
        }
        let limit = limits.get(&request).copied().unwrap_or(0) as i32;
        if max > limit {
            over.push(format!("{request}: {max} at once, limit {limit}"));
        }
    }
    println!(
        "storm: requests={REQUESTS} parts={} kills={kills} elapsed={elapsed:.1?} runs={} wrong={} over_limit={}",
        REQUESTS * PARTS,
        text.lines().filter(|l| l.starts_with("start")).count(),
        wrong.len(),
        over.len()
    );
    let _ = fs::remove_dir_all(&dir);
    assert!(wrong.is_empty(), "requests without their exact results within {BOUND:?}: {wrong:#?}");
    assert!(over.is_empty(), "limits exceeded by handlers of live workers: {over:#?}");
    assert!(elapsed < BOUND, "the storm took {elapsed:?}");
}
