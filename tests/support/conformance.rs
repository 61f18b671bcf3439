//! The conformance suite's harness: runs a scenario (`tests/conformance/*.json`) with the driver
//! of one language as producer and the drivers of another as workers, then checks what they
//! reported and logged against what the scenario implies (docs/conformance.md).
//!
//! The drivers are separate processes speaking only through Redis, the scenario file, the
//! producer's OUT file and the workers' shared LOG: the harness trusts nothing a driver claims
//! that it can check elsewhere (the terminal record is read back from Redis with `Admin`).

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::{json, Value};
use sluicegate::{Admin, Config, RequestId, RequestState};
use sluicegate_testkit::{keys_in_namespace, unique_namespace, TestBackend, Topology};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::logs::log_tail;

/// Which languages run (comma-separated); the default runs Rust and Python both ways.
const LANGS_ENV: &str = "SLUICEGATE_CONFORMANCE_LANGS";
const DEFAULT_LANGS: &str = "rust,python";
/// `SLUICEGATE_CONFORMANCE_DRIVER_<LANG>`: the command of a language's driver, split at spaces
/// (overrides the built-in Rust and Python ones; required for any other language).
const DRIVER_ENV_PREFIX: &str = "SLUICEGATE_CONFORMANCE_DRIVER_";

/// How long a worker may take to print `READY` (an interpreter starting on a busy machine).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// The producer's own `--timeout-s`, and the harness's limit on the whole producer process.
const PRODUCER_TIMEOUT_S: u64 = 60;
const PRODUCER_LIMIT: Duration = Duration::from_secs(90);
/// How long a worker may take to stop after SIGTERM (it lets its running handlers finish).
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// Scenarios

/// A scenario file: the drivers' keys (defaults as in the interface) and the harness's own.
#[derive(Deserialize, Debug, Clone)]
#[serde(default, deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    pub parts: u64,
    pub priority: u8,
    pub concurrency: u32,
    pub max_attempts: u32,
    pub fail_permanently: Vec<u64>,
    pub fail_times: HashMap<String, u32>,
    pub sleep_ms: u64,
    pub streamed: bool,
    pub chunk: usize,
    pub own_stream: bool,
    pub cancel_after_ms: Option<u64>,
    /// Only the harness reads this; drivers ignore it.
    pub harness: HarnessSetup,
    /// Where it was read from (not in the file).
    #[serde(skip)]
    pub path: PathBuf,
}

impl Default for Scenario {
    fn default() -> Self {
        Self {
            name: String::new(),
            parts: 0,
            priority: 50,
            concurrency: 1,
            max_attempts: 3,
            fail_permanently: Vec::new(),
            fail_times: HashMap::new(),
            sleep_ms: 0,
            streamed: false,
            chunk: 5,
            own_stream: false,
            cancel_after_ms: None,
            harness: HarnessSetup::default(),
            path: PathBuf::new(),
        }
    }
}

/// How the harness runs a scenario.
#[derive(Deserialize, Debug, Clone)]
#[serde(default, deny_unknown_fields)]
pub struct HarnessSetup {
    /// Worker processes (default 1).
    pub workers: usize,
    /// `--slots` of each (default 4).
    pub slots: usize,
    /// SIGKILL the first worker once it runs a part; its parts must run again on another.
    pub kill_one_worker: bool,
    /// Where the request must live, if the scenario is about it: `"lane"` (its priority's shared
    /// lane, a lane record `<ns>:{<ns>.q<s>}:s:<kid>`) or `"own"` (keys of its own,
    /// `<ns>:r:{<kid>}`), as in docs/protocol.md §3.
    pub placement: Option<String>,
}

impl Default for HarnessSetup {
    fn default() -> Self {
        Self { workers: 1, slots: 4, kill_one_worker: false, placement: None }
    }
}

/// What part `i` ends as, by the interface's handler rules.
#[derive(Debug, Clone, PartialEq)]
enum Expected {
    Done { result: Value, attempts: u32 },
    Dead { error: String, attempts: u32 },
}

