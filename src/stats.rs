//! Stats by stage: per namespace and priority, how many requests were submitted, started,
//! completed and failed, how many sub-request attempts succeeded, were retried or
//! dead-lettered, how many acks were fenced, and histograms of the queue wait (submit to a
//! request's first start), the run time of each sub-request attempt and the request duration
//! (submit to its terminal state).
//!
//! Kept in Redis as one hash per minute (`Keys::stats_minute`, docs/protocol.md §3), like
//! Sidekiq 7's metrics: bounded memory whatever the load, and a window of any length read with
//! one pipeline. Nothing is written on the hot path: producers and workers count in memory
//! ([`Recorder`]) and add what they counted with one `stats_add` call per flush interval
//! (`Config::stats_flush_interval`), and a worker once more when it stops. The times come back
//! without a call of their own: `acquire` (and a lane's hand-out) reports the queue wait when it
//! starts a request, and a finish reports the request's lifecycle, whose first digits are its
//! creation time.
//!
//! Minutes are the counting process's clock's (Unix ms / 60,000); the queue wait is measured by
//! Redis's clock, the request duration from Redis's creation time to the finishing worker's
//! clock, so keep the clocks in step (NTP).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use fred::prelude::*;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::protocol::stats::{self as calls, MinuteCounts};
use crate::request::Priority;
use crate::store::Store;

/// A minute's length in ms: a bucket's width.
const MINUTE_MS: u64 = 60_000;

/// The upper bounds (ms) of the histograms' buckets, 1-2-5 steps from 1 ms to about 2.8 h; a last
/// bucket, `inf`, holds the rest. A bucket holds the samples above the previous bound, at most its
/// own. Only buckets with samples are stored.
pub(crate) const BOUNDS_MS: [u64; 22] = [
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000,
    500_000, 1_000_000, 2_000_000, 5_000_000, 10_000_000,
];

/// At most this many minutes are read at once (a pipeline each).
const READ_CHUNK: usize = 500;

/// The longest window [`read`] looks at: 31 days of minutes.
const LONGEST: Duration = Duration::from_secs(31 * 24 * 3600);

/// What is counted, one field `<priority>|<name>` per minute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Counter {
    /// Requests accepted by a producer (counted by the producer).
    Submitted,
    /// Requests started: the first hand-out of one of their parts.
    Started,
    /// Requests that turned completed (in a worker's ack).
    Completed,
    /// Requests that turned failed (in a worker's ack).
    Failed,
    /// Sub-request attempts whose result was stored.
    Succeeded,
    /// Sub-request attempts that failed and will run again.
    Retried,
    /// Sub-requests dead-lettered.
    DeadLettered,
    /// Acks refused because the slot no longer held the token as it was.
    Fenced,
}

impl Counter {
    const ALL: [Counter; 8] = [
        Counter::Submitted,
        Counter::Started,
        Counter::Completed,
        Counter::Failed,
        Counter::Succeeded,
        Counter::Retried,
        Counter::DeadLettered,
        Counter::Fenced,
    ];

    fn name(self) -> &'static str {
        match self {
            Counter::Submitted => "submitted",
            Counter::Started => "started",
            Counter::Completed => "completed",
            Counter::Failed => "failed",
            Counter::Succeeded => "succeeded",
            Counter::Retried => "retried",
            Counter::DeadLettered => "dead_lettered",
            Counter::Fenced => "fenced",
        }
    }
}

/// What is timed, one field `<priority>|<name>|<bucket>` per bucket with samples per minute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Timing {
    /// From a request's submit (its commit, or the end of its delay) to its first start.
    Wait,
    /// One sub-request attempt's handler run.
    Run,
    /// From a request's submit to its terminal state (completed or failed).
    Duration,
}

impl Timing {
    const ALL: [Timing; 3] = [Timing::Wait, Timing::Run, Timing::Duration];

    fn name(self) -> &'static str {
        match self {
            Timing::Wait => "wait",
            Timing::Run => "run",
            Timing::Duration => "duration",
        }
    }
}

/// One field of a minute's hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Stat {
    Count(Counter),
    /// A histogram's bucket: its index in `BOUNDS_MS`, or `BOUNDS_MS.len()` for `inf`.
    Bucket(Timing, u8),
}

