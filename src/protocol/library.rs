//! The server-side half of sluicegate: the Redis Functions library assembled from `lua/`.
//!
//! Every multi-step state change is one function, named for the transition, whose keys all share
//! one hash tag. The library is versioned by name (`sluicegate_v2`, functions `sg2_<name>`), so a
//! future protocol can be loaded beside this one while old workers drain. Why Functions rather
//! than EVALSHA: docs/architecture.md, "Server-side logic".

use std::collections::HashSet;

/// Protocol version: part of the library and function names, and stored in each request.
pub const PROTOCOL_VERSION: u32 = 2;

/// The library name as loaded into Redis.
pub const LIBRARY_NAME: &str = "sluicegate_v2";

const PRELUDE: &str = include_str!("../../lua/prelude.lua");

/// `lua/REVISION`: "<revision> <fingerprint>", the library's revision and the FNV-1a (64 bit) of
/// the library without it (`unrevised`). The revision grows with every change to the library, so
/// that a component loads its copy only over an older one (`Store::load_library`; docs/operations.md,
/// "Upgrades"): a change to `lua/` without a new revision fails
/// `the_checked_in_library_is_the_one_the_rust_loads`, and `SLUICEGATE_BLESS=1` gives it one.
const REVISION: &str = include_str!("../../lua/REVISION");

/// One state transition of the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Func {
    SubmitOpen,
    LoadParts,
    SubmitCommit,
    SubmitSmall,
    SubmitAbort,
    StreamOpen,
    StreamAppend,
    StreamFinalize,
    Outstanding,
    ResultsFrom,
    Register,
    Push,
    Reopen,
    Arm,
    Take,
    Untake,
    Acquire,
    Ack,
    GiveBack,
    Release,
    Holds,
    FinishIndex,
    Sweep,
    Seal,
    Unindex,
    ClaimDue,
    Census,
    Verify,
    Restore,
    Reclaim,
    DropGone,
    Cancel,
    RequeueDead,
    Reprioritize,
    Relist,
    Beat,
    Reaped,
    LaneSubmit,
    LaneSubmitMany,
    LaneAcquire,
    LaneAck,
    LaneCancel,
    LaneRequeue,
    List,
    Track,
    Unlist,
    Purge,
    Relabel,
    StatsAdd,
    SchedGet,
    SchedAdd,
    SchedPause,
    SchedFire,
    SchedPaid,
    SchedDel,
    DagLink,
    DagSettle,
    RelDone,
    GroupSet,
    GroupAudit,
}

impl Func {
    /// Every transition, in library order: a file may call a function defined before it
    /// (`submit_small` calls `submit_open`, `load_parts`, `submit_commit`; `stream_open` calls
    /// `submit_open`; `take` calls `give_back` and `lane_acquire`).
    pub(crate) const ALL: [Func; 60] = [
        Func::SubmitOpen,
        Func::LoadParts,
        Func::SubmitCommit,
        Func::SubmitSmall,
        Func::SubmitAbort,
        Func::StreamOpen,
        Func::StreamAppend,
        Func::StreamFinalize,
        Func::Outstanding,
        Func::ResultsFrom,
        Func::Register,
        Func::Push,
        Func::Reopen,
        Func::Arm,
        Func::LaneAcquire,
        Func::GiveBack,
        Func::Take,
        Func::Untake,
        Func::Acquire,
        Func::Ack,
        Func::Release,
        Func::Holds,
        Func::FinishIndex,
        Func::Sweep,
        Func::Seal,
        Func::Unindex,
        Func::ClaimDue,
        Func::Census,
        Func::Verify,
        Func::Restore,
        Func::Reclaim,
        Func::DropGone,
        Func::Cancel,
        Func::RequeueDead,
        Func::Reprioritize,
        Func::Relist,
        Func::Beat,
        Func::Reaped,
        Func::LaneSubmit,
        Func::LaneSubmitMany,
        Func::LaneAck,
        Func::LaneCancel,
        Func::LaneRequeue,
        Func::List,
        Func::Track,
        Func::Unlist,
        Func::Purge,
        Func::Relabel,
        Func::StatsAdd,
        Func::SchedGet,
        Func::SchedAdd,
        Func::SchedPause,
        Func::SchedFire,
        Func::SchedPaid,
        Func::SchedDel,
        Func::DagLink,
        Func::DagSettle,
        Func::RelDone,
        Func::GroupSet,
        Func::GroupAudit,
    ];

