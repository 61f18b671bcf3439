//! `schedule add | list | pause | resume | remove`: requests submitted by a cron pattern. The
//! request of each tick is described after `--` exactly as `submit` takes it (the same parser),
//! and its input is read once, now: its lines are stored with the schedule as the parts.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::Path;

use clap::Parser;
use serde_json::{json, Value};
use sluicegate::{Admin, Missed, ScheduleSpec};

use crate::cli::{MissedArg, ScheduleAction, ScheduleAddArgs, SubmitArgs, SubmitTemplate};
use crate::failure::Failure;
use crate::input::{open_error, read_part};
use crate::output::{count, timestamp, Out};
use crate::Ctx;

pub(crate) async fn run(ctx: &Ctx, action: ScheduleAction) -> Result<(), Failure> {
    match action {
        ScheduleAction::Add(args) => add(ctx, args).await,
        ScheduleAction::List => list(ctx).await,
        ScheduleAction::Pause(a) => switch(ctx, &a.name, true).await,
        ScheduleAction::Resume(a) => switch(ctx, &a.name, false).await,
        ScheduleAction::Remove(a) => {
            let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
            admin.schedule_remove(&a.name).await?;
            let mut out = Out::new();
            if ctx.json {
                out.json(&json!({ "name": a.name, "removed": true }))?;
            } else {
                out.line(&format!("removed schedule {} (its requests stay)", a.name))?;
            }
            out.flush()
        }
    }
}

async fn add(ctx: &Ctx, args: ScheduleAddArgs) -> Result<(), Failure> {
    let template = SubmitTemplate::try_parse_from(std::iter::once("submit".to_owned()).chain(args.submit))
        .map_err(|e| {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            Failure::bad_input(format!("the request after `--`: {}", first.trim_start_matches("error: ")))
        })?
        .args;
    let refused = [
        (template.id.is_some(), "--id (each tick's request is NAME@<tick ms>)"),
        (template.stream, "--stream"),
        (template.wait, "--wait"),
        (template.expire_open_after.is_some(), "--expire-open-after"),
        (!template.after.is_empty(), "--after (a schedule has no upstreams)"),
        (template.group.is_some(), "--group (a schedule's requests have no group yet)"),
    ];
    if let Some((_, option)) = refused.iter().find(|(given, _)| *given) {
        return Err(Failure::bad_input(format!("a schedule's request cannot take {option}")));
    }
    let missed = match (args.missed, args.catch_up) {
        (MissedArg::Skip, None) => Missed::Skip,
        (MissedArg::CatchUp, Some(n)) => Missed::CatchUp(n),
        (MissedArg::CatchUp, None) => {
            return Err(Failure::bad_input("--missed catch-up needs --catch-up N (1 to 100)"))
        }
        (MissedArg::Skip, Some(_)) => {
            return Err(Failure::bad_input("--catch-up N goes with --missed catch-up"))
        }
    };
    let mut spec = ScheduleSpec::new(args.name.clone(), args.cron)?.missed(missed)?;
    if let Some(tz) = args.tz {
        spec = spec.time_zone(tz)?;
    }
    spec = with_template(spec, &template)?.parts(read_parts(&template)?)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    if args.replace {
        admin.schedule_replace(&spec).await?;
    } else {
        admin.schedule_add(&spec).await?;
    }
    let listed = admin.schedule(spec.name()).await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&listed)?;
    } else {
        let first = listed.next_ms.map_or_else(|| "never".to_owned(), |t| timestamp(t.max(0) as u64));
        out.line(&format!(
            "schedule {}: {} per tick, first tick {first}",
            listed.name,
            count(listed.parts as u64, "sub-request")
        ))?;
    }
    out.flush()
}

/// The schedule's request: `submit`'s options.
fn with_template(mut spec: ScheduleSpec, t: &SubmitArgs) -> Result<ScheduleSpec, Failure> {
    spec = spec
        .priority(t.priority)?
        .concurrency(t.concurrency)?
        .max_attempts(t.max_attempts)?
        .backoff(t.backoff, t.backoff_max)?
        .fail_fast(t.fail_fast)
        .discard_results(t.discard_results)
        .own_stream(t.own_stream);
    if let Some(limit) = t.timeout {
        spec = spec.timeout(limit)?;
    }
    if let Some(delay) = t.delay {
        spec = spec.delay(delay);
    }
    for tag in &t.tags {
        spec = spec.tag(tag.clone())?;
    }
    if t.unlisted {
        spec = spec.unlisted();
    }
    Ok(spec)
}

/// Every line of the template's input (a file, or standard input) as a part.
fn read_parts(t: &SubmitArgs) -> Result<Vec<Value>, Failure> {
    let mut reader: Box<dyn BufRead> = match t.file.as_deref() {
        None => Box::new(BufReader::new(io::stdin())),
        Some(path) if path == Path::new("-") => Box::new(BufReader::new(io::stdin())),
        Some(path) => {
            let file = File::open(path).map_err(|e| Failure::bad_input(open_error(path, &e)))?;
            Box::new(BufReader::new(file))
        }
    };
    let mut parts = Vec::new();
    let mut buf = Vec::new();
    for line in 1.. {
        match read_part(&mut reader, &mut buf, t.max_payload_bytes, line) {
            Ok(Some(value)) => parts.push(value),
            Ok(None) => break,
            Err(problem) => return Err(Failure::bad_input(format!("{problem}; no schedule was added"))),
        }
    }
    if parts.is_empty() {
        return Err(Failure::bad_input(
            "the input has no lines: each tick's request needs at least one sub-request",
        ));
    }
    Ok(parts)
}

async fn list(ctx: &Ctx) -> Result<(), Failure> {
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let schedules = admin.schedules().await?;
    let mut out = Out::new();
    if ctx.json {
        for s in &schedules {
            out.json(s)?;
        }
        return out.flush();
    }
    let at = |t: Option<i64>| t.map_or_else(|| "-".to_owned(), |t| timestamp(t.max(0) as u64));
    out.line(&format!(
        "{:<24} {:<18} {:<16} {:<12} {:<24} {:<24} OWED",
        "NAME", "CRON", "ZONE", "MISSED", "NEXT", "LAST"
    ))?;
    for s in &schedules {
        let next = match s.paused_ms {
            Some(p) => format!("paused since {}", timestamp(p.max(0) as u64)),
            None => at(s.next_ms),
        };
        out.line(&format!(
            "{:<24} {:<18} {:<16} {:<12} {:<24} {:<24} {}",
            s.name,
            s.cron,
            s.time_zone.as_deref().unwrap_or("UTC"),
            s.missed.to_string(),
            next,
            at(s.last_ms),
            s.owed_ms.len()
        ))?;
    }
    out.flush()
}

async fn switch(ctx: &Ctx, name: &str, pause: bool) -> Result<(), Failure> {
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let changed = if pause { admin.schedule_pause(name).await? } else { admin.schedule_resume(name).await? };
    let (done, already) =
        if pause { ("paused", "was paused already") } else { ("resumed", "was not paused") };
    let mut out = Out::new();
    if ctx.json {
        out.json(&json!({ "name": name, done: changed }))?;
    } else if changed {
        out.line(&format!("{done} schedule {name}"))?;
    } else {
        out.line(&format!("schedule {name} {already}"))?;
    }
    out.flush()
}
