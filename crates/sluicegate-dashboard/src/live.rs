//! The live hub: one reading of the namespace per interval and one events listener, shared by
//! every browser, fanned out as server-sent events.
//!
//! Why shared: a dashboard left open in ten tabs must not read Redis ten times as often. The
//! reader reads only while someone watches (an SSE client is connected); each reading is one
//! `Admin::stats` (its tally, at most `sluicegate::MAX_TALLY` records, only every `tally_interval`
//! once it reads more than 1,000), one page of the newest requests, and every
//! `throughput_interval` the per-minute counts of the last hour.
//! Completion events come from one [`Listener`] (one blocking read at a time). The tasks belong to
//! the hub and are aborted when it is dropped.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use serde::Serialize;
use sluicegate::{Admin, Config, ListQuery, Listener, StageStats};
use tokio::sync::broadcast;
use tokio::task::AbortHandle;

use crate::DashboardOptions;

/// Completion events kept for `/api/events` and for browsers that open the Events page; as many
/// of each token shard's newest retained events are read at the start.
const EVENTS_KEPT: usize = 200;

/// The listener's pause after each batch of completion events: events reach browsers at most
/// this late, and a flood of them costs one read of Redis per pause.
const EVENTS_PAUSE: Duration = Duration::from_millis(250);

/// Rows of the newest requests each reading carries.
const RECENT: u32 = 15;

/// Messages a slow browser may fall behind by before it skips some (it gets the next reading).
const CHANNEL: usize = 1024;

/// What the stream carries.
#[derive(Clone, Debug)]
pub(crate) enum Live {
    /// A reading of the namespace (`event: overview`), as JSON.
    Overview(Arc<str>),
    /// A request reached its terminal state (`event: completion`), as JSON.
    Completion(Arc<str>),
}

/// A completion event as the API and the stream show it.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Completion {
    /// The request.
    pub(crate) id: String,
    /// completed, failed or cancelled.
    pub(crate) state: String,
    /// When Redis wrote it (ms since the Unix epoch).
    pub(crate) at_ms: u64,
    /// The events cursor after it (`sluicegate events --after`).
    pub(crate) cursor: String,
}

/// Per-minute throughput, summed over priorities.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Throughput {
    pub(crate) from_ms: u64,
    pub(crate) to_ms: u64,
    pub(crate) minutes: Vec<MinuteCounts>,
}

/// One minute's counts.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct MinuteCounts {
    pub(crate) minute_ms: u64,
    pub(crate) submitted: u64,
    pub(crate) started: u64,
    pub(crate) completed: u64,
    pub(crate) failed: u64,
}

impl Throughput {
    pub(crate) fn from_stages(stages: &StageStats) -> Self {
        let minutes = stages
            .minutes
            .iter()
            .map(|m| {
                let mut c = MinuteCounts { minute_ms: m.minute_ms, ..MinuteCounts::default() };
                for (field, n) in &m.fields {
                    // `<priority>|<counter>`; histogram fields have a third part.
                    let mut parts = field.split('|');
                    let (_, Some(name), None) = (parts.next(), parts.next(), parts.next()) else { continue };
                    match name {
                        "submitted" => c.submitted += n,
                        "started" => c.started += n,
                        "completed" => c.completed += n,
                        "failed" => c.failed += n,
                        _ => {}
                    }
                }
                c
            })
            .collect();
        Self { from_ms: stages.from_ms, to_ms: stages.to_ms, minutes }
    }
}

/// The hub.
pub(crate) struct Hub {
    sender: broadcast::Sender<Live>,
    inner: Arc<Inner>,
    tasks: Mutex<Option<Vec<AbortHandle>>>,
    admin: Admin,
    config: Config,
    options: DashboardOptions,
}

/// What the tasks and the handlers share.
#[derive(Default)]
struct Inner {
    latest: Mutex<Option<Arc<str>>>,
    events: Mutex<VecDeque<Completion>>,
    throughput: Mutex<Option<(std::time::Instant, Arc<Throughput>)>>,
    /// The last tally, when it was read, and whether it is large enough to be read less often.
    tally: Mutex<Option<(std::time::Instant, sluicegate::Tally)>>,
}