    /// The Lua function name, which is also the file name in `lua/`.
    pub(crate) fn local_name(self) -> &'static str {
        match self {
            Func::SubmitOpen => "submit_open",
            Func::LoadParts => "load_parts",
            Func::SubmitCommit => "submit_commit",
            Func::SubmitSmall => "submit_small",
            Func::SubmitAbort => "submit_abort",
            Func::StreamOpen => "stream_open",
            Func::StreamAppend => "stream_append",
            Func::StreamFinalize => "stream_finalize",
            Func::Outstanding => "outstanding",
            Func::ResultsFrom => "results_from",
            Func::Register => "register",
            Func::Push => "push",
            Func::Reopen => "reopen",
            Func::Arm => "arm",
            Func::Take => "take",
            Func::Untake => "untake",
            Func::Acquire => "acquire",
            Func::Ack => "ack",
            Func::GiveBack => "give_back",
            Func::Release => "release",
            Func::Holds => "holds",
            Func::FinishIndex => "finish_index",
            Func::Sweep => "sweep",
            Func::Seal => "seal",
            Func::Unindex => "unindex",
            Func::ClaimDue => "claim_due",
            Func::Census => "census",
            Func::Verify => "verify",
            Func::Restore => "restore",
            Func::Reclaim => "reclaim",
            Func::DropGone => "drop_gone",
            Func::Cancel => "cancel",
            Func::RequeueDead => "requeue_dead",
            Func::Reprioritize => "reprioritize",
            Func::Relist => "relist",
            Func::Beat => "beat",
            Func::Reaped => "reaped",
            Func::LaneSubmit => "lane_submit",
            Func::LaneSubmitMany => "lane_submit_many",
            Func::LaneAcquire => "lane_acquire",
            Func::LaneAck => "lane_ack",
            Func::LaneCancel => "lane_cancel",
            Func::LaneRequeue => "lane_requeue",
            Func::List => "list",
            Func::Track => "track",
            Func::Unlist => "unlist",
            Func::Purge => "purge",
            Func::Relabel => "relabel",
            Func::StatsAdd => "stats_add",
            Func::SchedGet => "sched_get",
            Func::SchedAdd => "sched_add",
            Func::SchedPause => "sched_pause",
            Func::SchedFire => "sched_fire",
            Func::SchedPaid => "sched_paid",
            Func::SchedDel => "sched_del",
            Func::DagLink => "dag_link",
            Func::DagSettle => "dag_settle",
            Func::GroupSet => "group_set",
            Func::GroupAudit => "group_audit",
            Func::RelDone => "rel_done",
        }
    }

    /// The name to FCALL.
    pub(crate) fn fcall_name(self) -> String {
        format!("sg{PROTOCOL_VERSION}_{}", self.local_name())
    }

    /// Functions that only read, registered `no-writes`: callable with FCALL_RO, on replicas, and
    /// while Redis is at its memory limit.
    pub(crate) fn read_only(self) -> bool {
        matches!(self, Func::Holds | Func::Outstanding | Func::List | Func::SchedGet)
    }

    fn source(self) -> &'static str {
        match self {
            Func::SubmitOpen => include_str!("../../lua/submit_open.lua"),
            Func::LoadParts => include_str!("../../lua/load_parts.lua"),
            Func::SubmitCommit => include_str!("../../lua/submit_commit.lua"),
            Func::SubmitSmall => include_str!("../../lua/submit_small.lua"),
            Func::SubmitAbort => include_str!("../../lua/submit_abort.lua"),
            Func::StreamOpen => include_str!("../../lua/stream_open.lua"),
            Func::StreamAppend => include_str!("../../lua/stream_append.lua"),
            Func::StreamFinalize => include_str!("../../lua/stream_finalize.lua"),
            Func::Outstanding => include_str!("../../lua/outstanding.lua"),
            Func::ResultsFrom => include_str!("../../lua/results_from.lua"),
            Func::Register => include_str!("../../lua/register.lua"),
            Func::Push => include_str!("../../lua/push.lua"),
            Func::Reopen => include_str!("../../lua/reopen.lua"),
            Func::Arm => include_str!("../../lua/arm.lua"),
            Func::Take => include_str!("../../lua/take.lua"),
            Func::Untake => include_str!("../../lua/untake.lua"),
            Func::Acquire => include_str!("../../lua/acquire.lua"),
            Func::Ack => include_str!("../../lua/ack.lua"),
            Func::GiveBack => include_str!("../../lua/give_back.lua"),
            Func::Release => include_str!("../../lua/release.lua"),
            Func::Holds => include_str!("../../lua/holds.lua"),
            Func::FinishIndex => include_str!("../../lua/finish_index.lua"),
            Func::Sweep => include_str!("../../lua/sweep.lua"),
            Func::Seal => include_str!("../../lua/seal.lua"),
            Func::Unindex => include_str!("../../lua/unindex.lua"),
            Func::ClaimDue => include_str!("../../lua/claim_due.lua"),
            Func::Census => include_str!("../../lua/census.lua"),
            Func::Verify => include_str!("../../lua/verify.lua"),
            Func::Restore => include_str!("../../lua/restore.lua"),
            Func::Reclaim => include_str!("../../lua/reclaim.lua"),
            Func::DropGone => include_str!("../../lua/drop_gone.lua"),
            Func::Cancel => include_str!("../../lua/cancel.lua"),
            Func::RequeueDead => include_str!("../../lua/requeue_dead.lua"),
            Func::Reprioritize => include_str!("../../lua/reprioritize.lua"),
            Func::Relist => include_str!("../../lua/relist.lua"),
            Func::Beat => include_str!("../../lua/beat.lua"),
            Func::Reaped => include_str!("../../lua/reaped.lua"),
            Func::LaneSubmit => include_str!("../../lua/lane_submit.lua"),
            Func::LaneSubmitMany => include_str!("../../lua/lane_submit_many.lua"),
            Func::LaneAcquire => include_str!("../../lua/lane_acquire.lua"),
            Func::LaneAck => include_str!("../../lua/lane_ack.lua"),
            Func::LaneCancel => include_str!("../../lua/lane_cancel.lua"),
            Func::LaneRequeue => include_str!("../../lua/lane_requeue.lua"),
            Func::List => include_str!("../../lua/list.lua"),
            Func::Track => include_str!("../../lua/track.lua"),
            Func::Unlist => include_str!("../../lua/unlist.lua"),
            Func::Purge => include_str!("../../lua/purge.lua"),
            Func::Relabel => include_str!("../../lua/relabel.lua"),
            Func::StatsAdd => include_str!("../../lua/stats_add.lua"),
            Func::SchedGet => include_str!("../../lua/sched_get.lua"),
            Func::SchedAdd => include_str!("../../lua/sched_add.lua"),
            Func::SchedPause => include_str!("../../lua/sched_pause.lua"),
            Func::SchedFire => include_str!("../../lua/sched_fire.lua"),
            Func::SchedPaid => include_str!("../../lua/sched_paid.lua"),
            Func::SchedDel => include_str!("../../lua/sched_del.lua"),
            Func::DagLink => include_str!("../../lua/dag_link.lua"),
            Func::DagSettle => include_str!("../../lua/dag_settle.lua"),
            Func::GroupSet => include_str!("../../lua/group_set.lua"),
            Func::GroupAudit => include_str!("../../lua/group_audit.lua"),
            Func::RelDone => include_str!("../../lua/rel_done.lua"),
        }
    }
}

