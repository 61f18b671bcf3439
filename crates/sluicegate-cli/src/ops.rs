//! The operator's commands: status, cancel, requeue, stats, results, events.

use std::time::Duration;

use serde_json::{json, Value};
use sluicegate::{
    shutdown_signal, Admin, Cancelled, Listener, Paused, Priority, Producer, RequestId, RequestStatus, Stats,
};

use crate::cli::{DashboardArgs, EventsArgs, PurgeArgs, ResultsArgs};
use crate::failure::{Code, Failure};
use crate::output::{count, elapsed, print_results, timestamp, Out, ResultStyle};
use crate::submit::wait;
use crate::Ctx;

/// Without `--follow`, `events` ends once the retained events are printed: when no new one has
/// come for this long.
const EVENTS_QUIET: Duration = Duration::from_secs(1);

fn request_id(id: &str) -> Result<RequestId, Failure> {
    Ok(RequestId::new(id).map_err(sluicegate::Error::from)?)
}

pub(crate) async fn status(ctx: &Ctx, id: &str) -> Result<(), Failure> {
    let id = request_id(id)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let status = admin.status(&id).await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&status)?;
    } else {
        for line in status_lines(&status) {
            out.line(&line)?;
        }
    }
    out.flush()
}

/// The human form of a status, one fact per line.
fn status_lines(s: &RequestStatus) -> Vec<String> {
    let mut lines = vec![
        format!("request      {}", s.id),
        format!("state        {}", s.state),
        format!(
            "priority     {}{}",
            s.priority,
            if s.paused { " (paused: no slot takes it until `resume`)" } else { "" }
        ),
        format!("concurrency  {}", s.concurrency),
        format!(
            "open         {}",
            if s.open { "yes: a streamed request still taking sub-requests" } else { "no" }
        ),
        format!(
            "sub-requests {} total, {} done, {} failed, {} running, {} waiting for a retry",
            s.total, s.done, s.failed, s.running, s.retrying
        ),
        format!(
            "attempts     at most {} on any sub-request; {} succeeded after a retry",
            s.max_attempts_seen, s.succeeded_after_retry
        ),
        format!("created      {}", timestamp(s.created_ms)),
    ];
    if !s.tags.is_empty() || s.tracked {
        let tracked = if s.tracked { " (tracked)" } else { "" };
        lines.push(format!("tags         {}{tracked}", s.tags.join(", ")));
    }
    if let Some(started) = s.started_ms {
        lines.push(format!(
            "started      {} ({} after created)",
            timestamp(started),
            elapsed(s.created_ms, started)
        ));
    }
    if let Some(finished) = s.finished_ms {
        // A request that never started (cancelled while queued, failed by its upstream) counts
        // from its creation.
        let (since, what) = match s.started_ms {
            Some(started) => (started, "started"),
            None => (s.created_ms, "created"),
        };
        lines.push(format!(
            "finished     {} ({} after {what})",
            timestamp(finished),
            elapsed(since, finished)
        ));
    }
    if let Some(rate) = s.rate {
        lines.push(format!(
            "rate         at most {} started per {}",
            rate.n,
            humantime::format_duration(std::time::Duration::from_millis(rate.per_ms))
        ));
    }
    if let Some(dl) = s.deadline_ms {
        lines.push(format!("deadline     {}", timestamp(dl)));
    }
    if let Some(reason) = &s.reason {
        match reason.strip_prefix("upstream:") {
            Some(up) => lines.push(format!(
                "reason       {reason} (upstream {up} did not complete, so this request did not run)"
            )),
            None => lines.push(format!("reason       {reason}")),
        }
    }
    if let Some(group) = &s.group {
        lines.push(format!("group        {group}"));
    }
    if s.discard_results {
        lines.push(
            "results      discarded: never stored (`submit --discard-results`); errors are kept".to_owned(),
        );
    }
    if !s.upstreams.is_empty() {
        let policy = match s.on_upstream_failure {
            Some(sluicegate::OnUpstreamFailure::Run) => "it runs once they all ended, however",
            _ => "it fails if one does not complete",
        };
        lines.push(format!("upstreams (it runs after them; {policy}):"));
        for u in &s.upstreams {
            lines.push(format!("  {}: {}", u.id, u.ended.as_deref().unwrap_or("not ended yet")));
        }
    }
    if !s.downstreams.is_empty() {
        let shown =
            if s.downstreams.len() == sluicegate::STATUS_DOWNSTREAMS { ", the first ones" } else { "" };
        lines.push(format!("downstreams (they run after it{shown}):"));
        for d in &s.downstreams {
            lines.push(format!("  {d}"));
        }
    }
    if !s.errors.is_empty() {
        let shown = if s.errors.len() == sluicegate::STATUS_ERRORS { " (the first ones)" } else { "" };
        lines.push(format!("errors{shown}:"));
        for e in &s.errors {
            let kind = if e.error.permanent { ", permanent" } else { "" };
            lines.push(format!("  #{}: {} (attempt {}{kind})", e.index, e.error.message, e.error.attempts));
        }
    }
    lines
}

