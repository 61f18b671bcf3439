//! Listening to the terminal state of every request.
//!
//! Terminal events are kept in a durable stream (trimmed to the retention), not only published:
//! a listener reads the stream from where it left off, so it learns every terminal state exactly
//! once even across reconnects, and a listener that starts late can replay what is retained.

use std::collections::VecDeque;

use fred::prelude::*;

use crate::config::Config;
use crate::error::{retry_transient, Error, Result};
use crate::keys::RequestId;
use crate::reply;
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
    /// The event's id in the events stream: a resume point for [`Listener::resume_after`].
    pub cursor: String,
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
    cursor: String,
    buffered: VecDeque<CompletionEvent>,
}

impl Listener {
    /// Listens to completions from now on.
    pub async fn connect(config: &Config) -> Result<Self> {
        let mut listener = Self::resume_after(config, "0-0").await?;
        let last: Value =
            listener.store.client.xrevrange(listener.store.keys.events(), "+", "-", Some(1)).await?;
        if let Some(entry) = reply::array(last)?.into_iter().next() {
            let id = reply::array(entry)?.into_iter().next();
            if let Some(id) = id {
                listener.cursor = reply::text(&id)?;
            }
        }
        Ok(listener)
    }

    /// Listens to every completion still retained, then to new ones.
    pub async fn from_beginning(config: &Config) -> Result<Self> {
        Self::resume_after(config, "0-0").await
    }

    /// Resumes after a [`CompletionEvent::cursor`] seen earlier.
    pub async fn resume_after(config: &Config, cursor: &str) -> Result<Self> {
        let store = Store::connect(config).await?;
        let reader = store.blocking_client().await?;
        Ok(Self { store, reader, cursor: cursor.to_owned(), buffered: VecDeque::new() })
    }

    /// The next completion; waits for one.
    pub async fn next(&mut self) -> Result<CompletionEvent> {
        loop {
            if let Some(event) = self.buffered.pop_front() {
                return Ok(event);
            }
            let events = self.store.keys.events();
            let (reader, cursor) = (&self.reader, self.cursor.as_str());
            // A dropped connection is waited out: the cursor makes the read resumable.
            let reply: Value = retry_transient("listen", || async {
                reader.xread(Some(256), Some(BLOCK_MS), events.as_str(), cursor).await.map_err(Error::from)
            })
            .await?;
            self.buffer(reply)?;
        }
    }

    /// XREAD reply: [[stream, [[id, [field, value, ...]], ...]]] (RESP2) or a map (RESP3).
    fn buffer(&mut self, reply: Value) -> Result<()> {
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
            let mut entry = reply::array(entry)?.into_iter();
            let (Some(id), Some(fields)) = (entry.next(), entry.next()) else {
                continue;
            };
            let id = reply::text(&id)?;
            let fields = reply::array(fields)?;
            let mut rid = None;
            let mut state = None;
            for pair in fields.chunks(2) {
                if let [k, v] = pair {
                    match reply::text(k)?.as_str() {
                        "rid" => rid = Some(RequestId::from_key_id(&reply::text(v)?)?),
                        "state" => state = Some(reply::text(v)?.parse::<RequestState>()?),
                        _ => {}
                    }
                }
            }
            self.cursor = id.clone();
            if let (Some(id), Some(state)) = (rid, state) {
                self.buffered.push_back(CompletionEvent { id, state, cursor: self.cursor.clone() });
            }
        }
        Ok(())
    }
}
