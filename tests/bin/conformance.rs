//! The Rust driver of the conformance suite (`tests/conformance.rs`, docs/conformance.md): one
//! program that plays either side of a scenario with the sluicegate library, so that a producer
//! and workers written in different languages can be run against each other.
//!
//! ```text
//! conformance producer --url URL --namespace NS --scenario FILE --out OUT [--timeout-s 60]
//! conformance worker   --url URL --namespace NS --scenario FILE --log LOG [--slots 4]
//! ```
//!
//! The scenario is a JSON file (`tests/conformance/*.json`); keys it does not know (the harness's
//! own, under `"harness"`) are ignored. Every driver, in every language, implements exactly this:
//!
//! - Part `i`'s payload is `{"i": i, "s": "part-<i>"}`.
//! - The handler sleeps `sleep_ms`; then part `i` at attempt `a` fails permanently with
//!   `permanent <i>` if `i` is in `fail_permanently`, fails retryably with `flaky <i> attempt <a>`
//!   while `a <= fail_times["<i>"]`, and otherwise returns `{"i": i, "double": 2i, "s": "part-<i>"}`.
//! - The producer submits the request (backoff 10 ms to 100 ms; `open`/`add` in chunks/`finalize`
//!   when `streamed`; a stream of its own when `own_stream`), cancels it after `cancel_after_ms`
//!   if set, waits for it, and writes `{"id", "state", "results", "errors"}` to OUT.
//! - The worker prints `READY` once connected, appends one JSON line per handler start and end to
//!   LOG, and runs until SIGTERM (graceful, exit 0) or SIGKILL.
//!
//! Built by `cargo test` with the tests (a binary of the root package that needs the feature
//! `test-clock`, on in test builds only).

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::{json, Value};
use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Producer, Worker};

/// A scenario as the drivers read it; the defaults are those of the interface.
#[derive(Deserialize, Debug, Clone)]
#[serde(default)]
struct Scenario {
    parts: u64,
    priority: u8,
    concurrency: u32,
    max_attempts: u32,
    fail_permanently: Vec<u64>,
    /// Part index (as a string: JSON object keys are strings) to the number of attempts that fail.
    fail_times: HashMap<String, u32>,
    sleep_ms: u64,
    streamed: bool,
    chunk: usize,
    own_stream: bool,
    cancel_after_ms: Option<u64>,
}

impl Default for Scenario {
    fn default() -> Self {
        Self {
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
        }
    }
}

/// The short worker timings of the interface: a killed worker's parts run again within ~2 s.
const LEASE: Duration = Duration::from_millis(1500);
const HEARTBEAT: Duration = Duration::from_millis(300);
const RECOVERY: Duration = Duration::from_millis(300);
const IDLE_POLL: Duration = Duration::from_millis(250);
/// Retry backoff of the request: quick retries.
const BACKOFF_BASE: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(100);

/// Command-line options after the subcommand, `--name value` pairs.
struct Args(BTreeMap<String, String>);

impl Args {
    fn parse(rest: &[String]) -> Result<Self, String> {
        let mut map = BTreeMap::new();
        let mut it = rest.iter();
        while let Some(flag) = it.next() {
            let name = flag.strip_prefix("--").ok_or_else(|| format!("unexpected argument {flag:?}"))?;
            let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
            map.insert(name.to_owned(), value.clone());
        }
        Ok(Self(map))
    }

    fn required(&self, name: &str) -> Result<&str, String> {
        self.0.get(name).map(String::as_str).ok_or_else(|| format!("--{name} is required"))
    }

    fn number(&self, name: &str, default: u64) -> Result<u64, String> {
        match self.0.get(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|e| format!("--{name} {v:?}: {e}")),
        }
    }

    fn check_known(&self, known: &[&str]) -> Result<(), String> {
        match self.0.keys().find(|k| !known.contains(&k.as_str())) {
            Some(unknown) => Err(format!("unknown option --{unknown}")),
            None => Ok(()),
        }
    }
}

fn load_scenario(path: &str) -> Result<Scenario, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading scenario {path}: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("scenario {path}: {e}"))
}

fn config(args: &Args) -> Result<Config, String> {
    Ok(Config::new(args.required("url")?).namespace(args.required("namespace")?))
}

fn now_us() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros())
}

/// The scenario's handler, logging each start and end.
struct ScenarioHandler {
    scenario: Scenario,
    /// Opened in append mode (O_APPEND): each line is one write, so processes sharing the file
    /// never interleave within a line.
    log: Mutex<File>,
    pid: u32,
}

impl ScenarioHandler {
    /// Appends one event line. A log that cannot be written fails the run: the harness's checks
    /// depend on it.
    fn log(&self, ev: &str, ctx: &Context) -> Result<(), HandlerError> {
        let line = json!({
            "ev": ev,
            "rid": ctx.request_id().to_string(),
            "i": ctx.index(),
            "attempt": ctx.attempt(),
            "t_us": now_us() as u64,
            "pid": self.pid,
        });
        let mut text = line.to_string();
        text.push('\n');
        let mut file = self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        file.write_all(text.as_bytes())
            .and_then(|()| file.flush())
            .map_err(|e| HandlerError::permanent(format!("conformance log: {e}")))
    }

