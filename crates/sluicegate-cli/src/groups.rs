//! `group set | list | show`: tenant groups. A group bounds how many sub-requests of all its
//! requests run at once (`submit --group`), optionally how many start per interval, and within a
//! priority the groups with work take turns.

use std::time::Duration;

use sluicegate::{Admin, Error, GroupStatus};

use crate::cli::{GroupAction, GroupSetArgs};
use crate::failure::Failure;
use crate::output::Out;
use crate::Ctx;

pub(crate) async fn run(ctx: &Ctx, action: GroupAction) -> Result<(), Failure> {
    match action {
        GroupAction::Set(args) => set(ctx, args).await,
        GroupAction::List => list(ctx).await,
        GroupAction::Show(a) => {
            let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
            let group = admin.group(&a.name).await.map_err(refused)?;
            show(ctx, &group)
        }
    }
}

/// The library's refusal of a name, limit or rate, without its `invalid request: ` (it is not a
/// request): `a group name is 1 to 64 ASCII letters, ...`.
fn refused(e: Error) -> Failure {
    match e {
        Error::InvalidRequest(why) => Failure::bad_input(why),
        other => Failure::from(other),
    }
}

/// Sets what was asked (the rate first: it checks the name too, so a refused name or rate changes
/// nothing; the limit's range is clap's), then shows the group.
async fn set(ctx: &Ctx, args: GroupSetArgs) -> Result<(), Failure> {
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    match (args.rate, args.no_rate) {
        (Some(rate), _) => admin.set_group_rate(&args.name, Some(rate)).await.map_err(refused)?,
        (None, true) => admin.set_group_rate(&args.name, None).await.map_err(refused)?,
        (None, false) => {}
    }
    if let Some(limit) = args.limit {
        admin.set_group(&args.name, limit).await.map_err(refused)?;
    }
    let group = admin.group(&args.name).await.map_err(refused)?;
    show(ctx, &group)
}

fn show(ctx: &Ctx, g: &GroupStatus) -> Result<(), Failure> {
    let mut out = Out::new();
    if ctx.json {
        out.json(g)?;
    } else {
        for line in show_lines(g) {
            out.line(&line)?;
        }
    }
    out.flush()
}

/// The human form of a group, one fact per line.
fn show_lines(g: &GroupStatus) -> Vec<String> {
    let limit = if g.configured { "set by an operator" } else { "the default: never set" };
    let rate = g.rate.map_or_else(|| "none".to_owned(), |r| rate_words(r.n, r.per_ms));
    let waiting = if g.waiting.is_empty() {
        "nothing".to_owned()
    } else {
        g.waiting.iter().map(|(p, n)| format!("{n} at priority {p}")).collect::<Vec<_>>().join(", ")
    };
    vec![
        format!("group        {}", g.name),
        format!("limit        {} ({limit})", g.limit),
        format!("shard        {}", g.shard),
        format!(
            "tokens       {} held, {} queued, {} parked, {} waiting for the rate",
            g.held, g.queued, g.parked, g.rate_waiting
        ),
        format!("rate         {rate}"),
        format!("waiting      {waiting}"),
    ]
}

/// A rate for `group show`: `at most 100 started per 1s`, as `status` words a request's.
fn rate_words(n: u32, per_ms: u64) -> String {
    format!("at most {n} started per {}", per(per_ms))
}

/// A rate for `group list`, as `--rate` takes it: `100/1s`, `20/250ms`, `5/1m`.
fn rate_cell(n: u32, per_ms: u64) -> String {
    format!("{n}/{}", per(per_ms))
}

fn per(ms: u64) -> String {
    humantime::format_duration(Duration::from_millis(ms)).to_string()
}

async fn list(ctx: &Ctx) -> Result<(), Failure> {
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let groups = admin.groups().await?;
    let mut out = Out::new();
    if ctx.json {
        for g in &groups {
            out.json(g)?;
        }
        return out.flush();
    }
    out.line(&row([
        "NAME",
        "LIMIT",
        "CONFIGURED",
        "HELD",
        "QUEUED",
        "PARKED",
        "RATE-WAITING",
        "RATE",
        "WAITING",
    ]))?;
    for g in &groups {
        let rate = g.rate.map_or_else(|| "-".to_owned(), |r| rate_cell(r.n, r.per_ms));
        let waiting = if g.waiting.is_empty() {
            "-".to_owned()
        } else {
            g.waiting.iter().map(|(p, n)| format!("p{p}:{n}")).collect::<Vec<_>>().join(" ")
        };
        out.line(&row([
            &g.name,
            &g.limit.to_string(),
            if g.configured { "yes" } else { "no" },
            &g.held.to_string(),
            &g.queued.to_string(),
            &g.parked.to_string(),
            &g.rate_waiting.to_string(),
            &rate,
            &waiting,
        ]))?;
    }
    out.flush()
}

/// One line of `group list`'s table.
fn row(cells: [&str; 9]) -> String {
    let [name, limit, configured, held, queued, parked, rate_waiting, rate, waiting] = cells;
    format!(
        "{name:<24} {limit:>5} {configured:<10} {held:>5} {queued:>6} {parked:>6} {rate_waiting:>12} {rate:<12} {waiting}"
    )
    .trim_end()
    .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group() -> GroupStatus {
        GroupStatus {
            name: "customer-42".into(),
            shard: 0,
            limit: 4,
            configured: true,
            held: 1,
            queued: 2,
            parked: 1,
            rate_waiting: 0,
            // (RateLimit is non_exhaustive: `rate_words` and `rate_cell` are tested alone.)
            rate: None,
            waiting: vec![(80, 3), (50, 12)],
        }
    }

    #[test]
    fn a_group_shows_one_fact_per_line() {
        assert_eq!(
            show_lines(&group()),
            [
                "group        customer-42",
                "limit        4 (set by an operator)",
                "shard        0",
                "tokens       1 held, 2 queued, 1 parked, 0 waiting for the rate",
                "rate         none",
                "waiting      3 at priority 80, 12 at priority 50",
            ]
        );
        let idle = GroupStatus { configured: false, limit: 10, waiting: vec![], ..group() };
        let lines = show_lines(&idle);
        assert_eq!(
            (lines[1].as_str(), lines[5].as_str()),
            ("limit        10 (the default: never set)", "waiting      nothing")
        );
        assert_eq!(rate_words(100, 1000), "at most 100 started per 1s");
        assert_eq!((rate_cell(20, 250), rate_cell(5, 60_000)), ("20/250ms".to_owned(), "5/1m".to_owned()));
    }

    #[test]
    fn the_list_lines_up_under_its_header() {
        let header = row([
            "NAME",
            "LIMIT",
            "CONFIGURED",
            "HELD",
            "QUEUED",
            "PARKED",
            "RATE-WAITING",
            "RATE",
            "WAITING",
        ]);
        let line = row(["customer-42", "4", "yes", "1", "2", "1", "0", "100/1s", "p80:3 p50:12"]);
        assert_eq!(
            header,
            "NAME                     LIMIT CONFIGURED  HELD QUEUED PARKED RATE-WAITING RATE         WAITING"
        );
        assert_eq!(line, "customer-42                  4 yes            1      2      1            0 100/1s       p80:3 p50:12");
        assert_eq!(header.rfind("WAITING"), line.find("p80"), "{header}\n{line}");
    }
}
