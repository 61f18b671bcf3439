//! Measures the ways fred 10.1 can call a small server-side script, to choose between a Redis
//! Functions library (`FUNCTION LOAD` + `FCALL`) and `EVALSHA` with reload on `NOSCRIPT`.
//!
//! The script is the shape of an ack: `DECR KEYS[1]; HSET KEYS[2] ARGV[1] ARGV[2]; return` the
//! counter. Every key carries the hash tag `{bench}`. Modes:
//!
//! 0. `ref-decr`: a plain `DECR` (not a script), the ceiling of fred's ordinary pipelining;
//! 1. `evalsha-reload`: `Script::evalsha_with_reload` (reloads and retries once on `NOSCRIPT`);
//! 2. `evalsha`: `LuaInterface::evalsha`;
//! 3. `fcall`: `FunctionInterface::fcall` (what `Function::fcall` calls);
//! 4. `custom-fcall`: `custom(CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false), ..)`;
//! 5. `custom-evalsha`: the same with `EVALSHA`.
//!
//! For each target (one `Client`, a `Pool` of 4) and each concurrency (1, 16, 64 tasks) it runs
//! every mode for `SCM_SECS` seconds (default 3) and prints calls/s, p50/p99 latency, Redis CPU per
//! call (`INFO cpu` user+sys delta / calls) and the command's own `usec` per call (`INFO
//! commandstats` delta). Each task owns a counter starting at a distinct base, so every reply is
//! checked against the one value it must have: a reply delivered to the wrong caller counts as a
//! mismatch.
//!
//! It then reports which error each mode returns when the script or function is missing, shows a
//! reload-and-retry for each, flushes the script cache and deletes the library in the middle of a
//! concurrent run, and tries `FCALL` on clients configured with `Blocking::Error` / `Interrupt`.
//!
//! Run it against a throwaway server only, never a shared one. The missing-script checks run
//! `SCRIPT FLUSH` (every cached script on that server) and `FUNCTION DELETE scm`, so they are
//! skipped unless `SCM_FLUSH_OK=1`:
//!
//! ```sh
//! redis-server --port 6411 --bind 127.0.0.1 --save "" --appendonly no &
//! REDIS_URL=redis://127.0.0.1:6411 SCM_FLUSH_OK=1 cargo run --release --example script_call_modes
//! ```

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use fred::{
    prelude::*,
    types::{
        scripts::{Function, Script},
        ClusterHash, CustomCommand,
    },
    util::redis_keyslot,
};

/// The ack-shaped script, for `EVALSHA`.
const LUA: &str = "local r = redis.call('DECR', KEYS[1]); \
                   redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]); return r";

/// The same body as a function in library `scm`, for `FUNCTION LOAD REPLACE` + `FCALL`.
const LIBRARY: &str = "#!lua name=scm\n\
    redis.register_function('scm_ack', function(keys, args)\n\
      local r = redis.call('DECR', keys[1])\n\
      redis.call('HSET', keys[2], args[1], args[2])\n\
      return r\n\
    end)\n";

const LIBRARY_NAME: &str = "scm";
const FUNCTION_NAME: &str = "scm_ack";
const HASH_KEY: &str = "{bench}:h";

/// `FCALL` sent through `custom`, so fred does not mark the connection blocked. The cluster hash
/// offset indexes the argument vector given to `custom`, which excludes the command name:
/// `[function, numkeys, key1, ..]`, so the first key is at offset 2.
fn custom_fcall() -> CustomCommand {
    CustomCommand::new_static("FCALL", ClusterHash::Offset(2), false)
}

/// `EVALSHA` through `custom`: `[sha1, numkeys, key1, ..]`, first key at offset 2.
fn custom_evalsha() -> CustomCommand {
    CustomCommand::new_static("EVALSHA", ClusterHash::Offset(2), false)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    RefDecr,
    EvalshaReload,
    Evalsha,
    Fcall,
    CustomFcall,
    CustomEvalsha,
}

impl Mode {
    const ALL: [Mode; 6] = [
        Mode::RefDecr,
        Mode::EvalshaReload,
        Mode::Evalsha,
        Mode::Fcall,
        Mode::CustomFcall,
        Mode::CustomEvalsha,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::RefDecr => "0 ref-decr",
            Mode::EvalshaReload => "1 evalsha-reload",
            Mode::Evalsha => "2 evalsha",
            Mode::Fcall => "3 fcall",
            Mode::CustomFcall => "4 custom-fcall",
            Mode::CustomEvalsha => "5 custom-evalsha",
        }
    }

    /// The `INFO commandstats` entry the mode's calls are counted under.
    fn cmdstat(self) -> &'static str {
        match self {
            Mode::RefDecr => "cmdstat_decr",
            Mode::EvalshaReload | Mode::Evalsha | Mode::CustomEvalsha => "cmdstat_evalsha",
            Mode::Fcall | Mode::CustomFcall => "cmdstat_fcall",
        }
    }
}

