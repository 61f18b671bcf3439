//! The text forms that cross between Rust and Lua (docs/protocol.md §3): a token's element in a
//! priority list, `<kid>|<k>|<epoch>`; a slot's take record in a shard's `held` hash,
//! `<kid>|<k>|<epoch>|<take>|<list>`; the doorbell message of a finished request,
//! `<kid>|<state>`. Parsed and formatted here only.

use std::fmt;

/// A token as it waits in a priority list: request key id, token number, epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TokenElement {
    pub(crate) key_id: String,
    pub(crate) k: u32,
    pub(crate) epoch: u64,
}

impl TokenElement {
    /// `None` unless `text` is exactly `<kid>|<k>|<epoch>` with numbers where numbers belong.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split('|');
        let (key_id, k, epoch) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || key_id.is_empty() {
            return None;
        }
        Some(Self { key_id: key_id.to_owned(), k: k.parse().ok()?, epoch: epoch.parse().ok()? })
    }

    /// The token number of an element's text, without checking the rest: where a malformed
    /// element only has to go somewhere (its request's home shard, token 0).
    pub(crate) fn token_of(text: &str) -> Option<u32> {
        text.split('|').nth(1)?.parse().ok()
    }
}

impl fmt::Display for TokenElement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}|{}|{}", self.key_id, self.k, self.epoch)
    }
}

/// What a slot writes when it takes a token: the token, the take's serial number, and the list it
/// came from (so that recovery can put it back there); for a request in a tenant group, the list
/// is the group's queue, and the group's token the take holds follows (`|<group>|<k>|<epoch>`,
/// given back by whichever call ends the record).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TakeRecord {
    pub(crate) token: TokenElement,
    pub(crate) take: String,
    pub(crate) list: String,
    /// The group token held with it, as written: `<group>|<k>|<epoch>`.
    pub(crate) group_token: Option<String>,
}

impl TakeRecord {
    /// `None` unless `text` is a token element followed by `|<take>|<list>` (the list name may
    /// itself contain `|`).
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let f: Vec<&str> = text.splitn(5, '|').collect();
        let [key_id, k, epoch, take, list] = f[..] else { return None };
        let token = TokenElement::parse(&format!("{key_id}|{k}|{epoch}"))?;
        let (list, group_token) = match list.split_once('|') {
            Some((queue, group)) if crate::keys::group_of_queue(queue).is_some() => {
                (queue, Some(group.to_owned()))
            }
            _ => (list, None),
        };
        Some(Self { token, take: take.to_owned(), list: list.to_owned(), group_token })
    }
}

impl fmt::Display for TakeRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}|{}|{}", self.token, self.take, self.list)?;
        match &self.group_token {
            Some(group) => write!(f, "|{group}"),
            None => Ok(()),
        }
    }
}

/// The request key ids a doorbell message names: one line `<kid>|<state>` per request that turned
/// terminal (a lane ack announces all the requests it finished in one message).
pub(crate) fn doorbell_key_ids(message: &str) -> impl Iterator<Item = &str> {
    message.split('\n').filter_map(|line| line.split('|').next()).filter(|kid| !kid.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_and_records_round_trip_and_refuse_what_is_malformed() {
        let e = TokenElement::parse("abc|3|17").expect("well formed");
        assert_eq!((e.key_id.as_str(), e.k, e.epoch), ("abc", 3, 17));
        assert_eq!(e.to_string(), "abc|3|17");
        for bad in ["", "abc", "abc|3", "abc|x|1", "abc|3|y", "abc|3|1|extra", "|3|1", "abc|-1|1"] {
            assert_eq!(TokenElement::parse(bad), None, "{bad:?}");
        }
        assert_eq!(TokenElement::token_of("abc|3|x"), Some(3));
        assert_eq!(TokenElement::token_of("abc"), None);

        let text = "abc|3|17|42|ns:{ns.q0}:p:50";
        let r = TakeRecord::parse(text).expect("well formed");
        assert_eq!((r.token.k, r.take.as_str(), r.list.as_str()), (3, "42", "ns:{ns.q0}:p:50"));
        assert_eq!(r.to_string(), text);
        assert_eq!(TakeRecord::parse("abc|3|17|42"), None);
        assert_eq!(TakeRecord::parse("abc|x|17|42|l"), None);
        assert_eq!(doorbell_key_ids("abc|completed").collect::<Vec<_>>(), ["abc"]);
        assert_eq!(doorbell_key_ids("a|completed\nb|failed").collect::<Vec<_>>(), ["a", "b"]);
    }
}
