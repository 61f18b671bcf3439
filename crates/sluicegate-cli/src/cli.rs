//! The command line: every flag and subcommand, with the example each `--help` shows.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use sluicegate::DEFAULT_REDIS_URL;

/// Durations on the command line: `500ms`, `2s`, `1m30s`, `1h`.
/// `--reserve N:P`: N slots for priority P and above (the worker checks the numbers' range).
fn reserve(text: &str) -> Result<(usize, u8), String> {
    let bad = || format!("`{text}` is not N:P, a count of slots and a priority, e.g. 2:90");
    let (n, p) = text.split_once(':').ok_or_else(bad)?;
    Ok((n.trim().parse().map_err(|_| bad())?, p.trim().parse().map_err(|_| bad())?))
}

/// `--urgent P|off`: the urgent slot's priority floor, or none.
fn urgent(text: &str) -> Result<Urgent, String> {
    match text.trim() {
        "off" => Ok(Urgent(None)),
        p => match p.parse() {
            Ok(p @ 1..=99) => Ok(Urgent(Some(p))),
            _ => Err(format!("`{text}` is neither a priority from 1 to 99 nor `off`, e.g. --urgent 90")),
        },
    }
}

/// The worker's urgent slot: for priorities from this one up, or none.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Urgent(pub(crate) Option<u8>);

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (examples: 500ms, 2s, 1m30s)"))
}

/// A point in time: `+DURATION` from now, or an RFC 3339 time in UTC.
fn deadline(text: &str) -> Result<Deadline, String> {
    if let Some(rest) = text.strip_prefix('+') {
        return duration(rest).map(Deadline::In);
    }
    humantime::parse_rfc3339_weak(text)
        .map(Deadline::At)
        .map_err(|e| format!("{e} (examples: +10m, +1h30m, 2026-12-01T10:00:00Z)"))
}

/// A rate limit: `N/DURATION`, the duration's 1 optional (`100/s`, `5/1m`, `20/250ms`).
fn rate(text: &str) -> Result<(u32, Duration), String> {
    let fail = || format!("{text:?} is not a rate (examples: 100/s, 5/1m, 20/250ms)");
    let (n, per) = text.split_once('/').ok_or_else(fail)?;
    let n = n.trim().parse::<u32>().map_err(|_| fail())?;
    let per = per.trim();
    let per = if per.starts_with(|c: char| c.is_ascii_digit()) { per.to_owned() } else { format!("1{per}") };
    Ok((n, humantime::parse_duration(&per).map_err(|_| fail())?))
}

/// When a request must be done by (`submit --deadline`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deadline {
    /// This long after the submit.
    In(Duration),
    /// At this time.
    At(std::time::SystemTime),
}