impl Hub {
    pub(crate) fn new(admin: Admin, config: Config, options: &DashboardOptions) -> Self {
        let (sender, _) = broadcast::channel(CHANNEL);
        Self {
            sender,
            inner: Arc::new(Inner::default()),
            tasks: Mutex::new(None),
            admin,
            config,
            options: options.clone(),
        }
    }

    /// Starts the reader and the listener, once.
    pub(crate) fn start(&self) {
        let mut tasks = self.tasks.lock().unwrap_or_else(PoisonError::into_inner);
        if tasks.is_some() {
            return;
        }
        let reader = tokio::spawn(read_loop(
            self.admin.clone(),
            self.sender.clone(),
            self.inner.clone(),
            self.options.clone(),
        ));
        let listener = tokio::spawn(listen_loop(
            self.config.clone(),
            self.sender.clone(),
            self.inner.clone(),
            self.options.interval,
        ));
        *tasks = Some(vec![reader.abort_handle(), listener.abort_handle()]);
    }

    /// The newest completion events (at most 200): those retained when the dashboard started,
    /// then those since. Newest first.
    pub(crate) fn events(&self) -> Vec<Completion> {
        self.start();
        self.inner.events.lock().unwrap_or_else(PoisonError::into_inner).iter().rev().cloned().collect()
    }

    /// The throughput of the last hour, read again once it is older than `throughput_interval`.
    pub(crate) async fn throughput(&self) -> sluicegate::Result<Arc<Throughput>> {
        throughput(&self.admin, &self.inner, self.options.throughput_interval).await
    }

    /// A reading of the namespace now (what `/api/overview` answers), JSON.
    pub(crate) async fn overview(&self) -> sluicegate::Result<Arc<str>> {
        let text = overview(&self.admin, &self.inner, &self.options).await?;
        Ok(text)
    }

