//! Why a command stopped: a one-line message for stderr and the exit code scripts branch on.

use std::fmt;
use std::io;

use sluicegate::Error;

/// The exit codes, documented in docs/cli.md. Clap's own usage errors also exit with 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Code {
    /// Not a failure: our stdout was closed by its reader; stop quietly.
    OutputClosed = 0,
    /// The request ended failed or cancelled (submit --wait, results).
    RequestFailed = 1,
    /// The command line, the input or the configuration is unusable.
    BadInput = 2,
    /// Redis could not be reached, or answered with an error.
    Redis = 3,
    /// No request has this id (never submitted, or expired), or no schedule this name.
    UnknownRequest = 4,
    /// `results` of a request that is still running.
    NotFinished = 5,
    /// Interrupted by ctrl-c or SIGTERM while waiting (128 + SIGINT, as shells report it).
    Interrupted = 130,
}

/// A command's failure: printed as `error: <message>` and turned into the exit code.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: Code,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    pub(crate) fn bad_input(message: impl Into<String>) -> Self {
        Self::new(Code::BadInput, message)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        // The library quotes ids through their Debug form (`RequestId("x")`); a person wants "x".
        match &e {
            Error::UnknownRequest(id) => {
                return Self::new(
                    Code::UnknownRequest,
                    format!("no request with id {:?} (never submitted, or its results expired)", id.as_str()),
                )
            }
            // Only `submit --after` names upstreams; nothing of the request was kept.
            Error::UnknownUpstream { id, why } => {
                return Self::new(
                    Code::UnknownRequest,
                    format!("--after {:?}: that request {why}; nothing was submitted", id.as_str()),
                )
            }
            Error::DuplicateRequestId(id) => {
                return Self::bad_input(format!(
                    "request id {:?} is already in use; choose another --id or wait until its retention ends",
                    id.as_str()
                ))
            }
            // The functions library refusing an argument, passed on as Redis's error reply (the
            // library's `reprioritize` of a request in a tenant group does): bad input, in its
            // words.
            Error::Redis(r) if r.code() == Some("SGINVALID") => {
                let why = r.message().trim_start_matches("SGINVALID").trim_start();
                return Self::bad_input(format!("refused: {why}"));
            }
            _ => {}
        }
        let code = match &e {
            Error::Config(_)
            | Error::InvalidRequestId(_)
            | Error::InvalidRequest(_)
            | Error::InvalidCursor(_)
            | Error::DuplicateRequestId(_)
            | Error::Expired(_)
            | Error::NotOpen(_)
            | Error::NoDeadLetters(_)
            | Error::Refused(_)
            | Error::InvalidSchedule(_)
            | Error::ScheduleExists(_)
            | Error::Codec(_) => Code::BadInput,
            Error::UnknownRequest(_) | Error::UnknownSchedule(_) | Error::UnknownUpstream { .. } => {
                Code::UnknownRequest
            }
            // Redis, an unsupported server, a protocol mismatch, and whatever the library adds
            // later: all are about the server side, not about what the user typed.
            _ => Code::Redis,
        };
        Self::new(code, e.to_string())
    }
}

/// Writing our own output failed. A closed pipe (`sluicegate results x | head`) is not an error
/// of ours: the reader had enough, so the command ends quietly and successfully.
pub(crate) fn output_error(e: io::Error) -> Failure {
    if e.kind() == io::ErrorKind::BrokenPipe {
        Failure::new(Code::OutputClosed, "")
    } else {
        Failure::new(Code::Redis, format!("cannot write the output: {e}"))
    }
}

/// The message with the password of `url` (if it has one) replaced by `***`: errors quote the
/// URL, and stderr ends up in logs.
pub(crate) fn redact(message: &str, url: &str) -> String {
    let Some((_, rest)) = url.split_once("://") else {
        return message.to_owned();
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    let Some((userinfo, _host)) = authority.rsplit_once('@') else {
        return message.to_owned();
    };
    // redis://:password@host and redis://user:password@host; a lone user name is no secret.
    match userinfo.split_once(':') {
        Some((_, password)) if !password.is_empty() => message.replace(password, "***"),
        _ => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_in_urls_never_reach_stderr() {
        let url = "redis://app:s3cret@db:6379/0";
        assert_eq!(
            redact(&format!("cannot connect to {url}: refused"), url),
            "cannot connect to redis://app:***@db:6379/0: refused"
        );
        assert_eq!(redact("x redis://:pw@h y", "redis://:pw@h"), "x redis://:***@h y");
        assert_eq!(redact("redis://user@h", "redis://user@h"), "redis://user@h");
        assert_eq!(redact("plain", "not a url"), "plain");
    }

    #[test]
    fn library_errors_map_to_documented_codes() {
        let unknown = Error::UnknownRequest(sluicegate::RequestId::new("x").unwrap());
        let failure = Failure::from(unknown);
        assert_eq!(failure.code, Code::UnknownRequest);
        assert_eq!(failure.message, "no request with id \"x\" (never submitted, or its results expired)");
        assert_eq!(Failure::from(Error::Config("bad".into())).code, Code::BadInput);
        assert_eq!(Failure::from(Error::Protocol("odd".into())).code, Code::Redis);
        let upstream = Error::UnknownUpstream {
            id: sluicegate::RequestId::new("up").unwrap(),
            why: "is unknown (never submitted, or its retention ran out)",
        };
        let failure = Failure::from(upstream);
        assert_eq!(failure.code, Code::UnknownRequest);
        assert_eq!(
            failure.message,
            "--after \"up\": that request is unknown (never submitted, or its retention ran out); nothing was submitted"
        );
    }
}