/// Distributed batch processing on Redis, from a shell.
///
/// A request is a file of lines: each line is one sub-request. Workers run a command of
/// yours per sub-request, at most N at a time per request, highest priority first.
#[derive(Parser, Debug)]
#[command(
    name = "sluicegate",
    version,
    after_help = "Example:\n  \
        sluicegate worker --exec './resize.sh' --slots 4 &\n  \
        sluicegate submit --concurrency 3 --wait images.txt > results.jsonl\n\n\
        Exit codes: 0 ok, 1 request failed or cancelled, 2 bad input, 3 Redis error,\n\
        4 unknown request, 5 not finished yet (see docs/cli.md)."
)]
pub(crate) struct Cli {
    /// Redis to use: redis://[user:password@]host:port[/db], rediss:// for TLS,
    /// redis+unix:///path/to/socket.
    #[arg(
        long = "redis",
        global = true, help_heading = "Global options",
        env = "REDIS_URL",
        hide_env_values = true,
        default_value = DEFAULT_REDIS_URL,
        value_name = "URL"
    )]
    pub(crate) redis: String,

    /// Key prefix shared by the producers and workers of one system [default: sluicegate].
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "SLUICEGATE_NAMESPACE",
        hide_env_values = true,
        value_name = "NS"
    )]
    pub(crate) namespace: Option<String>,

    /// Machine-readable output: one JSON object per line.
    #[arg(long, global = true, help_heading = "Global options")]
    pub(crate) json: bool,

    /// How long a worker stays alive in the registry without a heartbeat; a killed worker's work
    /// comes back about this long after it died [default: 2s].
    #[arg(long, global = true, help_heading = "Global options", value_parser = duration, value_name = "DURATION")]
    pub(crate) lease: Option<Duration>,

    /// How often a worker beats the registry; at most half of --lease [default: 500ms].
    #[arg(long, global = true, help_heading = "Global options", value_parser = duration, value_name = "DURATION")]
    pub(crate) heartbeat: Option<Duration>,

    /// How often workers poll for requests that asked recovery to look at them [default: 200ms].
    #[arg(long = "recovery-interval", global = true, help_heading = "Global options", value_parser = duration, value_name = "DURATION")]
    pub(crate) recovery_interval: Option<Duration>,

    /// For rediss:// URLs: trust the CA certificates in this PEM file (a private CA, a
    /// self-signed server) instead of the system's roots.
    #[arg(
        long = "tls-ca-file",
        global = true,
        help_heading = "Global options",
        env = "SLUICEGATE_TLS_CA_FILE",
        value_name = "PATH"
    )]
    pub(crate) tls_ca_file: Option<PathBuf>,

    /// How many token shards the namespace uses (1 to 1024; `Config::token_shards`): a worker
    /// serves shards 0 to N-1, a producer spreads its requests' tokens over them, and `list` and
    /// `stats` read them all. Use the setting of the namespace's producers and workers
    /// [default: 1].
    #[arg(
        long = "token-shards",
        global = true,
        help_heading = "Global options",
        env = "SLUICEGATE_TOKEN_SHARDS",
        value_name = "N"
    )]
    pub(crate) token_shards: Option<u32>,

    /// Give up connecting to Redis after this long.
    #[arg(long = "connect-timeout", global = true, help_heading = "Global options", value_parser = duration, default_value = "5s", value_name = "DURATION")]
    pub(crate) connect_timeout: Duration,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Submit a request: each input line is one sub-request.
    #[command(after_help = "Example:\n  \
        sluicegate submit --priority 80 --concurrency 3 --max-attempts 3 --wait lines.txt\n  \
        printf '{\"n\": 1}\\n{\"n\": 2}\\n' | sluicegate submit --id job-42 -\n  \
        tail -f urls.txt | sluicegate submit --stream --concurrency 8\n  \
        sluicegate submit --after job-42 --after job-43 merge.txt   # runs once both have completed\n  \
        sluicegate submit --group customer-42 --concurrency 8 big.txt  # within the group's limit\n\n\
        A line that parses as JSON is sent as that JSON value; any other line is sent as a JSON string.\n\
        With --wait, results are printed one per line in input order; a failed sub-request prints\n\
        {\"error\": \"...\", \"attempts\": N, \"permanent\": BOOL}.")]
    Submit(SubmitArgs),

    /// Run sub-requests with a command of yours: payload on stdin, result on stdout.
    #[command(after_help = "Example:\n  \
        sluicegate worker --exec 'python3 resize.py --width 200' --slots 8 --timeout 30s\n\n\
        The command is split like a shell would split it (quotes, backslashes) but is not run\n\
        by a shell: use --exec \"sh -c '...'\" for pipes and redirections.\n\
        Contract: stdin = the payload as JSON and a newline; env SLUICEGATE_REQUEST_ID,\n\
        SLUICEGATE_INDEX, SLUICEGATE_ATTEMPT; stdout = the result (JSON, else a JSON string);\n\
        exit 0 = success, exit 100 = permanent failure (no retry), any other exit, a signal or\n\
        the timeout = failure retried up to the request's --max-attempts.")]
    Worker(WorkerArgs),

    /// Show a request's state, counters, timings, errors, and the requests it runs after and
    /// before.
    #[command(
        after_help = "Example:\n  sluicegate status job-42\n  sluicegate --json status job-42 | jq .done\n  sluicegate --json status job-42 | jq '.upstreams, .downstreams'"
    )]
    Status(IdArg),

    /// Close a streamed request whose producer is gone: it completes once its parts are done.
    #[command(
        after_help = "Example:\n  sluicegate status job-42   # open: yes\n  sluicegate finalize job-42"
    )]
    Finalize(IdArg),

    /// Cancel a request: no sub-request of it starts afterwards.
    #[command(after_help = "Example:\n  sluicegate cancel job-42")]
    Cancel(IdArg),

    /// Run a request's dead-lettered sub-requests again, each with fresh attempts.
    #[command(after_help = "Example:\n  sluicegate requeue job-42 && sluicegate results --wait job-42")]
    Requeue(IdArg),

    /// Change the priority of a queued or running request.
    #[command(after_help = "Example:\n  \
        sluicegate reprioritize job-42 90\n\n\
        Its tokens waiting in the old priority's lists move now; tokens held by workers move when\n\
        they are next handed back (at the end of a slot's quantum). Refused for a finished request\n\
        and for a small request that shares its priority's lane (see docs/cli.md).")]
    Reprioritize(ReprioritizeArgs),

    /// Delete finished requests now (one, or by state and age), or everything of the namespace.
    #[command(after_help = "Example:\n  \
        sluicegate purge job-42                               # one finished request's keys\n  \
        sluicegate purge --state failed --older-than 7d --yes # finished ones by state and age\n  \
        sluicegate --namespace staging purge --all --yes      # every key of the namespace\n\n\
        A request that has not finished is refused (cancel it first). --all is refused while\n\
        workers are registered in the namespace (stop them first), unless --force; its keys are\n\
        found with SCAN on every master and deleted with UNLINK, and nothing else is touched.")]
    Purge(PurgeArgs),

    /// List requests newest first, filtered by state, priority, tag, tracking and age.
    #[command(after_help = "Example:\n  \
        sluicegate list --state failed --limit 20\n  \
        sluicegate list --tag customer:42 --older-than 1h\n  \
        sluicegate --json list --state running | jq -r .id\n\n\
        A page ends with the cursor of the next one: `list ... --cursor C`. Finished requests are\n\
        listed for their retention. With --json, one request per line, then {\"cursor\": ...}.")]
    List(ListArgs),

    /// Mark a request as tracked (`list --tracked` shows it), or unmark it with --off.
    #[command(
        after_help = "Example:\n  sluicegate track job-42\n  sluicegate list --tracked\n  sluicegate track --off job-42"
    )]
    Track(TrackArgs),

    /// Print a request's dead-lettered sub-requests: index, attempts, error and payload.
    #[command(after_help = "Example:\n  \
        sluicegate dead job-42\n  \
        sluicegate --json dead job-42 | jq -r .payload\n\n\
        A payload is printed as JSON when it decodes as MessagePack (what `submit` and the Rust\n\
        producer send), else as the text or bytes it is. `sluicegate requeue ID` runs them again.")]
    Dead(IdArg),

    /// Tokens waiting per priority, active requests, live workers; with --since, the stats by
    /// stage of that window.
    #[command(after_help = "Example:\n  \
        sluicegate stats\n  \
        sluicegate --json stats | jq '.workers | length'\n  \
        sluicegate stats --since 1h\n  \
        sluicegate --json stats --since 15m | jq '.priorities[0].queue_wait.buckets'\n\n\
        With --since, per priority: requests submitted, started, completed and failed, sub-request\n\
        attempts succeeded, retried and dead-lettered, acks fenced, each with its rate per second,\n\
        and p50/p95/p99 of the queue wait, run time and request duration. Counted in one-minute\n\
        buckets: the window starts at the beginning of the minute it falls in.")]
    Stats(StatsArgs),

    /// Stop workers taking new tokens of the namespace, or of one priority; submits still work.
    #[command(after_help = "Example:\n  \
        sluicegate pause                # the whole namespace\n  \
        sluicegate pause --priority 10  # only priority 10\n\n\
        Idle slots stop within one idle poll (1 s by default); a slot running a request finishes\n\
        its quantum (32 sub-requests or 250 ms) first; running handlers finish. The pause is kept\n\
        in Redis: it holds across worker restarts until `sluicegate resume`.")]
    Pause(PauseArgs),

    /// Undo `pause`: everything, or one priority.
    #[command(after_help = "Example:\n  \
        sluicegate resume               # the namespace and every paused priority\n  \
        sluicegate resume --priority 10 # only priority 10 (a pause of the namespace stays)")]
    Resume(PauseArgs),

    /// Serve the namespace's gauges for Prometheus (backlog, active requests, workers, pauses).
    #[command(after_help = "Example:\n  \
        sluicegate metrics --listen 127.0.0.1:9465\n\n\
        Read from Redis at each scrape by this one process, not by every worker; each worker\n\
        serves its own counters with `worker --metrics-addr`. Runs until ctrl-c or SIGTERM.")]
    Metrics(MetricsArgs),

    /// Serve a live web dashboard of the namespace, its JSON API and its gauges.
    #[command(after_help = "Example:\n  \
        sluicegate dashboard --listen 127.0.0.1:8080                  # read-only, then open http://127.0.0.1:8080\n  \
        sluicegate dashboard --listen 127.0.0.1:8080 --allow-actions  # with cancel, requeue, reprioritize, purge, pause\n  \
        sluicegate dashboard --listen 0.0.0.0:8080 --token \"$TOKEN\" # beyond loopback a token is required\n\n\
        Pages: overview, requests, request detail, workers, completion events, token audit (with\n\
        the tenant groups); they update live (server-sent events) from one reading of the\n\
        namespace per --interval, shared by every browser. Also serves the JSON API (/api/...,\n\
        docs/dashboard.md) and /metrics.\n\
        Every action is logged to stderr with the peer and how it authenticated. Runs until\n\
        ctrl-c or SIGTERM.")]
    Dashboard(DashboardArgs),

    /// Print a finished request's results, one per line in input order.
    #[command(
        after_help = "Example:\n  sluicegate results job-42 > results.jsonl\n  sluicegate results --wait --raw job-42"
    )]
    Results(ResultsArgs),

    /// Print requests reaching their terminal state (completed, failed, cancelled).
    #[command(after_help = "Example:\n  \
        sluicegate events            # what is retained, then exit\n  \
        sluicegate events --follow   # and keep printing new ones until ctrl-c")]
    Events(EventsArgs),

    /// Requests submitted by a cron pattern: add, list, pause, resume, remove schedules.
    #[command(after_help = "Example:\n  \
        sluicegate schedule add nightly --cron '30 2 * * *' --tz Europe/Rome -- --priority 70 report.jsonl\n  \
        sluicegate schedule list\n  \
        sluicegate schedule pause nightly\n\n\
        Each tick submits request NAME@<tick ms>, tagged schedule:NAME, exactly once however many\n\
        workers run; the workers' recovery fires them (`list --tag schedule:NAME` finds them).")]
    Schedule(ScheduleArgs),

    /// Tenant groups: set a group's limit and rate, list the groups, show one.
    #[command(after_help = "Example:\n  \
        sluicegate group set customer-42 --limit 4 --rate 100/s\n  \
        sluicegate submit --group customer-42 --concurrency 8 lines.txt\n  \
        sluicegate group list\n  \
        sluicegate group show customer-42\n\n\
        At most LIMIT sub-requests of all the group's requests run at once, across all workers;\n\
        within a priority the groups with work take turns. A group nobody set has limit 10.")]
    Group(GroupArgs),
}

