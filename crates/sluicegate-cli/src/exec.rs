//! The `--exec` handler: runs a command of the user's per sub-request.
//!
//! The contract (docs/cli.md): the payload as JSON and a newline on stdin; SLUICEGATE_REQUEST_ID,
//! SLUICEGATE_INDEX and SLUICEGATE_ATTEMPT in the environment; stdout (less one trailing newline)
//! is the result, as JSON if it parses, else as a JSON string; exit 0 is success,
//! [`PERMANENT_EXIT`] a permanent failure, anything else (another exit code, a signal, the
//! timeout) a failure that is retried while the request's max attempts allow.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::Value;
use sluicegate::{async_trait, Context, Handler, HandlerError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// The exit code by which a command says "retrying cannot help" (bad input, say). 100 is outside
/// the ranges shells (126-165) and sysexits (64-78) give meanings to.
pub(crate) const PERMANENT_EXIT: i32 = 100;

/// How much of a failing command's stderr goes into the error message (its end: the last lines
/// usually say what went wrong).
const STDERR_TAIL_BYTES: usize = 400;

/// A command to run per sub-request, its program resolved once at start-up.
#[derive(Debug)]
pub(crate) struct Exec {
    program: PathBuf,
    args: Vec<String>,
    /// The command as the user wrote it, for messages.
    shown: String,
    timeout: Option<Duration>,
    max_output: usize,
}

impl Exec {
    /// Splits `command` by shell rules (quotes, backslashes; no expansion, no pipes) and checks
    /// that its program can be run, so a typo stops the worker at once rather than failing every
    /// sub-request it takes.
    pub(crate) fn new(command: &str, timeout: Option<Duration>, max_output: usize) -> Result<Self, String> {
        let words =
            shell_words::split(command).map_err(|e| format!("cannot parse --exec {command:?}: {e}"))?;
        let Some((program, args)) = words.split_first() else {
            return Err("--exec needs a command, e.g. --exec './handle.sh --fast'".into());
        };
        let program = resolve(program, std::env::var_os("PATH").as_deref())
            .map_err(|why| format!("cannot start {program:?}: {why}"))?;
        Ok(Self { program, args: args.to_vec(), shown: command.to_owned(), timeout, max_output })
    }

    /// The command as given, for the worker's start-up line.
    pub(crate) fn shown(&self) -> &str {
        &self.shown
    }

    async fn run(&self, ctx: &Context, input: &Value) -> Result<Value, HandlerError> {
        let mut payload = serde_json::to_vec(input).map_err(|e| HandlerError::permanent(e.to_string()))?;
        payload.push(b'\n');
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .env("SLUICEGATE_REQUEST_ID", ctx.request_id().as_str())
            .env("SLUICEGATE_INDEX", ctx.index().to_string())
            .env("SLUICEGATE_ATTEMPT", ctx.attempt().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A timeout, a lost claim or a hard shutdown drops this future: the child goes with it,
            // and `Group` takes whatever it started along.
            .kill_on_drop(true)
            // Its own process group: a ctrl-c in the worker's terminal reaches the worker, which
            // then lets running commands finish (the shutdown grace) instead of losing them; and
            // the group is what is killed at the end.
            .process_group(0);
        let mut child = command
            .spawn()
            .map_err(|e| HandlerError::permanent(format!("cannot start {}: {e}", self.shown)))?;
        let group = Group::new(child.id());
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let feed = async move {
            if let Some(mut stdin) = stdin {
                // A command that does not read its stdin closes it early; that is its business.
                let _ = stdin.write_all(&payload).await;
            }
        };
        // Once the command exits, what it left running in its group goes too, which also closes
        // the pipes a background grandchild kept open, so that the reads end.
        let exited = async {
            let status = child.wait().await;
            group.kill();
            status
        };
        let ((_, out, err), status) = tokio::join!(
            async { tokio::join!(feed, read_capped(stdout, self.max_output), read_tail(stderr)) },
            exited
        );
        let status = status.map_err(|e| HandlerError::new(format!("waiting for {}: {e}", self.shown)))?;
        let (out, overflowed) =
            out.map_err(|e| HandlerError::new(format!("reading the output of {}: {e}", self.shown)))?;
        let tail = err.unwrap_or_default();
        if let Some(failure) = judge(&self.shown, status, &tail) {
            return Err(failure);
        }
        if overflowed {
            return Err(HandlerError::permanent(format!(
                "{} printed more than {} bytes (--max-output-bytes)",
                self.shown, self.max_output
            )));
        }
        parse_output(out).map_err(HandlerError::permanent)
    }
}

#[async_trait]
impl Handler for Exec {
    type Input = Value;
    type Output = Value;

    async fn handle(&self, ctx: Context, input: Value) -> Result<Value, HandlerError> {
        let run = self.run(&ctx, &input);
        let limited = async {
            match self.timeout {
                Some(limit) => tokio::time::timeout(limit, run).await.map_err(|_| {
                    HandlerError::new(format!(
                        "{} timed out after {} and was killed",
                        self.shown,
                        humantime::format_duration(limit)
                    ))
                })?,
                None => run.await,
            }
        };
        tokio::select! {
            result = limited => result,
            // The claim moved on (cancel, lost lease): the result would be dropped anyway.
            () = ctx.cancelled().cancelled() => Err(HandlerError::new(format!("{} was killed: its sub-request was cancelled or reclaimed", self.shown))),
        }
    }
}

/// A command's process group (its pid, as `process_group(0)` made it), killed with SIGKILL when
/// dropped: a timeout, a cancel or a shutdown ends the grandchildren too, not only the command.
/// Killed once only: after that the group id may in time name another process's group.
struct Group(AtomicU32);

impl Group {
    fn new(pid: Option<u32>) -> Self {
        Self(AtomicU32::new(pid.unwrap_or(0)))
    }

    fn kill(&self) {
        let pid = self.0.swap(0, Ordering::Relaxed);
        if let Ok(pid @ 1..) = i32::try_from(pid) {
            // A group already gone answers ESRCH, which is fine.
            let _ =
                nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The failure an exit status means, if any.
fn judge(shown: &str, status: ExitStatus, stderr_tail: &str) -> Option<HandlerError> {
    let said = if stderr_tail.is_empty() { String::new() } else { format!(": {stderr_tail}") };
    match (status.code(), status.signal()) {
        (Some(0), _) => None,
        (Some(PERMANENT_EXIT), _) => {
            Some(HandlerError::permanent(format!("{shown} exited with {PERMANENT_EXIT} (permanent){said}")))
        }
        (Some(code), _) => Some(HandlerError::new(format!("{shown} exited with {code}{said}"))),
        (None, Some(signal)) => {
            Some(HandlerError::new(format!("{shown} was killed by signal {signal}{said}")))
        }
        (None, None) => Some(HandlerError::new(format!("{shown} ended abnormally{said}"))),
    }
}

/// stdout less one trailing newline, as JSON if it parses, else as a JSON string.
fn parse_output(mut out: Vec<u8>) -> Result<Value, String> {
    if out.last() == Some(&b'\n') {
        out.pop();
        if out.last() == Some(&b'\r') {
            out.pop();
        }
    }
    let text = String::from_utf8(out).map_err(|e| {
        format!(
            "the output is neither JSON nor UTF-8 text (invalid byte at {})",
            e.utf8_error().valid_up_to()
        )
    })?;
    Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// Reads up to `cap` bytes, then drains the rest (so the command is not blocked on a full pipe)
/// and reports whether there was more.
async fn read_capped(pipe: Option<impl AsyncRead + Unpin>, cap: usize) -> std::io::Result<(Vec<u8>, bool)> {
    let Some(mut pipe) = pipe else { return Ok((Vec::new(), false)) };
    let mut buf = Vec::new();
    let limit = u64::try_from(cap).unwrap_or(u64::MAX).saturating_add(1);
    (&mut pipe).take(limit).read_to_end(&mut buf).await?;
    let overflowed = buf.len() > cap;
    if overflowed {
        buf.truncate(cap);
        tokio::io::copy(&mut pipe, &mut tokio::io::sink()).await?;
    }
    Ok((buf, overflowed))
}

/// The end of stderr, on one line: the last [`STDERR_TAIL_BYTES`], lines joined with " | ".
async fn read_tail(pipe: Option<impl AsyncRead + Unpin>) -> std::io::Result<String> {
    let Some(mut pipe) = pipe else { return Ok(String::new()) };
    let mut tail: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = pipe.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        tail.extend_from_slice(&chunk[..n]);
        if tail.len() > 2 * STDERR_TAIL_BYTES {
            tail.drain(..tail.len() - STDERR_TAIL_BYTES);
        }
    }
    let start = tail.len().saturating_sub(STDERR_TAIL_BYTES);
    let text = String::from_utf8_lossy(&tail[start..]);
    Ok(text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" | "))
}

/// Finds `program` as a shell would: a name with a `/` is a path, any other is looked up in PATH.
/// Returns why it cannot be run otherwise.
fn resolve(program: &str, path: Option<&std::ffi::OsStr>) -> Result<PathBuf, String> {
    if program.contains('/') {
        return runnable(Path::new(program)).map(|()| PathBuf::from(program));
    }
    let mut not_executable = None;
    for dir in path.map(|p| std::env::split_paths(p).collect::<Vec<_>>()).unwrap_or_default() {
        let candidate = dir.join(program);
        match runnable(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(why) if candidate.exists() => {
                not_executable.get_or_insert(why);
            }
            Err(_) => {}
        }
    }
    Err(not_executable.unwrap_or_else(|| "not found in PATH".into()))
}

fn runnable(path: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.is_dir() {
        return Err(format!("{} is a directory", path.display()));
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err(format!("{} is not executable (chmod +x it)", path.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn programs_are_found_like_a_shell_finds_them() {
        let path = std::ffi::OsString::from("/nonexistent:/bin:/usr/bin");
        assert!(resolve("sh", Some(&path)).unwrap().ends_with("sh"));
        assert_eq!(resolve("no-such-program-xyz", Some(&path)).unwrap_err(), "not found in PATH");
        let plain = std::env::temp_dir().join(format!("sluicegate-plain-{}", std::process::id()));
        std::fs::write(&plain, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        let refused = resolve(&plain.display().to_string(), None);
        std::fs::remove_file(&plain).unwrap();
        assert!(refused.unwrap_err().ends_with("is not executable (chmod +x it)"));
        assert!(resolve("/tmp", None).unwrap_err().contains("is a directory"));
        assert!(resolve("./missing.sh", None).unwrap_err().contains("No such file"));
    }

    #[test]
    fn a_command_that_cannot_start_stops_the_worker_with_one_line() {
        let err = Exec::new("./missing.sh --fast", None, 10).unwrap_err();
        assert!(err.starts_with("cannot start \"./missing.sh\": ./missing.sh: No such file"), "{err}");
        assert!(Exec::new("  ", None, 10).unwrap_err().contains("needs a command"));
        assert!(Exec::new("sh -c 'unclosed", None, 10).unwrap_err().contains("cannot parse --exec"));
    }

    #[test]
    fn output_is_json_when_it_parses_else_a_string() {
        assert_eq!(parse_output(b"{\"a\": 1}\n".to_vec()), Ok(json!({"a": 1})));
        assert_eq!(parse_output(b"HELLO\n\n".to_vec()), Ok(json!("HELLO\n")));
        assert_eq!(parse_output(b"".to_vec()), Ok(json!("")));
        assert!(parse_output(b"\xff".to_vec()).unwrap_err().contains("neither JSON nor UTF-8"));
    }

    #[test]
    fn exit_statuses_map_to_success_retry_or_permanent_failure() {
        let status = |code: i32| ExitStatus::from_raw(code << 8);
        assert!(judge("x", status(0), "").is_none());
        let retry = judge("x", status(3), "oops | more").unwrap();
        assert_eq!((retry.message(), retry.is_permanent()), ("x exited with 3: oops | more", false));
        assert!(judge("x", status(PERMANENT_EXIT), "").unwrap().is_permanent());
        let killed = judge("x", ExitStatus::from_raw(9), "").unwrap();
        assert_eq!((killed.message(), killed.is_permanent()), ("x was killed by signal 9", false));
    }
}