impl Scenario {
    fn expected(&self, i: u64) -> Expected {
        if self.fail_permanently.contains(&i) {
            return Expected::Dead { error: format!("permanent {i}"), attempts: 1 };
        }
        let flaky = self.fail_times.get(&i.to_string()).copied().unwrap_or(0);
        if flaky >= self.max_attempts {
            let last = self.max_attempts;
            return Expected::Dead { error: format!("flaky {i} attempt {last}"), attempts: last };
        }
        Expected::Done {
            result: json!({"i": i, "double": 2 * i, "s": format!("part-{i}")}),
            attempts: flaky + 1,
        }
    }

    fn expected_state(&self) -> RequestState {
        if self.cancel_after_ms.is_some() {
            RequestState::Cancelled
        } else if (0..self.parts).any(|i| matches!(self.expected(i), Expected::Dead { .. })) {
            RequestState::Failed
        } else {
            RequestState::Completed
        }
    }

    /// Whether the runs of the request must reach its limit at some instant: it has enough parts
    /// and they take long enough for the tokens to overlap.
    fn must_reach_limit(&self) -> bool {
        self.parts >= u64::from(self.concurrency) && self.sleep_ms > 0
    }
}

/// Every scenario of `tests/conformance/`, by name.
pub fn scenarios() -> Vec<Scenario> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/conformance");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    paths.sort();
    let all: Vec<Scenario> = paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let mut s: Scenario =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(!s.name.is_empty(), "{}: a scenario needs a name", path.display());
            s.path = path;
            s
        })
        .collect();
    assert!(all.len() >= 10, "only {} scenarios in {}", all.len(), dir.display());
    all
}

// ---------------------------------------------------------------------------------------------
// Drivers

/// The command of a language's driver: program and leading arguments.
#[derive(Debug, Clone)]
pub struct Driver {
    pub lang: String,
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

/// The languages `SLUICEGATE_CONFORMANCE_LANGS` selects.
pub fn selected_langs() -> Vec<String> {
    let text = std::env::var(LANGS_ENV).ok().filter(|v| !v.trim().is_empty());
    let text = text.as_deref().unwrap_or(DEFAULT_LANGS);
    let mut langs: Vec<String> = Vec::new();
    for lang in text.split(',').map(|l| l.trim().to_ascii_lowercase()).filter(|l| !l.is_empty()) {
        if !langs.contains(&lang) {
            langs.push(lang);
        }
    }
    langs
}

/// The driver of `lang`: `SLUICEGATE_CONFORMANCE_DRIVER_<LANG>` if set, else the built-in one
/// (Rust: the test kit's `conformance` binary, built now; Python: the client's driver in the
/// venv of `./test.sh`). Panics, saying what to do, when it cannot be run.
pub async fn driver(lang: &str) -> Driver {
    let var = format!("{DRIVER_ENV_PREFIX}{}", lang.to_ascii_uppercase());
    if let Some(command) = std::env::var(&var).ok().filter(|v| !v.trim().is_empty()) {
        let mut words = command.split_whitespace();
        let program = PathBuf::from(words.next().unwrap());
        return Driver { lang: lang.into(), program, args: words.map(OsString::from).collect() };
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    match lang {
        "rust" => {
            // tests/bin/conformance.rs, which `cargo test` builds with the tests.
            let program = PathBuf::from(env!("CARGO_BIN_EXE_sluicegate-conformance"));
            Driver { lang: lang.into(), program, args: Vec::new() }
        }
        "python" => {
            let python = root.join("target/py-venv/bin/python");
            let script = root.join("clients/python/tests/conformance_driver.py");
            for needed in [&python, &script] {
                assert!(
                    needed.is_file(),
                    "the Python conformance driver cannot run: {} is missing; run ./test.sh to create \
                     target/py-venv (with the Python client of clients/python installed in it), or leave \
                     Python out with {LANGS_ENV}=rust",
                    needed.display()
                );
            }
            Driver { lang: lang.into(), program: python, args: vec![script.into_os_string()] }
        }
        other => panic!(
            "no driver for {other:?}: set {var} to its command (see docs/conformance.md), or leave it out \
             of {LANGS_ENV}"
        ),
    }
}

impl Driver {
    fn command(&self, role: &str) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args).arg(role).stdin(Stdio::null()).kill_on_drop(true);
        cmd
    }
}

