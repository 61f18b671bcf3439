//! The server-side half of sluicegate: the Redis Functions library assembled from `lua/`.
//!
//! Every multi-step state change is one function, named for the transition, whose keys all share
//! one hash tag. The library is versioned by name (`sluicegate_v1`, functions `sg1_<name>`), so a
//! future protocol can be loaded beside this one while old workers drain. Why Functions rather
//! than EVALSHA: docs/architecture.md, "Server-side logic".

/// Protocol version: part of the library and function names, and stored in each request.
pub const PROTOCOL_VERSION: u32 = 1;

/// The library name as loaded into Redis.
pub const LIBRARY_NAME: &str = "sluicegate_v1";

const PRELUDE: &str = include_str!("../lua/prelude.lua");

/// One state transition of the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Func {
    SubmitOpen,
    LoadParts,
    SubmitCommit,
    SubmitSmall,
    SubmitAbort,
    Ring,
    Acquire,
    Ack,
    FinishIndex,
    Seal,
    Unindex,
    Renew,
    ClaimDue,
    Census,
    VerifyTokens,
    RestoreTokens,
    Cancel,
    RequeueDead,
    StreamOpen,
    StreamAppend,
    StreamFinalize,
}

impl Func {
    pub(crate) const ALL: [Func; 21] = [
        Func::SubmitOpen,
        Func::LoadParts,
        Func::SubmitCommit,
        Func::SubmitSmall,
        Func::SubmitAbort,
        Func::Ring,
        Func::Acquire,
        Func::Ack,
        Func::FinishIndex,
        Func::Seal,
        Func::Unindex,
        Func::Renew,
        Func::ClaimDue,
        Func::Census,
        Func::VerifyTokens,
        Func::RestoreTokens,
        Func::Cancel,
        Func::RequeueDead,
        Func::StreamOpen,
        Func::StreamAppend,
        Func::StreamFinalize,
    ];

    /// The Lua function name, which is also the file name in `lua/`.
    pub(crate) fn local_name(self) -> &'static str {
        match self {
            Func::SubmitOpen => "submit_open",
            Func::LoadParts => "load_parts",
            Func::SubmitCommit => "submit_commit",
            Func::SubmitSmall => "submit_small",
            Func::SubmitAbort => "submit_abort",
            Func::Ring => "ring",
            Func::Acquire => "acquire",
            Func::Ack => "ack",
            Func::FinishIndex => "finish_index",
            Func::Seal => "seal",
            Func::Unindex => "unindex",
            Func::Renew => "renew",
            Func::ClaimDue => "claim_due",
            Func::Census => "census",
            Func::VerifyTokens => "verify_tokens",
            Func::RestoreTokens => "restore_tokens",
            Func::Cancel => "cancel",
            Func::RequeueDead => "requeue_dead",
            Func::StreamOpen => "stream_open",
            Func::StreamAppend => "stream_append",
            Func::StreamFinalize => "stream_finalize",
        }
    }

    /// The name to FCALL.
    pub(crate) fn fcall_name(self) -> String {
        format!("sg{PROTOCOL_VERSION}_{}", self.local_name())
    }

    fn source(self) -> &'static str {
        match self {
            Func::SubmitOpen => include_str!("../lua/submit_open.lua"),
            Func::LoadParts => include_str!("../lua/load_parts.lua"),
            Func::SubmitCommit => include_str!("../lua/submit_commit.lua"),
            Func::SubmitSmall => include_str!("../lua/submit_small.lua"),
            Func::SubmitAbort => include_str!("../lua/submit_abort.lua"),
            Func::Ring => include_str!("../lua/ring.lua"),
            Func::Acquire => include_str!("../lua/acquire.lua"),
            Func::Ack => include_str!("../lua/ack.lua"),
            Func::FinishIndex => include_str!("../lua/finish_index.lua"),
            Func::Seal => include_str!("../lua/seal.lua"),
            Func::Unindex => include_str!("../lua/unindex.lua"),
            Func::Renew => include_str!("../lua/renew.lua"),
            Func::ClaimDue => include_str!("../lua/claim_due.lua"),
            Func::Census => include_str!("../lua/census.lua"),
            Func::VerifyTokens => include_str!("../lua/verify_tokens.lua"),
            Func::RestoreTokens => include_str!("../lua/restore_tokens.lua"),
            Func::Cancel => include_str!("../lua/cancel.lua"),
            Func::RequeueDead => include_str!("../lua/requeue_dead.lua"),
            Func::StreamOpen => include_str!("../lua/stream_open.lua"),
            Func::StreamAppend => include_str!("../lua/stream_append.lua"),
            Func::StreamFinalize => include_str!("../lua/stream_finalize.lua"),
        }
    }
}

/// The complete library source, ready for `FUNCTION LOAD REPLACE`. Clients in other languages
/// load the same text (docs/protocol.md describes how it is assembled).
pub fn library_source() -> String {
    let mut code = format!("#!lua name={LIBRARY_NAME}\n\n{PRELUDE}\n");
    for f in Func::ALL {
        code.push_str(f.source());
        code.push('\n');
    }
    for f in Func::ALL {
        code.push_str(&format!("redis.register_function('{}', {})\n", f.fcall_name(), f.local_name()));
    }
    code
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
    "info",
    "fcall",
    "fcall_ro",
    // blocking reads and pub/sub, sent by the client itself
    "brpop",
    "xread",
    "subscribe",
    "unsubscribe",
    // inside the functions, and reads by producers and operators
    "del",
    "exists",
    "hdel",
    "hget",
    "hgetall",
    "hincrby",
    "hmget",
    "hset",
    "llen",
    "lpop",
    "lpos",
    "lpush",
    "lrem",
    "persist",
    "pexpire",
    "publish",
    "rpush",
    "time",
    "xack",
    "xadd",
    "xclaim",
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
    "zrangebyscore",
    "zrem",
    "zscore",
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
        assert!(library_source().starts_with("#!lua name=sluicegate_v1\n"));
    }
}
