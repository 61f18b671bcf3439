//! A request's input: one sub-request per line, read lazily so that a file of any length is
//! submitted in bounded memory.

use std::io::{self, BufRead, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::ser::Error as _;
use serde::{Serialize, Serializer};
use serde_json::Value;

/// What reading the input found, shared with the caller: the submit API consumes the iterator,
/// so this is how the line count and the first problem come back out.
#[derive(Default, Debug)]
pub(crate) struct InputReport {
    parts: AtomicU64,
    at_end: AtomicBool,
    problem: Mutex<Option<String>>,
}

impl InputReport {
    /// How many lines became sub-requests.
    pub(crate) fn parts(&self) -> u64 {
        self.parts.load(Ordering::Relaxed)
    }

    /// Whether the whole input was read (a submit may stop before: a duplicate id, say).
    pub(crate) fn at_end(&self) -> bool {
        self.at_end.load(Ordering::Relaxed)
    }

    /// The reason the input was refused, if it was.
    pub(crate) fn take_problem(&self) -> Option<String> {
        self.problem.lock().map_or(None, |mut p| p.take())
    }

    fn refuse(&self, problem: String) {
        if let Ok(mut slot) = self.problem.lock() {
            slot.get_or_insert(problem);
        }
    }
}

/// One sub-request's payload, or the marker of an input that must not be submitted.
pub(crate) enum Part {
    Payload(Value),
    /// Refuses to serialize: the producer's encoder fails, so the submit aborts before its commit
    /// and nothing of the request becomes visible. The submit API takes a plain iterator, and this
    /// is the one way an iterator can make it stop with an error.
    Refused,
}

impl Serialize for Part {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Part::Payload(value) => value.serialize(serializer),
            Part::Refused => Err(S::Error::custom("the input was refused")),
        }
    }
}

/// The input's lines as parts. Ends after the first problem, which it reports through the
/// [`InputReport`] and a final [`Part::Refused`].
pub(crate) struct InputLines<R> {
    reader: R,
    max_bytes: usize,
    line: u64,
    buf: Vec<u8>,
    ended: bool,
    report: Arc<InputReport>,
}

impl<R: BufRead> InputLines<R> {
    pub(crate) fn new(reader: R, max_bytes: usize, report: Arc<InputReport>) -> Self {
        Self { reader, max_bytes, line: 0, buf: Vec::new(), ended: false, report }
    }
}

impl<R: BufRead> Iterator for InputLines<R> {
    type Item = Part;

    fn next(&mut self) -> Option<Part> {
        if self.ended {
            return None;
        }
        self.line += 1;
        // The producer calls this from async code; reading a pipe may block for long, so the
        // runtime is told to move its other tasks (the Redis connection) off this thread.
        let read = tokio::task::block_in_place(|| {
            read_part(&mut self.reader, &mut self.buf, self.max_bytes, self.line)
        });
        match read {
            Ok(Some(value)) => {
                self.report.parts.fetch_add(1, Ordering::Relaxed);
                Some(Part::Payload(value))
            }
            Ok(None) => {
                self.ended = true;
                self.report.at_end.store(true, Ordering::Relaxed);
                None
            }
            Err(problem) => {
                self.ended = true;
                self.report.refuse(problem);
                Some(Part::Refused)
            }
        }
    }
}

/// Reads line number `line` into a payload: the line parsed as JSON, or else the line as a JSON
/// string. `None` at the end of the input. Never buffers more than `max_bytes` of one line.
pub(crate) fn read_part(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    max_bytes: usize,
    line: u64,
) -> Result<Option<Value>, String> {
    buf.clear();
    // Room for the longest allowed line plus "\r\n": a longer line is refused before it is read
    // whole, so one endless line cannot exhaust memory.
    let limit = u64::try_from(max_bytes).unwrap_or(u64::MAX).saturating_add(2);
    let n = reader
        .by_ref()
        .take(limit)
        .read_until(b'\n', buf)
        .map_err(|e| format!("cannot read line {line} of the input: {e}"))?;
    if n == 0 {
        return Ok(None);
    }
    let complete = buf.last() == Some(&b'\n');
    if complete {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
    }
    if buf.len() > max_bytes {
        return Err(format!(
            "line {line} is longer than the payload limit of {max_bytes} bytes (--max-payload-bytes)"
        ));
    }
    let text = std::str::from_utf8(buf).map_err(|e| {
        format!("line {line} is not valid UTF-8 (invalid byte at column {})", e.valid_up_to() + 1)
    })?;
    Ok(Some(serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))))
}

/// Turns a read error on standard input or a file into the message for a person.
pub(crate) fn open_error(path: &std::path::Path, e: &io::Error) -> String {
    format!("cannot read {}: {e}", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parts(input: &[u8], max: usize) -> Result<Vec<Value>, String> {
        let mut reader = input;
        let mut buf = Vec::new();
        let mut out = Vec::new();
        for line in 1.. {
            match read_part(&mut reader, &mut buf, max, line)? {
                Some(v) => out.push(v),
                None => return Ok(out),
            }
        }
        unreachable!()
    }

    #[test]
    fn json_lines_stay_json_and_other_lines_become_strings() {
        let got = parts(b"{\"n\": 1}\nhello world\n42\n\"quoted\"\n\ntrue\r\nlast", 100).unwrap();
        assert_eq!(
            got,
            [
                json!({"n": 1}),
                json!("hello world"),
                json!(42),
                json!("quoted"),
                json!(""),
                json!(true),
                json!("last")
            ]
        );
    }

    #[test]
    fn a_final_newline_adds_no_part() {
        assert_eq!(parts(b"a\nb\n", 100).unwrap().len(), 2);
        assert_eq!(parts(b"", 100).unwrap().len(), 0);
    }

    #[test]
    fn invalid_utf8_names_the_line_and_column() {
        let err = parts(b"ok\nab\xffcd\n", 100).unwrap_err();
        assert_eq!(err, "line 2 is not valid UTF-8 (invalid byte at column 3)");
    }

    #[test]
    fn an_oversized_line_is_refused_without_reading_it_whole() {
        assert_eq!(parts(b"12345\r\n", 5).unwrap(), [json!(12345)]);
        let err = parts(b"ok\n123456\n", 5).unwrap_err();
        assert!(err.starts_with("line 2 is longer than the payload limit of 5 bytes"), "{err}");
        let endless = vec![b'x'; 1 << 20];
        let mut reader = &endless[..];
        let mut buf = Vec::new();
        assert!(read_part(&mut reader, &mut buf, 10, 1).is_err());
        assert!(buf.len() <= 12, "read {} bytes of an oversized line", buf.len());
    }

    #[test]
    fn a_refused_part_fails_to_encode_and_the_report_says_why() {
        let report = Arc::new(InputReport::default());
        let lines: Vec<Part> = InputLines::new(&b"a\n\xff\nc\n"[..], 100, report.clone()).collect();
        assert_eq!(lines.len(), 2, "reading stops at the first problem");
        assert!(matches!(lines[1], Part::Refused));
        assert!(sluicegate::codec::encode(&lines[1]).is_err());
        assert_eq!((report.parts(), report.at_end()), (1, false));
        assert_eq!(
            report.take_problem().as_deref(),
            Some("line 2 is not valid UTF-8 (invalid byte at column 1)")
        );
    }
}