// ---------------------------------------------------------------------------------------------
// Running a pair

/// Runs every scenario with a `producer` driver and `workers` drivers on a fresh backend of
/// `topology`, the scenarios at once (each in its own namespace), and fails with every problem
/// found. Skipped (with a line on stdout) when a language is not selected.
pub async fn run_pair(topology: Topology, producer: &str, workers: &str) {
    let langs = selected_langs();
    if !langs.iter().any(|l| l == producer) || !langs.iter().any(|l| l == workers) {
        println!("skipped: {producer} producer with {workers} workers ({LANGS_ENV}={})", langs.join(","));
        return;
    }
    run_pairs(topology, &[(producer.to_owned(), workers.to_owned())]).await;
}

/// Every pair of selected languages that involves one other than Rust and Python.
pub async fn run_other_pairs(topology: Topology) {
    let langs = selected_langs();
    let builtin = |l: &String| l == "rust" || l == "python";
    let mut pairs = Vec::new();
    for p in &langs {
        for w in &langs {
            if !builtin(p) || !builtin(w) {
                pairs.push((p.clone(), w.clone()));
            }
        }
    }
    if pairs.is_empty() {
        println!("no language beside rust and python selected ({LANGS_ENV}={})", langs.join(","));
        return;
    }
    run_pairs(topology, &pairs).await;
}