fn bucket_name(index: usize) -> String {
    BOUNDS_MS.get(index).map_or_else(|| "inf".to_owned(), u64::to_string)
}

fn field(priority: u8, stat: Stat) -> String {
    match stat {
        Stat::Count(c) => format!("{priority}|{}", c.name()),
        Stat::Bucket(t, b) => format!("{priority}|{}|{}", t.name(), bucket_name(usize::from(b))),
    }
}

/// The bucket of a duration.
fn bucket_of(d: Duration) -> u8 {
    let ms = d.as_secs_f64() * 1000.0;
    BOUNDS_MS.iter().position(|b| ms <= *b as f64).unwrap_or(BOUNDS_MS.len()) as u8
}

/// Unix time in ms by this process's clock.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A component's counts not yet added to Redis: per minute, priority and field, a delta. Counting
/// takes a lock and a hash-map update (no allocation once a field has been seen that minute).
#[derive(Debug)]
pub(crate) struct Recorder {
    /// How long Redis keeps a minute's hash; zero: nothing is counted.
    keep: Duration,
    pending: Mutex<HashMap<(u64, u8, Stat), i64>>,
}

impl Recorder {
    /// A recorder whose counts Redis keeps for `keep` (zero: one that counts nothing).
    pub(crate) fn new(keep: Duration) -> Self {
        Self { keep, pending: Mutex::new(HashMap::new()) }
    }

    /// One that counts nothing.
    pub(crate) fn off() -> Self {
        Self::new(Duration::ZERO)
    }

    /// Whether it counts.
    pub(crate) fn is_on(&self) -> bool {
        !self.keep.is_zero()
    }

    /// Whether it holds nothing to flush.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(u64, u8, Stat), i64>> {
        // Single inserts and updates: a panic cannot leave the map inconsistent.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, priority: Priority, stat: Stat, n: i64) {
        if !self.is_on() || n == 0 {
            return;
        }
        let minute = now_ms() / MINUTE_MS;
        *self.lock().entry((minute, priority.get(), stat)).or_default() += n;
    }

    /// Counts `n` of `counter` at `priority`, in the current minute.
    pub(crate) fn count(&self, priority: Priority, counter: Counter, n: u64) {
        self.add(priority, Stat::Count(counter), i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Adds a sample of `timing` at `priority`, in the current minute.
    pub(crate) fn time(&self, priority: Priority, timing: Timing, took: Duration) {
        self.add(priority, Stat::Bucket(timing, bucket_of(took)), 1);
    }

    /// A request of `priority` turned `state` (counted if completed or failed), in lifecycle
    /// `lifecycle` (its created ms * 1000, plus less than 1000): its duration is from its creation
    /// to now.
    pub(crate) fn finished(&self, priority: Priority, state: &str, lifecycle: i64) {
        let counter = match state {
            "completed" => Counter::Completed,
            "failed" => Counter::Failed,
            _ => return,
        };
        self.count(priority, counter, 1);
        let created = u64::try_from(lifecycle / 1000).unwrap_or(0);
        self.time(priority, Timing::Duration, Duration::from_millis(now_ms().saturating_sub(created)));
    }

    /// Adds what was counted to Redis in one call, and forgets it. If the call fails, the counts
    /// are kept for the next flush (those of minutes older than the retention are dropped).
    pub(crate) async fn flush(&self, store: &Store) -> Result<()> {
        let taken = std::mem::take(&mut *self.lock());
        if taken.is_empty() {
            return Ok(());
        }
        let mut minutes: BTreeMap<u64, Vec<(String, i64)>> = BTreeMap::new();
        for ((minute, priority, stat), n) in &taken {
            minutes.entry(*minute).or_default().push((field(*priority, *stat), *n));
        }
        let minutes: Vec<MinuteCounts> = minutes.into_iter().collect();
        match calls::add(store, self.keep, &minutes).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let oldest = now_ms().saturating_sub(crate::config::millis(self.keep)) / MINUTE_MS;
                let mut pending = self.lock();
                for (key, n) in taken {
                    if key.0 >= oldest {
                        *pending.entry(key).or_default() += n;
                    }
                }
                Err(e)
            }
        }
    }
}

