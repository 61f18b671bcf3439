//! `sluicegate worker --exec`: a worker whose handler is a command of the user's.

use serde_json::json;
use sluicegate::Worker;

use crate::cli::WorkerArgs;
use crate::exec::Exec;
use crate::failure::Failure;
use crate::output::Out;
use crate::Ctx;

pub(crate) async fn run(ctx: &Ctx, args: WorkerArgs) -> Result<(), Failure> {
    // Checked before connecting: a typo in the command is the likelier mistake, and reporting it
    // should not depend on Redis being up.
    let exec = Exec::new(&args.exec, args.timeout, args.max_output_bytes).map_err(Failure::bad_input)?;
    let shown = exec.shown().to_owned();
    let mut builder = Worker::builder(&ctx.config, exec)
        .slots(args.slots)
        .urgent(args.urgent.0)
        .shutdown_grace(args.shutdown_grace)
        .stage_stats(!args.no_stage_stats)
        .label(shown.clone());
    if let Some((n, priority)) = args.reserve {
        builder = builder.reserve(n, priority);
    }
    let worker = ctx.connecting(builder.build()).await?;
    let urgent = args.urgent.0.filter(|_| args.reserve.is_none());
    let metrics = worker.metrics();
    // Bound before the worker starts, so that a port in use is a start-up error, not a log line.
    let exporter = match args.metrics_addr {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                Failure::bad_input(format!("cannot serve metrics on {addr} (--metrics-addr): {e}"))
            })?;
            let exporter = sluicegate_metrics::Exporter::new(ctx.config.namespace_str(), metrics.clone());
            Some(tokio::spawn(async move {
                if let Err(e) = exporter.serve(listener).await {
                    eprintln!("error: the metrics endpoint stopped: {e}");
                }
            }))
        }
        None => None,
    };
    // The start-up line goes to stderr, so stdout stays free for a supervisor's use; with --json it
    // is a record on stdout that a script can wait for.
    if ctx.json {
        let mut out = Out::new();
        let mut line = json!({ "worker": worker.id(), "exec": shown, "slots": args.slots });
        if let Some((n, priority)) = args.reserve {
            line["reserved"] = json!({ "slots": n, "min_priority": priority });
        }
        line["urgent"] = json!(urgent.map(|p| json!({ "min_priority": p })));
        out.json(&line)?;
        out.flush()?;
    } else {
        let reserved = match args.reserve {
            Some((n, priority)) => format!(" ({n} kept for priority {priority} and above)"),
            None => match urgent {
                Some(p) => format!(" and an urgent one for priority {p} and above"),
                None => String::new(),
            },
        };
        eprintln!(
            "worker {} running `{shown}` with {} slot(s){reserved} in namespace {}; stop with ctrl-c or SIGTERM",
            worker.id(),
            args.slots,
            ctx.config.namespace_str()
        );
    }
    let ran = worker.run().await;
    if let Some(exporter) = exporter {
        exporter.abort();
    }
    ran?;
    let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    if !ctx.json {
        eprintln!(
            "worker stopped: {} succeeded, {} retried, {} dead-lettered",
            count(&metrics.succeeded),
            count(&metrics.retried),
            count(&metrics.dead_lettered)
        );
    }
    Ok(())
}