/// One task's keys and arguments, built once so every mode pays the same allocation cost.
struct Call {
    counter: String,
    field: String,
}

/// Everything a call needs besides its client.
struct Shared {
    script: Script,
    function: Function,
}

/// Makes one call in `mode`, returning the counter value the script returned.
async fn call(shared: &Shared, client: &Client, mode: Mode, c: &Call, seq: u64) -> Result<i64, Error> {
    let keys = vec![c.counter.clone(), HASH_KEY.to_owned()];
    let args: Vec<Value> = vec![c.field.clone().into(), (seq as i64).into()];
    match mode {
        Mode::RefDecr => client.decr(c.counter.clone()).await,
        Mode::EvalshaReload => shared.script.evalsha_with_reload(client, keys, args).await,
        Mode::Evalsha => client.evalsha(shared.script.sha1().clone(), keys, args).await,
        Mode::Fcall => shared.function.fcall(client, keys, args).await,
        Mode::CustomFcall => {
            let argv: Vec<Value> = vec![
                FUNCTION_NAME.into(),
                2_i64.into(),
                c.counter.clone().into(),
                HASH_KEY.into(),
                c.field.clone().into(),
                (seq as i64).into(),
            ];
            client.custom(custom_fcall(), argv).await
        }
        Mode::CustomEvalsha => {
            let argv: Vec<Value> = vec![
                shared.script.sha1().to_string().into(),
                2_i64.into(),
                c.counter.clone().into(),
                HASH_KEY.into(),
                c.field.clone().into(),
                (seq as i64).into(),
            ];
            client.custom(custom_evalsha(), argv).await
        }
    }
}

/// A single client or a pool; calls go to `pool.next()`, as the pool's own interfaces do.
#[derive(Clone)]
enum Target {
    Single(Client),
    Pool(Pool),
}

impl Target {
    fn label(&self) -> String {
        match self {
            Target::Single(_) => "client".to_owned(),
            Target::Pool(p) => format!("pool({})", p.size()),
        }
    }

    fn client(&self) -> &Client {
        match self {
            Target::Single(c) => c,
            Target::Pool(p) => p.next(),
        }
    }
}

#[derive(Default)]
struct TaskResult {
    latencies_ns: Vec<u64>,
    errors: u64,
    mismatches: u64,
    first_error: Option<String>,
}

/// Base of task `t`'s counter; distinct per task so a misrouted reply cannot look right.
fn base(t: usize) -> i64 {
    (t as i64 + 1) * 1_000_000_000
}

async fn reset_counters(admin: &Client, tasks: usize) -> Result<(), Error> {
    for t in 0..tasks {
        admin.set::<(), _, _>(format!("{{bench}}:ctr:{t}"), base(t), None, None, false).await?;
    }
    Ok(())
}

/// Runs `tasks` tasks calling `mode` until `dur` has passed; returns per-task results.
async fn run(
    shared: &Arc<Shared>,
    target: &Target,
    mode: Mode,
    tasks: usize,
    dur: Duration,
) -> Vec<TaskResult> {
    let stop_at = Instant::now() + dur;
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let shared = Arc::clone(shared);
            let target = target.clone();
            tokio::spawn(async move {
                let c = Call { counter: format!("{{bench}}:ctr:{t}"), field: format!("t{t}") };
                let mut res = TaskResult::default();
                let mut seq = 0_u64;
                let mut expected = base(t);
                while Instant::now() < stop_at {
                    seq += 1;
                    let started = Instant::now();
                    let reply = call(&shared, target.client(), mode, &c, seq).await;
                    res.latencies_ns.push(started.elapsed().as_nanos() as u64);
                    match reply {
                        Ok(v) => {
                            expected -= 1;
                            if v != expected {
                                res.mismatches += 1;
                                expected = v; // resynchronise, keep counting
                            }
                        }
                        Err(e) => {
                            res.errors += 1;
                            res.first_error.get_or_insert_with(|| format!("{e:?}"));
                        }
                    }
                }
                res
            })
        })
        .collect();
    let mut out = Vec::with_capacity(tasks);
    for h in handles {
        match h.await {
            Ok(r) => out.push(r),
            Err(e) => eprintln!("task failed: {e}"),
        }
    }
    out
}