/// Flushes `recorder` every flush interval until `stop`, then once more. Owned by the component
/// that started it (a worker's `run_until`, a producer's last handle).
pub(crate) async fn flush_until(recorder: &Recorder, store: &Store, stop: CancellationToken) {
    let every = store.config.stats_flush;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
        if let Err(e) = recorder.flush(store).await {
            tracing::debug!(error = %e, "could not add the stats by stage; trying again at the next flush");
        }
    }
    if let Err(e) = recorder.flush(store).await {
        tracing::warn!(error = %e, "could not add the last stats by stage; they are lost");
    }
}

/// A histogram of the stats by stage: samples per bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StageHistogram {
    /// The buckets with samples, in order: each holds the samples above the previous bucket's
    /// bound, at most its own `le_ms` (`None`: no bound, the last bucket).
    pub buckets: Vec<StageBucket>,
}

/// One bucket of a [`StageHistogram`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StageBucket {
    /// Its upper bound in ms; `None` for the last bucket, which has none.
    pub le_ms: Option<u64>,
    /// Samples in it.
    pub count: u64,
}

impl StageHistogram {
    /// How many samples it holds.
    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.count).sum()
    }

    /// The `q` quantile (0 to 1), interpolated linearly within its bucket as Prometheus's
    /// `histogram_quantile` does (a sample in the last bucket counts as the last bound); `None`
    /// without samples. Its error is at most its bucket's width.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for b in &self.buckets {
            let lower = lower_bound(b.le_ms);
            if (below + b.count) as f64 >= rank && b.count > 0 {
                let Some(upper) = b.le_ms else {
                    return Some(Duration::from_millis(lower));
                };
                let within = ((rank - below as f64) / b.count as f64).clamp(0.0, 1.0);
                let ms = lower as f64 + (upper - lower) as f64 * within;
                return Some(Duration::from_secs_f64(ms / 1000.0));
            }
            below += b.count;
        }
        self.buckets.last().map(|b| Duration::from_millis(b.le_ms.unwrap_or_else(|| lower_bound(None))))
    }

    fn add(&mut self, le_ms: Option<u64>, n: u64) {
        match self.buckets.iter_mut().find(|b| b.le_ms == le_ms) {
            Some(b) => b.count += n,
            None => {
                self.buckets.push(StageBucket { le_ms, count: n });
                self.buckets.sort_by_key(|b| b.le_ms.unwrap_or(u64::MAX));
            }
        }
    }
}

/// The bound below the bucket whose upper bound is `le_ms` (0 below the first).
fn lower_bound(le_ms: Option<u64>) -> u64 {
    let at = le_ms.and_then(|l| BOUNDS_MS.iter().position(|b| *b == l)).unwrap_or(BOUNDS_MS.len());
    at.checked_sub(1).map_or(0, |i| BOUNDS_MS[i])
}

/// The stats by stage of one priority over a window ([`StageStats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PriorityStages {
    /// The priority.
    pub priority: u8,
    /// Requests submitted (counted by producers).
    pub submitted: u64,
    /// Requests started (their first part handed out).
    pub started: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Requests that failed (a part dead-lettered).
    pub failed: u64,
    /// Sub-request attempts whose result was stored.
    pub succeeded: u64,
    /// Sub-request attempts that failed and were retried.
    pub retried: u64,
    /// Sub-requests dead-lettered.
    pub dead_lettered: u64,
    /// Acks refused because the slot no longer held the token as it was (results dropped).
    pub fenced: u64,
    /// From submit to first start, one sample per request started.
    pub queue_wait: StageHistogram,
    /// Each sub-request attempt's run.
    pub run_time: StageHistogram,
    /// From submit to completed or failed, one sample per request.
    pub duration: StageHistogram,
}

impl PriorityStages {
    fn counter(&mut self, c: Counter) -> &mut u64 {
        match c {
            Counter::Submitted => &mut self.submitted,
            Counter::Started => &mut self.started,
            Counter::Completed => &mut self.completed,
            Counter::Failed => &mut self.failed,
            Counter::Succeeded => &mut self.succeeded,
            Counter::Retried => &mut self.retried,
            Counter::DeadLettered => &mut self.dead_lettered,
            Counter::Fenced => &mut self.fenced,
        }
    }

    fn histogram(&mut self, t: Timing) -> &mut StageHistogram {
        match t {
            Timing::Wait => &mut self.queue_wait,
            Timing::Run => &mut self.run_time,
            Timing::Duration => &mut self.duration,
        }
    }
}

