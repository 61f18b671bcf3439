//! A worker process for the chaos suite (`tests/chaos.rs`): a sluicegate worker whose handler
//! counts itself in Redis, so the test can check from outside what ran, how often and how many at
//! once, even across SIGKILLs.
//!
//! Configured by environment variables (the test harness sets them all):
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `REDIS_URL` | where sluicegate connects (in the proxy run: the proxy) | `redis://127.0.0.1:6379` |
//! | `CHAOS_COUNTER_URL` | where the handler counts itself: the real server, never through the proxy, so counting is not disturbed by the faults under test | `REDIS_URL` |
//! | `CHAOS_NAMESPACE` | the sluicegate namespace | `chaos` |
//! | `CHAOS_SLOTS` | slots of this worker | 4 |
//! | `CHAOS_LEASE_MS`, `CHAOS_HEARTBEAT_MS`, `CHAOS_RECOVERY_MS` | sluicegate timings | 1500, 300, 300 |
//! | `CHAOS_RETENTION_MS` | how long results and records of a request this worker finishes are kept | 5000 |
//! | `CHAOS_IDLE_POLL_MS` | BRPOP timeout of an idle slot (bounds a graceful stop) | 250 |
//! | `CHAOS_QUANTUM_PARTS`, `CHAOS_QUANTUM_MS` | quantum: short, so tokens circulate a lot | 8, 100 |
//! | `CHAOS_EXTRA_SLEEP_MS` | `lo-hi`: random extra sleep per part, on top of the part's own `sleep_ms` | `0-0` |
//! | `RUST_LOG` | log filter (logs go to stderr) | `warn` |
//!
//! The handler takes a [`Part`] `{n, sleep_ms}`, sleeps, and returns `n * 3`. Around the sleep it
//! keeps these keys, outside the sluicegate namespace (`<ns>` is the namespace, `<kid>` the
//! request's key id):
//!
//! - `chaos:<ns>:running:<kid>`: sorted set of the handlers of that request running right now,
//!   member `<pid>:<uuid>`. A SIGKILLed process never removes its members; the harness removes
//!   every `<pid>:` member once the process is dead (see `tests/support/chaos.rs`).
//! - `chaos:<ns>:max:<kid>`: the most members the running set ever had.
//! - `chaos:<ns>:exec:<kid>`: set with one member `<index>:<pid>:<uuid>` per execution started.
//!
//! Every write is idempotent, so a command that fred re-sends after a reconnect (it retries
//! commands whose connection dropped in flight) cannot inflate a count. A plain INCR could.
//!
//! Once connected it prints one line on stdout, `READY pid=<pid> counter_client=<name>`. `<name>`
//! is the `CLIENT SETNAME` of its counting connection, which the harness uses to see when a killed
//! process's connection is gone. It stops gracefully on SIGTERM or ctrl-c.

use std::io::Write;
use std::ops::RangeInclusive;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fred::prelude::{
    Builder, Client, ClientLike, Config as FredConfig, ReconnectPolicy, SortedSetsInterface,
};
use fred::types::scripts::Script;
use rand::Rng;
use serde::{Deserialize, Serialize};
use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Quantum, Worker};

/// One sub-request of the chaos suite. The test harness has an identical struct.
#[derive(Serialize, Deserialize, Debug, Clone, Copy)]
struct Part {
    /// The number to transform.
    n: u64,
    /// How long the handler sleeps.
    sleep_ms: u64,
}

/// Registers a running handler and counts its execution, atomically, so the maximum is taken over
/// exactly the set that includes this handler.
/// KEYS: running zset, max string, exec set. ARGV: running member, score (ms), exec member.
const ENTER: &str = r"
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[3])
local n = redis.call('ZCARD', KEYS[1])
local max = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > max then redis.call('SET', KEYS[2], n) end
return n
";

/// How long the handler keeps retrying a counter write before it gives up. Long enough to ride
/// through a Redis restart; a give-up turns into a failed part, which the test reports.
const COUNTER_PATIENCE: Duration = Duration::from_secs(60);

/// The handler: counts itself, sleeps, answers `n * 3`.
struct Counted {
    counter: Client,
    enter: Script,
    namespace: String,
    pid: u32,
    extra_sleep_ms: RangeInclusive<u64>,
}

#[async_trait]
impl Handler for Counted {
    type Input = Part;
    type Output = u64;

    async fn handle(&self, ctx: Context, part: Part) -> Result<u64, HandlerError> {
        let kid = ctx.request_id().key_id();
        let prefix = format!("chaos:{}", self.namespace);
        let running = format!("{prefix}:running:{kid}");
        let max = format!("{prefix}:max:{kid}");
        let exec = format!("{prefix}:exec:{kid}");
        let me = format!("{}:{}", self.pid, uuid::Uuid::new_v4().simple());
        let execution = format!("{}:{me}", ctx.index());
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);

        retry("enter", || async {
            self.enter
                .evalsha_with_reload::<i64, _, _>(
                    &self.counter,
                    vec![running.clone(), max.clone(), exec.clone()],
                    vec![me.clone(), now_ms.to_string(), execution.clone()],
                )
                .await
        })
        .await?;