#[derive(Args, Debug)]
pub(crate) struct GroupArgs {
    #[command(subcommand)]
    pub(crate) action: GroupAction,
}

#[derive(Subcommand, Debug)]
pub(crate) enum GroupAction {
    /// Set a group's limit, its rate limit, or both; takes effect at once.
    #[command(after_help = "Example:\n  \
        sluicegate group set customer-42 --limit 4\n  \
        sluicegate group set customer-42 --rate 100/s\n  \
        sluicegate group set customer-42 --limit 8 --no-rate\n\n\
        A raised limit adds tokens now; a lowered one retires tokens as they come back (running\n\
        sub-requests are never stopped). Prints the group as `group show` does.")]
    Set(GroupSetArgs),
    /// List every group in use or configured (at most 1000), by name.
    #[command(
        after_help = "Example:\n  sluicegate group list\n  sluicegate --json group list | jq -r .name"
    )]
    List,
    /// Show one group: its limit, its tokens, its rate and the work waiting in it.
    #[command(
        after_help = "Example:\n  sluicegate group show customer-42\n  sluicegate --json group show customer-42 | jq .held"
    )]
    Show(GroupNameArg),
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("change").required(true).multiple(true).args(["limit", "rate", "no_rate"])))]
pub(crate) struct GroupSetArgs {
    /// The group's name: 1 to 64 of A-Z a-z 0-9 . _ -.
    pub(crate) name: String,

