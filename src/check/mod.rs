//! The randomized model-based protocol checker (test builds only).
//!
//! It drives the real code (producers' submits, slots' token takes, some giving way to a higher
//! priority announced while they hold a token, recovery passes, operators' commands: cancel,
//! requeue, finalize, reprioritize, pause, track, purge and purge of the finished ones; producers'
//! and workers' flushes of their stats by stage) against the real Functions library on a
//! redis-server of its own, with every Redis
//! call parked at a gate (`gate.rs`) so that a seeded scheduler chooses the interleaving and the
//! faults: a reply lost after the call ran, a call re-sent, a call refused (not run, an error that
//! is not the connection's, as `OOM` would be), a process killed between any two of
//! its calls, time that runs past leases (the library's clock is virtual, see
//! `protocol::checker_library_source`), a Redis crash and restart from its AOF; and a slot's
//! lane finish's releases run in the slot or as actors of their own (`Op::Take::apart`), as a
//! worker runs them in tasks that die with its process, and its first batch handed back after
//! its first part (`Op::Take::cut`), as when that part ran past the batch's budget, and its
//! batches two entries within a quantum of three parts or wide, up to four within six
//! (`Op::Take::wide`), so that one `ack` settles a run of several outcomes, and takes while the
//! worker's holds fill its slots (`Op::Take::room`: an unreserved slot gives back what it owes on
//! its own before it takes, and its token at its first batch's end, as while a worker's urgent
//! slot runs one hold over its slots); and copies of token
//! elements seen earlier pushed onto their lists again (`Op::Plant`), as re-sent pushes and clean
//! stops leave them, often of tokens that moved on or of requests purged since. After every step
//! it checks the invariants of CONTRACT.md against Redis's state (`model.rs`); at the end of each
//! sequence it drains everything to completion and checks that every accepted part ended with a
//! result or a dead letter, one event per lifecycle (and that a listener hears each once and in
//! order, stopping and resuming from its cursors), the listing index, the stats by stage against
//! what happened, and that nothing is left without an expiry. Some sequences also drain half-way
//! (`Op::Drain`) and go on, so that operators' commands meet finished requests.
//!
//! ```text
//! cargo test --lib check::                         # the CI budget (about 2.5 minutes)
//! SLUICEGATE_CHECK_SECS=3600 cargo test --release --lib check:: -- --ignored --nocapture   # long
//! SLUICEGATE_CHECK_SEED=1234 cargo test --lib check::   # replays one seed (and shrinks it)
//! SLUICEGATE_CHECK_REPLAY=target/checker/failure-1234.json cargo test --lib check::
//! ```
//!
//! A failure prints its seed and the shortest sequence the shrinker found, and writes that
//! sequence to `target/checker/failure-<seed>.json`. Once fixed, the sequence goes to
//! `src/check/found/<defect>.json`, which `recorded_failures_stay_fixed` replays in every run.

pub(crate) mod gate;
mod model;
mod ops;
#[cfg(feature = "schedules")]
mod schedules;
mod windows;
mod world;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fred::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use gate::Drawn;
use ops::{draw, Mix, Op, SLOTS, WORKERS};
use sluicegate_testkit::RedisServer;
use world::World;

/// Drain rounds before a request still unfinished counts as stuck (see `DRAIN_EXTRA`). Each round advances the clock
/// by `DRAIN_TICK`: with a 1 s lease and a recovery pass per round, a lost token is back within
/// two or three rounds.
const DRAIN_ROUNDS: usize = 40;
/// A drain that is still making progress in its last rounds (a request ended, or one turned
/// runnable: a chain of downstreams, each waiting for its upstream, needs a round or more per
/// hop; or a part was settled: a request held to a rate of one part per 1.7 s needs several rounds
/// per part) gets this many more, up to `DRAIN_EXTENSIONS` times; one that made none is stuck.
const DRAIN_EXTRA: usize = 10;
const DRAIN_EXTENSIONS: usize = 4;
const DRAIN_TICK: u32 = 300;
/// Rounds, before the last few, that advance the clock by a census interval each: a look that
/// could not be armed (Redis refused the call) is covered by the census backstop, which is the
/// liveness promise for that case, not a lease. The rounds after them let leases settle again.
/// (Counted back from the drain's last round.)
const BACKSTOP_ROUNDS: std::ops::Range<usize> = 6..9;

