//! Everything printed on stdout: results, JSON records, human-readable times.

use std::io::{self, BufWriter, Stdout, Write};
use std::time::{Duration, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;
use sluicegate::{Completion, PartError, RequestState};

use crate::failure::{output_error, Code, Failure};

/// Buffered stdout whose write errors are [`Failure`]s (a closed pipe ends the command quietly).
pub(crate) struct Out {
    inner: BufWriter<Stdout>,
}

impl Out {
    pub(crate) fn new() -> Self {
        Self { inner: BufWriter::new(io::stdout()) }
    }

    pub(crate) fn line(&mut self, text: &str) -> Result<(), Failure> {
        self.inner.write_all(text.as_bytes()).and_then(|()| self.inner.write_all(b"\n")).map_err(output_error)
    }

    /// One JSON object on a line of its own, for `--json`.
    pub(crate) fn json<T: Serialize>(&mut self, record: &T) -> Result<(), Failure> {
        let text = serde_json::to_string(record)
            .map_err(|e| Failure::new(Code::Redis, format!("cannot print as JSON: {e}")))?;
        self.line(&text)
    }

    pub(crate) fn flush(&mut self) -> Result<(), Failure> {
        self.inner.flush().map_err(output_error)
    }
}

/// How results are printed, one line per sub-request in input order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResultStyle {
    /// Each result as JSON; a failed sub-request as its error record.
    Json,
    /// As `Json`, but string results as plain text (a text file in, a text file out).
    Raw,
    /// `--json`: `{"index", "ok"}` or `{"index", "error", "attempts", "permanent"}`, so that a
    /// result that happens to look like an error record cannot be mistaken for one.
    Tagged,
}

/// `--json` records of results; structs rather than `json!` so fields print in this order.
#[derive(Serialize)]
struct TaggedOk<'a> {
    index: usize,
    ok: &'a Value,
}

#[derive(Serialize)]
struct TaggedError<'a> {
    index: usize,
    error: &'a str,
    attempts: u32,
    permanent: bool,
}

/// The line printed for sub-request `index`.
pub(crate) fn result_line(index: usize, result: &Result<Value, PartError>, style: ResultStyle) -> String {
    let line = match (result, style) {
        (Ok(Value::String(text)), ResultStyle::Raw) => return text.clone(),
        (Ok(value), ResultStyle::Tagged) => serde_json::to_string(&TaggedOk { index, ok: value }),
        (Ok(value), _) => return value.to_string(),
        (Err(e), ResultStyle::Tagged) => serde_json::to_string(&TaggedError {
            index,
            error: &e.message,
            attempts: e.attempts,
            permanent: e.permanent,
        }),
        // The error record as the library stores it: {"error", "attempts", "permanent"}.
        (Err(e), _) => serde_json::to_string(e),
    };
    // Serializing strings, numbers and bools cannot fail; the fallback only keeps this total.
    line.unwrap_or_else(|e| format!("{{\"error\":\"cannot print result {index}: {e}\"}}"))
}

/// Prints every result, then turns the request's terminal state into the command's outcome.
pub(crate) fn print_results(
    out: &mut Out,
    completion: &Completion<Value>,
    style: ResultStyle,
) -> Result<(), Failure> {
    for (index, result) in completion.results.iter().enumerate() {
        out.line(&result_line(index, result, style))?;
    }
    out.flush()?;
    outcome(completion)
}

/// Completed is success; failed and cancelled are [`Code::RequestFailed`], with a summary.
pub(crate) fn outcome(completion: &Completion<Value>) -> Result<(), Failure> {
    let id = &completion.id;
    let upstream = completion.reason.as_deref().and_then(|r| r.strip_prefix("upstream:"));
    match completion.state {
        RequestState::Completed => Ok(()),
        RequestState::Failed if upstream.is_some() => {
            let up = upstream.unwrap_or_default();
            Err(Failure::new(
                Code::RequestFailed,
                format!(
                    "request {id} failed: its upstream {up} did not complete, so it did not run (see `sluicegate status {up}`)"
                ),
            ))
        }
        RequestState::Failed => {
            let total = completion.results.len() as u64;
            let mut failed =
                completion.results.iter().enumerate().filter_map(|(i, r)| Some((i, r.as_ref().err()?)));
            let first = failed.next();
            let failures = (first.iter().count() + failed.count()) as u64;
            // A request that discards its results reports its counts alone.
            let (failures, total) =
                if total == 0 { (completion.failed, completion.total) } else { (failures, total) };
            let first = first.map_or(String::new(), |(i, e)| format!(" (first: #{i}: {e})"));
            Err(Failure::new(
                Code::RequestFailed,
                format!("request {id} failed: {failures} of {} failed{first}", count(total, "sub-request")),
            ))
        }
        RequestState::Cancelled => {
            Err(Failure::new(Code::RequestFailed, format!("request {id} was cancelled")))
        }
        other => {
            Err(Failure::new(Code::Redis, format!("request {id} ended in an unexpected state: {other}")))
        }
    }
}

/// `1 sub-request`, `2 sub-requests`.
pub(crate) fn count(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// A Redis timestamp (ms since the Unix epoch) as RFC 3339 UTC, e.g. `2024-05-01T12:00:00.123Z`.
pub(crate) fn timestamp(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// The time from `from_ms` to `to_ms` for a person: `1.25s`, `3m 2s`.
pub(crate) fn elapsed(from_ms: u64, to_ms: u64) -> String {
    let ms = to_ms.saturating_sub(from_ms);
    if ms < 60_000 {
        format!("{:.2}s", ms as f64 / 1000.0)
    } else {
        humantime::format_duration(Duration::from_secs(ms / 1000)).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn part_error() -> PartError {
        serde_json::from_value(json!({"error": "boom", "attempts": 3, "permanent": false})).unwrap()
    }

    #[test]
    fn results_print_as_json_raw_text_or_tagged_records() {
        let ok: Result<Value, PartError> = Ok(json!("AB"));
        let err: Result<Value, PartError> = Err(part_error());
        assert_eq!(result_line(0, &ok, ResultStyle::Json), "\"AB\"");
        assert_eq!(result_line(0, &ok, ResultStyle::Raw), "AB");
        assert_eq!(result_line(0, &Ok(json!({"n": 1})), ResultStyle::Raw), "{\"n\":1}");
        assert_eq!(result_line(4, &ok, ResultStyle::Tagged), "{\"index\":4,\"ok\":\"AB\"}");
        assert_eq!(
            result_line(1, &err, ResultStyle::Json),
            "{\"error\":\"boom\",\"attempts\":3,\"permanent\":false}"
        );
        assert_eq!(
            result_line(1, &err, ResultStyle::Tagged),
            "{\"index\":1,\"error\":\"boom\",\"attempts\":3,\"permanent\":false}"
        );
    }

    #[test]
    fn times_read_well() {
        assert_eq!(timestamp(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(elapsed(1_000, 2_250), "1.25s");
        assert_eq!(elapsed(0, 182_000), "3m 2s");
        assert_eq!(
            (count(1, "part"), count(0, "part"), count(2, "part")),
            ("1 part".into(), "0 parts".into(), "2 parts".into())
        );
    }
}
