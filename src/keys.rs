//! The key schema: the only place a Redis key or channel name is built.
//!
//! Every key starts with the namespace and a colon, so `SCAN MATCH <ns>:*` finds all of them.
//! All keys of one request share the hash tag `{<request key id>}`; the token lists of shard `s`
//! (and the indexes kept beside them) share the tag `{<ns>.q<s>}` (one shard, `q0`, by default). Lua scripts only ever touch keys of one
//! tag, which makes the same code correct on Redis Cluster. docs/protocol.md documents the schema.

use crate::request::{Namespace, Priority};

/// The token shard a request calls home (its `active` index entry and its events live there),
/// for a request submitted with `shards` token shards: FNV-1a (32 bit) of the key id, modulo
/// `shards`. Token k of the request lives on shard `(home + k) % shards`.
pub(crate) fn home_shard(key_id: &str, shards: u32) -> u32 {
    if let Some((shard, _)) = lane_of(key_id) {
        return shard;
    }
    fnv1a(key_id) % shards.max(1)
}

/// FNV-1a, 32 bit.
fn fnv1a(text: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in text.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// The shard of token `k` of a request with `shards` shards (a lane's tokens are all on its own).
pub(crate) fn token_shard(key_id: &str, shards: u32, k: u64) -> u32 {
    if let Some((shard, _)) = lane_of(key_id) {
        return shard;
    }
    let shards = shards.max(1);
    ((u64::from(home_shard(key_id, shards)) + k) % u64::from(shards)) as u32
}

/// The shard of tenant group `name` among `shards` token shards: FNV-1a (32 bit) of the name,
/// modulo `shards`. Every token of a request in the group lives there.
pub(crate) fn group_shard(name: &str, shards: u32) -> u32 {
    fnv1a(name) % shards.max(1)
}

/// The group name of a group queue key (`...:grp:<name>:p:<priority>`); `None` for any other key.
pub(crate) fn group_of_queue(list: &str) -> Option<&str> {
    let (_, rest) = list.rsplit_once(":grp:")?;
    let (name, _) = rest.split_once(":p:")?;
    Some(name)
}

/// The key id of the lane of `priority` on `shard`: `~<shard>.<priority>`. A request's key id never
/// starts with `~` (it is percent-encoded), so lanes and requests never share keys.
pub(crate) fn lane_key_id(shard: u32, priority: Priority) -> String {
    format!("~{shard}.{}", priority.get())
}

/// The shard and priority of a lane's key id; `None` for a request's.
pub(crate) fn lane_of(key_id: &str) -> Option<(u32, Priority)> {
    let (shard, priority) = key_id.strip_prefix('~')?.split_once('.')?;
    Some((shard.parse().ok()?, Priority::new(priority.parse().ok()?).ok()?))
}

/// Builds the keys of one namespace.
#[derive(Clone, Debug)]
pub(crate) struct Keys {
    ns: String,
    /// Token shards this component serves and submits to (`Config::token_shards`).
    shards: u32,
}

impl Keys {
    pub(crate) fn new(ns: &Namespace, shards: u32) -> Self {
        let ns = ns.as_str().to_owned();
        let shards = shards.max(1);
        Self { ns, shards }
    }

    /// How many token shards this component uses.
    pub(crate) fn shards(&self) -> u32 {
        self.shards
    }

    /// The channel on which a push onto an empty priority list of `shard` is announced (message:
    /// the priority), for busy slots holding a lower one to give way.
    pub(crate) fn up_channel(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:up", self.ns, self.ns)
    }

    /// Priority lists of one shard, highest first.
    pub(crate) fn token_lists(&self, shard: u32) -> Vec<String> {
        Priority::all_descending().map(|p| self.token_list(shard, p)).collect()
    }

    /// What the priority lists of one shard are named: this prefix, then the priority.
    pub(crate) fn list_prefix(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:p:", self.ns, self.ns)
    }

    /// The list of one priority on one shard (any shard, configured here or not).
    pub(crate) fn token_list(&self, shard: u32, priority: Priority) -> String {
        format!("{}{}", self.list_prefix(shard), priority.get())
    }

    /// The shard and priority a token list key stands for: a shard's priority list, or a tenant
    /// group's queue (whose priority lists are on its shard).
    pub(crate) fn priority_of_list(&self, list: &str) -> Option<(u32, Priority)> {
        let p: u8 = list.rsplit(':').next()?.parse().ok()?;
        let p = Priority::new(p).ok()?;
        let prefix = format!("{}:{{{}.q", self.ns, self.ns);
        let shard: u32 = list.strip_prefix(&prefix)?.split('}').next()?.parse().ok()?;
        if let Some(name) = group_of_queue(list) {
            return (self.group_queue(shard, name, p) == list).then_some((shard, p));
        }
        (self.token_list(shard, p) == list).then_some((shard, p))
    }

    /// The meta hash of tenant group `name` on `shard`, its group's shard (docs/protocol.md §3,
    /// "Tenant groups"): its limit and its tokens.
    pub(crate) fn group(&self, shard: u32, name: &str) -> String {
        format!("{}grp:{name}", self.shard_prefix(shard))
    }

    /// The queue of group `name`'s request token elements of `priority`.
    pub(crate) fn group_queue(&self, shard: u32, name: &str, priority: Priority) -> String {
        format!("{}:p:{}", self.group(shard, name), priority.get())
    }

    /// Sorted set of the priorities whose queue of group `name` may hold elements.
    pub(crate) fn group_work(&self, shard: u32, name: &str) -> String {
        format!("{}:w", self.group(shard, name))
    }

    /// Hash of the group limits operators set for the groups of `shard`: name -> limit.
    pub(crate) fn group_limits(&self, shard: u32) -> String {
        format!("{}gconf", self.shard_prefix(shard))
    }

    /// Set of the groups of `shard` that have a meta hash (recovery's audit scans it).
    pub(crate) fn groups(&self, shard: u32) -> String {
        format!("{}groups", self.shard_prefix(shard))
    }

    /// Sorted set of the requests homed on `shard` not yet terminal; score: when recovery should
    /// next look.
    pub(crate) fn active(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:active", self.ns, self.ns)
    }

    /// Hash of the listing index of the requests homed on `shard`: key id ->
    /// `<kind>|<priority>|<limit>|<tags>`. The index's sorted sets (`ix:live`, `ix:completed`,
    /// `ix:failed`, `ix:cancelled`, `ix:t:<tag>`, `ix:tracked`, `ix:exp`) are named by the
    /// functions from its prefix (prelude.lua, "The listing index").
    pub(crate) fn index_rows(&self, shard: u32) -> String {
        format!("{}ix:row", self.shard_prefix(shard))
    }

    /// One key of the listing index of `shard`: a set (`live`, `completed`, `t:<tag>`, `exp`, ...)
    /// or the count of queued lane requests not listed as live yet (`lq`).
    pub(crate) fn index_set(&self, shard: u32, set: &str) -> String {
        format!("{}ix:{set}", self.shard_prefix(shard))
    }

    fn shard_prefix(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:", self.ns, self.ns)
    }

    /// Hash of what an operator paused on `shard` (`Admin::pause`): field `all` (the namespace) or
    /// a priority's number, value `1`. Every shard holds the same fields; `take` reads its own.
    pub(crate) fn paused(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:paused", self.ns, self.ns)
    }

    /// Sorted set of the looks asked for before a step (arm with a deadline, `shards::armed`);
    /// score: when that look is due (ms). Beside `active`, which keeps only the earliest look, so
    /// that a census that begins before such a look is due does not cancel it.
    pub(crate) fn armed(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:armed", self.ns, self.ns)
    }

    /// List of wake-ups for idle slots of `shard`: one per element pushed (push, give_back,
    /// verify). An idle slot blocks on it alone, then takes the highest priority with `take`.
    pub(crate) fn bell(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:bell", self.ns, self.ns)
    }

    /// Hash of the hand-offs reserved slots of `shard` wait for: holder -> `<floor>|<take id>|<consumer>|<batch>|<until ms>`
    /// (lua/prelude.lua, "Hand-offs").
    pub(crate) fn offers(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:wait", self.ns, self.ns)
    }

    /// List where `lane_submit` or `push` leaves the token it hands to `holder` on `shard`, for its
    /// blocked pop.
    pub(crate) fn hand(&self, shard: u32, holder: &str) -> String {
        format!("{}:{{{}.q{shard}}}:hand:{holder}", self.ns, self.ns)
    }

    /// Hash of what the slots took on `shard`: holder `<worker>/<slot>` -> `<element>|<take id>|<list>`.
    pub(crate) fn held(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:held", self.ns, self.ns)
    }

    /// Hash of when the requests homed on `shard` were registered (key id -> ms), while indexed.
    pub(crate) fn registrations(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:reg", self.ns, self.ns)
    }

    /// Sorted set of dead workers claimed for reaping; score: when the claim runs out (ms). On
    /// shard 0.
    pub(crate) fn reaping(&self) -> String {
        format!("{}:{{{}.q0}}:reaping", self.ns, self.ns)
    }

    /// Stream of terminal events of the requests homed on `shard`, trimmed to the retention.
    pub(crate) fn events(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:events", self.ns, self.ns)
    }

    /// Hash of a finished request's marks on its home shard: `e`, the last lifecycle whose event
    /// was written; `o`, the last lifecycle reopened by requeue. Expires with the retention.
    pub(crate) fn finish_marks(&self, shard: u32, key_id: &str) -> String {
        format!("{}:{{{}.q{shard}}}:f:{key_id}", self.ns, self.ns)
    }

    /// Sorted set of live workers; score: when their registration expires (ms, Redis time). On
    /// shard 0.
    pub(crate) fn workers(&self) -> String {
        format!("{}:{{{}.q0}}:workers", self.ns, self.ns)
    }

    /// Hash: worker id -> JSON description (slots, pid, host, started). On shard 0.
    pub(crate) fn worker_info(&self) -> String {
        format!("{}:{{{}.q0}}:winfo", self.ns, self.ns)
    }

    /// Hash of the stats by stage counted in one minute (`minute`: Unix time in ms / 60,000, by
    /// the clock of the component that counted): fields `<priority>|<counter>` and
    /// `<priority>|<histogram>|<bucket>`, whole numbers (`stats`). On shard 0, so that one
    /// pipeline reads a range of minutes; expires `Config::stats_retention` after its last
    /// addition.
    pub(crate) fn stats_minute(&self, minute: u64) -> String {
        format!("{}:{{{}.q0}}:st:{minute}", self.ns, self.ns)
    }

    /// Set of the downstreams of request `key_id`, on its home shard: `<dkid>|<D's token shards>`
    /// (docs/protocol.md §5, "Dependencies").
    pub(crate) fn downstreams(&self, shard: u32, key_id: &str) -> String {
        format!("{}:{{{}.q{shard}}}:dn:{key_id}", self.ns, self.ns)
    }

    /// Sorted set of the releases owed by the requests homed on `shard` (the release outbox): key
    /// id of a finished request with downstreams; score: when recovery should run its release (ms).
    pub(crate) fn releases(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:rel", self.ns, self.ns)
    }

    #[cfg(feature = "schedules")]
    /// Hash of the schedules: name -> spec (JSON: cron, time zone, missed policy, request
    /// template). On shard 0, with the other schedule keys; none expires.
    pub(crate) fn schedules(&self) -> String {
        format!("{}:{{{}.q0}}:sch", self.ns, self.ns)
    }

    /// Sorted set of the schedules; score: when a worker should look at it next (ms): its next
    /// tick, or the end of a claim. On shard 0.
    pub(crate) fn schedules_due(&self) -> String {
        format!("{}:{{{}.q0}}:sch:due", self.ns, self.ns)
    }

    #[cfg(feature = "schedules")]
    /// Hash: the schedules' counter (field `n`), from which every change of a schedule takes its `gen`, so
    /// that no two states of any schedule share one. On shard 0.
    pub(crate) fn schedules_gen(&self) -> String {
        format!("{}:{{{}.q0}}:sch:gen", self.ns, self.ns)
    }

    #[cfg(feature = "schedules")]
    /// Hash of one schedule's state (`gen`, `from`, `next`, `paused`, `gaps`, `owe`, `last`:
    /// lua/sched_add.lua). On shard 0.
    pub(crate) fn schedule_state(&self, name: &str) -> String {
        format!("{}:{{{}.q0}}:sch:s:{name}", self.ns, self.ns)
    }

    /// Pub/sub channel announcing terminal states ("<key id>|<state>").
    pub(crate) fn done_channel(&self) -> String {
        format!("{}:done", self.ns)
    }

    /// The record of lane request `key_id` on `shard` (its home shard): a hash in the shard's slot.
    pub(crate) fn record(&self, shard: u32, key_id: &str) -> String {
        format!("{}{key_id}", self.record_prefix(shard))
    }

    /// What the records of lane requests homed on `shard` start with (the lane functions name
    /// records from it and the key ids in the lane's entries).
    pub(crate) fn record_prefix(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:s:", self.ns, self.ns)
    }

    /// The keys of one request; for a lane's key id (`lane_key_id`), the lane's, in its shard's slot.
    /// What the meta key of each lane of `shard` starts with; its priority follows.
    pub(crate) fn lane_prefix(&self, shard: u32) -> String {
        format!("{}:{{{}.q{shard}}}:lane:", self.ns, self.ns)
    }

    pub(crate) fn request(&self, key_id: &str) -> RequestKeys {
        let base = match lane_of(key_id) {
            Some((shard, priority)) => format!("{}{}", self.lane_prefix(shard), priority.get()),
            None => format!("{}:r:{{{key_id}}}", self.ns),
        };
        RequestKeys {
            stream: format!("{base}:s"),
            results: format!("{base}:res"),
            errors: format!("{base}:err"),
            orphans: format!("{base}:orph"),
            retry: format!("{base}:retry"),
            meta: base,
        }
    }
}

/// The keys of one request; all share its hash tag.
#[derive(Clone, Debug)]
pub(crate) struct RequestKeys {
    /// Hash: state, counters, token states.
    pub(crate) meta: String,
    /// Stream of sub-requests (entry id `0-<index+1>`, one field `p`), consumer group `g`.
    pub(crate) stream: String,
    /// Hash: index -> result bytes (MessagePack).
    pub(crate) results: String,
    /// Hash: index -> error record (JSON: error, attempts, permanent).
    pub(crate) errors: String,
    /// List: entries whose holder lost its token (declared dead, fail-fast), to hand out again first.
    pub(crate) orphans: String,
    /// Sorted set: entries waiting to be retried, scored by when (ms).
    pub(crate) retry: String,
}

impl RequestKeys {
    /// The six keys every request-side function takes, in protocol order.
    pub(crate) fn all(&self) -> [&str; 6] {
        [&self.meta, &self.stream, &self.results, &self.errors, &self.orphans, &self.retry]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::RequestId;

    #[test]
    fn request_keys_share_one_hash_tag_and_token_lists_another() {
        let keys = Keys::new(&Namespace::new("ns").unwrap(), 1);
        let r = keys.request(&RequestId::new("a:b").unwrap().key_id());
        for k in r.all() {
            assert!(k.starts_with("ns:r:{a%3Ab}"), "{k}");
        }
        assert_eq!(keys.list_prefix(0), "ns:{ns.q0}:p:");
        assert_eq!(keys.token_list(0, Priority::new(99).unwrap()), "ns:{ns.q0}:p:99");
        assert_eq!(keys.priority_of_list("ns:{ns.q0}:p:7"), Some((0, Priority::new(7).unwrap())));
        assert_eq!(keys.active(0), "ns:{ns.q0}:active");
        assert_eq!(keys.events(0), "ns:{ns.q0}:events");
        assert_eq!(keys.workers(), "ns:{ns.q0}:workers");
        assert_eq!(keys.worker_info(), "ns:{ns.q0}:winfo");
        assert_eq!(keys.stats_minute(28_000_000), "ns:{ns.q0}:st:28000000");
        assert_eq!(keys.releases(2), "ns:{ns.q2}:rel");
        assert_eq!(keys.downstreams(2, "a%7Cb"), "ns:{ns.q2}:dn:a%7Cb");
        assert_eq!(keys.schedules_due(), "ns:{ns.q0}:sch:due");
        #[cfg(feature = "schedules")]
        assert_eq!(
            (keys.schedules(), keys.schedule_state("nightly"), keys.schedules_gen()),
            ("ns:{ns.q0}:sch".into(), "ns:{ns.q0}:sch:s:nightly".into(), "ns:{ns.q0}:sch:gen".into())
        );
    }

    #[test]
    fn lanes_live_in_their_shards_slot_and_never_share_a_requests_keys() {
        let keys = Keys::new(&Namespace::new("ns").unwrap(), 3);
        let lane = lane_key_id(2, Priority::new(7).unwrap());
        assert_eq!(lane, "~2.7");
        assert_eq!(lane_of(&lane), Some((2, Priority::new(7).unwrap())));
        assert_eq!(keys.request(&lane).meta, "ns:{ns.q2}:lane:7");
        assert_eq!(keys.request(&lane).stream, "ns:{ns.q2}:lane:7:s");
        assert_eq!((home_shard(&lane, 3), token_shard(&lane, 3, 5)), (2, 2));
        assert_eq!(keys.record(1, "abc"), "ns:{ns.q1}:s:abc");
        // A request whose id looks like a lane's is percent-encoded.
        let id = RequestId::new("~2.7").unwrap().key_id();
        assert_eq!(lane_of(&id), None);
        assert!(keys.request(&id).meta.starts_with("ns:r:{"));
    }

    #[test]
    fn shards_have_their_own_tags_and_tokens_of_a_request_rotate_over_them() {
        let keys = Keys::new(&Namespace::new("ns").unwrap(), 3);
        assert_eq!(keys.token_list(2, Priority::new(0).unwrap()), "ns:{ns.q2}:p:0");
        assert_eq!(keys.priority_of_list("ns:{ns.q2}:p:7"), Some((2, Priority::new(7).unwrap())));
        assert_eq!(keys.priority_of_list("ns:{ns.qx}:p:7"), None);
        assert_eq!(keys.active(1), "ns:{ns.q1}:active");
        // With one shard everything is on shard 0.
        assert_eq!(home_shard("anything", 1), 0);
        let h = home_shard("req-1", 3);
        assert_eq!(token_shard("req-1", 3, 0), h);
        assert_eq!(token_shard("req-1", 3, 1), (h + 1) % 3);
        assert_eq!(token_shard("req-1", 3, 5), (h + 2) % 3);
        // FNV-1a 32 of "a" is 0xe40c292c.
        assert_eq!(home_shard("a", 1 << 31), 0xe40c_292c % (1 << 31));
        // Homes of many ids spread over the shards.
        let mut count = [0u32; 3];
        for i in 0..3000 {
            count[home_shard(&format!("{i:032x}"), 3) as usize] += 1;
        }
        assert!(count.iter().all(|&c| (900..1100).contains(&c)), "{count:?}");
    }
}
