//! What the chaos and topology runs count: the completions each listener heard, and the tokens
//! left at the end (key names from docs/protocol.md §3).

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fred::prelude::{Client, HashesInterface, ListInterface, SortedSetsInterface};
use sluicegate::{Listener, RequestId};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What one listener task counted.
#[derive(Default)]
pub struct Heard {
    pub by_request: HashMap<String, u64>,
    pub total: u64,
    pub errors: u64,
}

/// Reads every completion with `listener` until `stop`, counting per request. A failed read (the
/// connection was cut, Redis restarted) is counted and retried: the listener resumes from its
/// cursor.
pub fn spawn_listener(
    mut listener: Listener,
    stop: CancellationToken,
) -> (Arc<Mutex<Heard>>, JoinHandle<()>) {
    let heard = Arc::new(Mutex::new(Heard::default()));
    let out = heard.clone();
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                event = listener.next() => match event {
                    Ok(event) => {
                        let mut h = out.lock().unwrap();
                        *h.by_request.entry(event.id.as_str().to_owned()).or_default() += 1;
                        h.total += 1;
                    }
                    Err(e) => {
                        // Expected under connection faults; counted in the figures.
                        tracing::debug!(error = %e, "listener read failed; resuming");
                        out.lock().unwrap().errors += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
    });
    (heard, task)
}

/// Tokens still in circulation after every request finished: token fields left in a meta hash,
/// elements in the priority lists, requests still in `active` (token shard 0). Each request comes
/// with the label its test reports it by.
///
/// Requests that finished more than a retention ago have no meta hash any more (nothing to count);
/// finding none at all means the key schema changed under this census, which is reported rather
/// than passed silently.
pub async fn tokens_outstanding(client: &Client, ns: &str, requests: &[(u64, RequestId)]) -> Vec<String> {
    let mut outstanding = Vec::new();
    let mut metas_found = 0;
    for (label, id) in requests {
        let meta = format!("{ns}:r:{{{}}}", id.key_id());
        let fields: HashMap<String, String> = client.hgetall(&meta).await.expect("HGETALL meta");
        metas_found += usize::from(!fields.is_empty());
        // A lane request has a record on its home shard instead, and no tokens of its own (its
        // lane's tokens are counted through the lists and `active`).
        for shard in 0..4 {
            let record = format!("{ns}:{{{ns}.q{shard}}}:s:{}", id.key_id());
            let fields: HashMap<String, Vec<u8>> = client.hgetall(&record).await.expect("HGETALL record");
            metas_found += usize::from(!fields.is_empty());
        }
        for (field, value) in &fields {
            let is_token = field
                .strip_prefix('t')
                .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()));
            if is_token {
                outstanding.push(format!("request {label}: {field}={value}"));
            }
        }
    }
    for p in 0..100 {
        let list = format!("{ns}:{{{ns}.q0}}:p:{p}");
        let elements: Vec<String> = client.lrange(&list, 0, -1).await.expect("LRANGE");
        outstanding.extend(elements.into_iter().map(|e| format!("{list}: {e}")));
    }
    let active: Vec<String> = client
        .zrange(format!("{ns}:{{{ns}.q0}}:active"), 0, -1, None, false, None, false)
        .await
        .expect("ZRANGE");
    outstanding.extend(active.into_iter().map(|a| format!("active: {a}")));
    if metas_found == 0 && !requests.is_empty() {
        outstanding.push(
            "census: no meta hash or lane record found for any request; key schema changed?".to_string(),
        );
    }
    outstanding
}
