//! `sluicegate submit`: a file of lines in, one sub-request per line; with `--wait`, results out.

use std::fs::File;
use std::io::{self, BufRead, BufReader, IsTerminal};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use sluicegate::{
    shutdown_signal, Admin, Config, OnUpstreamFailure, Producer, RequestBuilder, RequestHandle, RequestId,
};

use crate::cli::{Deadline, SubmitArgs, UpstreamFailureArg};
use crate::failure::{Code, Failure};
use crate::input::{open_error, read_part, InputLines, InputReport};
use crate::output::{count, print_results, Out, ResultStyle};
use crate::Ctx;

/// How often the progress bar asks for the request's counters.
const PROGRESS_POLL: Duration = Duration::from_millis(250);

/// Input buffer: large reads keep a multi-gigabyte file from costing a syscall per line.
const READ_BUFFER: usize = 256 * 1024;

/// Lines read ahead of a streamed request's adds: bounds memory, and makes a slow Redis slow
/// down the reading (backpressure) instead of buffering the input.
const STREAM_BUFFER: usize = 1_024;

/// The most lines one add of a streamed request carries.
const STREAM_BATCH: usize = 1_000;

pub(crate) async fn run(ctx: &Ctx, args: SubmitArgs) -> Result<(), Failure> {
    let upstreams = upstreams(&args.after)?;
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
        .backoff(args.backoff, args.backoff_max)?
        .fail_fast(args.fail_fast)
        .discard_results(args.discard_results)
        .own_stream(args.own_stream);
    if let Some(id) = &args.id {
        request = request.id(id.clone())?;
    }
    for tag in &args.tags {
        request = request.tag(tag.clone())?;
    }
    if args.unlisted {
        request = request.unlisted();
    }
    if let Some(limit) = args.timeout {
        request = request.timeout(limit)?;
    }
    if let Some(delay) = args.delay {
        request = request.delay(delay);
    }
    if let Some((n, per)) = args.rate {
        request = request.rate(n, per)?;
    }
    match args.deadline {
        Some(Deadline::In(d)) => request = request.deadline_in(d),
        Some(Deadline::At(at)) => request = request.deadline(at),
        None => {}
    }
    if let Some(expiry) = args.expire_open_after {
        request = request.expire_open_after(expiry);
    }
    if !upstreams.is_empty() {
        let policy = match args.on_upstream_failure {
            Some(UpstreamFailureArg::Run) => OnUpstreamFailure::Run,
            Some(UpstreamFailureArg::Fail) | None => OnUpstreamFailure::Fail,
        };
        request = request.after(upstreams).on_upstream_failure(policy);
    }
    if let Some(name) = &args.group {
        request = request.group(name).map_err(|e| flag_refused("--group", e))?;
    }
    let submitted = if args.stream {
        stream(ctx, request, reader, args.max_payload_bytes, !args.wait).await
    } else {
        all_at_once(request, reader, args.max_payload_bytes).await
    };
    // This process may exit soon, and the flush a dropped producer starts could race the
    // runtime's shutdown: its count of the submit (or of a stream it cancelled) goes to the stats
    // by stage now, whatever the outcome (a failure there fails nothing).
    if let Err(e) = producer.flush_stats().await {
        eprintln!("warning: the submit was not counted in the stats by stage: {e}");
    }
    let (handle, parts) = submitted?;
    let id = handle.id().clone();

    if !args.wait {
        // A streamed request printed its id when it opened.
        if !args.stream {
            print_id(ctx, &id, Some(parts))?;
        }
        return Ok(());
    }
    // With --wait, stdout carries only the results; the id still matters (to cancel, say).
    eprintln!("submitted {id} ({}); waiting for it to finish", count(parts, "sub-request"));
    let completion = wait(&ctx.config, &handle, parts, !ctx.json).await?;
    if args.discard_results && completion.state == sluicegate::RequestState::Completed {
        // Nothing to print on stdout: its counts say it finished.
        eprintln!("{id} completed: {}, results discarded", count(completion.total, "sub-request"));
    }
    let style = match (ctx.json, args.raw) {
        (true, _) => ResultStyle::Tagged,
        (false, true) => ResultStyle::Raw,
        (false, false) => ResultStyle::Json,
    };
    print_results(&mut Out::new(), &completion, style)
}

/// The ids of `--after`, checked before anything is read or sent.
fn upstreams(after: &[String]) -> Result<Vec<RequestId>, Failure> {
    after
        .iter()
        .map(|id| RequestId::new(id.as_str()).map_err(|e| Failure::bad_input(format!("--after {id:?}: {e}"))))
        .collect()
}

/// A refusal of the library's about one flag's value, naming the flag: `--group: a group name
/// is ...`. Other errors as usual.
fn flag_refused(flag: &str, e: sluicegate::Error) -> Failure {
    match e {
        sluicegate::Error::InvalidRequest(why) => Failure::bad_input(format!("{flag}: {why}")),
        other => Failure::from(other),
    }
}

fn print_id(ctx: &Ctx, id: &RequestId, parts: Option<u64>) -> Result<(), Failure> {
    let mut out = Out::new();
    match (ctx.json, parts) {
        (true, Some(parts)) => out.json(&json!({ "id": id.as_str(), "parts": parts }))?,
        (true, None) => out.json(&json!({ "id": id.as_str() }))?,
        (false, _) => out.line(id.as_str())?,
    }
    out.flush()
}