    /// At most N sub-requests of all the group's requests run at once (1 to 10000).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=i64::from(sluicegate::MAX_GROUP_LIMIT)))]
    pub(crate) limit: Option<u32>,

    /// At most N of the group's sub-requests start per DURATION, across all workers: 100/s, 5/1m,
    /// 20/250ms (N 1 to 1000000, DURATION 1ms to 1 day).
    #[arg(long, value_parser = rate, value_name = "N/DURATION", conflicts_with = "no_rate")]
    pub(crate) rate: Option<(u32, Duration)>,

    /// Remove the group's rate limit.
    #[arg(long = "no-rate")]
    pub(crate) no_rate: bool,
}

#[derive(Args, Debug)]
pub(crate) struct GroupNameArg {
    /// The group's name.
    pub(crate) name: String,
}

#[derive(Args, Debug)]
pub(crate) struct ScheduleArgs {
    #[command(subcommand)]
    pub(crate) action: ScheduleAction,
}

#[derive(Subcommand, Debug)]
pub(crate) enum ScheduleAction {
    /// Add a schedule: its cron pattern, and after `--` the request as `submit` takes it.
    #[command(after_help = "Example:\n  \
        sluicegate schedule add every-5m --cron '*/5 * * * *' -- --concurrency 2 --tag sync jobs.txt\n  \
        echo '{\"report\": \"daily\"}' | sluicegate schedule add daily --cron @daily --missed catch-up --catch-up 3 --\n\n\
        The pattern has 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds\n\
        first, or is @hourly, @daily, @weekly, @monthly, @yearly. The input (a file, or stdin) is\n\
        read now: its lines are the parts of every tick's request, stored with the schedule.\n\
        Not with --id (ids are NAME@<tick>), --stream, --wait or --expire-open-after.")]
    Add(ScheduleAddArgs),
    /// List the schedules: pattern, policy, next and last tick, ticks owed.
    List,
    /// Pause a schedule: ticks after now are not owed until it is resumed.
    Pause(ScheduleNameArg),
    /// Resume a paused schedule: ticks while it was paused are never owed.
    Resume(ScheduleNameArg),
    /// Remove a schedule (its requests stay).
    Remove(ScheduleNameArg),
}