/// The complete library source, ready for `FUNCTION LOAD REPLACE`. Clients in other languages
/// load the same text (docs/protocol.md describes how it is assembled).
///
/// Lua lets a chunk hold at most 200 local variables, and the prelude's helpers are most of them:
/// a transition whose function and file-level names no other one uses is defined and registered
/// inside a `do ... end` block of its own, so that none of them is one of the chunk's locals; the
/// few that others use (`take` calls `give_back`) stay at the top and are registered at the end.
pub fn library_source() -> String {
    static SOURCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SOURCE.get_or_init(|| revised(&unrevised(), library_revision())).clone()
}

/// The revision of the library this build loads: it grows with every change to the library
/// (`lua/REVISION`). `sg2_revision` returns the revision of the one loaded.
pub fn library_revision() -> u64 {
    parse_revision(REVISION).map_or(0, |(revision, _)| revision)
}

/// "<revision> <fingerprint>" (`lua/REVISION`).
fn parse_revision(text: &str) -> Option<(u64, u64)> {
    let mut words = text.split_whitespace();
    let revision = words.next()?.parse().ok()?;
    let fingerprint = u64::from_str_radix(words.next()?, 16).ok()?;
    Some((revision, fingerprint))
}

/// FNV-1a, 64 bit: the fingerprint of the library without its revision.
#[cfg(test)]
fn fingerprint(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The library `unrevised` with its revision: one function more, `sg2_revision` (no keys, no
/// arguments; registered `no-writes`), which returns it. Defined inline: the chunk's locals are
/// nearly all taken (see `library_source`).
fn revised(unrevised: &str, revision: u64) -> String {
    format!(
        "{unrevised}-- The library's revision (docs/operations.md, \"Upgrades\"): a component loads its copy only\n\
         -- over an older one.\n\
         redis.register_function{{function_name='sg{PROTOCOL_VERSION}_revision', callback=function() return \
         {revision} end, flags={{'no-writes'}}}}\n"
    )
}

fn unrevised() -> String {
    let mut code = format!("#!lua name={LIBRARY_NAME}\n\n{PRELUDE}\n");
    let register = |f: Func| {
        if f.read_only() {
            format!(
                "redis.register_function{{function_name='{}', callback={}, flags={{'no-writes'}}}}\n",
                f.fcall_name(),
                f.local_name()
            )
        } else {
            format!("redis.register_function('{}', {})\n", f.fcall_name(), f.local_name())
        }
    };
    let words: Vec<HashSet<&str>> = Func::ALL.iter().map(|f| code_words(f.source())).collect();
    let named: Vec<bool> = Func::ALL
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let locals = file_locals(f.source());
            words.iter().enumerate().any(|(j, w)| j != i && locals.iter().any(|l| w.contains(l)))
        })
        .collect();
    for (f, named) in Func::ALL.into_iter().zip(&named) {
        if *named {
            code.push_str(f.source());
            code.push('\n');
        } else {
            code.push_str(&format!("do\n{}{}end\n", f.source(), register(f)));
        }
    }
    for (f, _) in Func::ALL.into_iter().zip(&named).filter(|(_, named)| **named) {
        code.push_str(&register(f));
    }
    code
}

