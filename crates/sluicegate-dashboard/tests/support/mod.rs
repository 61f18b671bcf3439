//! Shared set-up of the dashboard's tests: a Redis of the test's own, a dashboard served on a free
//! port, a worker whose parts take a while, and a small HTTP client.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use sluicegate::{async_trait, Admin, Config, Context, Handler, HandlerError, Producer, Worker};
use sluicegate_dashboard::{Dashboard, DashboardOptions};
use sluicegate_testkit::{unique_namespace, TestBackend, Topology};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// A test's Redis, namespace and configuration.
pub struct Env {
    pub redis: TestBackend,
    pub config: Config,
}

pub async fn env(topology: Topology, name: &str) -> Env {
    let redis = TestBackend::start(topology).await.unwrap_or_else(|e| panic!("{e}"));
    let config = Config::new(redis.url())
        .namespace(unique_namespace(name))
        .lease(Duration::from_millis(1500))
        .heartbeat(Duration::from_millis(200))
        .recovery_interval(Duration::from_millis(300))
        .stats_flush_interval(Duration::from_millis(200))
        // Every request gets keys of its own, so its tokens show.
        .lane_tokens(0);
    Env { redis, config }
}

/// A dashboard served on a free port of 127.0.0.1; aborted on drop.
pub struct Served {
    pub addr: SocketAddr,
    task: JoinHandle<std::io::Result<()>>,
}

impl Served {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve(config: &Config, options: DashboardOptions) -> Served {
    let admin = Admin::connect(config).await.unwrap();
    let dashboard = Dashboard::new(
        admin,
        config,
        options.interval(Duration::from_millis(250)).throughput_interval(Duration::from_millis(500)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(dashboard.serve(listener));
    Served { addr, task }
}

/// Sleeps `ms` milliseconds, then returns its input.
pub struct Slow {
    pub ms: u64,
}

#[async_trait]
impl Handler for Slow {
    type Input = u64;
    type Output = u64;
    async fn handle(&self, _ctx: Context, n: u64) -> Result<u64, HandlerError> {
        tokio::time::sleep(Duration::from_millis(self.ms)).await;
        if n == u64::MAX {
            return Err(HandlerError::permanent("the test asked for a dead letter"));
        }
        Ok(n)
    }
}

/// A worker in the background, stopped on drop.
pub struct Running(JoinHandle<()>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub async fn worker(config: &Config, ms: u64, slots: usize) -> Running {
    let worker = Worker::builder(config, Slow { ms }).slots(slots).build().await.unwrap();
    Running(tokio::spawn(async move {
        let _ = worker.run().await;
    }))
}

pub async fn producer(config: &Config) -> Producer {
    Producer::connect(config).await.unwrap()
}

/// An HTTP/1.1 exchange on a connection of its own: the status and the body.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut reply)).await.unwrap().unwrap();
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let status = reply.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (status, body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

pub async fn get_json(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, serde_json::Value) {
    let (status, body) = http(addr, "GET", path, headers, "").await;
    (status, serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body)))
}

pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, serde_json::Value) {
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    let (status, body) = http(addr, "POST", path, &all, body).await;
    (status, serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body)))
}
