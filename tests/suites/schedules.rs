// The body of tests/integration/schedules.rs: written once, run against a single Redis and a 3-master Redis
// Cluster (`per_topology!` runs it once for each).
//
// Time moves through Redis's clock only: the tests that need more of it than they can wait for
// run a test build of the functions library (`Config::test_clock`) whose clock runs faster, or
// jumps, set on every master (`set_test_clock`). Workers' own clocks never decide a tick.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use fred::prelude::*;
use fred::types::sorted_sets::Ordering;
use fred::types::{ClusterHash, CustomCommand, SetOptions};
use sluicegate::{Admin, Config, Error, ListQuery, Listener, Missed, Quantum, RequestId, RequestState, ScheduleSpec};
use tokio_util::sync::CancellationToken;

use crate::support::{env_on, fast, start_worker, Job, Probe};

/// The key of shard 0 named `suffix`.
fn shard0(config: &Config, suffix: &str) -> String {
    let ns = config.namespace_str();
    format!("{ns}:{{{ns}.q0}}:{suffix}")
}

/// `FCALL sg2_<function>` with `keys` (all on shard 0) and `args`, sent raw: a worker of another
/// implementation, or one that dies half-way.
async fn fcall(redis: &Client, function: &str, keys: &[String], args: &[String]) -> Value {
    let slot = fred::util::redis_keyslot(keys[0].as_bytes());
    let mut all: Vec<Value> = vec![format!("sg2_{function}").into(), (keys.len() as i64).into()];
    all.extend(keys.iter().map(|k| Value::from(k.as_str())));
    all.extend(args.iter().map(|a| Value::from(a.as_str())));
    redis.custom(CustomCommand::new("FCALL", ClusterHash::Custom(slot), false), all).await.unwrap()
}

/// The requests of schedule `name`, by tick: their state now (the listing, by their tag).
async fn fired(admin: &Admin, name: &str) -> BTreeMap<i64, RequestState> {
    let mut out = BTreeMap::new();
    let mut query = ListQuery::new().tag(format!("schedule:{name}")).limit(sluicegate::MAX_LIST_LIMIT);
    loop {
        let page = admin.list(&query).await.unwrap();
        for r in page.requests {
            let (prefix, tick) = r.id.rsplit_once('@').expect("a schedule's request id");
            assert_eq!(prefix, name, "{}", r.id);
            out.insert(tick.parse().expect("a tick in ms"), r.state);
        }
        match page.cursor {
            Some(cursor) => query = query.cursor(cursor),
            None => return out,
        }
    }
}