/// The names a transition's file declares at its top level (`local function f`, `local A, b = ...`
/// at the start of a line): its function, and any constant or helper of its own.
fn file_locals(source: &str) -> Vec<&str> {
    source
        .lines()
        .filter_map(|line| line.strip_prefix("local "))
        .flat_map(|rest| {
            let rest = rest.strip_prefix("function ").unwrap_or(rest);
            let names = rest.split(['=', '(']).next().unwrap_or_default();
            names.split(',').map(str::trim).filter(|n| !n.is_empty())
        })
        .collect()
}

/// The words (runs of letters, digits and `_`) of Lua `source`'s code, outside comments and
/// quoted text: the names it uses, called or passed as values.
fn code_words(source: &str) -> HashSet<&str> {
    let mut words = HashSet::new();
    for line in source.lines() {
        let code = line.split("--").next().unwrap_or_default();
        // Quoted text sits between odd and even quote marks: keep what is outside.
        for outside in code.split(['\'', '"']).step_by(2) {
            words.extend(
                outside.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| !w.is_empty()),
            );
        }
    }
    words
}

/// The library as the randomized checker loads it: identical but for the clock, which reads an
/// offset the checker advances (`sgcheck:clock`, ms), so that leases and backoffs run out on the
/// checker's schedule instead of the wall clock's.
#[cfg(test)]
pub(crate) fn checker_library_source() -> String {
    const REAL: &str = REAL_CLOCK;
    const VIRTUAL: &str = "return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) \
                           + tonumber(redis.call('GET', 'sgcheck:clock') or '0')\n";
    // A lane walk of `list` gives up after 2 entries passed over instead of 10,000, so that the
    // checker's small lanes reach the page's floor (lua/list.lua).
    const SKIP: &str = "local LIST_LANE_SKIP = 10000\n";
    let real = library_source();
    assert_eq!(real.matches(REAL).count(), 1, "sg_ms in lua/prelude.lua changed: update the checker's clock");
    // Every reading of Redis's clock goes through sg_ms, whose line is replaced: one that did not
    // would run on the wall clock while the rest of the library runs on the checker's.
    assert_eq!(
        real.matches("redis.call('TIME')").count(),
        real.matches("sg_ms(redis.call('TIME'))").count() + real.matches("local now = sg_ms(t)").count(),
        "a reading of TIME in the library does not go through sg_ms"
    );
    assert_eq!(real.matches(SKIP).count(), 1, "LIST_LANE_SKIP in lua/list.lua changed: update the checker's");
    real.replace(REAL, VIRTUAL).replace(SKIP, "local LIST_LANE_SKIP = 2\n")
}