async fn run_pairs(topology: Topology, pairs: &[(String, String)]) {
    let scenarios = scenarios();
    let backend = TestBackend::start(topology).await.unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    for (producer, workers) in pairs {
        let (p, w) = (driver(producer).await, driver(workers).await);
        let started = Instant::now();
        let runs = scenarios.iter().map(|s| run_scenario(&backend, topology, s, &p, &w));
        let outcomes = futures::future::join_all(runs).await;
        println!(
            "{topology}: {producer} producer, {workers} workers: {} scenarios in {:.1} s",
            scenarios.len(),
            started.elapsed().as_secs_f64()
        );
        for (s, outcome) in scenarios.iter().zip(outcomes) {
            if let Err(problems) = outcome {
                failures.push(format!("{producer} producer, {workers} workers, {}:\n  {problems}", s.name));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{topology}: {} scenario runs failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A worker process and what the harness knows of it.
struct WorkerProc {
    child: Child,
    pid: u32,
    stderr: PathBuf,
}

/// One scenario run; `Err` lists every problem (with the paths of the run's files to look at).
async fn run_scenario(
    backend: &TestBackend,
    topology: Topology,
    s: &Scenario,
    producer: &Driver,
    workers: &Driver,
) -> Result<(), String> {
    let ns = unique_namespace(&format!("conf-{}", s.name.replace('_', "-")));
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("conformance-{topology}-{}-{}-{ns}", producer.lang, workers.lang));
    std::fs::create_dir_all(&dir).unwrap();
    let result = run_in(backend, s, producer, workers, &ns, &dir).await;
    match result {
        Ok(()) => {
            let _ = std::fs::remove_dir_all(&dir);
            Ok(())
        }
        Err(problems) => Err(format!("{} (files in {})", problems.join("\n  "), dir.display())),
    }
}

async fn run_in(
    backend: &TestBackend,
    s: &Scenario,
    producer: &Driver,
    workers: &Driver,
    ns: &str,
    dir: &Path,
) -> Result<(), Vec<String>> {
    let url = backend.url();
    let log = dir.join("events.jsonl");
    let out = dir.join("out.json");
    let mut problems = Vec::new();

    let mut procs = Vec::new();
    for n in 0..s.harness.workers.max(1) {
        procs.push(start_worker(workers, url, ns, s, &log, &dir.join(format!("worker-{n}.stderr"))).await?);
    }

    let producer_err = dir.join("producer.stderr");
    let mut cmd = producer.command("producer");
    cmd.arg("--url")
        .arg(url)
        .arg("--namespace")
        .arg(ns)
        .arg("--scenario")
        .arg(&s.path)
        .arg("--out")
        .arg(&out)
        .arg("--timeout-s")
        .arg(PRODUCER_TIMEOUT_S.to_string())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&producer_err).unwrap());
    let mut child = cmd.spawn().map_err(|e| vec![format!("starting the {} producer: {e}", producer.lang)])?;

    // The kill: the first worker, once a round of parts has ended (so every slot got going and
    // the limit was reached) and the log shows it running a part.
    let mut killed: Option<(u32, u64)> = None;
    if s.harness.kill_one_worker {
        let victim = procs[0].pid;
        let deadline = Instant::now() + PRODUCER_LIMIT;
        loop {
            let events = read_log(&log);
            let ended = events.iter().filter(|e| e.ev == "end").count();
            let running = events
                .iter()
                .filter(|e| e.pid == victim)
                .fold(0i64, |n, e| n + if e.ev == "start" { 1 } else { -1 });
            if running > 0 && ended >= s.concurrency as usize {
                procs[0].child.start_kill().unwrap();
                let _ = procs[0].child.wait().await;
                killed = Some((victim, now_us()));
                break;
            }
            if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
                problems.push(format!("worker {victim} (the one to kill) never ran a part"));
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    let status = match tokio::time::timeout(PRODUCER_LIMIT, child.wait()).await {
        Ok(status) => status.map_err(|e| e.to_string()),
        Err(_) => {
            let _ = child.start_kill();
            Err(format!("still running after {PRODUCER_LIMIT:?}"))
        }
    };
    match status {
        Ok(st) if st.success() => {}
        Ok(st) => problems.push(format!("producer failed ({st}): {}", log_tail(&producer_err, 10))),
        Err(e) => problems.push(format!("producer: {e}: {}", log_tail(&producer_err, 10))),
    }

    // Graceful stop of every worker still alive: exit 0 within the limit.
    for p in procs.iter_mut().filter(|p| killed.map_or(true, |(pid, _)| pid != p.pid)) {
        let _ = std::process::Command::new("kill").arg("-TERM").arg(p.pid.to_string()).status();
    }
    for p in procs.iter_mut().filter(|p| killed.map_or(true, |(pid, _)| pid != p.pid)) {
        match tokio::time::timeout(STOP_TIMEOUT, p.child.wait()).await {
            Ok(Ok(st)) if st.success() => {}
            Ok(Ok(st)) => problems.push(format!(
                "worker {} exited with {st} after SIGTERM: {}",
                p.pid,
                log_tail(&p.stderr, 10)
            )),
            Ok(Err(e)) => problems.push(format!("worker {}: {e}", p.pid)),
            Err(_) => {
                let _ = p.child.start_kill();
                problems.push(format!("worker {} still running {STOP_TIMEOUT:?} after SIGTERM", p.pid));
            }
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }

    let report = match std::fs::read_to_string(&out)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str::<Report>(&t).map_err(|e| format!("{e} in {t:?}")))
    {
        Ok(r) => r,
        Err(e) => return Err(vec![format!("producer's OUT {}: {e}", out.display())]),
    };
    let events = read_log(&log);
    check_report(s, &report, &mut problems);
    check_events(s, &report, &events, killed, &mut problems);
    check_record(url, ns, s, &report, &mut problems).await;
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

async fn start_worker(
    driver: &Driver,
    url: &str,
    ns: &str,
    s: &Scenario,
    log: &Path,
    stderr: &Path,
) -> Result<WorkerProc, Vec<String>> {
    let mut cmd = driver.command("worker");
    cmd.arg("--url")
        .arg(url)
        .arg("--namespace")
        .arg(ns)
        .arg("--scenario")
        .arg(&s.path)
        .arg("--log")
        .arg(log)
        .arg("--slots")
        .arg(s.harness.slots.to_string())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(stderr).unwrap());
    let mut child = cmd.spawn().map_err(|e| vec![format!("starting a {} worker: {e}", driver.lang)])?;
    let pid = child.id().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let ready = tokio::time::timeout(READY_TIMEOUT, async {
        loop {
            line.clear();
            match stdout.read_line(&mut line).await {
                Ok(0) | Err(_) => return false,
                Ok(_) if line.trim() == "READY" => return true,
                Ok(_) => continue,
            }
        }
    })
    .await;
    if ready != Ok(true) {
        let _ = child.start_kill();
        return Err(vec![format!(
            "the {} worker did not print READY within {READY_TIMEOUT:?}: {}",
            driver.lang,
            log_tail(stderr, 10)
        )]);
    }
    // Keep reading stdout, so a chatty driver never blocks on a full pipe.
    tokio::spawn(async move {
        let mut sink = String::new();
        while stdout.read_line(&mut sink).await.is_ok_and(|n| n > 0) {
            sink.clear();
        }
    });
    Ok(WorkerProc { child, pid, stderr: stderr.to_path_buf() })
}

// ---------------------------------------------------------------------------------------------
// Checks

/// The producer's OUT file.
#[derive(Deserialize, Debug)]
struct Report {
    id: String,
    state: String,
    results: Vec<Value>,
    errors: BTreeMap<String, String>,
}

/// One line of the workers' LOG.
#[derive(Deserialize, Debug, Clone)]
struct Event {
    ev: String,
    rid: String,
    i: u64,
    attempt: u32,
    t_us: u64,
    pid: u32,
}

fn read_log(path: &Path) -> Vec<Event> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    // A line a killed process left half-written has no newline; it cannot parse and is skipped.
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// State, results in order, errors naming their parts.
fn check_report(s: &Scenario, report: &Report, problems: &mut Vec<String>) {
    let expected_state = s.expected_state();
    if report.state != expected_state.as_str() {
        problems.push(format!("state {:?}, expected {:?}", report.state, expected_state.as_str()));
    }
    if report.results.len() as u64 != s.parts {
        problems.push(format!("{} results for {} parts", report.results.len(), s.parts));
        return;
    }
    let cancelled = expected_state == RequestState::Cancelled;
    let mut expected_errors = BTreeMap::new();
    for (i, got) in (0..s.parts).zip(&report.results) {
        match s.expected(i) {
            // A cancelled request's parts either finished before the cancel or have no result.
            Expected::Done { result, .. } if cancelled => {
                if !got.is_null() && *got != result {
                    problems.push(format!("part {i}: result {got}, expected {result} or null"));
                }
            }
            Expected::Done { result, .. } => {
                if *got != result {
                    problems.push(format!("part {i}: result {got}, expected {result}"));
                }
            }
            Expected::Dead { error, .. } => {
                if !got.is_null() {
                    problems.push(format!("part {i}: result {got}, expected null (it fails)"));
                }
                expected_errors.insert(i.to_string(), error);
            }
        }
    }
    if cancelled && report.results.iter().all(|r| !r.is_null()) {
        problems.push("cancelled, yet every part has a result (the cancel came too late to test)".into());
    }
    // A cancelled request's parts that never ran may carry an entry saying so (the Python client
    // reports `no result recorded (request cancelled)`, as the Rust library's `PartError` does;
    // the Rust driver leaves them out): allowed on a part without a result, nowhere else.
    let errors: BTreeMap<String, String> = report
        .errors
        .iter()
        .filter(|(index, message)| {
            let unrun = cancelled
                && !expected_errors.contains_key(*index)
                && index
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| report.results.get(i))
                    .is_some_and(Value::is_null)
                && !message.is_empty();
            !unrun
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if errors != expected_errors {
        problems.push(format!("errors {:?}, expected {:?}", report.errors, expected_errors));
    }
}

/// From the workers' log: one request, the limit (never exceeded, reached), attempts per part,
/// and after a kill, the killed worker's parts run again elsewhere.
fn check_events(
    s: &Scenario,
    report: &Report,
    events: &[Event],
    killed: Option<(u32, u64)>,
    problems: &mut Vec<String>,
) {
    if let Some(e) = events.iter().find(|e| e.rid != report.id) {
        problems.push(format!("the log names request {:?}, not {:?}: {e:?}", e.rid, report.id));
        return;
    }
    if let Some(e) = events.iter().find(|e| e.ev != "start" && e.ev != "end") {
        problems.push(format!("unknown event {:?}", e.ev));
        return;
    }

    // Runs: a start and its end, by (pid, part, attempt). A run of the killed worker without an
    // end ended when it was killed.
    let mut runs: BTreeMap<(u32, u64, u32), (u64, Option<u64>)> = BTreeMap::new();
    for e in events {
        let run = runs.entry((e.pid, e.i, e.attempt)).or_insert((u64::MAX, None));
        if e.ev == "start" {
            run.0 = run.0.min(e.t_us);
        } else {
            run.1 = Some(e.t_us);
        }
    }
    let mut edges = Vec::new();
    for (&(pid, i, attempt), &(start, end)) in &runs {
        if start == u64::MAX {
            problems.push(format!("part {i} attempt {attempt} on {pid}: an end without a start"));
            continue;
        }
        let end = match (end, killed) {
            (Some(end), _) => end,
            (None, Some((victim, at))) if victim == pid => at,
            (None, _) => {
                problems.push(format!("part {i} attempt {attempt} on {pid}: started, never ended"));
                continue;
            }
        };
        // Ends sort before starts at the same instant: a token handed over is not an overlap.
        edges.push((start, 1i64));
        edges.push((end, -1i64));
    }
    edges.sort();
    let (mut now, mut max) = (0i64, 0i64);
    for (_, d) in edges {
        now += d;
        max = max.max(now);
    }
    let limit = i64::from(s.concurrency);
    if max > limit {
        problems.push(format!("limit exceeded: {max} runs at once, limit {limit}"));
    }
    if s.must_reach_limit() && max < limit {
        problems.push(format!("limit never reached: at most {max} runs at once, limit {limit}"));
    }

    // Attempts per part: each part's runs are attempts 1..=n with n as the handler rules say
    // (a kill adds re-runs; a cancel leaves parts unrun).
    let mut attempts: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
    for &(_, i, attempt) in runs.keys() {
        attempts.entry(i).or_default().insert(attempt);
    }
    if let Some(&i) = attempts.keys().find(|&&i| i >= s.parts) {
        problems.push(format!("part {i} ran, but the request has {} parts", s.parts));
    }
    let cancelled = s.expected_state() == RequestState::Cancelled;
    for i in 0..s.parts {
        let ran = attempts.get(&i).cloned().unwrap_or_default();
        let want = match s.expected(i) {
            Expected::Done { attempts, .. } | Expected::Dead { attempts, .. } => attempts,
        };
        let consecutive = ran.iter().copied().eq(1..=ran.len() as u32);
        if cancelled {
            if !consecutive || ran.len() as u32 > want {
                problems.push(format!("part {i} ran attempts {ran:?}; at most 1..={want} expected"));
            }
        } else if killed.is_some() {
            // A kill may cost an attempt that never logged a start (the part was delivered to the
            // killed worker's slot, not yet begun): then the logged attempts start above 1.
            let ended = runs.iter().any(|(&(_, j, _), &(_, end))| j == i && end.is_some());
            let last = ran.iter().next_back().copied().unwrap_or(0);
            if !ended || last > s.max_attempts || (ran.len() as u32) < want {
                problems.push(format!(
                    "part {i} ran attempts {ran:?} (ended: {ended}); at least {want}, at most attempt {} expected",
                    s.max_attempts
                ));
            }
        } else if ran.len() as u32 != want || !consecutive {
            problems.push(format!("part {i} ran attempts {ran:?}; expected 1..={want}"));
        }
    }

    // After the kill: every part the killed worker left unfinished started again on another.
    if let Some((victim, _)) = killed {
        let orphans: Vec<(u64, u32)> = runs
            .iter()
            .filter(|(&(pid, _, _), &(_, end))| pid == victim && end.is_none())
            .map(|(&(_, i, attempt), _)| (i, attempt))
            .collect();
        if orphans.is_empty() {
            problems.push(format!("the killed worker {victim} left no part unfinished"));
        }
        for (i, attempt) in orphans {
            let rerun = runs.keys().any(|&(pid, j, a)| pid != victim && j == i && a > attempt);
            if !rerun {
                problems.push(format!("part {i}, cut off by the kill at attempt {attempt}, never ran again"));
            }
        }
    }
}

/// The terminal record in Redis, read back with `Admin`, agrees with the report and the scenario.
async fn check_record(url: &str, ns: &str, s: &Scenario, report: &Report, problems: &mut Vec<String>) {
    let admin = match Admin::connect(&Config::new(url).namespace(ns)).await {
        Ok(a) => a,
        Err(e) => return problems.push(format!("admin: {e}")),
    };
    let id = match RequestId::new(report.id.clone()) {
        Ok(id) => id,
        Err(e) => return problems.push(format!("the reported id {:?}: {e}", report.id)),
    };
    let status = match admin.status(&id).await {
        Ok(st) => st,
        Err(e) => return problems.push(format!("status of {id}: {e}")),
    };
    let state = s.expected_state();
    let failed = (0..s.parts).filter(|&i| matches!(s.expected(i), Expected::Dead { .. })).count() as u64;
    let mut want = vec![
        ("state", status.state.as_str().to_owned(), state.as_str().to_owned()),
        ("priority", status.priority.to_string(), s.priority.to_string()),
        ("concurrency", status.concurrency.to_string(), s.concurrency.to_string()),
        ("total", status.total.to_string(), s.parts.to_string()),
    ];
    if state != RequestState::Cancelled {
        want.push(("done", status.done.to_string(), s.parts.to_string()));
        want.push(("failed", status.failed.to_string(), failed.to_string()));
    }
    if state != RequestState::Cancelled && !s.harness.kill_one_worker {
        // The record's own count of attempts agrees with the handler rules (retry: 3; 1 when
        // every part succeeded at once).
        let most = (0..s.parts)
            .map(|i| match s.expected(i) {
                Expected::Done { attempts, .. } | Expected::Dead { attempts, .. } => attempts,
            })
            .max()
            .unwrap_or(0);
        want.push(("max_attempts_seen", status.max_attempts_seen.to_string(), most.to_string()));
    }
    for (what, got, expected) in want {
        if got != expected {
            problems.push(format!("terminal record: {what} {got}, expected {expected}"));
        }
    }

    if let Some(placement) = &s.harness.placement {
        let keys = match keys_in_namespace(url, ns).await {
            Ok(keys) => keys,
            Err(e) => return problems.push(format!("listing the namespace's keys: {e}")),
        };
        let kid = id.key_id();
        let own = keys.iter().any(|k| *k == format!("{ns}:r:{{{kid}}}"));
        let lane = keys
            .iter()
            .any(|k| k.starts_with(&format!("{ns}:{{{ns}.q")) && k.ends_with(&format!(":s:{kid}")));
        let found = match (own, lane) {
            (true, false) => "own",
            (false, true) => "lane",
            (false, false) => "neither",
            (true, true) => "both",
        };
        if found != placement {
            problems
                .push(format!("the request has keys of kind {found:?}, expected {placement:?}: {keys:?}"));
        }
    }
}
