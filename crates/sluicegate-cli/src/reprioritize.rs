//! `sluicegate reprioritize ID P`: change the priority of a queued or running request.

use serde_json::json;
use sluicegate::{Admin, Priority, RequestId};

use crate::cli::ReprioritizeArgs;
use crate::failure::Failure;
use crate::output::{count, Out};
use crate::Ctx;

/// Gives the request its new priority and says what moved now; a finished request, one still
/// being submitted, or a small request in a shared lane is refused (exit 2), an unknown id is
/// exit 4.
pub(crate) async fn run(ctx: &Ctx, args: ReprioritizeArgs) -> Result<(), Failure> {
    let id = RequestId::new(args.id).map_err(sluicegate::Error::from)?;
    let priority = Priority::new(args.priority).map_err(sluicegate::Error::from)?;
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let done = admin.reprioritize(&id, priority).await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&json!({
            "id": id.as_str(),
            "from": done.from,
            "to": done.to,
            "moved": done.moved,
            "left": done.left,
        }))?;
    } else {
        let mut line = format!(
            "{id}: priority {} -> {}; {} moved now",
            done.from,
            done.to,
            count(done.moved, "waiting token")
        );
        if done.left > 0 {
            line.push_str(&format!(", {} more when next handed back", done.left));
        }
        line.push_str("; tokens held by workers move when handed back");
        out.line(&line)?;
    }
    out.flush()
}
