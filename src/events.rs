//! Listening to the terminal state of every request.
//!
//! Terminal events are kept in a durable stream (trimmed to the retention), not only published:
//! a listener reads the stream from where it left off, so it learns every terminal state exactly
//! once even across reconnects, and a listener that starts late can replay what is retained.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;

use fred::prelude::*;

use crate::config::Config;
use crate::error::{retry_transient, Error, Result};
use crate::hangup::Hangup;
use crate::reply;
use crate::request::RequestId;
use crate::request::RequestState;
use crate::store::Store;

/// How long one blocking read waits before it is re-issued (bounds how late a dead connection is
/// noticed; not a latency: events arrive as soon as they are written).
const BLOCK_MS: u64 = 1_000;

/// One request reaching its terminal state.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompletionEvent {
    /// The request.
    pub id: RequestId,
    /// Completed, failed or cancelled.
    pub state: RequestState,
    /// When the event was written (ms since the Unix epoch, Redis's clock: its stream id's time).
    pub at_ms: u64,
    /// Where the listener had read to when it returned this event: a resume point for
    /// [`Listener::resume_after`].
    pub cursor: Cursor,
}

/// A point in a namespace's events to resume listening after: per token shard, the id of the
/// last entry of its events stream read, and of the one being read how many of its events (an
/// entry holds the events of all the lane requests one call finished).
///
/// Its text form (for storing it, or for `sluicegate events`) is one position per token shard
/// joined by `,`: a stream id (`<ms>-<seq>`, the entry read to its end), or a stream id and `/n`
/// (the first `n` events of that entry read). A single position applies to every shard, so `0-0`
/// is the beginning.
/// ```
/// use sluicegate::Cursor;
/// let cursor: Cursor = "1732000000000-0,1732000000123-4/2".parse().unwrap();
/// assert_eq!(cursor.to_string(), "1732000000000-0,1732000000123-4/2");
/// assert_eq!(Cursor::beginning().to_string(), "0-0");
/// assert!("yesterday".parse::<Cursor>().is_err());
/// assert!("1732000000123-4/x".parse::<Cursor>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Cursor {
    /// Positions (a stream id, maybe with `/n`), one per shard (or one for all).
    ids: Vec<String>,
}

/// A position in one shard's events stream: after entry `.0`, or, with `.1` = Some(n), after the
/// first n events of entry `.0`.
fn position(id: &str) -> (&str, Option<usize>) {
    match id.split_once('/') {
        Some((entry, n)) => (entry, n.parse().ok()),
        None => (id, None),
    }
}

impl Cursor {
    /// Before every retained event.
    pub fn beginning() -> Self {
        Self { ids: vec!["0-0".into()] }
    }

    /// The id to read after in each of `shards` events streams.
    fn per_shard(&self, shards: usize) -> Vec<String> {
        (0..shards)
            .map(|s| if self.ids.len() == shards { &self.ids[s] } else { &self.ids[0] }.clone())
            .collect()
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.ids.join(","))
    }
}

impl FromStr for Cursor {
    type Err = Error;

    /// Reads the text form: positions (`<milliseconds>-<sequence>`, maybe followed by `/<n>`)
    /// joined by `,`.
    fn from_str(text: &str) -> Result<Self> {
        let digits = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
        let is_position = |id: &str| {
            let (entry, read) = id.split_once('/').unwrap_or((id, "0"));
            let (ms, seq) = entry.split_once('-').unwrap_or((entry, "0"));
            [ms, seq, read].into_iter().all(digits)
        };
        let ids: Vec<String> = text.split(',').map(|id| id.trim().to_owned()).collect();
        if ids.iter().all(|id| is_position(id)) {
            Ok(Self { ids })
        } else {
            Err(Error::InvalidCursor(format!(
                "{text:?} is not an events cursor: stream ids like 1732000000000-0 (or 1732000000000-0/2, two \
                 events of that entry read), one per token shard, joined by ','"
            )))
        }
    }
}