/// The request template of `schedule add`: the arguments after `--`, read as `submit` reads its
/// own.
#[derive(Parser, Debug)]
#[command(
    name = "sluicegate schedule add NAME --cron PATTERN --",
    disable_help_flag = true,
    disable_version_flag = true
)]
pub(crate) struct SubmitTemplate {
    #[command(flatten)]
    pub(crate) args: SubmitArgs,
}

#[derive(Args, Debug)]
pub(crate) struct ScheduleNameArg {
    /// The schedule's name.
    pub(crate) name: String,
}

/// What to do about ticks missed while no worker fired a schedule.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MissedArg {
    /// Submit only the latest missed tick.
    Skip,
    /// Submit the last N missed ticks (--catch-up N), oldest first.
    CatchUp,
}

#[derive(Args, Debug)]
pub(crate) struct ScheduleAddArgs {
    /// The schedule's name: 1 to 55 characters of A-Z a-z 0-9 _ . : / = + - (not @).
    pub(crate) name: String,

    /// The cron pattern, e.g. '*/5 * * * *'.
    #[arg(long, value_name = "PATTERN")]
    pub(crate) cron: String,

    /// The pattern's time zone (an IANA name, e.g. Europe/Rome) [default: UTC].
    #[arg(long, value_name = "ZONE")]
    pub(crate) tz: Option<String>,

    /// Ticks missed while no worker ran: submit the latest only, or catch up on the last N.
    #[arg(long, value_enum, default_value = "skip")]
    pub(crate) missed: MissedArg,

    /// With --missed catch-up: how many missed ticks to submit, 1 to 100.
    #[arg(long = "catch-up", value_name = "N")]
    pub(crate) catch_up: Option<u32>,

    /// Replace a schedule of this name that has another spec (it is active again from now).
    #[arg(long)]
    pub(crate) replace: bool,

    /// The request of each tick, as `submit` takes it: options, then the input file (or none:
    /// standard input).
    #[arg(last = true, value_name = "SUBMIT ARGS")]
    pub(crate) submit: Vec<String>,
}

#[derive(Args, Debug)]
pub(crate) struct SubmitArgs {
    /// The input: one sub-request per line; `-` or nothing reads standard input.
    #[arg(value_name = "FILE|-")]
    pub(crate) file: Option<PathBuf>,

    /// The request's id [default: a generated, time-ordered id].
    #[arg(long)]
    pub(crate) id: Option<String>,

    /// 0 (lowest) to 99 (highest).
    #[arg(long, default_value_t = 50)]
    pub(crate) priority: u8,

    /// At most this many sub-requests run at once, across all workers.
    #[arg(long, default_value_t = 1)]
    pub(crate) concurrency: u32,

    /// Each sub-request runs at most this many times.
    #[arg(long = "max-attempts", default_value_t = 1, value_name = "K")]
    pub(crate) max_attempts: u32,

    /// Delay before the first retry; doubles per attempt, with jitter.
    #[arg(long, value_parser = duration, default_value = "1s", value_name = "DURATION")]
    pub(crate) backoff: Duration,

    /// The longest delay between attempts.
    #[arg(long = "backoff-max", value_parser = duration, default_value = "60s", value_name = "DURATION")]
    pub(crate) backoff_max: Duration,

    /// Abandon an attempt that runs longer than this (a retryable failure) [default: none].
    #[arg(long, value_parser = duration, value_name = "DURATION")]
    pub(crate) timeout: Option<Duration>,