    /// What part `i` at attempt `a` does, after its sleep.
    fn outcome(&self, i: u64, a: u32) -> Result<Value, HandlerError> {
        let s = &self.scenario;
        if s.fail_permanently.contains(&i) {
            return Err(HandlerError::permanent(format!("permanent {i}")));
        }
        if a <= s.fail_times.get(&i.to_string()).copied().unwrap_or(0) {
            return Err(HandlerError::new(format!("flaky {i} attempt {a}")));
        }
        Ok(json!({"i": i, "double": 2 * i, "s": format!("part-{i}")}))
    }
}

#[async_trait]
impl Handler for ScenarioHandler {
    type Input = Value;
    type Output = Value;

    async fn handle(&self, ctx: Context, payload: Value) -> Result<Value, HandlerError> {
        self.log("start", &ctx)?;
        let i = ctx.index();
        // The payload is checked against the index: a driver that mixed up parts would be caught
        // by the results, but this names the cause.
        let expected = json!({"i": i, "s": format!("part-{i}")});
        let outcome = if payload != expected {
            Err(HandlerError::permanent(format!("part {i}: payload {payload} is not {expected}")))
        } else {
            tokio::time::sleep(Duration::from_millis(self.scenario.sleep_ms)).await;
            self.outcome(i, ctx.attempt())
        };
        // Logged before returning: the end precedes the ack that frees the token, so a start
        // that the freed token allows is always logged after this end.
        self.log("end", &ctx)?;
        outcome
    }
}

async fn worker(args: &Args) -> Result<(), String> {
    args.check_known(&["url", "namespace", "scenario", "log", "slots"])?;
    let scenario = load_scenario(args.required("scenario")?)?;
    let log_path = PathBuf::from(args.required("log")?);
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| format!("opening log {}: {e}", log_path.display()))?;
    let slots = usize::try_from(args.number("slots", 4)?).map_err(|e| format!("--slots: {e}"))?;
    let config =
        config(args)?.lease(LEASE).heartbeat(HEARTBEAT).recovery_interval(RECOVERY).census_interval(RECOVERY);
    let handler = ScenarioHandler { scenario, log: Mutex::new(log), pid: std::process::id() };
    let worker = Worker::builder(&config, handler)
        .slots(slots)
        .idle_poll(IDLE_POLL)
        .build()
        .await
        .map_err(|e| format!("worker: {e}"))?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "READY").and_then(|()| stdout.flush()).map_err(|e| format!("stdout: {e}"))?;
    drop(stdout);
    // Until SIGTERM (or ctrl-c): then running handlers finish and the tokens go back.
    worker.run().await.map_err(|e| format!("worker: {e}"))
}

async fn producer(args: &Args) -> Result<(), String> {
    args.check_known(&["url", "namespace", "scenario", "out", "timeout-s"])?;
    let s = load_scenario(args.required("scenario")?)?;
    let out = PathBuf::from(args.required("out")?);
    let limit = Duration::from_secs(args.number("timeout-s", 60)?);
    let config = config(args)?.wait_poll(Duration::from_millis(200));
    let producer = Producer::connect(&config).await.map_err(|e| format!("producer: {e}"))?;
    let fail = |e: sluicegate::Error| format!("submit: {e}");
    let builder = producer
        .request()
        .priority(s.priority)
        .and_then(|b| b.concurrency(s.concurrency))
        .and_then(|b| b.max_attempts(s.max_attempts))
        .and_then(|b| b.backoff(BACKOFF_BASE, BACKOFF_MAX))
        .map_err(fail)?
        .own_stream(s.own_stream);
    let payloads: Vec<Value> = (0..s.parts).map(|i| json!({"i": i, "s": format!("part-{i}")})).collect();
    let handle = if s.streamed {
        let mut open = builder.open().await.map_err(fail)?;
        for chunk in payloads.chunks(s.chunk.max(1)) {
            open.add(chunk.iter()).await.map_err(fail)?;
        }
        open.finalize().await.map_err(fail)?
    } else {
        builder.submit(payloads).await.map_err(fail)?
    };
    if let Some(ms) = s.cancel_after_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        handle.cancel().await.map_err(|e| format!("cancel: {e}"))?;
    }
    let done = handle.wait_timeout::<Value>(limit).await.map_err(|e| format!("wait: {e}"))?;
    let mut results = Vec::with_capacity(done.results.len());
    let mut errors = serde_json::Map::new();
    for (n, result) in done.results.into_iter().enumerate() {
        let index = done.first + n as u64;
        match result {
            Ok(value) => results.push(value),
            Err(e) => {
                results.push(Value::Null);
                // Only parts that ran and failed have an error record; a part that never ran
                // (its request cancelled) has none, and the library says so with 0 attempts.
                if e.attempts > 0 {
                    errors.insert(index.to_string(), Value::String(e.message));
                }
            }
        }
    }
    let report = json!({
        "id": handle.id().to_string(),
        "state": done.state.as_str(),
        "results": results,
        "errors": errors,
    });
    std::fs::write(&out, report.to_string()).map_err(|e| format!("writing {}: {e}", out.display()))
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let run = match argv.split_first() {
        Some((cmd, rest)) if cmd == "producer" => match Args::parse(rest) {
            Ok(args) => producer(&args).await,
            Err(e) => Err(e),
        },
        Some((cmd, rest)) if cmd == "worker" => match Args::parse(rest) {
            Ok(args) => worker(&args).await,
            Err(e) => Err(e),
        },
        _ => Err("usage: conformance producer|worker --url URL --namespace NS --scenario FILE ...".into()),
    };
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("conformance: {e}");
            ExitCode::FAILURE
        }
    }
}
