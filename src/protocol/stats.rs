//! The stats by stage (docs/protocol.md §3, "Stats by stage"): `stats_add`, which a producer or a
//! worker calls once per flush interval with what it counted in memory since.

use std::time::Duration;

use fred::types::Value;

use super::{ms, Func};
use crate::error::Result;
use crate::reply;
use crate::store::Store;

/// What one minute's hash gets: its minute (Unix ms / 60,000) and its field/delta pairs.
pub(crate) type MinuteCounts = (u64, Vec<(String, i64)>);

/// `stats_add`: adds `minutes` to their per-minute hashes, each then kept for `keep` (at least
/// 1 ms). Returns how many fields were added to.
pub(crate) async fn add(store: &Store, keep: Duration, minutes: &[MinuteCounts]) -> Result<u64> {
    let keys: Vec<String> = minutes.iter().map(|(minute, _)| store.keys.stats_minute(*minute)).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut args: Vec<Value> = vec![ms(keep.max(Duration::from_millis(1)))];
    for (_, fields) in minutes {
        args.push((fields.len() as i64).into());
        for (field, delta) in fields {
            args.extend([field.as_str().into(), (*delta).into()]);
        }
    }
    Ok(reply::int(&store.fcall(Func::StatsAdd, &keys, args).await?)?.max(0) as u64)
}