/// One minute's hash as stored: its fields and counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct MinuteStats {
    /// When the minute began (Unix ms).
    pub minute_ms: u64,
    /// Its fields (`<priority>|<counter>`, `<priority>|<histogram>|<bucket>`) and counts.
    pub fields: BTreeMap<String, u64>,
}

/// A namespace's stats by stage over a window of whole minutes (`Admin::stats_since`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StageStats {
    /// When the window began: the start of its first minute (Unix ms).
    pub from_ms: u64,
    /// When it was read (Unix ms).
    pub to_ms: u64,
    /// Per priority with anything counted, highest first.
    pub priorities: Vec<PriorityStages>,
    /// The minutes with anything counted, oldest first, as stored.
    pub minutes: Vec<MinuteStats>,
}

impl StageStats {
    /// The window's length.
    pub fn window(&self) -> Duration {
        Duration::from_millis(self.to_ms.saturating_sub(self.from_ms).max(1))
    }

    /// `n` per second over the window.
    pub fn per_second(&self, n: u64) -> f64 {
        n as f64 / self.window().as_secs_f64()
    }

    /// Sums the minutes into the per-priority figures.
    pub(crate) fn from_minutes(from_ms: u64, to_ms: u64, minutes: Vec<MinuteStats>) -> Self {
        let mut by: BTreeMap<u8, PriorityStages> = BTreeMap::new();
        for m in &minutes {
            for (name, n) in &m.fields {
                let Some((priority, stat)) = parse_field(name) else { continue };
                let p =
                    by.entry(priority).or_insert_with(|| PriorityStages { priority, ..Default::default() });
                match stat {
                    Stat::Count(c) => *p.counter(c) += n,
                    Stat::Bucket(t, b) => p.histogram(t).add(BOUNDS_MS.get(usize::from(b)).copied(), *n),
                }
            }
        }
        Self { from_ms, to_ms, priorities: by.into_values().rev().collect(), minutes }
    }
}

/// Whether `name` is a field this version writes (`<priority>|<counter>`,
/// `<priority>|<histogram>|<bucket>`).
#[cfg(test)]
pub(crate) fn is_known_field(name: &str) -> bool {
    parse_field(name).is_some()
}

/// A stored field's priority and meaning; `None` for a field this version does not know.
fn parse_field(name: &str) -> Option<(u8, Stat)> {
    let mut parts = name.split('|');
    let priority: u8 = parts.next()?.parse().ok()?;
    Priority::new(priority).ok()?;
    let what = parts.next()?;
    let stat = match parts.next() {
        None => Stat::Count(*Counter::ALL.iter().find(|c| c.name() == what)?),
        Some(bucket) => {
            let timing = *Timing::ALL.iter().find(|t| t.name() == what)?;
            let index = (0..=BOUNDS_MS.len()).find(|i| bucket_name(*i) == bucket)?;
            Stat::Bucket(timing, index as u8)
        }
    };
    parts.next().is_none().then_some((priority, stat))
}