/// Receives the completion of every request of a namespace, each once.
///
/// ```no_run
/// # async fn demo() -> sluicegate::Result<()> {
/// let mut listener = sluicegate::Listener::connect(&sluicegate::Config::from_env()).await?;
/// loop {
///     let event = listener.next().await?;
///     println!("{} is {}", event.id, event.state);
/// }
/// # }
/// ```
pub struct Listener {
    store: Store,
    reader: Client,
    /// Its connections when they are its own (`resume_after`), closed when it is dropped.
    _hangup: Hangup,
    /// Per token shard, its position: the id of the last entry read from its events stream (with
    /// `/n` while the events of that entry are buffered, for the cursors of the first n).
    cursors: Vec<String>,
    /// The shard the next blocking read waits on (with several shards, they take turns).
    turn: usize,
    buffered: VecDeque<CompletionEvent>,
}

impl Listener {
    /// Listens to completions from now on.
    pub async fn connect(config: &Config) -> Result<Self> {
        Self::from_last(config, 0).await
    }

    /// Listens to the completions of the last `n` entries retained in each token shard's events
    /// stream (fewer when fewer are retained; an entry holds one request's completion, or those of
    /// all the lane requests one call finished, so there may be more than `n`), then to new ones:
    /// what a display that shows recent events wants at its start. One `XREVRANGE` of at most
    /// `n + 1` entries per shard.
    pub async fn from_last(config: &Config, n: usize) -> Result<Self> {
        let mut listener = Self::resume_after(config, &Cursor::beginning()).await?;
        for shard in 0..listener.cursors.len() {
            let events = listener.store.keys.events(shard as u32);
            let count = n as u64 + 1;
            let newest: Value = listener.store.client.xrevrange(events, "+", "-", Some(count)).await?;
            let newest = reply::array(newest)?;
            // The (n+1)-th newest event is the cursor, so that the n after it are read; with n or
            // fewer retained, every one is.
            if newest.len() as u64 == count {
                if let Some(entry) = newest.into_iter().last() {
                    if let Some(id) = reply::array(entry)?.into_iter().next() {
                        listener.cursors[shard] = reply::text(&id)?;
                    }
                }
            }
        }
        Ok(listener)
    }

    /// Listens to every completion still retained, then to new ones.
    pub async fn from_beginning(config: &Config) -> Result<Self> {
        Self::resume_after(config, &Cursor::beginning()).await
    }

    /// Resumes after a [`CompletionEvent::cursor`] seen earlier.
    pub async fn resume_after(config: &Config, cursor: &Cursor) -> Result<Self> {
        let store = crate::protocol::connect(config).await?;
        let mut hangup = Hangup::new(store.client.clone());
        let reader = store.blocking_client().await?;
        hangup.blocking(reader.clone());
        let mut listener = Self::start(store, reader, cursor).await?;
        listener._hangup = hangup;
        Ok(listener)
    }

    /// A listener of `store`'s namespace reading with `reader` (which it may block), after `cursor`.
    pub(crate) async fn start(store: Store, reader: Client, cursor: &Cursor) -> Result<Self> {
        let shards = store.keys.shards() as usize;
        let cursors = cursor.per_shard(shards);
        let mut listener =
            Self { store, reader, cursors, turn: 0, buffered: VecDeque::new(), _hangup: Hangup::none() };
        // A position inside an entry: the rest of that entry's events first.
        for shard in 0..shards {
            let (entry, read) = position(&listener.cursors[shard]);
            let (entry, Some(read)) = (entry.to_owned(), read) else { continue };
            listener.cursors[shard] = entry.clone();
            let events = listener.store.keys.events(shard as u32);
            let found: Value = retry_transient("listen", || async {
                listener
                    .reader
                    .xrange(events.as_str(), entry.as_str(), entry.as_str(), None)
                    .await
                    .map_err(Error::from)
            })
            .await?;
            for found in reply::array(found)? {
                listener.entry(shard, found, read)?;
            }
        }
        Ok(listener)
    }

    /// The resume point after everything read so far.
    fn cursor(&self) -> Cursor {
        Cursor { ids: self.cursors.clone() }
    }