/// A run that broke an invariant: where, and why.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    /// Index of the operation after which the invariant broke (`len` for the drain).
    pub(crate) at: usize,
    pub(crate) message: String,
}

impl Failure {
    /// The failure without its particulars (ids, numbers): what shrinking must preserve.
    fn kind(&self) -> String {
        let head = self.message.split(['[', '{']).next().unwrap_or_default();
        head.split_whitespace()
            .filter(|w| !w.chars().any(|c| c.is_ascii_digit()))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// One redis-server for one runner thread, with `appendfsync always` so that a restart loses
/// nothing acknowledged.
struct Server {
    redis: RedisServer,
    admin: Client,
    conns: world::Connections,
}

impl Server {
    async fn start() -> Server {
        let redis = RedisServer::builder().aof_always(true).start().await.unwrap_or_else(|e| panic!("{e}"));
        // Reconnects by itself across the restarts of `Op::Restart`.
        let config = fred::prelude::Config::from_url(&redis.url()).expect("a valid url");
        let admin = Builder::from_config(config)
            .set_policy(ReconnectPolicy::new_constant(0, 20))
            .build()
            .expect("a client");
        admin.init().await.expect("the checker's server answers");
        let conns = World::connections(&redis.url()).await.unwrap_or_else(|e| panic!("{e}"));
        Server { redis, admin, conns }
    }

    async fn reset(&self) {
        let _: () = self.admin.flushall(false).await.expect("FLUSHALL on the checker's own server");
    }
}

/// Runs `ops` from a clean server, then drains; `Err` on the first broken invariant.
async fn run(server: &mut Server, ops: &[Op]) -> Result<(), Failure> {
    server.reset().await;
    let mut world = World::new(&mut server.conns, server.admin.clone());
    let result = play(server, &mut world, ops).await;
    world.end(&mut server.conns);
    result
}

async fn play(server: &mut Server, world: &mut World, ops: &[Op]) -> Result<(), Failure> {
    let fail = |at: usize| move |message: String| Failure { at, message };
    let profile = std::env::var("SLUICEGATE_CHECK_PROFILE").is_ok();
    let t0 = Instant::now();
    let mut in_checks = Duration::ZERO;
    let trace = std::env::var("SLUICEGATE_CHECK_TRACE").is_ok();
    // The drain's takes run releases apart every other round only in sequences that draw it, so
    // that those recorded before it replay as they were.
    let apart = ops.iter().any(|op| matches!(op, Op::Take { apart: true, .. }));
    // And ask for wide batches on the rounds between, only in sequences that draw a wide take.
    let wide = ops.iter().any(|op| matches!(op, Op::Take { wide: true, .. }));
    let drawn = Drawn { apart, cut: false, wide, room: false };
    for (at, op) in ops.iter().enumerate() {
        if trace {
            eprintln!("{at:>3} {op}  [parked: {}]", world.parked.len());
        }
        if *op == Op::Restart {
            // Every actor is parked before its next call: none is in the middle of one.
            server.redis.kill().map_err(|e| fail(at)(e.to_string()))?;
            server.redis.restart().await.map_err(|e| fail(at)(e.to_string()))?;
        } else if *op == Op::Drain {
            drain(world, drawn).await.map_err(fail(at))?;
        } else {
            world.apply(op).await.map_err(fail(at))?;
        }
        let c = Instant::now();
        model::check_step(world).await.map_err(fail(at))?;
        world.note_elements().await.map_err(fail(at))?;
        in_checks += c.elapsed();
    }
    let t1 = Instant::now();
    drain(world, drawn).await.map_err(fail(ops.len()))?;
    let t2 = Instant::now();
    world.stop_workers().await.map_err(fail(ops.len()))?;
    model::check_end(world).await.map_err(fail(ops.len()))?;
    if profile {
        eprintln!("ops {:?} (checks {:?}), drain {:?}, end {:?}", t1 - t0, in_checks, t2 - t1, t2.elapsed());
    }
    Ok(())
}

/// No more faults: every parked call and handler goes on, slots take, workers beat and recover,
/// time passes, an operator finalizes streamed requests whose producer died; until every request
/// is finished and nothing runs (at the end of a sequence, and where it has an `Op::Drain`).
/// `drawn.apart`: every other round, the slots' takes run their releases apart
/// (`Op::Take::apart`); `drawn.wide`: on the rounds between, they ask for wide batches
/// (`Op::Take::wide`).
async fn drain(world: &mut World, drawn: Drawn) -> Result<(), String> {
    use gate::{Fault, Verdict};
    let trace = std::env::var("SLUICEGATE_CHECK_TRACE").is_ok();
    let mut rounds = DRAIN_ROUNDS;
    // The round when what is unfinished last changed, and what it was.
    let mut progress = (0, Vec::<(u8, String)>::new());
    let mut round = 0;
    while round < rounds {
        // Whatever an operator paused is resumed, so that the drain can finish the work (again
        // each round: a pause parked before the drain may land after a resume).
        let ns = world.config.namespace_str().to_owned();
        let paused: i64 =
            world.reader.exists(format!("{ns}:{{{ns}.q0}}:paused")).await.map_err(|e| e.to_string())?;
        if paused > 0 {
            world.apply(&Op::Resume { priority: None }).await?;
        }
        // Schedules are paused, so that their ticks stop and the drain can end (again each round:
        // an add or resume parked before the drain may land after a pause).
        #[cfg(feature = "schedules")]
        for name in 0..ops::SCHEDULES {
            if world.model.schedules.active(name) {
                let action = ops::ScheduleAction::Pause;
                world.apply(&Op::Schedule { name, action }).await?;
            }
        }
        if trace {
            eprintln!(
                "drain round {round} [parked: {}, actors: {}]",
                world.parked.len(),
                world.actor_count()
            );
        }
        // Everything parked goes on until it parks again or ends, for a bounded number of steps.
        for _ in 0..200 {
            if world.parked.is_empty() {
                break;
            }
            let parked = world.parked.remove(0);
            world.resume(parked, Fault::None, Verdict::Ok).await?;
            model::check_step(world).await?;
        }
        let (seen, _) = model::snapshot(world).await?;
        let unfinished: Vec<u8> = seen
            .iter()
            .filter(|(_, s)| {
                !s.meta.is_empty()
                    && !s.terminal()
                    && s.meta.get("state").map(String::as_str) != Some("loading")
            })
            .map(|(i, _)| *i)
            .collect();
        let indexed = seen.values().filter(|s| s.indexed).count();
        // Only registrations of requests that never came to be are left: let their time run out.
        let idle = unfinished.is_empty() && world.actor_count() == 0;
        // Every dead worker reaped: the registry holds only the live ones, none is being reaped.
        let live: Vec<String> = world.live_workers().into_iter().map(|(_, id)| id).collect();
        let registered = model::registry(world).await?;
        let ns = world.config.namespace_str();
        let reaping: i64 =
            world.reader.zcard(format!("{ns}:{{{ns}.q0}}:reaping")).await.map_err(|e| e.to_string())?;
        let held: Vec<String> =
            world.reader.hkeys(format!("{ns}:{{{ns}.q0}}:held")).await.map_err(|e| e.to_string())?;
        // Stale elements (of finished requests, or older epochs) are taken and dropped by slots.
        let mut queued = 0;
        for p in [10, 50, 90] {
            let n: i64 =
                world.reader.llen(format!("{ns}:{{{ns}.q0}}:p:{p}")).await.map_err(|e| e.to_string())?;
            queued += n;
        }
        // Releases owed (the outbox): one whose finisher failed is run by recovery once it falls due.
        let owed: i64 =
            world.reader.zcard(format!("{ns}:{{{ns}.q0}}:rel")).await.map_err(|e| e.to_string())?;
        let reaped = queued == 0
            && reaping == 0
            && registered.keys().all(|w| live.contains(w))
            && held
                .iter()
                .all(|h| live.iter().any(|w| h.strip_prefix(w.as_str()).is_some_and(|s| s.starts_with('/'))));
        if idle && indexed == 0 && owed == 0 && reaped && schedules_quiet(world).await? {
            return Ok(());
        }
        // What is unfinished, in which state, and how many of its parts are left: a change is
        // progress (a rate-limited request settles a part every few rounds, staying `running`).
        let now: Vec<(u8, String)> = unfinished
            .iter()
            .map(|i| {
                let field = |f: &str| seen[i].meta.get(f).cloned().unwrap_or_default();
                (*i, format!("{} {}", field("state"), field("left")))
            })
            .collect();
        if now != progress.1 {
            progress = (round, now);
        }
        if round == rounds - 1
            && progress.0 + DRAIN_EXTRA > round
            && rounds < DRAIN_ROUNDS + DRAIN_EXTRA * DRAIN_EXTENSIONS
        {
            rounds += DRAIN_EXTRA;
        }
        if round == rounds - 1 {
            let states: Vec<String> =
                unfinished.iter().map(|i| format!("{}: {:?}", world::request_id(*i), seen[i].meta)).collect();
            let indexed: Vec<String> = seen
                .iter()
                .filter(|(_, s)| s.indexed)
                .map(|(i, s)| format!("{} ({:?})", world::request_id(*i), s.meta.get("state")))
                .collect();
            let held: Vec<(String, String)> =
                world.reader.hgetall(format!("{ns}:{{{ns}.q0}}:held")).await.map_err(|e| e.to_string())?;
            let scores: Vec<(String, f64)> = world
                .reader
                .zrange(format!("{ns}:{{{ns}.q0}}:active"), 0, -1, None, false, None, true)
                .await
                .map_err(|e| e.to_string())?;
            let (_, now) = model::snapshot(world).await?;
            let looks: Vec<String> =
                scores.iter().map(|(k, s)| format!("{k} in {} ms", *s as i64 - now as i64)).collect();
            let mut lists = Vec::new();
            for p in [10, 50, 90] {
                let l: Vec<String> = world
                    .reader
                    .lrange(format!("{ns}:{{{ns}.q0}}:p:{p}"), 0, -1)
                    .await
                    .map_err(|e| e.to_string())?;
                lists.push((p, l));
            }
            return Err(format!(
                "liveness: still unfinished after the drain: [{}]; indexed: {indexed:?}; actors: {}; held: {held:?}; \
                 lists: {lists:?}; live workers: {live:?}; next looks: {looks:?}; releases owed: {owed}",
                states.join("; "),
                world.actor_count()
            ));
        }
        for i in &unfinished {
            let open = seen[i].meta.get("open").map(String::as_str) == Some("1");
            if open && !world.busy_with(&world::request_id(*i).key_id()) {
                world.apply(&Op::Finalize { request: *i }).await?;
            }
        }
        // A streamed request's reader goes on reading its pages (results_from) while it drains.
        for (i, s) in &seen {
            if s.meta.contains_key("open") && !s.meta.contains_key("discard") && round % 2 == 0 {
                world.apply(&Op::ReadResults { request: *i, count: 2 }).await?;
            }
        }
        for w in 0..WORKERS {
            world.apply(&Op::Beat { worker: w }).await?;
            for slot in 0..SLOTS {
                world
                    .apply(&Op::Take {
                        worker: w,
                        slot,
                        floor: None,
                        way: false,
                        apart: drawn.apart && round % 2 == 0,
                        cut: false,
                        wide: drawn.wide && round % 2 == 1,
                        room: false,
                    })
                    .await?;
            }
        }
        world.apply(&Op::Recover { worker: (round % WORKERS as usize) as u8 }).await?;
        // Time leaps only while no schedule ticks: a leap would owe a schedule more ticks than it
        // catches up on, which the model does not follow (they are paused at the next round).
        #[cfg(feature = "schedules")]
        let ticking = (0..ops::SCHEDULES).any(|n| world.model.schedules.active(n));
        #[cfg(not(feature = "schedules"))]
        let ticking = false;
        let tick = if ticking {
            DRAIN_TICK
        } else if BACKSTOP_ROUNDS.contains(&(rounds - round)) {
            world.config.census_interval.as_millis() as u32
        } else if idle && (indexed > 0 || stray_registrations(world).await? > 0) {
            world.config.loading_ttl.as_millis() as u32 / 2
        } else if idle && owed > 0 {
            RELEASE_DUE_MS
        } else {
            DRAIN_TICK
        };
        world.apply(&Op::Advance { ms: tick }).await?;
        model::check_step(world).await?;
        round += 1;
    }
    Ok(())
}

/// How long the drain lets time run while only releases are owed: past the outbox's delay
/// (prelude.lua, SG_REL_DELAY_MS), after which recovery's claim runs a release its finisher left.
const RELEASE_DUE_MS: u32 = 10_500;

/// How many looks in shard 0's `active` index are registrations of requests the model does not
/// follow and that never came to be: a schedule's tick whose submit was refused after its
/// registration, and whose schedule was removed before the tick was fired again (the owed tick
/// goes with its schedule). Recovery drops such a registration once the loading ttl has passed
/// since it was made, so the drain lets that time run out, as it does for the model's own.
async fn stray_registrations(world: &World) -> Result<usize, String> {
    let ns = world.config.namespace_str();
    let e = |e: fred::error::Error| e.to_string();
    let looks: Vec<String> = world
        .reader
        .zrange(format!("{ns}:{{{ns}.q0}}:active"), 0, -1, None, false, None, false)
        .await
        .map_err(e)?;
    let mut strays = 0;
    // (The model's requests are `r<i>`, lanes `~<shard>.<priority>`.)
    for kid in looks.iter().filter(|k| !k.starts_with('r') && !k.starts_with('~')) {
        let exists: i64 = world.reader.exists(format!("{ns}:r:{{{kid}}}")).await.map_err(e)?;
        strays += usize::from(exists == 0);
    }
    Ok(strays)
}

/// Whether no schedule fires any more: none is in the due set (a schedule leaves it only once it
/// is paused and every tick before its pause was fired, or removed) and none owes a tick, and
/// every request they fired has finished its steps (recovery's index and the listing's live set
/// are empty: the requests of the pool are checked the same way above).
async fn schedules_quiet(world: &World) -> Result<bool, String> {
    if !cfg!(feature = "schedules") {
        return Ok(true);
    }
    let ns = world.config.namespace_str();
    let e = |e: fred::error::Error| e.to_string();
    let shard0 = |suffix: &str| format!("{ns}:{{{ns}.q0}}:{suffix}");
    let indexed: i64 = world.reader.zcard(shard0("active")).await.map_err(e)?;
    let live: i64 = world.reader.zcard(shard0("ix:live")).await.map_err(e)?;
    let due: i64 = world.reader.zcard(shard0("sch:due")).await.map_err(e)?;
    let mut quiet = indexed == 0 && live == 0 && due == 0;
    for name in 0..ops::SCHEDULES {
        let owe: Option<String> =
            world.reader.hget(shard0(&format!("sch:s:s{name}")), "owe").await.map_err(e)?;
        quiet &= owe.is_none();
    }
    Ok(quiet)
}

/// Draws the sequence of seed `seed`.
fn sequence(seed: u64, mix: &Mix) -> Vec<Op> {
    let mut rng = StdRng::seed_from_u64(seed);
    let drain_at =
        rng.gen_bool(mix.drains).then(|| rng.gen_range(mix.len / 2..(mix.len * 3 / 4).max(mix.len / 2 + 1)));
    (0..mix.len)
        .map(|at| match drain_at {
            Some(d) if at == d => Op::Drain,
            d => draw(&mut rng, mix, d.is_some_and(|d| at > d)),
        })
        .collect()
}

/// Removes operations while the failure (its kind) stays: chunks first, then single ones.
async fn shrink(
    server: &mut Server,
    mut ops: Vec<Op>,
    failure: &Failure,
    budget: Duration,
) -> (Vec<Op>, Failure) {
    let started = Instant::now();
    let kind = failure.kind();
    let mut best = failure.clone();
    ops.truncate((failure.at + 1).min(ops.len()));
    let mut chunk = (ops.len() / 2).max(1);
    loop {
        let mut progressed = false;
        let mut i = 0;
        while i < ops.len() && started.elapsed() < budget {
            let mut candidate = ops.clone();
            candidate.drain(i..(i + chunk).min(candidate.len()));
            match run(server, &candidate).await {
                Err(f) if f.kind() == kind => {
                    candidate.truncate((f.at + 1).min(candidate.len()));
                    ops = candidate;
                    best = f;
                    progressed = true;
                }
                _ => i += chunk,
            }
        }
        if started.elapsed() >= budget || (chunk == 1 && !progressed) {
            return (ops, best);
        }
        if !progressed {
            chunk = (chunk / 2).max(1);
        }
    }
}

fn report(seed: u64, ops: &[Op], failure: &Failure, tried: u64) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target").join("checker");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("failure-{seed}.json"));
    let _ = std::fs::write(&path, serde_json::to_vec_pretty(ops).unwrap_or_default());
    let listing: Vec<String> = ops.iter().enumerate().map(|(i, op)| format!("  {i:>3} {op}")).collect();
    format!(
        "the protocol checker broke an invariant after {tried} sequences\n  seed {seed} (replay: \
         SLUICEGATE_CHECK_SEED={seed})\n  {}\n  shortest sequence found ({} operations, replay: \
         SLUICEGATE_CHECK_REPLAY={}):\n{}",
        failure.message,
        ops.len(),
        path.display(),
        listing.join("\n")
    )
}

/// Runs sequences on `threads` runners until `budget` is spent or one fails.
fn search(budget: Duration, threads: usize, mix: Mix) -> Result<(u64, u64), String> {
    let base: u64 = match std::env::var("SLUICEGATE_CHECK_SEED") {
        Ok(s) => s.parse().expect("SLUICEGATE_CHECK_SEED is a number"),
        Err(_) => match std::env::var("SLUICEGATE_CHECK_SEED_BASE") {
            Ok(s) => s.parse().expect("SLUICEGATE_CHECK_SEED_BASE is a number"),
            Err(_) => rand::random::<u32>().into(),
        },
    };
    let fixed = std::env::var("SLUICEGATE_CHECK_SEED").is_ok();
    let replay: Option<Vec<Op>> = std::env::var("SLUICEGATE_CHECK_REPLAY").ok().map(|p| {
        serde_json::from_slice(&std::fs::read(&p).expect("SLUICEGATE_CHECK_REPLAY names a file"))
            .expect("a sequence")
    });
    let threads =
        std::env::var("SLUICEGATE_CHECK_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(threads);
    eprintln!("protocol checker: seeds from {base}, {} s, {threads} runner(s)", budget.as_secs());
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let found: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let steps = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + budget;
    let runners: Vec<_> = (0..threads)
        .map(|_| {
            let (next, stop, found, steps, replay) =
                (next.clone(), stop.clone(), found.clone(), steps.clone(), replay.clone());
            on_a_deep_stack(move || {
                let rt =
                    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
                rt.block_on(async {
                    let mut server = Server::start().await;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let seed = base + n;
                        let ops = match &replay {
                            Some(ops) => ops.clone(),
                            None => sequence(seed, &mix),
                        };
                        let result = run(&mut server, &ops).await;
                        steps.fetch_add(ops.len() as u64, Ordering::Relaxed);
                        if let Err(failure) = result {
                            if stop.swap(true, Ordering::Relaxed) {
                                return;
                            }
                            let shrink_for =
                                if std::env::var("SLUICEGATE_CHECK_NOSHRINK").is_ok() { 0 } else { 90 };
                            let (min, why) =
                                shrink(&mut server, ops, &failure, Duration::from_secs(shrink_for)).await;
                            *found.lock().expect("no panic holds it") = Some(report(seed, &min, &why, n + 1));
                            return;
                        }
                        if fixed || replay.is_some() {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                });
            })
        })
        .collect();
    for r in runners {
        r.join().map_err(|_| "a checker runner panicked".to_string())?;
    }
    if let Some(report) = found.lock().expect("no panic holds it").take() {
        return Err(report);
    }
    Ok((next.load(Ordering::Relaxed), steps.load(Ordering::Relaxed)))
}

fn budget(default: u64) -> Duration {
    Duration::from_secs(
        std::env::var("SLUICEGATE_CHECK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(default),
    )
}

const CI_MIX: Mix = Mix { len: 60, faults: 0.12, restarts: true, drains: 0.2, dags: 0.0 };

/// The mix of the dependencies' share of the CI budget: one operation in six a submit after
/// other requests, a requeue or a cancel, so that downstreams wait, fail with their upstreams and
/// reopen when those are requeued and complete.
const DAG_MIX: Mix = Mix { len: 80, drains: 0.6, dags: 0.2, ..CI_MIX };

/// Runs a search over `budget`, three quarters of it on `mix` and a quarter on it with the
/// dependencies' share of [`DAG_MIX`], and reports what it covered.
fn search_both(budget: Duration, mix: Mix) {
    let dag_part = budget / 4;
    let dag_mix = Mix { len: mix.len.max(DAG_MIX.len), ..DAG_MIX };
    for (part, mix) in [(budget - dag_part, mix), (dag_part, dag_mix)] {
        match search(part, 2, mix) {
            Ok((sequences, steps)) => eprintln!(
                "protocol checker: {sequences} sequences, {steps} operations (dependencies' share {}): no \
                 invariant broken; so far {} requests ended at their deadline, {} failed because of an \
                 upstream, {} ran after theirs, {} handler runs of grouped requests were checked under group tokens, \
                 {} lane tokens were handed to a waiting slot, {} releases ran apart from their slots, {} \
                 sub-requests were reported unrun (skip), {} batches of more than two parts were reported in one call, \
                 {} copies of token elements were planted on their lists, {} groups of finished lane requests \
                 were seen in the terminal sets, {} single-part lane requests were seen running by their \
                 lanes' marks, {} cancelled entries were seen in lanes' cancelled sets",
                mix.dags,
                model::ENDED_AT_DEADLINE.load(Ordering::Relaxed),
                model::FAILED_BY_UPSTREAM.load(Ordering::Relaxed),
                model::RAN_AFTER_UPSTREAMS.load(Ordering::Relaxed),
                model::GROUPED_RUNS_CHECKED.load(Ordering::Relaxed),
                model::HANDED_OFF.load(Ordering::Relaxed),
                model::RELEASED_APART.load(Ordering::Relaxed),
                model::HANDED_BACK.load(Ordering::Relaxed),
                model::WIDE_BATCHES.load(Ordering::Relaxed),
                model::PLANTED.load(Ordering::Relaxed),
                model::TERMINAL_GROUPS_SEEN.load(Ordering::Relaxed),
                model::RUNNING_BY_MARKS.load(Ordering::Relaxed),
                model::CANCELLED_IN_LANE.load(Ordering::Relaxed)
            ),
            Err(report) => panic!("{report}"),
        }
    }
    // A search that never hands a single-part lane request out without its record has not tried
    // the path most small requests take (hundreds of sightings in 40 s). Cancels of entries still
    // waiting in a lane (mostly `Op::CancelQueued`'s) are rarer (tens of sightings in most 40 s
    // runs, none in one of three): counted only, and tried every run by
    // `windows::a_cancelled_request_of_an_id_whose_earlier_request_still_runs_never_starts` and
    // by `found/a-single-part-lane-entry-cancelled-while-it-waits-was-handed-out.json`.
    let searched = std::env::var("SLUICEGATE_CHECK_SEED").is_err()
        && std::env::var("SLUICEGATE_CHECK_REPLAY").is_err()
        && budget >= Duration::from_secs(30);
    if searched {
        assert!(
            model::RUNNING_BY_MARKS.load(Ordering::Relaxed) > 0,
            "the search never saw a single-part lane request running by its lane's marks: the \
             record-less hand-out went untried"
        );
    }
}

/// The CI budget: 150 s of sequences (the whole suite must stay under 20 minutes on 2 cores; it
/// takes about 10, four tests at a time, this one beside the others), seeds
/// varying per run and printed.
#[test]
fn randomized_interleavings_keep_every_invariant() {
    search_both(budget(150), CI_MIX);
}

/// The long mode: `SLUICEGATE_CHECK_SECS` (default an hour), longer sequences.
#[test]
#[ignore = "long search: SLUICEGATE_CHECK_SECS=3600 cargo test --release --lib check:: -- --ignored"]
fn randomized_interleavings_keep_every_invariant_long() {
    search_both(budget(3600), Mix { len: 150, ..CI_MIX });
}

/// Every failure the search found and that was fixed is kept in `src/check/found/` (the shrunk
/// sequence of its report, named for the defect) and replayed here, so that it stays fixed.
#[test]
fn recorded_failures_stay_fixed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/check/found");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("src/check/found exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let replay = on_a_deep_stack(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        rt.block_on(async {
            let mut server = Server::start().await;
            for file in files {
                let ops: Vec<Op> = serde_json::from_slice(&std::fs::read(&file).expect("readable"))
                    .unwrap_or_else(|e| panic!("{}: not a sequence: {e}", file.display()));
                if let Err(failure) = run(&mut server, &ops).await {
                    panic!(
                        "{} fails again after operation {}: {}",
                        file.display(),
                        failure.at,
                        failure.message
                    );
                }
            }
        })
    });
    if let Err(panic) = replay.join() {
        std::panic::resume_unwind(panic);
    }
}

/// A thread for a world's runtime. Every actor of a world is polled on its one thread, through
/// the real worker's futures, nested deeper than a test thread's 2 MiB holds in a debug build.
fn on_a_deep_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> std::thread::JoinHandle<T> {
    std::thread::Builder::new().stack_size(64 << 20).spawn(f).expect("a thread")
}
