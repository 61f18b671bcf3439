//! `sluicegate`: submit requests, run workers and operate a sluicegate system from a shell.
//!
//! Each command lives in a module of its own (`submit`, `worker` with its `exec` handler,
//! `reprioritize`, `schedules`, `groups`, `ops` for the operator's other commands); `cli` has the
//! command line, `failure` the exit codes, `input` and `output` what goes in and out. docs/cli.md
//! is the manual.

mod cli;
mod exec;
mod failure;
mod groups;
mod input;
mod listing;
mod ops;
mod output;
mod reprioritize;
mod schedules;
mod stats;
mod submit;
mod worker;

use std::future::Future;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use sluicegate::Config;

use crate::cli::{Cli, Command};
use crate::failure::{redact, Code, Failure};

/// What every command needs: the configuration, the output mode, how long to try to connect.
pub(crate) struct Ctx {
    pub(crate) config: Config,
    pub(crate) json: bool,
    connect_timeout: Duration,
}

impl Ctx {
    /// Runs a connect, giving up after `--connect-timeout`: the client retries a refused
    /// connection forever (right for a worker outliving a Redis restart), which would leave a
    /// command pointed at the wrong address hanging without a word.
    pub(crate) async fn connecting<T>(
        &self,
        connect: impl Future<Output = sluicegate::Result<T>>,
    ) -> Result<T, Failure> {
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Err(sluicegate::Error::Redis(e))) if e.is_connection() => {
                let reason = e.reason();
                let message = if reason.contains("InvalidCertificate(UnknownIssuer)") {
                    format!(
                        "cannot connect to Redis at {}: the server's TLS certificate is not trusted: {reason} \
                         (name its CA with --tls-ca-file)",
                        self.config.url()
                    )
                } else if reason.contains("InvalidCertificate") {
                    format!("cannot connect to Redis at {}: the server's TLS certificate is refused: {reason}", self.config.url())
                } else {
                    format!("cannot connect to Redis at {}: {reason}", self.config.url())
                };
                Err(Failure::new(Code::Redis, message))
            }
            Ok(connected) => Ok(connected?),
            Err(_) => Err(Failure::new(
                Code::Redis,
                format!(
                    "cannot connect to Redis at {}: no answer within {} (is it running? see --redis or REDIS_URL)",
                    self.config.url(),
                    humantime::format_duration(self.connect_timeout)
                ),
            )),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Library diagnostics (a slot that died, a failed registration) go to stderr; RUST_LOG
    // chooses how much, warnings by default.
    // The dashboard logs who did what at info level.
    let default =
        if matches!(cli.command, Command::Dashboard(_)) { "warn,sluicegate_dashboard=info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();

    let url = cli.redis.clone();
    let outcome = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => {
            let outcome = runtime.block_on(async {
                let outcome = run(cli).await;
                // Components dropped on the way out (an error returned early) close their
                // connections in tasks of their own: a shutdown now would cut them short, and
                // fred would warn on stderr.
                sluicegate::dropped_connections_closed().await;
                outcome
            });
            // A blocking task left running (a read of stdin nobody closed, a lookup) must not hold
            // the exit: dropping the runtime would wait for it.
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            outcome
        }
        Err(e) => Err(Failure::new(Code::Redis, format!("cannot start the async runtime: {e}"))),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) if failure.code == Code::OutputClosed => ExitCode::SUCCESS,
        Err(failure) => {
            // One line, whatever the message carries: scripts read stderr line by line.
            let message = redact(&failure.message, &url).replace('\n', " ");
            eprintln!("error: {message}");
            ExitCode::from(failure.code as u8)
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let mut config = Config::new(cli.redis);
    if let Some(ns) = cli.namespace {
        config = config.namespace(ns);
    }
    if let Some(lease) = cli.lease {
        config = config.lease(lease);
    }
    if let Some(heartbeat) = cli.heartbeat {
        config = config.heartbeat(heartbeat);
    }
    if let Some(interval) = cli.recovery_interval {
        config = config.recovery_interval(interval);
    }
    if let Some(ca) = cli.tls_ca_file {
        config = config.tls_ca_file(ca);
    }
    if let Some(shards) = cli.token_shards {
        config = config.token_shards(shards);
    }
    let ctx = Ctx { config, json: cli.json, connect_timeout: cli.connect_timeout };
    match cli.command {
        Command::Submit(args) => submit::run(&ctx, args).await,
        Command::Worker(args) => worker::run(&ctx, args).await,
        Command::Status(args) => ops::status(&ctx, &args.id).await,
        Command::Finalize(args) => ops::finalize(&ctx, &args.id).await,
        Command::Cancel(args) => ops::cancel(&ctx, &args.id).await,
        Command::Requeue(args) => ops::requeue(&ctx, &args.id).await,
        Command::Reprioritize(args) => reprioritize::run(&ctx, args).await,
        Command::Stats(args) => match args.since {
            None => ops::stats(&ctx).await,
            Some(since) => stats::since(&ctx, since).await,
        },
        Command::Dead(args) => ops::dead(&ctx, &args.id).await,
        Command::Purge(args) => listing::purge(&ctx, &args).await,
        Command::List(args) => listing::list(&ctx, &args).await,
        Command::Track(args) => listing::track(&ctx, &args).await,
        Command::Metrics(args) => ops::metrics(&ctx, args.listen).await,
        Command::Dashboard(args) => ops::dashboard(&ctx, &args).await,
        Command::Pause(args) => ops::pause(&ctx, args.priority, true).await,
        Command::Resume(args) => ops::pause(&ctx, args.priority, false).await,
        Command::Results(args) => ops::results(&ctx, args).await,
        Command::Events(args) => ops::events(&ctx, args).await,
        Command::Schedule(args) => schedules::run(&ctx, args.action).await,
        Command::Group(args) => groups::run(&ctx, args.action).await,
    }
}
