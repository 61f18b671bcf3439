//! Reading another request's results from a handler (`Context::upstream`):
//! a request of its own stream keeps them in its `:res` and `:err` hashes, a lane request in its
//! record (`o<i>`, `e<i>`), both by part index. Two reads per call, whatever the range's size.

use std::ops::Range;

use fred::prelude::*;
use serde::de::DeserializeOwned;

use crate::codec;
use crate::error::{Error, Result};
use crate::request::{PartError, RequestId};
use crate::store::Store;

/// The outcomes of parts `range` of request `id` (clamped to its parts), decoded.
pub(crate) async fn results<O: DeserializeOwned>(
    store: &Store,
    id: &RequestId,
    range: Range<u64>,
) -> Result<Vec<std::result::Result<O, PartError>>> {
    let key_id = id.key_id();
    let keys = store.keys.request(&key_id);
    let (total, discard): (Option<u64>, Option<String>) =
        store.client.hmget(keys.meta.as_str(), vec!["total", "discard"]).await?;
    let (total, oks, errs, discard) = match total {
        Some(total) => {
            let range = clamp(range, total);
            let fields: Vec<String> = range.clone().map(|i| i.to_string()).collect();
            let (oks, errs) = read_pair(store, &keys.results, &keys.errors, fields.clone(), fields).await?;
            (range, oks, errs, discard.as_deref() == Some("1"))
        }
        None => {
            let home = crate::shards::lane_home_found(store, &key_id).await?;
            let record = store.keys.record(home, &key_id);
            let (pol, discard): (Option<String>, Option<String>) =
                store.client.hmget(record.as_str(), vec!["pol", "discard"]).await?;
            let Some(pol) = pol else { return Err(Error::UnknownRequest(id.clone())) };
            let total = crate::protocol::lane::Settings::parse(&pol)?.values[2];
            let range = clamp(range, total);
            let o: Vec<String> = range.clone().map(|i| format!("o{i}")).collect();
            let e: Vec<String> = range.clone().map(|i| format!("e{i}")).collect();
            let (oks, errs) = read_pair(store, &record, &record, o, e).await?;
            // A discarding record counts its discarded parts in `discard`.
            (range, oks, errs, discard.is_some())
        }
    };
    total
        .zip(oks.into_iter().zip(errs))
        .map(|(index, outcome)| match outcome {
            (Some(bytes), _) => Ok(Ok(codec::decode::<O>(&bytes)?)),
            (None, Some(record)) => Ok(Err(PartError::from_record(&record))),
            (None, None) => Err(Error::NoResult {
                id: id.clone(),
                index,
                why: if discard {
                    "its results are discarded"
                } else {
                    "the part has not ended, or its result was taken (results_from) or expired with its retention"
                },
            }),
        })
        .collect()
}

/// `range` within `0..total`.
fn clamp(range: Range<u64>, total: u64) -> Range<u64> {
    range.start.min(total)..range.end.min(total)
}

/// `HMGET` of `ok_fields` in `oks` and of `err_fields` in `errs`, pipelined (no call for an empty
/// range).
async fn read_pair(
    store: &Store,
    oks: &str,
    errs: &str,
    ok_fields: Vec<String>,
    err_fields: Vec<String>,
) -> Result<(Vec<Option<Vec<u8>>>, Vec<Option<Vec<u8>>>)> {
    if ok_fields.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let pipe = store.client.pipeline();
    pipe.hmget::<(), _, _>(oks, ok_fields).await?;
    pipe.hmget::<(), _, _>(errs, err_fields).await?;
    Ok(pipe.all().await?)
}