pub(crate) async fn finalize(ctx: &Ctx, id: &str) -> Result<(), Failure> {
    let id = request_id(id)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    admin.finalize(&id).await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&json!({ "id": id.as_str(), "finalized": true }))?;
    } else {
        out.line(&format!("finalized {id}: it completes once its sub-requests are done"))?;
    }
    out.flush()
}

pub(crate) async fn cancel(ctx: &Ctx, id: &str) -> Result<(), Failure> {
    let id = request_id(id)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let outcome = admin.cancel(&id).await?;
    let mut out = Out::new();
    // Cancelling a finished request is not an error: the request is not running either way,
    // which is what the caller wanted; the output says which case it was.
    match (outcome, ctx.json) {
        (Cancelled::Now, true) => {
            out.json(&json!({ "id": id.as_str(), "cancelled": true, "state": "cancelled" }))?
        }
        (Cancelled::Now, false) => out.line(&format!("cancelled {id}"))?,
        (Cancelled::AlreadyFinished(state), true) => {
            out.json(&json!({ "id": id.as_str(), "cancelled": false, "state": state }))?
        }
        (Cancelled::AlreadyFinished(state), false) => {
            out.line(&format!("{id} had already finished: {state}; nothing to cancel"))?
        }
        (other, _) => out.line(&format!("{id}: {other:?}"))?,
    }
    out.flush()
}

pub(crate) async fn requeue(ctx: &Ctx, id: &str) -> Result<(), Failure> {
    let id = request_id(id)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let n = admin.requeue_dead(&id).await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&json!({ "id": id.as_str(), "requeued": n }))?;
    } else {
        out.line(&format!("requeued {} of {id}", count(n, "dead-lettered sub-request")))?;
    }
    out.flush()
}

pub(crate) async fn metrics(ctx: &Ctx, addr: std::net::SocketAddr) -> Result<(), Failure> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::bad_input(format!("cannot serve metrics on {addr} (--listen): {e}")))?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let ns = ctx.config.namespace_str();
    eprintln!("serving the gauges of namespace {ns} at http://{addr}/metrics; stop with ctrl-c or SIGTERM");
    let exporter = sluicegate_metrics::NamespaceExporter::new(ns, admin);
    tokio::select! {
        served = exporter.serve(listener) => served.map_err(|e| Failure::new(Code::Redis, format!("the metrics endpoint stopped: {e}")))?,
        () = shutdown_signal() => {}
    }
    Ok(())
}

/// `dashboard`: serves the pages, the JSON API and `/metrics` until ctrl-c or SIGTERM.
pub(crate) async fn dashboard(ctx: &Ctx, args: &DashboardArgs) -> Result<(), Failure> {
    let addr = args.listen;
    let token = args.token.clone().filter(|t| !t.is_empty());
    if !addr.ip().is_loopback() && token.is_none() {
        return Err(Failure::bad_input(format!(
            "the dashboard listens on {addr}, beyond this host: give it a --token (or SLUICEGATE_DASHBOARD_TOKEN), or listen on 127.0.0.1"
        )));
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::bad_input(format!("cannot serve the dashboard on {addr} (--listen): {e}")))?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let mut options = sluicegate_dashboard::DashboardOptions::new()
        .allow_actions(args.allow_actions)
        .interval(args.interval);
    if let Some(token) = token {
        options = options.token(token);
    }
    let ns = ctx.config.namespace_str();
    let mode = if args.allow_actions { "actions allowed" } else { "read-only" };
    let auth = if options.token_required() { ", token required" } else { "" };
    eprintln!("dashboard of namespace {ns} at http://{addr}/ ({mode}{auth}); stop with ctrl-c or SIGTERM");
    let dashboard = sluicegate_dashboard::Dashboard::new(admin, &ctx.config, options);
    tokio::select! {
        served = dashboard.serve(listener) => served.map_err(|e| Failure::new(Code::Redis, format!("the dashboard stopped: {e}")))?,
        () = shutdown_signal() => {}
    }
    Ok(())
}

