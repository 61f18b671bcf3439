//! What a Redis node was asked, from `MONITOR`: the top-level commands (not a function's own,
//! which MONITOR shows as `lua]`) whose line mentions a filter (a namespace, a key id).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

pub struct Monitor {
    addr: String,
    filter: String,
    lines: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Monitor {
    /// Starts recording once the node has confirmed `MONITOR`.
    pub async fn start(url: &str, filter: &str) -> Monitor {
        let addr = url.trim_start_matches("redis://").to_owned();
        let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        stream.write_all(b"MONITOR\r\n").await.unwrap();
        let mut reader = BufReader::new(stream).lines();
        let first = reader.next_line().await.unwrap().unwrap();
        assert_eq!(first, "+OK", "MONITOR on {addr}");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let wanted = filter.to_owned();
        let task = tokio::spawn(async move {
            while let Ok(Some(line)) = reader.next_line().await {
                if !line.contains(" lua] ") && line.contains(&wanted) {
                    sink.lock().unwrap().push(line);
                }
            }
        });
        Monitor { addr, filter: filter.to_owned(), lines, task }
    }

    /// The commands recorded, each as `["NAME", "arg", ...]` (quotes removed, escapes kept):
    /// every command the node ran before this call, since a marker sent now is waited for (MONITOR's
    /// lines trail the commands they show).
    pub async fn stop(self) -> Vec<Vec<String>> {
        let marker = format!("{}:monitor-end", self.filter);
        let mut stream = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        stream.write_all(format!("ECHO {marker}\r\n").as_bytes()).await.unwrap();
        let began = std::time::Instant::now();
        while !self.lines.lock().unwrap().iter().any(|l| l.contains(&marker)) {
            assert!(began.elapsed() < std::time::Duration::from_secs(10), "MONITOR never showed its marker");
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        self.task.abort();
        let lines = self.lines.lock().unwrap().clone();
        lines.iter().filter(|l| !l.contains(&marker)).map(|l| words(l)).collect()
    }
}

/// `+<time> [<db> <client>] "FCALL" "sg2_take" "5" ...` -> `["FCALL", "sg2_take", "5", ...]`.
fn words(line: &str) -> Vec<String> {
    let Some(start) = line.find("] \"") else { return Vec::new() };
    let body = &line[start + 3..];
    body.trim_end_matches('"').split("\" \"").map(str::to_owned).collect()
}

/// Top-level `FCALL`s by function name.
pub fn fcalls(commands: &[Vec<String>]) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for c in commands {
        if c.first().is_some_and(|w| w.eq_ignore_ascii_case("fcall")) {
            *counts.entry(c.get(1).cloned().unwrap_or_default()).or_insert(0) += 1;
        }
    }
    counts
}
