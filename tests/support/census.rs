//! The token census the chaos and topology tests end with (key names from docs/protocol.md §3).

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;

use fred::prelude::{Client, HashesInterface, ListInterface, SortedSetsInterface};
use sluicegate::RequestId;

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
        outstanding
            .push(format!("census: no meta hash found under {ns}:r:{{<key id>}}; key schema changed?"));
    }
    outstanding
}