    /// Start the request only this long after it is accepted (up to a recovery interval later).
    #[arg(long, value_parser = duration, value_name = "DURATION", conflicts_with = "stream")]
    pub(crate) delay: Option<Duration>,

    /// Past this time no sub-request starts, running ones are stopped, and the request ends
    /// failed (reason: deadline): `+DURATION` from now (+10m, +1h30m) or an RFC 3339 time in UTC
    /// (2026-12-01T10:00:00Z).
    #[arg(long, value_parser = deadline, value_name = "+DURATION|TIME")]
    pub(crate) deadline: Option<Deadline>,

    /// At most N sub-requests start per DURATION, across all workers, with bursts of up to N:
    /// 100/s, 5/1m, 20/250ms.
    #[arg(long, value_parser = rate, value_name = "N/DURATION")]
    pub(crate) rate: Option<(u32, Duration)>,

    /// End the request as failed at its first dead-lettered sub-request; the rest never run.
    #[arg(long = "fail-fast")]
    pub(crate) fail_fast: bool,

    /// Keep no results: the sub-requests' results are never stored (their errors are), for work
    /// whose effect is elsewhere. The request still finishes and keeps its status and errors;
    /// with --wait only its counts are printed.
    #[arg(long = "discard-results")]
    pub(crate) discard_results: bool,

    /// Streamed request: workers start on each line as soon as it is read; the request completes
    /// after the end of the input. For input that arrives over time (a pipe, `tail -f`).
    #[arg(long)]
    pub(crate) stream: bool,

    /// With --stream: a request still open this long after it was opened (its producer died,
    /// say) is cancelled [default: it stays open until finalized or cancelled].
    #[arg(long = "expire-open-after", value_parser = duration, value_name = "DURATION", requires = "stream")]
    pub(crate) expire_open_after: Option<Duration>,

    /// Refuse a line longer than this many bytes (nothing is submitted).
    #[arg(long = "max-payload-bytes", default_value_t = 16 * 1024 * 1024, value_name = "BYTES")]
    pub(crate) max_payload_bytes: usize,

    /// Wait for the request to finish and print its results.
    #[arg(long)]
    pub(crate) wait: bool,

    /// With --wait: print string results as plain text instead of JSON strings.
    #[arg(long, requires = "wait")]
    pub(crate) raw: bool,

    /// A tag for `list --tag` (repeat for more, at most 16): 1 to 64 characters of
    /// A-Z a-z 0-9 _ . : / = @ + -.
    #[arg(long = "tag", value_name = "TAG")]
    pub(crate) tags: Vec<String>,

    /// Leave the request out of the listing index (`list`, the dashboard's lists, the request
    /// counts of `stats`); everything by id works as usual. Only for a small request (at most 64
    /// lines and 64 KB, not --delay, not --stream). Not with --tag.
    #[arg(long, conflicts_with = "tags")]
    pub(crate) unlisted: bool,

    /// Give a small request (at most 64 lines and 64 KB) a stream of its own instead of its
    /// priority's lane, so that `reprioritize` can change its priority; it costs Redis a few
    /// more calls. Larger requests always have one.
    #[arg(long = "own-stream", conflicts_with = "unlisted")]
    pub(crate) own_stream: bool,

    /// Run the request only once request ID (its upstream) has completed; repeat for more (at
    /// most 1000). Until then it is `waiting`; an upstream that fails or is cancelled fails it
    /// too, without running it (see --on-upstream-failure). ID must exist already. Not with
    /// --stream, --delay or --unlisted.
    #[arg(long = "after", value_name = "ID", conflicts_with_all = ["stream", "delay", "unlisted"])]
    pub(crate) after: Vec<String>,

    /// With --after: what the request does when an upstream ends without completing (failed,
    /// cancelled, or gone) [default: fail].
    #[arg(long = "on-upstream-failure", value_enum, value_name = "fail|run", requires = "after")]
    pub(crate) on_upstream_failure: Option<UpstreamFailureArg>,

    /// Put the request in tenant group NAME: at most the group's limit of sub-requests of all its
    /// requests run at once (on top of --concurrency), and within a priority the groups with work
    /// take turns (`group set` sets the limit; default 10). NAME: 1 to 64 of A-Z a-z 0-9 . _ -.
    /// The request keeps its priority (no `reprioritize`). Not with --unlisted.
    #[arg(long = "group", value_name = "NAME", conflicts_with = "unlisted")]
    pub(crate) group: Option<String>,
}