/// Reads the minutes of the last `since` (whole minutes: the first one began before it; at most
/// 31 days), one pipeline per 500 minutes on shard 0.
pub(crate) async fn read(store: &Store, since: Duration) -> Result<StageStats> {
    let to_ms = now_ms();
    let since = crate::config::millis(since.min(LONGEST));
    let first = to_ms.saturating_sub(since) / MINUTE_MS;
    let last = to_ms / MINUTE_MS;
    let all: Vec<u64> = (first..=last).collect();
    let mut minutes = Vec::new();
    for chunk in all.chunks(READ_CHUNK) {
        let pipe = store.client.pipeline();
        for minute in chunk {
            pipe.hgetall::<(), _>(store.keys.stats_minute(*minute)).await?;
        }
        let read: Vec<HashMap<String, u64>> = pipe.all().await?;
        for (minute, fields) in chunk.iter().zip(read) {
            if !fields.is_empty() {
                minutes.push(MinuteStats {
                    minute_ms: minute * MINUTE_MS,
                    fields: fields.into_iter().collect(),
                });
            }
        }
    }
    Ok(StageStats::from_minutes(first * MINUTE_MS, to_ms, minutes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_fall_in_the_bucket_whose_bound_is_the_first_at_or_above_them() {
        assert_eq!(bucket_of(Duration::ZERO), 0);
        assert_eq!(bucket_of(Duration::from_millis(1)), 0);
        assert_eq!(bucket_of(Duration::from_micros(1001)), 1);
        assert_eq!(bucket_of(Duration::from_millis(50)), 5);
        assert_eq!(bucket_of(Duration::from_secs(1)), 9);
        assert_eq!(bucket_of(Duration::from_secs(10 * 3600)), BOUNDS_MS.len() as u8);
        assert_eq!(field(7, Stat::Bucket(Timing::Wait, 5)), "7|wait|50");
        assert_eq!(field(7, Stat::Bucket(Timing::Run, BOUNDS_MS.len() as u8)), "7|run|inf");
        assert_eq!(field(0, Stat::Count(Counter::DeadLettered)), "0|dead_lettered");
    }

    #[test]
    fn every_field_written_is_read_back_as_what_it_counts() {
        for p in [0u8, 42, 99] {
            for c in Counter::ALL {
                assert_eq!(parse_field(&field(p, Stat::Count(c))), Some((p, Stat::Count(c))));
            }
            for t in Timing::ALL {
                for b in 0..=BOUNDS_MS.len() as u8 {
                    let stat = Stat::Bucket(t, b);
                    assert_eq!(parse_field(&field(p, stat)), Some((p, stat)));
                }
            }
        }
        for unknown in ["100|started", "1|begun", "1|wait|3", "1|wait", "x|started", "1|run|5|x"] {
            assert_eq!(parse_field(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn minutes_sum_into_priorities_and_quantiles_interpolate_within_buckets() {
        let minute = |ms: u64, fields: &[(&str, u64)]| MinuteStats {
            minute_ms: ms,
            fields: fields.iter().map(|(f, n)| ((*f).to_owned(), *n)).collect(),
        };
        let stats = StageStats::from_minutes(
            0,
            120_000,
            vec![
                minute(0, &[("3|started", 2), ("3|wait|10", 1), ("3|wait|20", 1), ("9|submitted", 1)]),
                minute(60_000, &[("3|started", 2), ("3|wait|20", 2), ("3|future", 5)]),
            ],
        );
        assert_eq!(stats.priorities.iter().map(|p| p.priority).collect::<Vec<_>>(), [9, 3]);
        let p3 = &stats.priorities[1];
        assert_eq!((p3.started, p3.queue_wait.count()), (4, 4));
        assert_eq!(stats.priorities[0].submitted, 1);
        // 1 sample in (5, 10], 3 in (10, 20]: the median is 1/3 into (10, 20].
        let p50 = p3.queue_wait.quantile(0.5).unwrap().as_secs_f64() * 1000.0;
        assert!((p50 - 13.333).abs() < 0.01, "{p50}");
        assert_eq!(p3.queue_wait.quantile(1.0), Some(Duration::from_millis(20)));
        assert_eq!(p3.run_time.quantile(0.5), None);
        assert!((stats.per_second(240) - 2.0).abs() < 1e-9);
        let mut last = StageHistogram::default();
        last.add(None, 3);
        assert_eq!(last.quantile(0.99), Some(Duration::from_millis(*BOUNDS_MS.last().unwrap())));
    }

    #[test]
    fn a_recorder_that_is_off_counts_nothing() {
        let off = Recorder::off();
        off.count(Priority::DEFAULT, Counter::Started, 3);
        off.time(Priority::DEFAULT, Timing::Run, Duration::from_millis(3));
        assert!(off.lock().is_empty());
        let on = Recorder::new(Duration::from_secs(60));
        on.count(Priority::DEFAULT, Counter::Started, 3);
        on.finished(Priority::DEFAULT, "completed", (now_ms() as i64 - 1500) * 1000);
        on.finished(Priority::DEFAULT, "cancelled", 0);
        let fields: HashMap<String, i64> =
            on.lock().iter().map(|((_, p, stat), n)| (field(*p, *stat), *n)).collect();
        let p = Priority::DEFAULT.get();
        assert_eq!(fields.get(&format!("{p}|started")), Some(&3));
        assert_eq!(fields.get(&format!("{p}|completed")), Some(&1));
        assert_eq!(fields.get(&format!("{p}|duration|2000")), Some(&1), "{fields:?}");
        assert_eq!(fields.len(), 3, "{fields:?}");
    }
}