    /// The stream one browser gets: the latest reading at once, then every reading and event.
    pub(crate) fn stream(&self) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
        self.start();
        let receiver = self.sender.subscribe();
        let first = self.inner.latest.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let first = first.map(|text| Event::default().event("overview").data(&*text));
        let stream = futures::stream::unfold((first, receiver), |(first, mut receiver)| async move {
            if let Some(event) = first {
                return Some((Ok(event), (None, receiver)));
            }
            loop {
                match receiver.recv().await {
                    Ok(Live::Overview(text)) => {
                        return Some((Ok(Event::default().event("overview").data(&*text)), (None, receiver)))
                    }
                    Ok(Live::Completion(text)) => {
                        return Some((
                            Ok(Event::default().event("completion").data(&*text)),
                            (None, receiver),
                        ))
                    }
                    // Fell behind: the next reading brings it up to date.
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        Sse::new(stream).keep_alive(KeepAlive::default())
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        let tasks = self.tasks.get_mut().unwrap_or_else(PoisonError::into_inner);
        for task in tasks.take().into_iter().flatten() {
            task.abort();
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The reading `overview` builds.
#[derive(Serialize)]
struct Overview<'a> {
    at_ms: u64,
    stats: &'a sluicegate::Stats,
    tokens: TokenTotals,
    throughput: &'a Throughput,
    recent: &'a sluicegate::ListPage,
}

/// The namespace's token balance: capacity against waiting + held + parked.
#[derive(Serialize)]
struct TokenTotals {
    capacity: u64,
    waiting: u64,
    held: u64,
    parked: u64,
    /// capacity - (waiting + held + parked): zero on a healthy, quiet system. `None` when this
    /// reading carries an earlier tally (a large one, read every `tally_interval`).
    drift: Option<i64>,
    /// Whether the tally read every record (else capacity and parked cover the first ones).
    complete: bool,
    /// How old the tally is (0: read in this reading).
    tally_age_ms: u64,
}

/// A tally of more records than this is read every `tally_interval`, not at every reading.
const TALLY_EVERY_READING: u64 = 1_000;

async fn overview(admin: &Admin, inner: &Inner, options: &DashboardOptions) -> sluicegate::Result<Arc<str>> {
    let cached = inner.tally.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let (stats, tally_age) = match cached {
        Some((at, tally))
            if tally.records_read > TALLY_EVERY_READING && at.elapsed() < options.tally_interval =>
        {
            let mut stats = admin.stats_without_tally().await?;
            stats.tally = tally;
            (stats, Some(at.elapsed()))
        }
        _ => {
            let stats = admin.stats().await?;
            *inner.tally.lock().unwrap_or_else(PoisonError::into_inner) =
                Some((std::time::Instant::now(), stats.tally.clone()));
            (stats, None)
        }
    };
    let recent = admin.list(&ListQuery::new().limit(RECENT)).await?;
    let throughput = throughput(admin, inner, options.throughput_interval).await?;
    let waiting: u64 = stats.tokens_waiting.iter().map(|p| p.tokens).sum();
    let tally = &stats.tally;
    let drift = tally.token_capacity as i64 - (waiting + stats.tokens_held + tally.tokens_parked) as i64;
    let tokens = TokenTotals {
        capacity: tally.token_capacity,
        waiting,
        held: stats.tokens_held,
        parked: tally.tokens_parked,
        drift: tally_age.is_none().then_some(drift),
        complete: tally.complete,
        tally_age_ms: tally_age.map_or(0, |d| d.as_millis() as u64),
    };
    let reading =
        Overview { at_ms: now_ms(), stats: &stats, tokens, throughput: &throughput, recent: &recent };
    let text: Arc<str> =
        serde_json::to_string(&reading).map_err(|e| sluicegate::Error::Codec(e.to_string()))?.into();
    *inner.latest.lock().unwrap_or_else(PoisonError::into_inner) = Some(text.clone());
    Ok(text)
}

async fn throughput(admin: &Admin, inner: &Inner, every: Duration) -> sluicegate::Result<Arc<Throughput>> {
    if let Some((at, t)) = &*inner.throughput.lock().unwrap_or_else(PoisonError::into_inner) {
        if at.elapsed() < every {
            return Ok(t.clone());
        }
    }
    let stages = admin.stats_since(Duration::from_secs(3600)).await?;
    let t = Arc::new(Throughput::from_stages(&stages));
    *inner.throughput.lock().unwrap_or_else(PoisonError::into_inner) =
        Some((std::time::Instant::now(), t.clone()));
    Ok(t)
}

/// Reads the namespace every interval while someone watches, and sends the reading to all.
async fn read_loop(
    admin: Admin,
    sender: broadcast::Sender<Live>,
    inner: Arc<Inner>,
    options: DashboardOptions,
) {
    let mut ticks = tokio::time::interval(options.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if sender.receiver_count() == 0 {
            continue;
        }
        match overview(&admin, &inner, &options).await {
            Ok(text) => {
                let _ = sender.send(Live::Overview(text));
            }
            Err(e) => tracing::warn!(error = %e, "dashboard: cannot read the namespace"),
        }
    }
}

/// Forwards every completion event; reconnects after an error.
async fn listen_loop(config: Config, sender: broadcast::Sender<Live>, inner: Arc<Inner>, pause: Duration) {
    // After a reconnect, go on from the last event seen: none is missed or repeated.
    let mut last: Option<sluicegate::Cursor> = None;
    loop {
        // At the start, the newest retained events too, so the Events page is not empty.
        let connected = match &last {
            Some(cursor) => Listener::resume_after(&config, cursor).await,
            None => Listener::from_last(&config, EVENTS_KEPT).await,
        };
        let mut listener = match connected {
            Ok(listener) => listener,
            Err(e) => {
                tracing::warn!(error = %e, "dashboard: cannot listen to completion events");
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        loop {
            match listener.next_batch(EVENTS_KEPT).await {
                Ok(batch) => {
                    for event in batch {
                        last = Some(event.cursor.clone());
                        let completion = Completion {
                            id: event.id.to_string(),
                            state: event.state.to_string(),
                            at_ms: event.at_ms,
                            cursor: event.cursor.to_string(),
                        };
                        let text = serde_json::to_string(&completion).unwrap_or_default();
                        {
                            let mut events = inner.events.lock().unwrap_or_else(PoisonError::into_inner);
                            if events.len() >= EVENTS_KEPT {
                                events.pop_front();
                            }
                            events.push_back(completion);
                        }
                        let _ = sender.send(Live::Completion(text.into()));
                    }
                    // Under a flood of completions, one read per pause rather than one per event.
                    tokio::time::sleep(EVENTS_PAUSE).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "dashboard: the completion events listener stopped; reconnecting");
                    tokio::time::sleep(pause).await;
                    break;
                }
            }
        }
    }
}