/// Parses `INFO` text into `field -> value`.
fn info_map(text: &str) -> HashMap<String, String> {
    text.lines().filter_map(|l| l.trim().split_once(':')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
}

/// Redis CPU seconds (user + sys, main and background threads) and `total_reads_processed`
/// (socket reads; fewer reads than calls means several calls arrived together, i.e. pipelined).
async fn redis_cpu_reads(admin: &Client) -> Result<(f64, f64), Error> {
    let text: String = admin.info::<String>(None).await?;
    let m = info_map(&text);
    let get = |k: &str| m.get(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    Ok((get("used_cpu_user") + get("used_cpu_sys"), get("total_reads_processed")))
}

/// `(calls, usec)` of one `INFO commandstats` entry.
async fn cmdstat(admin: &Client, entry: &str) -> Result<(u64, u64), Error> {
    let text: String = admin.info(Some(fred::types::InfoKind::CommandStats)).await?;
    let m = info_map(&text);
    let Some(v) = m.get(entry) else {
        return Ok((0, 0));
    };
    let mut calls = 0;
    let mut usec = 0;
    for kv in v.split(',') {
        match kv.split_once('=') {
            Some(("calls", n)) => calls = n.parse().unwrap_or(0),
            Some(("usec", n)) => usec = n.parse().unwrap_or(0),
            _ => {}
        }
    }
    Ok((calls, usec))
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1000.0
}

async fn bench(
    shared: &Arc<Shared>,
    admin: &Client,
    target: &Target,
    mode: Mode,
    tasks: usize,
    dur: Duration,
) -> Result<(), Error> {
    reset_counters(admin, tasks).await?;
    // Warm up connections and the server's script path; not measured.
    let _ = run(shared, target, mode, tasks, Duration::from_millis(200)).await;
    reset_counters(admin, tasks).await?;

    let (cpu0, reads0) = redis_cpu_reads(admin).await?;
    let (calls0, usec0) = cmdstat(admin, mode.cmdstat()).await?;
    let started = Instant::now();
    let results = run(shared, target, mode, tasks, dur).await;
    let elapsed = started.elapsed().as_secs_f64();
    let (cpu1, reads1) = redis_cpu_reads(admin).await?;
    let (calls1, usec1) = cmdstat(admin, mode.cmdstat()).await?;

    let mut lat: Vec<u64> = results.iter().flat_map(|r| r.latencies_ns.iter().copied()).collect();
    lat.sort_unstable();
    let calls = lat.len() as f64;
    let errors: u64 = results.iter().map(|r| r.errors).sum();
    let mismatches: u64 = results.iter().map(|r| r.mismatches).sum();
    let server_calls = calls1.saturating_sub(calls0).max(1) as f64;
    println!(
        "| {:<9} | {:<16} | {:>3} | {:>8.0} | {:>7.1} | {:>7.1} | {:>8.2} | {:>6.2} | {:>5.2} | {:>4} | {:>4} |",
        target.label(),
        mode.name(),
        tasks,
        calls / elapsed,
        percentile(&lat, 0.50),
        percentile(&lat, 0.99),
        (cpu1 - cpu0) * 1e6 / calls.max(1.0),
        usec1.saturating_sub(usec0) as f64 / server_calls,
        (reads1 - reads0) / calls.max(1.0),
        errors,
        mismatches,
    );
    if let Some(e) = results.iter().find_map(|r| r.first_error.as_ref()) {
        println!("|   first error: {e}");
    }
    Ok(())
}

fn describe(r: &Result<i64, Error>) -> String {
    match r {
        Ok(v) => format!("Ok({v})"),
        Err(e) => format!("Err(kind={:?}, details={:?})", e.kind(), e.details()),
    }
}

/// True if `e` says the cached script or the function is gone, so the caller should reload.
fn is_missing_code(e: &Error) -> bool {
    let d = e.details();
    d.starts_with("NOSCRIPT") || d.contains("Function not found")
}

/// Calls `mode` once; on a missing script or function, reloads it and retries once.
async fn call_with_reload(
    shared: &Shared,
    client: &Client,
    mode: Mode,
    c: &Call,
    seq: u64,
) -> Result<i64, Error> {
    match call(shared, client, mode, c, seq).await {
        Err(e) if is_missing_code(&e) => {
            match mode {
                Mode::Fcall | Mode::CustomFcall => {
                    client.function_load::<String, _>(true, LIBRARY).await?;
                }
                _ => shared.script.load(client).await?,
            }
            call(shared, client, mode, c, seq).await
        }
        r => r,
    }
}

/// The missing-script / missing-function behaviour of every mode, plus a flush mid-run.
async fn missing_code_checks(shared: &Arc<Shared>, admin: &Client, client: &Client) -> Result<(), Error> {
    let c = Call { counter: "{bench}:ctr:0".to_owned(), field: "t0".to_owned() };
    admin.set::<(), _, _>(&c.counter, 100, None, None, false).await?;

    println!("\n## Missing script / function (one call each, nothing loaded)\n");
    for mode in [Mode::Evalsha, Mode::CustomEvalsha, Mode::EvalshaReload] {
        admin.script_flush(false).await?;
        let r = call(shared, client, mode, &c, 1).await;
        println!("- after SCRIPT FLUSH, {:<16}: {}", mode.name(), describe(&r));
    }
    for mode in [Mode::Fcall, Mode::CustomFcall] {
        let _: Result<String, _> = admin.function_delete(LIBRARY_NAME).await;
        let r = call(shared, client, mode, &c, 1).await;
        println!("- after FUNCTION DELETE scm, {:<16}: {}", mode.name(), describe(&r));
    }
    for mode in [Mode::Evalsha, Mode::CustomEvalsha, Mode::Fcall, Mode::CustomFcall] {
        admin.script_flush(false).await?;
        let _: Result<String, _> = admin.function_delete(LIBRARY_NAME).await;
        let r = call_with_reload(shared, client, mode, &c, 1).await;
        println!("- missing, then call_with_reload {:<16}: {}", mode.name(), describe(&r));
    }

    println!("\n## Flush / delete in the middle of a 1 s run, 16 tasks on one client\n");
    for (mode, with_reload) in [
        (Mode::EvalshaReload, false),
        (Mode::Evalsha, false),
        (Mode::Evalsha, true),
        (Mode::CustomEvalsha, true),
        (Mode::Fcall, false),
        (Mode::Fcall, true),
        (Mode::CustomFcall, true),
    ] {
        shared.script.load(client).await?;
        client.function_load::<String, _>(true, LIBRARY).await?;
        reset_counters(admin, 16).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let handles: Vec<_> = (0..16)
            .map(|t| {
                let shared = Arc::clone(shared);
                let client = client.clone();
                let stop = Arc::clone(&stop);
                tokio::spawn(async move {
                    let c = Call { counter: format!("{{bench}}:ctr:{t}"), field: format!("t{t}") };
                    let (mut ok, mut err, mut bad, mut seq, mut expected) = (0_u64, 0_u64, 0_u64, 0, base(t));
                    let mut first_err = None;
                    while !stop.load(Ordering::Relaxed) {
                        seq += 1;
                        let r = if with_reload {
                            call_with_reload(&shared, &client, mode, &c, seq).await
                        } else {
                            call(&shared, &client, mode, &c, seq).await
                        };
                        match r {
                            Ok(v) => {
                                ok += 1;
                                expected -= 1;
                                if v != expected {
                                    bad += 1;
                                    expected = v;
                                }
                            }
                            Err(e) => {
                                err += 1;
                                first_err.get_or_insert(e.details().to_owned());
                            }
                        }
                    }
                    (ok, err, bad, first_err)
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        match mode {
            Mode::Fcall | Mode::CustomFcall => {
                let _: Result<String, _> = admin.function_delete(LIBRARY_NAME).await;
            }
            _ => admin.script_flush(false).await?,
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::Relaxed);
        let (mut ok, mut err, mut bad, mut first) = (0, 0, 0, None);
        for h in handles {
            if let Ok((o, e, b, f)) = h.await {
                ok += o;
                err += e;
                bad += b;
                first = first.or(f);
            }
        }
        println!(
            "- {:<16} reload-wrapper={:<5}: ok={ok} errors={err} mismatches={bad}{}",
            mode.name(),
            with_reload,
            first.map(|f| format!(" first error={f:?}")).unwrap_or_default()
        );
    }
    shared.script.load(client).await?;
    client.function_load::<String, _>(true, LIBRARY).await?;
    Ok(())
}

/// `FCALL` is a blocking command to fred: under `Blocking::Error` other commands sent while one is
/// in flight fail, under `Blocking::Interrupt` they trigger `CLIENT UNBLOCK`. Shows each mode on
/// such a client (the default, `Blocking::Block`, is what the throughput table uses).
async fn blocking_policy_check(shared: &Arc<Shared>, admin: &Client, config: &Config) -> Result<(), Error> {
    for policy in [Blocking::Error, Blocking::Interrupt] {
        println!("\n## One client with Config.blocking = {policy:?}, 16 tasks, 1 s\n");
        let mut config = config.clone();
        config.blocking = policy;
        let client = Builder::from_config(config).build()?;
        client.init().await?;
        let target = Target::Single(client.clone());
        for mode in [Mode::Evalsha, Mode::Fcall, Mode::CustomFcall] {
            reset_counters(admin, 16).await?;
            let results = run(shared, &target, mode, 16, Duration::from_secs(1)).await;
            let calls: usize = results.iter().map(|r| r.latencies_ns.len()).sum();
            let errors: u64 = results.iter().map(|r| r.errors).sum();
            let bad: u64 = results.iter().map(|r| r.mismatches).sum();
            let first = results.iter().find_map(|r| r.first_error.clone()).unwrap_or_default();
            println!("- {:<16}: calls={calls} errors={errors} mismatches={bad} {first}", mode.name());
        }
        client.quit().await?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let url = std::env::var("REDIS_URL").map_err(|_| Error::new(ErrorKind::Config, "set REDIS_URL"))?;
    let secs: f64 = std::env::var("SCM_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let dur = Duration::from_secs_f64(secs);
    let flush_ok = std::env::var("SCM_FLUSH_OK").is_ok_and(|v| v == "1");
    let config = Config::from_url(&url)?;

    let admin = Builder::from_config(config.clone()).build()?;
    admin.init().await?;
    let client = Builder::from_config(config.clone()).build()?;
    client.init().await?;
    let pool = Builder::from_config(config.clone()).build_pool(4)?;
    pool.init().await?;

    let script = Script::from_lua(LUA);
    script.load(&admin).await?;
    let lib: String = admin.function_load(true, LIBRARY).await?;
    assert_eq!(lib, LIBRARY_NAME);
    let shared = Arc::new(Shared { script, function: Function::new(FUNCTION_NAME, vec![]) });

    // The custom commands route by the first key: check the offset picks it.
    let probe: Vec<Value> = vec![FUNCTION_NAME.into(), 2_i64.into(), "{bench}:ctr:0".into(), HASH_KEY.into()];
    let slot = custom_fcall().cluster_hash.hash(&probe);
    println!(
        "ClusterHash::Offset(2) on [fn, numkeys, key1, key2] -> slot {slot:?}; redis_keyslot(key1) = {}",
        redis_keyslot(b"{bench}:ctr:0")
    );

    // Correctness of each mode on one call.
    println!("\n## One call per mode (counter set to 10, expect 9)\n");
    for mode in Mode::ALL {
        admin.set::<(), _, _>("{bench}:ctr:0", 10, None, None, false).await?;
        let c = Call { counter: "{bench}:ctr:0".to_owned(), field: "t0".to_owned() };
        let r = call(&shared, &client, mode, &c, 1).await;
        let h: Option<i64> = admin.hget(HASH_KEY, "t0").await?;
        println!("- {:<16}: {} (HGET {HASH_KEY} t0 = {h:?})", mode.name(), describe(&r));
        admin.del::<(), _>(HASH_KEY).await?;
    }

    println!(
        "\n## Throughput, {secs} s per row (Redis µs/call = INFO cpu user+sys delta / calls; \
         cmd µs = INFO commandstats usec delta / calls; \
         reads = server socket reads per call; bad = replies not matching the caller)\n"
    );
    println!("| target    | mode             |   C |  calls/s | p50 µs  | p99 µs  | Redis µs | cmd µs | reads | errs | bad  |");
    println!("|-----------|------------------|-----|----------|---------|---------|----------|--------|-------|------|------|");
    for target in [Target::Single(client.clone()), Target::Pool(pool.clone())] {
        for tasks in [1, 16, 64] {
            for mode in Mode::ALL {
                bench(&shared, &admin, &target, mode, tasks, dur).await?;
            }
        }
    }

    if flush_ok {
        missing_code_checks(&shared, &admin, &client).await?;
    } else {
        println!("\n(missing-script checks skipped: set SCM_FLUSH_OK=1 on a throwaway server)");
    }
    blocking_policy_check(&shared, &admin, &config).await?;

    // Clean up our keys; leave the library and script loaded.
    let keys: Vec<String> = (0..64).map(|t| format!("{{bench}}:ctr:{t}")).collect();
    admin.del::<(), _>(keys).await?;
    admin.del::<(), _>(HASH_KEY).await?;
    pool.quit().await?;
    client.quit().await?;
    admin.quit().await?;
    Ok(())
}