pub(crate) async fn purge_namespace(ctx: &Ctx, args: &PurgeArgs) -> Result<(), Failure> {
    let ns = ctx.config.namespace_str();
    if !args.yes {
        return Err(Failure::bad_input(format!(
            "purge deletes everything of namespace \"{ns}\": add --yes to confirm"
        )));
    }
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let deleted = admin.purge_namespace(args.force).await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&json!({ "namespace": ns, "deleted_keys": deleted }))?;
    } else {
        out.line(&format!("purged namespace {ns}: {}", count(deleted, "key")))?;
    }
    out.flush()
}

pub(crate) async fn dead(ctx: &Ctx, id: &str) -> Result<(), Failure> {
    let id = request_id(id)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let dead = admin.dead(&id).await?;
    let mut out = Out::new();
    for d in &dead {
        let payload = payload_json(&d.payload);
        if ctx.json {
            out.json(&json!({
                "index": d.index,
                "attempts": d.error.attempts,
                "permanent": d.error.permanent,
                "error": d.error.message,
                "payload": payload,
            }))?;
        } else {
            let kind = if d.error.permanent { ", permanent" } else { "" };
            out.line(&format!("#{}  attempt {}{kind}: {}", d.index, d.error.attempts, d.error.message))?;
            out.line(&format!("    payload: {payload}"))?;
        }
    }
    if !ctx.json {
        out.line(&format!("{} of {id}", count(dead.len() as u64, "dead-lettered sub-request")))?;
    }
    out.flush()
}

/// A payload as JSON: decoded from MessagePack when it is that, else its text (or, for bytes that
/// are not text, an array of them).
fn payload_json(bytes: &[u8]) -> Value {
    sluicegate::codec::decode::<Value>(bytes).unwrap_or_else(|_| match std::str::from_utf8(bytes) {
        Ok(text) => Value::String(text.to_owned()),
        Err(_) => Value::Array(bytes.iter().map(|b| Value::from(*b)).collect()),
    })
}

/// `pause` (`pause` = true) or `resume`, of the namespace or of one priority; prints what is
/// paused afterwards.
pub(crate) async fn pause(ctx: &Ctx, priority: Option<u8>, pause: bool) -> Result<(), Failure> {
    let priority = priority.map(Priority::new).transpose().map_err(sluicegate::Error::from)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    if pause {
        admin.pause(priority).await?;
    } else {
        admin.resume(priority).await?;
    }
    let paused = admin.paused().await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&paused)?;
    } else {
        out.line(&format!("paused           {}", paused_text(&paused)))?;
    }
    out.flush()
}

/// `nothing`, `the whole namespace`, `priorities 90, 10`, or both.
fn paused_text(p: &Paused) -> String {
    let priorities: Vec<String> = p.priorities.iter().map(u8::to_string).collect();
    match (p.all, priorities.is_empty()) {
        (false, true) => "nothing".into(),
        (true, true) => "the whole namespace".into(),
        (false, false) => format!("priority {}", priorities.join(", ")),
        (true, false) => format!("the whole namespace (and priority {})", priorities.join(", ")),
    }
}

pub(crate) async fn stats(ctx: &Ctx) -> Result<(), Failure> {
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let stats = admin.stats().await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&stats)?;
    } else {
        for line in stats_lines(&stats, now_ms()) {
            out.line(&line)?;
        }
    }
    out.flush()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `n` bytes in the largest binary unit that keeps it at 1 or more (one decimal).