/// Waits until schedule `name`, paused, is done firing: every tick before its pause fired (it is
/// out of the due set, or due only after its pause), it owes nothing, and every request it fired
/// finished; returns them by tick.
async fn settled(admin: &Admin, config: &Config, name: &str, within: Duration) -> BTreeMap<i64, RequestState> {
    let redis = sluicegate_testkit::connect(config.url()).await.unwrap();
    let deadline = Instant::now() + within;
    loop {
        let due: Option<f64> = redis.zscore(shard0(config, "sch:due"), name).await.unwrap();
        let listed = admin.schedule(name).await.unwrap();
        let (owed, paused) = (listed.owed_ms, listed.paused_ms.expect("paused"));
        let fired = fired(admin, name).await;
        let done_firing = !matches!(due, Some(due) if due as i64 <= paused);
        if done_firing && owed.is_empty() && fired.values().all(|s| s.is_terminal()) {
            return fired;
        }
        assert!(Instant::now() < deadline, "schedule {name} is due at {due:?}, owes {owed:?}; fired {fired:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The difference of two sets of ticks, for a message.
fn missing(expected: &BTreeSet<i64>, got: &BTreeSet<i64>) -> String {
    let missing: Vec<i64> = expected.difference(got).copied().collect();
    let extra: Vec<i64> = got.difference(expected).copied().collect();
    format!("missing {missing:?}, extra {extra:?}")
}

/// Completion events per request id, from the beginning of the events streams.
async fn events(config: &Config) -> BTreeMap<String, Vec<RequestState>> {
    let mut listener = Listener::from_beginning(config).await.unwrap();
    let mut out: BTreeMap<String, Vec<RequestState>> = BTreeMap::new();
    while let Ok(Ok(batch)) = tokio::time::timeout(Duration::from_millis(500), listener.next_batch(1_000)).await {
        for e in batch {
            out.entry(e.id.to_string()).or_default().push(e.state);
        }
    }
    out
}

/// The whole seconds `t` with `after < t <= upto` (ms).
fn seconds(after: i64, upto: i64) -> BTreeSet<i64> {
    ((after / 1000 + 1)..=(upto / 1000)).map(|s| s * 1000).collect()
}

/// Keeps the schedules' claims from holding, as if every claimer stalled past its claim: over
/// and over, it reads Redis time (a `claim_due` of its own, whose index keys are empty and whose
/// claim is 0 ms) and brings every schedule claimed beyond the next few seconds back to now, so
/// that the next worker's pass takes it again while its claimer is still firing it. Returns how
/// many claims it broke.
async fn break_claims(redis: Client, config: Config, stop: CancellationToken) -> u64 {
    let keys = ["breaker-a", "breaker-b", "breaker-c", "sch:due"].map(|k| shard0(&config, k));
    let mut broken = 0;
    while !stop.is_cancelled() {
        let reply: Vec<Value> = fcall(&redis, "claim_due", &keys, &["100".into(), "0".into()]).await.convert().unwrap();
        // '' and the Redis time, then the releases and the names.
        let now = reply.get(1).and_then(Value::as_i64).expect("the Redis time");
        let scores: Vec<(String, f64)> = redis.zrange(&keys[3], 0, -1, None, false, None, true).await.unwrap();
        for (name, score) in scores {
            // A claim (five leases ahead), not a next tick (a second ahead at most).
            if score as i64 > now + 10_000 {
                let _: Value = redis
                    .zadd(&keys[3], Some(SetOptions::XX), Some(Ordering::LessThan), false, false, (now as f64, name))
                    .await
                    .unwrap();
                broken += 1;
            }
        }
        tokio::task::yield_now().await;
    }
    broken
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cron_fires_once_per_tick_with_three_workers_racing() {
    let env = env_on(TOPOLOGY, "sched-race").await;
    // Redis time runs 10 times as fast as real time: the 20 s lease is 2 s real, the 500 ms
    // heartbeat 5 s of Redis time; 12 s real are two minutes of ticks. Each worker looks for due
    // schedules every 3 ms, so that one looks while another is firing.
    let config = env
        .config
        .clone()
        .test_clock(true)
        .lease(Duration::from_secs(20))
        .heartbeat(Duration::from_millis(500))
        .recovery_interval(Duration::from_millis(3));
    sluicegate::set_test_clock(&config, 10.0, Duration::ZERO).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(start_worker(&config, Probe::default(), 2, Quantum::default()).await);
    }
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let stop = CancellationToken::new();
    let breaker = tokio::spawn(break_claims(redis, config.clone(), stop.clone()));
    let name = "every-second";
    let spec = ScheduleSpec::new(name, "* * * * * *")
        .and_then(|s| s.missed(Missed::CatchUp(100)))
        .and_then(|s| s.parts([Job::new(1)]))
        .unwrap();
    admin.schedule_add(&spec).await.unwrap();
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(admin.schedule_pause(name).await.unwrap());
    let mut fired = settled(&admin, &config, name, Duration::from_secs(30)).await;
    let listed = admin.schedule(name).await.unwrap();
    let paused = listed.paused_ms.expect("paused");
    let expected = seconds(listed.added_ms, paused);
    // The breaker moves a claimed schedule's due score past the pause while its claimer is still
    // submitting the last ticks before it, which `settled` takes for done: give the firing under
    // way the same 30 s to land (a tick never fired still fails below).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(expected.iter().all(|t| fired.contains_key(t)) && fired.values().all(|s| s.is_terminal()))
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        fired = fired_now(&admin, name).await;
    }
    stop.cancel();
    let broken = breaker.await.unwrap();

    // Every second after the add, up to the pause, fired: no tick missed, none at another time.
    assert!(expected.len() >= 100, "only {} ticks in the window", expected.len());
    let got: BTreeSet<i64> = fired.keys().copied().collect();
    assert_eq!(got, expected, "{}", missing(&expected, &got));
    assert!(fired.values().all(|s| *s == RequestState::Completed), "{fired:?}");
    // Each request completed once.
    let events = events(&config).await;
    for tick in &expected {
        let id = format!("{name}@{tick}");
        assert_eq!(events.get(&id).map(Vec::as_slice), Some(&[RequestState::Completed][..]), "{id}");
    }
    assert_eq!(events.len(), expected.len(), "events of other requests: {events:?}");
    // One submit per tick created its request; the race happened: claims broke, and workers met
    // each other's firings and submits.
    let sum = |f: fn(&sluicegate::WorkerMetrics) -> &std::sync::atomic::AtomicU64| {
        workers.iter().map(|w| f(&w.metrics()).load(Relaxed)).sum::<u64>()
    };
    let (submits, duplicates, conflicts) =
        (sum(|m| &m.schedule_submits), sum(|m| &m.schedule_duplicates), sum(|m| &m.schedule_conflicts));
    assert_eq!(submits, expected.len() as u64, "accepted submits (duplicates {duplicates})");
    assert!(duplicates + conflicts > 0, "no race: {duplicates} duplicates, {conflicts} conflicts, {broken} claims broken");
    eprintln!(
        "{} ticks: {submits} submits, {duplicates} duplicates, {conflicts} conflicts, {broken} claims broken",
        expected.len()
    );
    for w in workers {
        w.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_fired_by_a_worker_that_died_before_submitting_is_paid_after_the_claim() {
    let env = env_on(TOPOLOGY, "sched-dead").await;
    let config = fast(&env.config);
    let admin = Admin::connect(&config).await.unwrap();
    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let name = "dead-firer";
    let spec = ScheduleSpec::new(name, "* * * * * *").and_then(|s| s.parts([Job::new(7)])).unwrap();
    admin.schedule_add(&spec).await.unwrap();
    // A worker's pass, raw: it claims the schedule for 3 s, reads it, owes its first tick T...
    let claim_keys = ["dead-a", "dead-b", "dead-c", "sch:due"].map(|k| shard0(&config, k));
    let claimed: Vec<String> =
        fcall(&redis, "claim_due", &claim_keys, &["100".into(), "3000".into()]).await.convert().unwrap();
    // '', the Redis time, the releases claimed (none: "dead-c" is no outbox), then the names.
    assert_eq!(claimed.get(2).map(String::as_str), Some("0"), "{claimed:?}");
    assert_eq!(claimed.get(3).map(String::as_str), Some(name), "{claimed:?}");
    let now: i64 = claimed[1].parse().unwrap();
    let state_keys = [shard0(&config, "sch"), shard0(&config, &format!("sch:s:{name}"))];
    let read: Vec<Value> = fcall(&redis, "sched_get", &state_keys, &[name.into()]).await.convert().unwrap();
    let gen = read[1].as_string().unwrap();
    let tick = (now / 1000 + 1) * 1000;
    tokio::time::sleep(Duration::from_millis((tick - now + 50) as u64)).await;
    let fire_keys = [shard0(&config, "sch:due"), shard0(&config, &format!("sch:s:{name}"))];
    let args = [name.into(), gen, String::new(), (tick + 1000).to_string(), String::new(), "3000".into(), tick.to_string()];
    let fired: Vec<Value> = fcall(&redis, "sched_fire", &fire_keys, &args).await.convert().unwrap();
    assert_eq!(fired, [Value::from("ok"), Value::from(tick)]);
    let died = Instant::now();
    // ... and dies there. A worker starts: the claim holds for 3 s, then it pays the debt.
    let worker = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(fired_in(&admin, name).await, Vec::<i64>::new(), "nothing is submitted while the claim holds");
    let id = RequestId::new(format!("{name}@{tick}")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        match admin.status(&id).await {
            Ok(s) if s.state == RequestState::Completed => break s,
            Ok(_) | Err(Error::UnknownRequest(_)) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(Instant::now() < deadline, "tick {tick}'s request never completed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(died.elapsed() >= Duration::from_millis(2_800), "submitted {:?} after the death", died.elapsed());
    assert!(status.created_ms as i64 >= now + 3_000 - 100, "created at {} within the claim", status.created_ms);
    assert!(admin.schedule_pause(name).await.unwrap());
    let after = settled(&admin, &config, name, Duration::from_secs(10)).await;
    assert_eq!(after.get(&tick), Some(&RequestState::Completed));
    // The skip policy: at its first firing the worker owed the latest due tick, not the ones the
    // claim held back (besides the debt).
    let later: Vec<i64> = after.keys().copied().filter(|t| *t > tick).collect();
    assert!(later.first().is_some_and(|t| *t >= tick + 2_000), "{after:?}");
    worker.stop().await;
}

/// The ticks schedule `name` fired so far.
async fn fired_now(admin: &Admin, name: &str) -> BTreeMap<i64, RequestState> {
    fired(admin, name).await
}

async fn fired_in(admin: &Admin, name: &str) -> Vec<i64> {
    fired(admin, name).await.into_keys().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_schedule_owes_nothing_until_resumed_and_a_removed_one_is_gone() {
    let env = env_on(TOPOLOGY, "sched-pause").await;
    // Redis time runs 10 times as fast: 400 ms real are 4 s of ticks.
    let config = env
        .config
        .clone()
        .test_clock(true)
        .lease(Duration::from_secs(20))
        .heartbeat(Duration::from_millis(500))
        .recovery_interval(Duration::from_millis(20));
    sluicegate::set_test_clock(&config, 10.0, Duration::ZERO).await.unwrap();
    let admin = Admin::connect(&config).await.unwrap();
    let worker = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    let name = "pausing";
    let spec = ScheduleSpec::new(name, "* * * * * *")
        .and_then(|s| s.missed(Missed::CatchUp(100)))
        .and_then(|s| s.parts([Job::new(2)]))
        .and_then(|s| s.tag("team:ops"))
        .unwrap();
    admin.schedule_add(&spec).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(admin.schedule_pause(name).await.unwrap());
    assert!(!admin.schedule_pause(name).await.unwrap(), "paused already");
    let first_pause = admin.schedule(name).await.unwrap().paused_ms.expect("paused");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(admin.schedule_resume(name).await.unwrap());
    assert!(!admin.schedule_resume(name).await.unwrap(), "resumed already");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(admin.schedule_pause(name).await.unwrap());
    let fired = settled(&admin, &config, name, Duration::from_secs(20)).await;

    let redis = sluicegate_testkit::connect(env.redis.url()).await.unwrap();
    let state: BTreeMap<String, String> = redis.hgetall(shard0(&config, &format!("sch:s:{name}"))).await.unwrap();
    let listed = admin.schedule(name).await.unwrap();
    // Ticks from the add to the first pause, and from the resume to the second: none between.
    let resumed: i64 = state["resumed"].parse().unwrap();
    let paused = listed.paused_ms.expect("paused");
    let mut expected = seconds(listed.added_ms, first_pause);
    expected.extend(seconds(resumed, paused));
    let got: BTreeSet<i64> = fired.keys().copied().collect();
    assert_eq!(got, expected, "{}", missing(&expected, &got));
    assert!(got.len() >= 5, "{got:?}");
    // The listing.
    let all = admin.schedules().await.unwrap();
    assert_eq!(all.len(), 1);
    let s = &all[0];
    assert_eq!((s.name.as_str(), s.cron.as_str(), s.time_zone.as_deref()), (name, "* * * * * *", None));
    assert_eq!((s.missed, s.parts, s.priority), (Missed::CatchUp(100), 1, 50));
    assert_eq!(s.tags, ["schedule:pausing", "team:ops"]);
    assert_eq!((s.next_ms, s.last_ms, s.owed_ms.as_slice()), (None, got.last().copied(), &[][..]));
    // Removed: gone from the listing, its requests stay, and a second removal says it is unknown.
    admin.schedule_remove(name).await.unwrap();
    assert!(admin.schedules().await.unwrap().is_empty());
    assert!(matches!(admin.schedule_remove(name).await, Err(Error::UnknownSchedule(n)) if n == name));
    assert!(matches!(admin.schedule_pause(name).await, Err(Error::UnknownSchedule(_))));
    assert!(matches!(admin.schedule(name).await, Err(Error::UnknownSchedule(_))));
    assert_eq!(fired_in(&admin, name).await.len(), got.len());
    let keys: Vec<String> = sluicegate_testkit::keys_in_namespace(env.redis.url(), config.namespace_str())
        .await
        .unwrap()
        .into_iter()
        .filter(|k| (k.ends_with(":sch") || k.contains(":sch:")) && !k.ends_with(":sch:gen"))
        .collect();
    assert!(keys.is_empty(), "the schedule's keys are left (only the schedules' counter stays): {keys:?}");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missed_ticks_are_skipped_or_caught_up_as_each_schedule_says() {
    let env = env_on(TOPOLOGY, "sched-missed").await;
    let config = fast(&env.config).test_clock(true);
    let admin = Admin::connect(&config).await.unwrap();
    let spec = |name: &str, missed| {
        ScheduleSpec::new(name, "* * * * * *").and_then(|s| s.missed(missed)).and_then(|s| s.parts([Job::new(3)])).unwrap()
    };
    admin.schedule_add(&spec("skipping", Missed::Skip)).await.unwrap();
    admin.schedule_add(&spec("catching-up", Missed::CatchUp(3))).await.unwrap();
    // A minute passes without any worker.
    sluicegate::set_test_clock(&config, 1.0, Duration::from_secs(60)).await.unwrap();
    let worker = start_worker(&config, Probe::default(), 2, Quantum::default()).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for name in ["skipping", "catching-up"] {
        admin.schedule_pause(name).await.unwrap();
    }
    let skipped: Vec<i64> = settled(&admin, &config, "skipping", Duration::from_secs(10)).await.into_keys().collect();
    let caught: Vec<i64> = settled(&admin, &config, "catching-up", Duration::from_secs(10)).await.into_keys().collect();
    let added = admin.schedule("skipping").await.unwrap().added_ms;
    // Both fired every second from their first firing on, which came a minute after the add;
    // both were first claimed together, at one Redis time T: `skip` owed T alone, `catch-up 3`
    // the two seconds before it too.
    for ticks in [&skipped, &caught] {
        assert!(ticks.windows(2).all(|w| w[1] - w[0] == 1_000), "{ticks:?}");
        assert!(ticks[0] > added + 55_000, "{ticks:?} after an add at {added}");
    }
    assert_eq!(caught[0], skipped[0] - 2_000, "skip {skipped:?}, catch-up {caught:?}");
    worker.stop().await;
}

/// Europe/Rome: 02:00 CET becomes 03:00 CEST on 28 March 2027 (01:00 UTC), 03:00 CEST becomes
/// 02:00 CET on 31 October 2027 (01:00 UTC). Redis time jumps there and runs at 3,600 times real
/// time (an hour a second; leases and heartbeats scaled alike).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_time_in_a_time_zone_fires_once_across_each_change_of_its_clocks() {
    let env = env_on(TOPOLOGY, "sched-dst").await;
    let config = env
        .config
        .clone()
        .test_clock(true)
        .lease(Duration::from_secs(4 * 3600))
        .heartbeat(Duration::from_millis(500))
        .retention(Duration::from_secs(366 * 24 * 3600))
        .recovery_interval(Duration::from_millis(20));
    let jump_to = |at_ms: i64| {
        let config = config.clone();
        async move {
            let now = sluicegate::set_test_clock(&config, 3_600.0, Duration::ZERO).await.unwrap();
            let jump = Duration::from_millis(u64::try_from(at_ms - now).expect("forward"));
            sluicegate::set_test_clock(&config, 3_600.0, jump).await.unwrap()
        }
    };
    let admin = Admin::connect(&config).await.unwrap();
    let name = "half-past-two";
    let spec = ScheduleSpec::new(name, "0 30 2 * * *")
        .and_then(|s| s.time_zone("Europe/Rome"))
        .and_then(|s| s.parts([Job::new(4)]))
        .unwrap();
    // 2027-03-28 00:10 UTC (01:10 CET) to about 02:40 UTC: 02:30 does not exist that night.
    jump_to(1_806_192_600_000).await;
    admin.schedule_add(&spec).await.unwrap();
    let worker = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    admin.schedule_pause(name).await.unwrap();
    let spring = settled(&admin, &config, name, Duration::from_secs(10)).await;
    // Fired once, at the first instant after the gap: 03:00 CEST, 01:00 UTC.
    assert_eq!(spring.into_keys().collect::<Vec<_>>(), [1_806_195_600_000]);
    worker.stop().await;
    // 2027-10-31 00:00 UTC (02:00 CEST) to about 02:30 UTC: 02:30 happens twice that night.
    jump_to(1_824_940_800_000).await;
    admin.schedule_resume(name).await.unwrap();
    let worker = start_worker(&config, Probe::default(), 1, Quantum::default()).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    admin.schedule_pause(name).await.unwrap();
    let autumn: Vec<i64> = settled(&admin, &config, name, Duration::from_secs(10)).await.into_keys().collect();
    // Fired once, on the first pass: 02:30 CEST, 00:30 UTC (not again at 02:30 CET, 01:30 UTC).
    assert_eq!(autumn, [1_806_195_600_000, 1_824_942_600_000]);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_schedules_are_refused_with_what_is_wrong_and_an_add_is_idempotent() {
    let env = env_on(TOPOLOGY, "sched-bad").await;
    let admin = Admin::connect(&env.config).await.unwrap();
    let message = |e: Error| {
        assert!(matches!(e, Error::InvalidSchedule(_) | Error::InvalidRequest(_)), "{e:?}");
        e.to_string()
    };
    assert!(message(ScheduleSpec::new("a@b", "* * * * *").unwrap_err()).contains("invalid schedule name \"a@b\""));
    assert!(message(ScheduleSpec::new("", "* * * * *").unwrap_err()).contains("invalid schedule name \"\""));
    assert!(message(ScheduleSpec::new("x", "every minute").unwrap_err()).contains("invalid cron \"every minute\""));
    let ok = ScheduleSpec::new("x", "*/5 * * * *").unwrap();
    assert!(message(ok.clone().time_zone("Moon/Base").unwrap_err()).contains("unknown time zone \"Moon/Base\""));
    assert!(message(ok.clone().missed(Missed::CatchUp(101)).unwrap_err()).contains("catch-up 101 is out of range"));
    assert!(message(ok.clone().priority(100).unwrap_err()).contains("priority"));
    assert!(message(admin.schedule_add(&ok).await.unwrap_err()).contains("has no parts"));
    assert!(admin.schedules().await.unwrap().is_empty(), "nothing stored");
    // The same spec twice is one add; another spec under the name is refused, or replaces it.
    let ok = ok.parts([Job::new(1)]).unwrap();
    admin.schedule_add(&ok).await.unwrap();
    admin.schedule_add(&ok).await.unwrap();
    let other = ScheduleSpec::new("x", "0 * * * *").and_then(|s| s.parts([Job::new(1)])).unwrap();
    let e = admin.schedule_add(&other).await.unwrap_err();
    assert!(matches!(&e, Error::ScheduleExists(n) if n == "x"), "{e}");
    assert_eq!(admin.schedule("x").await.unwrap().cron, "*/5 * * * *");
    admin.schedule_replace(&other).await.unwrap();
    assert_eq!(admin.schedule("x").await.unwrap().cron, "0 * * * *");
    for e in [
        admin.schedule_pause("nope").await.unwrap_err(),
        admin.schedule_resume("nope").await.unwrap_err(),
        admin.schedule_remove("nope").await.unwrap_err(),
    ] {
        assert!(matches!(&e, Error::UnknownSchedule(n) if n == "nope"), "{e}");
    }
    assert!(message(admin.schedule("bad@name").await.unwrap_err()).contains("invalid schedule name"));
}