/// The whole input as one request, all or nothing. Returns the handle and the number of parts.
async fn all_at_once(
    request: RequestBuilder<'_>,
    reader: Box<dyn BufRead + Send>,
    max_bytes: usize,
) -> Result<(RequestHandle, u64), Failure> {
    let report = Arc::new(InputReport::default());
    let submitted = request.submit(InputLines::new(reader, max_bytes, report.clone())).await;
    // An input problem surfaces from the library as an encoding error of the refused part; the
    // report has the message that names the line.
    if let Some(problem) = report.take_problem() {
        return Err(Failure::bad_input(format!("{problem}; nothing was submitted")));
    }
    let parts = report.parts();
    if parts == 0 && report.at_end() && submitted.is_err() {
        return Err(Failure::bad_input("the input has no lines: a request needs at least one sub-request"));
    }
    Ok((submitted?, parts))
}

/// A streamed request: each line is added as soon as it is read (in batches when lines come
/// faster than Redis takes them), and the request is finalized at the end of the input. A bad
/// line cancels the request: parts before it may have run already, so all-or-nothing is not
/// possible, but a half request must not complete as if it were whole.
async fn stream(
    ctx: &Ctx,
    request: RequestBuilder<'_>,
    reader: Box<dyn BufRead + Send>,
    max_bytes: usize,
    announce: bool,
) -> Result<(RequestHandle, u64), Failure> {
    let mut open = request.open().await?;
    let id = open.handle().id().clone();
    if announce {
        print_id(ctx, &id, None)?;
    } else {
        eprintln!("streaming into request {id}");
    }
    // Reading blocks (a pipe may stay quiet for hours), so it gets a thread of its own; the
    // bounded channel is the backpressure.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Value, String>>(STREAM_BUFFER);
    let reading = std::thread::spawn(move || {
        let mut reader = reader;
        let mut buf = Vec::new();
        for line in 1.. {
            let part = match read_part(&mut reader, &mut buf, max_bytes, line) {
                Ok(Some(value)) => Ok(value),
                Ok(None) => return,
                Err(problem) => Err(problem),
            };
            let stop = part.is_err();
            if tx.blocking_send(part).is_err() || stop {
                return;
            }
        }
    });
    let mut problem = None;
    let mut added: Result<(), Failure> = Ok(());
    while let Some(first) = rx.recv().await {
        let mut batch = Vec::with_capacity(STREAM_BATCH);
        let mut next = Some(first);
        while let Some(part) = next.take() {
            match part {
                Ok(value) => batch.push(value),
                Err(why) => {
                    problem = Some(why);
                    break;
                }
            }
            if batch.len() < STREAM_BATCH {
                next = rx.try_recv().ok();
            }
        }
        if !batch.is_empty() {
            if let Err(e) = open.add(batch).await {
                added = Err(Failure::from(e));
                break;
            }
        }
        if problem.is_some() {
            break;
        }
    }
    // Dropping the receiver unblocks the reader thread if it is waiting to send.
    drop(rx);
    let parts = open.len();
    if let Err(failure) = added {
        // The request stays open: say how to close it, since this process cannot.
        return Err(Failure::new(
            failure.code,
            format!("{}; request {id} is still open with {} (`sluicegate finalize {id}` or `sluicegate cancel {id}`)", failure.message, count(parts, "sub-request")),
        ));
    }
    if let Some(problem) = problem {
        let cancelled = open.handle().cancel().await;
        let what = match cancelled {
            Ok(_) => format!("request {id} was cancelled after {}", count(parts, "sub-request")),
            Err(e) => {
                format!("request {id} could not be cancelled ({e}); cancel it with `sluicegate cancel {id}`")
            }
        };
        return Err(Failure::bad_input(format!("{problem}; {what}")));
    }
    // The thread ended (end of input) or is about to: nothing is waiting on it.
    let _ = reading.join();
    Ok((open.finalize().await?, parts))
}

/// Waits for the request, with a progress bar when stderr is a terminal (and `show_progress`).
/// Ctrl-c stops the waiting, not the request.
pub(crate) async fn wait(
    config: &Config,
    handle: &RequestHandle,
    total: u64,
    show_progress: bool,
) -> Result<sluicegate::Completion<Value>, Failure> {
    let warning = tokio::spawn(warn_without_workers(config.clone()));
    let bar = (show_progress && io::stderr().is_terminal()).then(|| progress_bar(total));
    let poller = bar.clone().map(|bar| tokio::spawn(poll_progress(config.clone(), handle.id().clone(), bar)));
    let waited = tokio::select! {
        done = handle.wait::<Value>() => Ok(done),
        () = shutdown_signal() => Err(()),
    };
    warning.abort();
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

/// Says once, on stderr, that nothing will run the request yet when no worker is registered in
/// the namespace waited in (a worker started with another `--namespace` is the usual cause).
async fn warn_without_workers(config: Config) {
    let Ok(admin) = Admin::connect(&config).await else { return };
    if admin.workers().await.is_ok_and(|w| w.is_empty()) {
        let ns = config.namespace_str();
        eprintln!(
            "warning: no worker is registered in namespace \"{ns}\"; waiting until one starts there \
             (sluicegate --namespace {ns} worker --exec ...)"
        );
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
