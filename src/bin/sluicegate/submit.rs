//! `sluicegate submit`: a file of lines in, one sub-request per line; with `--wait`, results out.

use std::fs::File;
use std::io::{self, BufRead, BufReader, IsTerminal};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use sluicegate::{shutdown_signal, Admin, Config, Producer, RequestHandle, RequestId};

use crate::cli::SubmitArgs;
use crate::failure::{Code, Failure};
use crate::input::{open_error, InputLines, InputReport};
use crate::output::{print_results, Out, ResultStyle};
use crate::Ctx;

/// How often the progress bar asks for the request's counters.
const PROGRESS_POLL: Duration = Duration::from_millis(250);

/// Input buffer: large reads keep a multi-gigabyte file from costing a syscall per line.
const READ_BUFFER: usize = 256 * 1024;

pub(crate) async fn run(ctx: &Ctx, args: SubmitArgs) -> Result<(), Failure> {
    let reader: Box<dyn BufRead + Send> = match args.file.as_deref() {
        None => Box::new(BufReader::with_capacity(READ_BUFFER, io::stdin())),
        Some(path) if path == Path::new("-") => Box::new(BufReader::with_capacity(READ_BUFFER, io::stdin())),
        Some(path) => {
            let file = File::open(path).map_err(|e| Failure::bad_input(open_error(path, &e)))?;
            Box::new(BufReader::with_capacity(READ_BUFFER, file))
        }
    };
    let producer = ctx.connecting(Producer::connect(&ctx.config)).await?;
    let mut request = producer
        .request()
        .priority(args.priority)?
        .concurrency(args.concurrency)?
        .max_attempts(args.max_attempts)?
        .backoff(args.backoff, args.backoff_max)?;
    if let Some(id) = &args.id {
        request = request.id(id.clone())?;
    }
    let report = Arc::new(InputReport::default());
    let submitted = request.submit(InputLines::new(reader, args.max_payload_bytes, report.clone())).await;
    // An input problem surfaces from the library as an encoding error of the refused part; the
    // report has the message that names the line.
    if let Some(problem) = report.take_problem() {
        return Err(Failure::bad_input(format!("{problem}; nothing was submitted")));
    }
    let handle = submitted?;
    let id = handle.id().clone();
    let parts = report.parts();

    if !args.wait {
        let mut out = Out::new();
        if ctx.json {
            out.json(&json!({ "id": id.as_str(), "parts": parts }))?;
        } else {
            out.line(id.as_str())?;
        }
        return out.flush();
    }
    // With --wait, stdout carries only the results; the id still matters (to cancel, say).
    eprintln!("submitted {id} ({parts} sub-requests); waiting for it to finish");
    let completion = wait(&ctx.config, &handle, parts, !ctx.json).await?;
    let style = match (ctx.json, args.raw) {
        (true, _) => ResultStyle::Tagged,
        (false, true) => ResultStyle::Raw,
        (false, false) => ResultStyle::Json,
    };
    print_results(&mut Out::new(), &completion, style)
}

/// Waits for the request, with a progress bar when stderr is a terminal (and `show_progress`).
/// Ctrl-c stops the waiting, not the request.
pub(crate) async fn wait(
    config: &Config,
    handle: &RequestHandle,
    total: u64,
    show_progress: bool,
) -> Result<sluicegate::Completion<Value>, Failure> {
    let bar = (show_progress && io::stderr().is_terminal()).then(|| progress_bar(total));
    let poller = bar.clone().map(|bar| tokio::spawn(poll_progress(config.clone(), handle.id().clone(), bar)));
    let waited = tokio::select! {
        done = handle.wait::<Value>() => Ok(done),
        () = shutdown_signal() => Err(()),
    };
    if let Some(poller) = poller {
        poller.abort();
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let id = handle.id();
    match waited {
        Ok(done) => Ok(done?),
        Err(()) => Err(Failure::new(
            Code::Interrupted,
            format!("stopped waiting; request {id} goes on (see `sluicegate status {id}`, `sluicegate results --wait {id}`)"),
        )),
    }
}

fn progress_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} done, {msg} ({elapsed}, eta {eta})")
    {
        bar.set_style(style);
    }
    bar
}

/// Progress is decoration: when Redis cannot tell, the bar just stops moving.
async fn poll_progress(config: Config, id: RequestId, bar: ProgressBar) {
    let Ok(admin) = Admin::connect(&config).await else { return };
    loop {
        if let Ok(status) = admin.status(&id).await {
            bar.set_length(status.total);
            bar.set_position(status.done);
            bar.set_message(format!(
                "{} running, {} retrying, {} failed",
                status.running, status.retrying, status.failed
            ));
        }
        tokio::time::sleep(PROGRESS_POLL).await;
    }
}
