//! `list`, `track`, and `purge` of finished requests (one, or by state and age); `purge --all`
//! is `ops::purge_namespace`.

use serde_json::json;
use sluicegate::{Admin, ListQuery, ListState, Priority, RequestId};

use crate::cli::{ListArgs, PurgeArgs, TrackArgs};
use crate::failure::Failure;
use crate::output::{count, elapsed, Out};
use crate::Ctx;

pub(crate) async fn list(ctx: &Ctx, args: &ListArgs) -> Result<(), Failure> {
    let mut query = ListQuery::new().limit(args.limit);
    if let Some(state) = &args.state {
        query = query.state(state.parse::<ListState>()?);
    }
    if let Some(p) = args.priority {
        query = query.priority(Priority::new(p).map_err(sluicegate::Error::from)?);
    }
    if let Some(tag) = &args.tag {
        query = query.tag(tag.clone());
    }
    if args.tracked {
        query = query.tracked();
    }
    if let Some(age) = args.older_than {
        query = query.older_than(age);
    }
    if let Some(cursor) = &args.cursor {
        query = query.cursor(cursor.clone());
    }
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let page = admin.list(&query).await?;
    let mut out = Out::new();
    if ctx.json {
        for r in &page.requests {
            out.json(r)?;
        }
        out.json(&json!({ "cursor": page.cursor }))?;
        return out.flush();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    out.line(&format!(
        "{:<36} {:<10} {:>4} {:>5} {:>24} {:>9}  TAGS",
        "ID", "STATE", "PRIO", "LIMIT", "DONE/FAILED/TOTAL", "AGE"
    ))?;
    for r in &page.requests {
        let state = if r.open { format!("{}*", r.state) } else { r.state.to_string() };
        let mut tags = r.tags.join(",");
        if r.tracked {
            tags = if tags.is_empty() { "(tracked)".into() } else { format!("{tags} (tracked)") };
        }
        out.line(&format!(
            "{:<36} {:<10} {:>4} {:>5} {:>24} {:>9}  {}",
            r.id,
            state,
            r.priority,
            r.concurrency,
            format!("{}/{}/{}", r.done, r.failed, r.total),
            elapsed(r.submitted_ms.max(0) as u64, now),
            tags
        ))?;
    }
    match &page.cursor {
        Some(c) => {
            out.line(&format!("({}; next page: --cursor {c})", count(page.requests.len() as u64, "request")))?
        }
        None => out.line(&format!("({}; no more)", count(page.requests.len() as u64, "request")))?,
    }
    out.flush()
}

pub(crate) async fn track(ctx: &Ctx, args: &TrackArgs) -> Result<(), Failure> {
    let id = RequestId::new(args.id.as_str()).map_err(sluicegate::Error::from)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    admin.track(&id, !args.off).await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&json!({ "id": id.as_str(), "tracked": !args.off }))?;
    } else {
        out.line(&format!("{} {id}", if args.off { "stopped tracking" } else { "tracking" }))?;
    }
    out.flush()
}

pub(crate) async fn purge(ctx: &Ctx, args: &PurgeArgs) -> Result<(), Failure> {
    if args.all {
        if args.id.is_some() || args.state.is_some() {
            return Err(Failure::bad_input("purge takes one of ID, --state or --all"));
        }
        return crate::ops::purge_namespace(ctx, args).await;
    }
    let mut out = Out::new();
    if let Some(id) = &args.id {
        if args.state.is_some() {
            return Err(Failure::bad_input("purge takes one of ID, --state or --all"));
        }
        let id = RequestId::new(id.as_str()).map_err(sluicegate::Error::from)?;
        let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
        let purged = admin.purge(&id).await?;
        if !purged {
            return Err(sluicegate::Error::UnknownRequest(id).into());
        }
        if ctx.json {
            out.json(&json!({ "id": id.as_str(), "purged": true }))?;
        } else {
            out.line(&format!("purged {id}"))?;
        }
        return out.flush();
    }
    let state: ListState = args.state.as_deref().unwrap_or_default().parse()?;
    let older_than = args.older_than.unwrap_or_default();
    if !args.yes {
        return Err(Failure::bad_input(format!(
            "purge deletes every {state} request{}: add --yes to confirm",
            args.older_than
                .map(|d| format!(" older than {}", humantime::format_duration(d)))
                .unwrap_or_default()
        )));
    }
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let purged = admin.purge_finished(state, older_than).await?;
    if ctx.json {
        out.json(&json!({ "state": state, "purged": purged }))?;
    } else {
        out.line(&format!("purged {}", count(purged, &format!("{state} request"))))?;
    }
    out.flush()
}