/// What a request submitted `--after` others does when one of them does not complete.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UpstreamFailureArg {
    /// End `failed` too, without running (reason upstream:<id>); it reopens and runs if that
    /// upstream is requeued and completes.
    Fail,
    /// Run anyway, once every upstream has ended.
    Run,
}

#[derive(Args, Debug)]
pub(crate) struct WorkerArgs {
    /// The command run per sub-request, with its arguments: 'CMD ARGS'.
    #[arg(long, value_name = "'CMD ARGS'")]
    pub(crate) exec: String,

    /// Commands run at once by this worker.
    #[arg(long, default_value_t = 4, value_name = "K")]
    pub(crate) slots: usize,

    /// Keep N of the slots for requests of priority P or higher (1 to 99): they take nothing
    /// lower, so such a request starts at once even while every other slot runs a long command.
    #[arg(long, value_parser = reserve, value_name = "N:P")]
    pub(crate) reserve: Option<(usize, u8)>,

    /// One slot beside the K for requests of priority P or higher, idle until one comes, so it
    /// starts at once while every other slot is busy; K + 1 commands then run until another slot
    /// ends its command. `off` for none (K at every moment). None with --reserve.
    #[arg(long, value_parser = urgent, default_value = "90", value_name = "P|off")]
    pub(crate) urgent: Urgent,

    /// Kill a command that runs longer than this (a retryable failure) [default: none].
    #[arg(long, value_parser = duration, value_name = "DURATION")]
    pub(crate) timeout: Option<Duration>,

    /// On ctrl-c or SIGTERM, how long running commands may go on before they are killed.
    #[arg(long = "shutdown-grace", value_parser = duration, default_value = "30s", value_name = "DURATION")]
    pub(crate) shutdown_grace: Duration,

    /// A command printing more than this many bytes fails permanently.
    #[arg(long = "max-output-bytes", default_value_t = 16 * 1024 * 1024, value_name = "BYTES")]
    pub(crate) max_output_bytes: usize,

    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics, e.g. 127.0.0.1:9464.
    #[arg(long = "metrics-addr", value_name = "ADDR")]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,

    /// Do not count the stats by stage (`stats --since`) of the work this worker does; its
    /// --metrics-addr metrics count either way.
    #[arg(long = "no-stage-stats")]
    pub(crate) no_stage_stats: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["id", "all", "state"])))]
pub(crate) struct PurgeArgs {
    /// One finished request, by id.
    pub(crate) id: Option<String>,

    /// Everything of the namespace (the global --namespace, or SLUICEGATE_NAMESPACE).
    #[arg(long)]
    pub(crate) all: bool,

    /// Every finished request in this state: completed, failed or cancelled.
    #[arg(long, value_name = "STATE")]
    pub(crate) state: Option<String>,

    /// With --state: only requests submitted at least this long ago [default: any].
    #[arg(long = "older-than", value_parser = duration, value_name = "DURATION", requires = "state")]
    pub(crate) older_than: Option<Duration>,

    /// Confirms a purge of --all or --state: without it nothing is deleted.
    #[arg(long)]
    pub(crate) yes: bool,

    /// Purge even while workers are registered in the namespace.
    #[arg(long)]
    pub(crate) force: bool,
}

#[derive(Args, Debug)]
pub(crate) struct ListArgs {
    /// Only requests in this state: queued, running, scheduled, waiting, open, completed, failed,
    /// cancelled.
    #[arg(long, value_name = "STATE")]
    pub(crate) state: Option<String>,

    /// Only requests of this priority.
    #[arg(long)]
    pub(crate) priority: Option<u8>,

    /// Only requests carrying this tag (`submit --tag`).
    #[arg(long)]
    pub(crate) tag: Option<String>,

    /// Only tracked requests (`track`).
    #[arg(long)]
    pub(crate) tracked: bool,

    /// Only requests submitted at least this long ago.
    #[arg(long = "older-than", value_parser = duration, value_name = "DURATION")]
    pub(crate) older_than: Option<Duration>,

    /// Requests per page (1 to 1000).
    #[arg(long, default_value_t = 100)]
    pub(crate) limit: u32,

    /// Go on from where a previous page ended.
    #[arg(long)]
    pub(crate) cursor: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct TrackArgs {
    /// The request's id.
    pub(crate) id: String,

    /// Stop tracking it.
    #[arg(long)]
    pub(crate) off: bool,
}

#[derive(Args, Debug)]
pub(crate) struct MetricsArgs {
    /// Where to serve http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub(crate) listen: std::net::SocketAddr,
}

#[derive(Args, Debug)]
pub(crate) struct DashboardArgs {
    /// Where to serve the dashboard, e.g. 127.0.0.1:8080.
    #[arg(long, value_name = "ADDR")]
    pub(crate) listen: std::net::SocketAddr,