    /// The next completion; waits for one.
    pub async fn next(&mut self) -> Result<CompletionEvent> {
        loop {
            if let Some(event) = self.buffered.pop_front() {
                return Ok(event);
            }
            let shards = self.cursors.len();
            if shards == 1 {
                self.read(0, Some(BLOCK_MS)).await?;
                continue;
            }
            // Several shards live in different slots, so one XREAD cannot cover them: look at
            // each without blocking, then block on one of them in turn for a share of BLOCK_MS.
            for shard in 0..shards {
                self.read(shard, None).await?;
            }
            if self.buffered.is_empty() {
                self.turn = (self.turn + 1) % shards;
                let block = (BLOCK_MS / shards as u64).max(10);
                self.read(self.turn, Some(block)).await?;
            }
        }
    }

    /// The next completions: waits for one, then returns it with those already read behind it,
    /// `max` at most (at least one). A consumer that handles events in batches and pauses between
    /// them (a display, say) reads Redis once per batch instead of once per event.
    pub async fn next_batch(&mut self, max: usize) -> Result<Vec<CompletionEvent>> {
        let first = self.next().await?;
        let more = self.buffered.len().min(max.max(1) - 1);
        Ok(std::iter::once(first).chain(self.buffered.drain(..more)).collect())
    }

    /// One XREAD of one shard's events stream from its cursor.
    async fn read(&mut self, shard: usize, block: Option<u64>) -> Result<()> {
        let events = self.store.keys.events(shard as u32);
        let (reader, cursor) = (&self.reader, self.cursors[shard].as_str());
        // A dropped connection is waited out: the cursor makes the read resumable.
        let reply: Value = retry_transient("listen", || async {
            reader.xread(Some(256), block, events.as_str(), cursor).await.map_err(Error::from)
        })
        .await?;
        self.buffer(shard, reply)
    }

    /// XREAD reply: [[stream, [[id, [field, value, ...]], ...]]] (RESP2) or a map (RESP3).
    fn buffer(&mut self, shard: usize, reply: Value) -> Result<()> {
        if reply.is_null() {
            return Ok(());
        }
        let entries = match reply {
            Value::Map(map) => map.inner().into_iter().next().map(|(_, v)| v),
            other => reply::array(other)?
                .into_iter()
                .next()
                .map(|s| reply::array(s).map(|mut kv| kv.pop().unwrap_or(Value::Null)))
                .transpose()?,
        };
        for entry in reply::array(entries.unwrap_or(Value::Null))? {
            self.entry(shard, entry, 0)?;
        }
        Ok(())
    }

    /// Buffers the events of one entry of `shard`'s events stream (`[id, [field, value, ...]]`),
    /// past the first `skip`: one request's (`rid`, `state`), or those of every lane request one
    /// call finished (`done`: lines `<key id>|<state>`). Each event's cursor is the position after
    /// it.
    fn entry(&mut self, shard: usize, entry: Value, skip: usize) -> Result<()> {
        let mut entry = reply::array(entry)?.into_iter();
        let (Some(id), Some(fields)) = (entry.next(), entry.next()) else {
            return Ok(());
        };
        let id = reply::text(&id)?;
        let fields = reply::array(fields)?;
        let mut rid = None;
        let mut state = None;
        let mut events = Vec::new();
        for pair in fields.chunks(2) {
            if let [k, v] = pair {
                match reply::text(k)?.as_str() {
                    "rid" => rid = Some(RequestId::from_key_id(&reply::text(v)?)?),
                    "state" => state = Some(reply::text(v)?.parse::<RequestState>()?),
                    "done" => {
                        for line in reply::text(v)?.lines() {
                            let Some((kid, state)) = line.rsplit_once('|') else { continue };
                            events.push((RequestId::from_key_id(kid)?, state.parse::<RequestState>()?));
                        }
                    }
                    _ => {}
                }
            }
        }
        if let (Some(id), Some(state)) = (rid, state) {
            events.push((id, state));
        }
        let at_ms = id.split('-').next().and_then(|ms| ms.parse().ok()).unwrap_or(0);
        let count = events.len();
        for (n, (request, state)) in events.into_iter().enumerate().skip(skip) {
            self.cursors[shard] = if n + 1 < count { format!("{id}/{}", n + 1) } else { id.clone() };
            self.buffered.push_back(CompletionEvent { id: request, state, at_ms, cursor: self.cursor() });
        }
        self.cursors[shard] = id;
        Ok(())
    }
}