/// The line of `sg_ms` (lua/prelude.lua) that turns Redis's clock into ms, which the test builds
/// of the library replace.
#[cfg(any(test, feature = "test-clock"))]
const REAL_CLOCK: &str = "return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n";

/// The library with a clock tests can move (`Config::test_clock`): Redis time runs at a speed
/// from an offset, both set by an extra function, `sg2_test_clock` (ARGV[1] the speed, a factor
/// of real time; ARGV[2] a jump forward, ms; returns the new time). Both live in a variable of the
/// library itself, not in a key: a key read would cross slots on a cluster, where each master
/// keeps its own clock, set by a call to each (`store::set_test_clock`). A `FUNCTION LOAD REPLACE`
/// resets it: components of a test-clock configuration load it without REPLACE.
#[cfg(feature = "test-clock")]
pub(crate) fn test_clock_library_source() -> String {
    const CLOCK: &str = r"
-- The test clock (test builds only): Redis time runs `speed` times as fast as the real clock from
-- the moment it was last set, plus the jumps it was given.
local sg_clock = {speed = 1, real = 0, virtual = 0}
local function sg_test_time(real)
  return math.floor(sg_clock.virtual + (real - sg_clock.real) * sg_clock.speed)
end
";
    const SET: &str = r"
local function test_clock(keys, args)
  local t = redis.call('TIME')
  local real = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local virtual = sg_test_time(real) + tonumber(args[2] or '0')
  sg_clock.real, sg_clock.virtual, sg_clock.speed = real, virtual, tonumber(args[1] or '1')
  return virtual
end
";
    let real = library_source();
    assert_eq!(
        real.matches(REAL_CLOCK).count(),
        1,
        "sg_ms in lua/prelude.lua changed: update the test clock"
    );
    let moved = real.replace(
        REAL_CLOCK,
        "return sg_test_time(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))\n",
    );
    let header_end = moved.find("\n\n").map_or(0, |i| i + 2);
    let (header, rest) = moved.split_at(header_end);
    format!(
        "{header}{CLOCK}\n{rest}{SET}redis.register_function('sg{PROTOCOL_VERSION}_test_clock', test_clock)\n"
    )
}

/// Commands sluicegate's producers, workers, listeners and operators send, directly or from
/// inside the functions (scripts run under the caller's ACL): nothing else is needed.
const APP_COMMANDS: &[&str] = &[
    // connection and set-up
    "ping",
    "quit",
    "hello",
    "auth",
    "select",
    "client|setname",
    // fred reads its connection's id at connect; a worker's stop wakes its idle slots' blocked
    // pops with it
    "client|id",
    "client|unblock",
    "info",
    "fcall",
    "fcall_ro",
    // blocking reads and pub/sub, sent by the client itself
    "brpop",
    // a standby's or reserved slot's wait on its hand list (and the bell)
    "blpop",
    "lmpop",
    "xread",
    "subscribe",
    "unsubscribe",
    // inside the functions, and reads by producers and operators
    "del",
    "exists",
    "hdel",
    "hexists",
    "hget",
    "hgetall",
    "hincrby",
    "hlen",
    "hmget",
    "hsetnx",
    "hset",
    "lindex",
    "linsert",
    "llen",
    "lpop",
    "lpos",
    "lpush",
    "lrange",
    "lrem",
    "persist",
    "pexpire",
    "pexpireat",
    "pttl",
    "publish",
    "rpop",
    "rpush",
    "sadd",
    "scard",
    "sscan",
    "time",
    "xack",
    "xadd",
    "xclaim",
    "xdel",
    "xgroup|create",
    "xinfo|groups",
    "xlen",
    "xpending",
    "xrange",
    "xreadgroup",
    "xrevrange",
    "xtrim",
    "zadd",
    "zcard",
    "zcount",
    "zmscore",
    "zrange",
    "zrangebyscore",
    "zrem",
    "zrevrangebyscore",
    "zscore",
    // tenant groups: group_set and take read a group's priorities, group_audit drops a gone
    // group from its shard's set, `Admin::groups` reads the sets and settings
    "hkeys",
    "smembers",
    "srem",
    "zrevrange",
    // the listing index's count of queued lane requests (`ix:lq`): submits and first hand-outs
    // change it, `Admin::stats` reads it
    "incrby",
    "decrby",
    "get",
];