    /// Allow actions: cancel, requeue dead letters, reprioritize, purge, pause, resume
    /// [default: read-only].
    #[arg(long = "allow-actions")]
    pub(crate) allow_actions: bool,

    /// Require this token (`Authorization: Bearer TOKEN`, or the login form); required when
    /// --listen is not a loopback address.
    #[arg(long, env = "SLUICEGATE_DASHBOARD_TOKEN", value_name = "TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,

    /// How often the namespace is read while a browser watches (one reading serves them all).
    #[arg(long, value_parser = duration, default_value = "2s", value_name = "DURATION")]
    pub(crate) interval: Duration,
}

#[derive(Args, Debug)]
pub(crate) struct PauseArgs {
    /// Only this priority (0 to 99) [default: the whole namespace].
    #[arg(long)]
    pub(crate) priority: Option<u8>,
}

#[derive(Args, Debug)]
pub(crate) struct ReprioritizeArgs {
    /// The request's id, as printed by `submit`.
    pub(crate) id: String,

    /// Its new priority: 0 (lowest) to 99 (highest).
    #[arg(value_name = "PRIORITY", value_parser = clap::value_parser!(u8).range(0..=99))]
    pub(crate) priority: u8,
}

#[derive(Args, Debug)]
pub(crate) struct StatsArgs {
    /// Show the stats by stage of this last stretch of time (1m to 31d): counts, rates and
    /// latency percentiles per priority.
    #[arg(long, value_parser = duration, value_name = "DURATION")]
    pub(crate) since: Option<Duration>,
}

#[derive(Args, Debug)]
pub(crate) struct IdArg {
    /// The request's id, as printed by `submit`.
    pub(crate) id: String,
}

#[derive(Args, Debug)]
pub(crate) struct ResultsArgs {
    /// The request's id, as printed by `submit`.
    pub(crate) id: String,

    /// Wait until the request finishes instead of failing while it runs.
    #[arg(long)]
    pub(crate) wait: bool,

    /// Print string results as plain text instead of JSON strings.
    #[arg(long)]
    pub(crate) raw: bool,
}

#[derive(Args, Debug)]
pub(crate) struct EventsArgs {
    /// Keep printing new events until ctrl-c or SIGTERM.
    #[arg(long)]
    pub(crate) follow: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_read_like_a_person_writes_them() {
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("1m30s"), Ok(Duration::from_secs(90)));
        assert!(duration("soon").is_err_and(|e| e.contains("examples")));
    }

    #[test]
    fn rates_are_a_count_per_duration() {
        assert_eq!(rate("100/s"), Ok((100, Duration::from_secs(1))));
        assert_eq!(rate("5/1m"), Ok((5, Duration::from_secs(60))));
        assert_eq!(rate("20/250ms"), Ok((20, Duration::from_millis(250))));
        assert!(rate("fast").is_err_and(|e| e.contains("100/s")));
        assert!(rate("-1/s").is_err());
    }

    #[test]
    fn deadlines_are_a_duration_from_now_or_a_time() {
        assert_eq!(deadline("+10m"), Ok(Deadline::In(Duration::from_secs(600))));
        let at = std::time::UNIX_EPOCH + Duration::from_secs(1_795_000_000);
        assert_eq!(deadline(&humantime::format_rfc3339(at).to_string()), Ok(Deadline::At(at)));
        assert!(deadline("tomorrow").is_err_and(|e| e.contains("+10m")));
        assert!(deadline("+soon").is_err_and(|e| e.contains("examples")));
    }

    #[test]
    fn group_help_gives_the_librarys_limits() {
        let mut cli = Cli::command();
        let help = cli.find_subcommand_mut("group").unwrap().render_long_help().to_string();
        assert!(help.contains(&format!("has limit {}.", sluicegate::DEFAULT_GROUP_LIMIT)), "{help}");
        let set = cli.find_subcommand_mut("group").unwrap().find_subcommand_mut("set").unwrap();
        let help = set.render_long_help().to_string();
        assert!(help.contains(&format!("(1 to {})", sluicegate::MAX_GROUP_LIMIT)), "{help}");
    }

    #[test]
    fn every_command_shows_an_example() {
        let mut cli = Cli::command();
        for sub in cli.get_subcommands_mut() {
            let help = sub.render_long_help().to_string();
            assert!(help.contains("Example:"), "{} --help has no example", sub.get_name());
        }
    }
}