fn bytes_text(n: u64) -> String {
    let mut value = n as f64;
    let mut unit = "B";
    for next in ["KiB", "MiB", "GiB", "TiB"] {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = next;
    }
    if unit == "B" {
        format!("{n} B")
    } else {
        format!("{value:.1} {unit}")
    }
}

fn stats_lines(stats: &Stats, now_ms: u64) -> Vec<String> {
    let mut lines = vec![format!("active requests  {}", stats.active_requests)];
    if !stats.paused.is_empty() {
        lines.push(format!("paused           {}", paused_text(&stats.paused)));
    }
    if stats.tokens_waiting.is_empty() {
        lines.push("tokens waiting   none".into());
    } else {
        let waiting: Vec<String> = stats
            .tokens_waiting
            .iter()
            .map(|p| {
                format!(
                    "{} at priority {} (next in line waiting {})",
                    p.tokens,
                    p.priority,
                    elapsed(0, p.oldest_waiting_ms)
                )
            })
            .collect();
        lines.push(format!("tokens waiting   {}", waiting.join(", ")));
    }
    lines.push(format!("tokens held      {}", stats.tokens_held));
    let t = &stats.tally;
    let partial =
        if t.complete { String::new() } else { format!(" (of the first {} records only)", t.records_read) };
    lines.push(format!(
        "token capacity   {} of unfinished requests, {} parked{partial}",
        t.token_capacity, t.tokens_parked
    ));
    lines.push(format!("dead letters     {}{partial}", t.dead_letters));
    lines.push(format!("redis memory     {}", bytes_text(stats.redis_memory_bytes)));
    let r = &stats.requests;
    lines.push(format!(
        "requests         {} unfinished, {} completed, {} failed, {} cancelled (finished: within their retention)",
        r.unfinished, r.completed, r.failed, r.cancelled
    ));
    let slots: usize = stats.workers.iter().map(|w| w.slots).sum();
    lines.push(format!("workers          {} ({slots} slots)", stats.workers.len()));
    for w in &stats.workers {
        lines.push(format!(
            "  {}  {} slots  pid {} on {}  up {}",
            w.id,
            w.slots,
            w.pid,
            w.host,
            elapsed(w.started_ms, now_ms)
        ));
    }
    lines
}

pub(crate) async fn results(ctx: &Ctx, args: ResultsArgs) -> Result<(), Failure> {
    let id = request_id(&args.id)?;
    let producer = ctx.connecting(Producer::connect(&ctx.config)).await?;
    let handle = producer.handle(id.clone());
    let completion = if args.wait {
        // The total is only for the progress bar, which reads it from the status itself.
        wait(&ctx.config, &handle, 0, !ctx.json).await?
    } else {
        match handle.try_completion().await? {
            Some(done) => done,
            None => {
                return Err(Failure::new(
                    Code::NotFinished,
                    format!("request {id} has not finished yet; use `sluicegate results --wait {id}` or `sluicegate status {id}`"),
                ))
            }
        }
    };
    let style = match (ctx.json, args.raw) {
        (true, _) => ResultStyle::Tagged,
        (false, true) => ResultStyle::Raw,
        (false, false) => ResultStyle::Json,
    };
    print_results(&mut Out::new(), &completion, style)
}

pub(crate) async fn events(ctx: &Ctx, args: EventsArgs) -> Result<(), Failure> {
    let mut listener = ctx.connecting(Listener::from_beginning(&ctx.config)).await?;
    let mut out = Out::new();
    let stop = shutdown_signal();
    tokio::pin!(stop);
    loop {
        let event = if args.follow {
            tokio::select! {
                event = listener.next() => event?,
                () = &mut stop => break,
            }
        } else {
            match tokio::time::timeout(EVENTS_QUIET, listener.next()).await {
                Ok(event) => event?,
                Err(_) => break,
            }
        };
        if ctx.json {
            out.json(
                &json!({ "id": event.id.as_str(), "state": event.state, "cursor": event.cursor.to_string() }),
            )?;
        } else {
            out.line(&format!("{}  {}  {}", event.cursor, event.state, event.id))?;
        }
        // Followers watch as it happens: no event may sit in the buffer.
        if args.follow {
            out.flush()?;
        }
    }
    out.flush()
}