/// A least-privilege ACL rule set for the applications of one namespace (producers, workers,
/// listeners): its keys and channels, only the commands above, no `EVAL`, no `FUNCTION LOAD`,
/// no `FLUSHALL`, no `CONFIG`. Use it as `ACL SETUSER <user> on ><password> <rules>`.
/// With `load_library`, the user may also load the functions library (`FUNCTION LOAD`), which
/// otherwise an operator does once per Redis (every component loads it when it may).
pub fn acl_rules(namespace: &str, load_library: bool) -> String {
    let mut rules = format!("resetkeys resetchannels ~{namespace}:* &{namespace}:* -@all");
    for c in APP_COMMANDS {
        rules.push_str(" +");
        rules.push_str(c);
    }
    if load_library {
        rules.push_str(" +function|load");
    }
    rules
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_transition_file_defines_its_function_and_lists_keys_and_args() {
        for f in Func::ALL {
            let src = f.source();
            assert!(
                src.contains(&format!("local function {}(keys, args)", f.local_name())),
                "lua/{}.lua must define local function {}",
                f.local_name(),
                f.local_name()
            );
            assert!(src.contains("KEYS[1") && src.contains("Returns"), "{} lacks its header", f.local_name());
        }
        assert!(library_source().starts_with("#!lua name=sluicegate_v2\n"));
    }

    /// Clients in other languages load the library from `lua/dist/` (docs/protocol.md §1), and the
    /// Python client ships a copy: both must be exactly what the Rust loads. `SLUICEGATE_BLESS=1`
    /// rewrites both after a change in `lua/`.
    ///
    /// A change to the library takes a new revision (`lua/REVISION`), which blessing gives it:
    /// the blessed files then carry the new revision, and the next build loads it.
    #[test]
    fn the_checked_in_library_is_the_one_the_rust_loads() {
        let root = env!("CARGO_MANIFEST_DIR");
        let bless = std::env::var("SLUICEGATE_BLESS").is_ok_and(|v| v == "1");
        let unrevised = super::unrevised();
        let (mut revision, recorded) =
            super::parse_revision(super::REVISION).expect("lua/REVISION is \"<n> <hex>\"");
        let now = super::fingerprint(&unrevised);
        if now != recorded {
            assert!(
                bless,
                "the library changed, and lua/REVISION still names the revision of the one before ({revision}): \
                 run `SLUICEGATE_BLESS=1 cargo test --lib protocol::` (it gives the library revision {}) and \
                 commit lua/REVISION and the files it writes",
                revision + 1
            );
            revision += 1;
            std::fs::write(format!("{root}/lua/REVISION"), format!("{revision} {now:016x}\n"))
                .expect("write lua/REVISION");
        }
        let built = super::revised(&unrevised, revision);
        if !bless {
            assert_eq!(revision, library_revision());
            assert!(built == library_source());
        }
        for path in [
            format!("{root}/lua/dist/{LIBRARY_NAME}.lua"),
            format!("{root}/clients/python/src/sluicegate/{LIBRARY_NAME}.lua"),
        ] {
            if bless {
                std::fs::write(&path, &built).expect("write the checked-in library");
            }
            let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                checked_in == built,
                "{path} differs from library_source(): after a change in lua/, run \
                 `SLUICEGATE_BLESS=1 cargo test --lib protocol::` and commit the file"
            );
        }
    }

    /// docs/operations.md shows the rule set for namespace `myapp`: it must be the one the code
    /// builds, or an operator following it gets a user that cannot run some transition.
    #[test]
    fn operations_doc_shows_the_acl_rules_the_code_builds() {
        let doc = include_str!("../../docs/operations.md");
        let rules = super::acl_rules("myapp", false);
        assert!(
            doc.contains(&format!("ACL SETUSER myapp-app on >PASSWORD {rules}\n")),
            "docs/operations.md's ACL SETUSER line differs from acl_rules(\"myapp\", false):\n{rules}"
        );
    }
}