        let extra = if self.extra_sleep_ms.is_empty() {
            0
        } else {
            rand::thread_rng().gen_range(self.extra_sleep_ms.clone())
        };
        let sleep = tokio::time::sleep(Duration::from_millis(part.sleep_ms + extra));
        // A handler whose claim was lost stops early: its result would be dropped anyway, and
        // leaving the running set promptly keeps the concurrency count honest.
        let cancelled = tokio::select! {
            () = sleep => false,
            () = ctx.cancelled().cancelled() => true,
        };

        retry("leave", || async { self.counter.zrem::<i64, _, _>(running.as_str(), me.as_str()).await })
            .await?;
        if cancelled {
            return Err(HandlerError::new("claim lost while running; stopped early"));
        }
        Ok(part.n * 3)
    }
}

/// Runs `op` until it succeeds, with a short backoff, for at most [`COUNTER_PATIENCE`]: the counter
/// connection may be reconnecting (Redis restart) and the handler must not miscount because of it.
async fn retry<T, F, Fut>(what: &str, mut op: F) -> Result<T, HandlerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, fred::error::Error>>,
{
    let give_up = tokio::time::Instant::now() + COUNTER_PATIENCE;
    let mut pause = Duration::from_millis(20);
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if tokio::time::Instant::now() < give_up => {
                tracing::warn!(what, error = %e, "counter write failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            Err(e) => return Err(HandlerError::new(format!("chaos counter ({what}) failed: {e}"))),
        }
    }
}

/// An environment variable parsed as `T`, or `default` when unset.
fn env_or<T: FromStr>(name: &str, default: T) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v.parse().map_err(|e| format!("{name}={v:?}: {e}")),
        _ => Ok(default),
    }
}

/// `lo-hi` (or a single number) as an inclusive range of milliseconds.
fn parse_range(name: &str, text: &str) -> Result<RangeInclusive<u64>, String> {
    let bad = |e: std::num::ParseIntError| format!("{name}={text:?}: {e}");
    let (lo, hi) = match text.split_once('-') {
        Some((lo, hi)) => (lo.trim().parse().map_err(bad)?, hi.trim().parse().map_err(bad)?),
        None => {
            let n = text.trim().parse().map_err(bad)?;
            (n, n)
        }
    };
    if lo > hi {
        return Err(format!("{name}={text:?}: the low end is above the high end"));
    }
    Ok(lo..=hi)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();

    let url = env_or("REDIS_URL", sluicegate::DEFAULT_REDIS_URL.to_owned())?;
    let counter_url = env_or("CHAOS_COUNTER_URL", url.clone())?;
    let namespace = env_or("CHAOS_NAMESPACE", "chaos".to_owned())?;
    let slots: usize = env_or("CHAOS_SLOTS", 4)?;
    let ms = |name: &str, default: u64| env_or(name, default).map(Duration::from_millis);
    let lease = ms("CHAOS_LEASE_MS", 1500)?;
    let heartbeat = ms("CHAOS_HEARTBEAT_MS", 300)?;
    let recovery = ms("CHAOS_RECOVERY_MS", 300)?;
    // The worker that completes a request sets the expiry of its results, so retention is a worker
    // setting too, not only the producer's.
    let retention = ms("CHAOS_RETENTION_MS", 5000)?;
    let idle_poll = ms("CHAOS_IDLE_POLL_MS", 250)?;
    let quantum = Quantum { parts: env_or("CHAOS_QUANTUM_PARTS", 8)?, time: ms("CHAOS_QUANTUM_MS", 100)? };
    let extra_sleep_ms =
        parse_range("CHAOS_EXTRA_SLEEP_MS", &env_or("CHAOS_EXTRA_SLEEP_MS", "0-0".to_owned())?)?;

    // Its own connection, straight to the server: the counts must not depend on the connection
    // faults the test injects between sluicegate and Redis. CLIENT SETNAME (fred's client id) is
    // re-sent on every reconnect, so the harness can always find this connection by name.
    let counter = Builder::from_config(FredConfig::from_url(&counter_url)?)
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 1_000, 2))
        .with_connection_config(|c| c.auto_client_setname = true)
        .build()?;
    counter.init().await?;

    let pid = std::process::id();
    let handler = Counted {
        counter: counter.clone(),
        enter: Script::from_lua(ENTER),
        namespace: namespace.clone(),
        pid,
        extra_sleep_ms,
    };
    let config = Config::new(url)
        .namespace(namespace)
        .lease(lease)
        .heartbeat(heartbeat)
        .recovery_interval(recovery)
        .retention(retention);
    let worker =
        Worker::builder(&config, handler).slots(slots).quantum(quantum).idle_poll(idle_poll).build().await?;

    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "READY pid={pid} counter_client={}", counter.id())?;
    stdout.flush()?;
    drop(stdout);

    worker.run().await?;
    counter.quit().await?;
    Ok(())
}
