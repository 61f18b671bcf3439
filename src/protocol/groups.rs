//! Tenant groups (docs/protocol.md §5, "Groups"): `group_set` and recovery's `group_audit`, on
//! the group's shard. Taking a group's token and giving it back are part of `take`, `give_back`,
//! `release` and `untake` (tokens.rs).

use fred::types::Value;

use super::Func;
use crate::error::Result;
use crate::reply;
use crate::store::Store;

/// A change of a group's rate limit (`group_set`'s `ARGV[3]`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum RateChange {
    /// Keep it as it is.
    Keep,
    /// No rate limit.
    Remove,
    /// At most `n` parts start per interval of this many ms.
    Set(u32, u64),
}

/// `group_set` on `shard`: sets group `name`'s limit (`None`: keep it) and rate. Returns (tokens
/// added, tokens retired now).
pub(crate) async fn set(
    store: &Store,
    shard: u32,
    name: &str,
    limit: Option<u32>,
    rate: RateChange,
) -> Result<(i64, i64)> {
    let (limits, meta) = (store.keys.group_limits(shard), store.keys.group(shard, name));
    let limit = limit.map_or(String::new(), |l| l.to_string());
    let rate = match rate {
        RateChange::Keep => String::new(),
        RateChange::Remove => "none".to_owned(),
        RateChange::Set(n, per) => format!("{n}/{per}"),
    };
    let args: Vec<Value> = vec![name.into(), limit.into(), rate.into()];
    let items = reply::array(store.fcall(Func::GroupSet, &[&limits, &meta], args).await?)?;
    let int = |i: usize| items.get(i).map(reply::int).transpose().map(Option::unwrap_or_default);
    Ok((int(0)?, int(1)?))
}

/// What a `group_audit` scan found.
pub(crate) struct Audit {
    /// The SSCAN cursor to go on from ("0" after the last group).
    pub(crate) next: String,
    /// Tokens it repaired itself: rate waits put back in `gwake`, queued tokens whose element
    /// was lost queued again.
    pub(crate) repaired: i64,
    /// Held tokens that no take record names, as `(<group>|<k>|<epoch>, holder)`: given back
    /// ([`end`]) once their holder's worker is known to be gone.
    pub(crate) unnamed: Vec<(String, String)>,
}

/// `group_audit` on `shard`, scan mode: looks at up to `count` groups from SSCAN cursor `cursor`.
pub(crate) async fn audit(store: &Store, shard: u32, cursor: &str, count: u32) -> Result<Audit> {
    let (held, groups) = (store.keys.held(shard), store.keys.groups(shard));
    let args: Vec<Value> = vec![cursor.into(), i64::from(count).into(), super::ms(store.config.grace())];
    let mut items = reply::array(store.fcall(Func::GroupAudit, &[&held, &groups], args).await?)?.into_iter();
    let next = items.next().map(|v| reply::text(&v)).transpose()?.unwrap_or_else(|| "0".to_owned());
    let repaired = items.next().map(|v| reply::int(&v)).transpose()?.unwrap_or_default();
    let mut unnamed = Vec::new();
    for item in items {
        let text = reply::text(&item)?;
        if let Some((token, holder)) = text.rsplit_once('|') {
            unnamed.push((token.to_owned(), holder.to_owned()));
        }
    }
    Ok(Audit { next, repaired, unnamed })
}

/// `group_audit` on `shard`, end mode: gives back each of `tokens` (`<group>|<k>|<epoch>`) still
/// held under that epoch by no take record. Returns how many went back.
pub(crate) async fn end(store: &Store, shard: u32, tokens: &[String]) -> Result<i64> {
    let (held, groups) = (store.keys.held(shard), store.keys.groups(shard));
    let mut args: Vec<Value> = vec!["end".into()];
    args.extend(tokens.iter().map(|t| Value::from(t.as_str())));
    reply::int(&store.fcall(Func::GroupAudit, &[&held, &groups], args).await?)
}
