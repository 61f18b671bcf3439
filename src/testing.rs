//! Throwaway Redis servers for tests and benchmarks.
//!
//! Two levels are offered:
//!
//! * [`RedisServer`] runs its own `redis-server` process on a free port of
//!   127.0.0.1, in its own temporary directory, and can kill, stop and restart
//!   it (on the same port and directory, so an AOF is replayed). Use it when a
//!   test needs to crash the server.
//! * [`TestRedis`] is what an ordinary integration test asks for: the server
//!   named by `REDIS_URL` if set, else a [`RedisServer`], else (with the
//!   `docker` feature) a Redis container, else [`HarnessError::NoRedis`]
//!   explaining how to get one.
//!
//! Tests that share one external server should put their keys under
//! [`unique_namespace`] and can inspect them with [`keys_in_namespace`].
//!
//! The process control here (`kill -TERM`, unix sockets) assumes a Unix host.
//!
//! ```no_run
//! # async fn demo() -> Result<(), sluicegate::testing::HarnessError> {
//! use sluicegate::testing::{RedisServer, TestRedis};
//!
//! let redis = TestRedis::start().await?;
//! println!("testing against {}", redis.url());
//!
//! let mut server = RedisServer::builder().aof_always(true).start().await?;
//! server.kill()?; // SIGKILL: a crash
//! server.restart().await?; // same port, same dir: the AOF is replayed
//! # Ok(())
//! # }
//! ```

use std::ffi::OsString;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::{Builder, Client, ClientLike, Config, KeysInterface};
use rand::Rng;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Address every [`RedisServer`] binds to.
const HOST: &str = "127.0.0.1";
/// How long a fresh server may take to answer `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// A restart replays the AOF, which takes time proportional to the data a
/// benchmark may have written, so it gets more patience than a fresh start.
const RESTART_TIMEOUT: Duration = Duration::from_secs(60);
/// Pause between readiness probes.
const POLL_INTERVAL: Duration = Duration::from_millis(25);
/// Ports we pick from. Below the Linux ephemeral range (32768+) so outgoing
/// connections are unlikely to hold them, and +10000 (the cluster bus port)
/// stays a valid port.
const PORT_RANGE: std::ops::Range<u16> = 15_000..32_000;
/// Offset of the cluster bus port from the client port.
const CLUSTER_BUS_OFFSET: u16 = 10_000;
/// Fresh ports tried when the chosen one turns out to be taken.
const MAX_PORT_ATTEMPTS: usize = 20;
/// Tries for a restart whose (fixed) port is briefly held by someone else,
/// e.g. another test's bind probe.
const MAX_RESTART_ATTEMPTS: usize = 10;
/// Lines of the server log quoted in [`HarnessError::StartFailed`].
const LOG_TAIL_LINES: usize = 30;
/// What Redis logs when it cannot bind its port.
const ADDR_IN_USE: &str = "Address already in use";
/// Image tag for the docker fallback: the module's default (5.0) is too old.
#[cfg(feature = "docker")]
const DOCKER_REDIS_TAG: &str = "7.2";

/// Errors from starting or talking to a test Redis.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A file, directory, socket or process operation failed.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// No Redis could be found or started; the message says how to get one.
    #[error(
        "no redis-server on PATH: install it (apt-get install -y redis-server), set REDIS_SERVER_BIN, set \
         REDIS_URL to an external server, or build with --features docker where Docker runs"
    )]
    NoRedis,
    /// `redis-server` exited or did not become ready in time.
    #[error("redis-server failed to start: {reason}\n--- end of redis log ---\n{log_tail}")]
    StartFailed {
        /// What went wrong (exit status, timeout, ...).
        reason: String,
        /// The last lines of the server's log file.
        log_tail: String,
    },
    /// A Redis command failed.
    #[error("Redis error: {0}")]
    Redis(#[from] fred::error::Error),
    /// The Docker fallback failed (no Docker engine, image pull failed, ...).
    #[cfg(feature = "docker")]
    #[error("Docker: {0}")]
    Docker(String),
}

/// Options for a [`RedisServer`]; get one from [`RedisServer::builder`].
#[derive(Debug, Clone, Default)]
pub struct RedisServerBuilder {
    aof_always: bool,
    unix_socket: bool,
    port: Option<u16>,
    extra_args: Vec<(String, String)>,
}

impl RedisServerBuilder {
    /// Turns on the append-only file with `appendfsync always`, so every
    /// acknowledged write survives a `kill -9` (default: persistence off).
    pub fn aof_always(mut self, on: bool) -> Self {
        self.aof_always = on;
        self
    }

    /// Adds `--key value` to the command line. Passed after the defaults, so
    /// it overrides them; `value` is a single argument (the leading `--` on
    /// `key` is optional).
    pub fn extra_arg(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_args.push((key.into(), value.into()));
        self
    }

    /// Also listens on a unix socket in the server's temp dir, see
    /// [`RedisServer::unix_socket_path`].
    pub fn unix_socket(mut self, on: bool) -> Self {
        self.unix_socket = on;
        self
    }

    /// Uses this port instead of a random free one; starting fails if the
    /// port is taken.
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Starts the server and waits until it answers `PING`.
    pub async fn start(self) -> Result<RedisServer, HarnessError> {
        let bin = find_redis_server().ok_or(HarnessError::NoRedis)?;
        let dir = make_temp_dir()?;
        // From here on, dropping `server` (also on error) removes the dir.
        let mut server = RedisServer { bin, dir, port: 0, opts: self, child: None };
        let forced = server.opts.port;
        let mut attempts = 0;
        loop {
            attempts += 1;
            server.port = match forced {
                Some(port) => port,
                None => free_port()?,
            };
            match server.spawn_and_wait(START_TIMEOUT).await {
                Ok(()) => return Ok(server),
                // Another process grabbed the port between our probe and
                // redis' bind: pick another one.
                Err(Attempt::PortTaken(_)) if forced.is_none() && attempts < MAX_PORT_ATTEMPTS => {}
                Err(Attempt::PortTaken(e) | Attempt::Failed(e)) => return Err(e),
            }
        }
    }
}

/// Outcome of one failed spawn, telling whether another port may help.
enum Attempt {
    PortTaken(HarnessError),
    Failed(HarnessError),
}

impl<E: Into<HarnessError>> From<E> for Attempt {
    fn from(e: E) -> Self {
        Attempt::Failed(e.into())
    }
}

/// A `redis-server` process owned by the test, on 127.0.0.1 and a free port.
///
/// Dropping it kills the process (SIGKILL) and removes its directory.
#[derive(Debug)]
pub struct RedisServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    opts: RedisServerBuilder,
    child: Option<Child>,
}

impl RedisServer {
    /// Options for a server; finish with [`RedisServerBuilder::start`].
    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    /// Starts a server with default options (no persistence).
    pub async fn start() -> Result<RedisServer, HarnessError> {
        Self::builder().start().await
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://{HOST}:{}", self.port)
    }

    /// The TCP port; it stays the same across [`restart`](Self::restart)s.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The host the server listens on: `127.0.0.1`.
    pub fn host(&self) -> &str {
        HOST
    }

    /// The process id, or `None` when the server was killed or stopped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's own directory (data, AOF, log, socket).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The server's log file (inside [`dir`](Self::dir)).
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("redis.log")
    }

    /// The unix socket path when enabled with [`RedisServerBuilder::unix_socket`].
    pub fn unix_socket_path(&self) -> Option<PathBuf> {
        self.opts.unix_socket.then(|| self.dir.join("redis.sock"))
    }

    /// Whether the process is still alive (reaps it if it has exited).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(Ok(Some(_))) => {
                self.child = None;
                false
            }
            // Cannot tell; report it as alive so Drop still kills it.
            Some(Err(_)) => true,
            None => false,
        }
    }

    /// Kills the server with SIGKILL, like a crash, and waits for it to exit.
    /// Does nothing if it is not running.
    pub fn kill(&mut self) -> Result<(), HarnessError> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Stops the server gracefully with SIGTERM (Redis flushes its AOF) and
    /// waits up to 10 s for it to exit, then falls back to SIGKILL. Blocks the
    /// calling thread while waiting (normally a few milliseconds).
    pub fn stop(&mut self) -> Result<(), HarnessError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // std can only send SIGKILL and the crate forbids unsafe/libc, so the
        // `kill` command sends SIGTERM.
        let signalled = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if signalled {
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if child.try_wait()?.is_some() {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        tracing::warn!(pid = child.id(), signalled, "redis-server did not stop on SIGTERM, killing it");
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Starts the server again on the same port and directory, so an AOF is
    /// replayed, and waits until loading has finished. A running server is
    /// [`stop`](Self::stop)ped first.
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        self.stop()?;
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.spawn_and_wait(RESTART_TIMEOUT).await {
                Ok(()) => return Ok(()),
                // The port must stay the same; whoever holds it (typically a
                // bind probe of a parallel test) lets go quickly.
                Err(Attempt::PortTaken(_)) if attempts < MAX_RESTART_ATTEMPTS => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(Attempt::PortTaken(e) | Attempt::Failed(e)) => return Err(e),
            }
        }
    }

    /// The command line for the current port. Persistence is off unless asked
    /// for: tests must not leave dump files around or spend time saving.
    fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut opt = |key: &str, value: OsString| {
            let key = key.strip_prefix("--").unwrap_or(key);
            args.push(format!("--{key}").into());
            args.push(value);
        };
        opt("port", self.port.to_string().into());
        opt("bind", HOST.into());
        opt("daemonize", "no".into());
        opt("dir", self.dir.clone().into());
        opt("logfile", self.log_path().into());
        opt("save", "".into());
        if self.opts.aof_always {
            opt("appendonly", "yes".into());
            opt("appendfsync", "always".into());
        } else {
            opt("appendonly", "no".into());
        }
        if let Some(sock) = self.unix_socket_path() {
            opt("unixsocket", sock.into());
            opt("unixsocketperm", "700".into());
        }
        for (key, value) in &self.opts.extra_args {
            opt(key, value.into());
        }
        args
    }

    /// Spawns `redis-server` on `self.port` and waits until this very process
    /// answers `PING` with `PONG` (not `LOADING`).
    async fn spawn_and_wait(&mut self, timeout: Duration) -> Result<(), Attempt> {
        let log_path = self.log_path();
        // stdout/stderr go to the log too: config errors are printed there
        // before redis opens its logfile.
        let log = OpenOptions::new().create(true).append(true).open(&log_path)?;
        let log_start = log.metadata()?.len();
        let child = Command::new(&self.bin)
            .args(self.args())
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot run {}: {e}", self.bin.display())))?;
        let pid = child.id();
        self.child = Some(child);

        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.as_mut().map(Child::try_wait).transpose()?.flatten() {
                self.child = None;
                let err = self.start_failed(format!("redis-server exited with {status}"));
                let this_run = read_log_from(&log_path, log_start);
                return Err(if this_run.contains(ADDR_IN_USE) {
                    Attempt::PortTaken(err)
                } else {
                    Attempt::Failed(err)
                });
            }
            if probe(self.port).await == Some(pid) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill()?;
                return Err(Attempt::Failed(
                    self.start_failed(format!("not ready on port {} within {timeout:?}", self.port)),
                ));
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    fn start_failed(&self, reason: String) -> HarnessError {
        HarnessError::StartFailed { reason, log_tail: log_tail(&self.log_path()) }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; the process is gone either way
        // once the test process exits, and the dir is only temp space.
        let _ = self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A Redis for an integration test; see [`TestRedis::start`].
#[derive(Debug)]
pub struct TestRedis {
    url: String,
    backend: Backend,
}

/// Where a [`TestRedis`] runs; kept alive for as long as the `TestRedis`.
#[derive(Debug)]
enum Backend {
    External,
    Owned(RedisServer),
    /// Never read: held so the container lives as long as the `TestRedis`
    /// (dropping it removes the container).
    #[cfg(feature = "docker")]
    Docker {
        _container: Box<testcontainers::ContainerAsync<testcontainers_modules::redis::Redis>>,
    },
}

impl TestRedis {
    /// Gets a Redis for a test, in this order:
    ///
    /// 1. the server at `REDIS_URL` when that variable is set (nothing started;
    ///    share it safely via [`unique_namespace`]);
    /// 2. a [`RedisServer`] from `REDIS_SERVER_BIN` or `redis-server` on `PATH`;
    /// 3. with the `docker` feature, a `redis:7.2` container;
    /// 4. otherwise [`HarnessError::NoRedis`].
    pub async fn start() -> Result<TestRedis, HarnessError> {
        if let Some(url) = std::env::var("REDIS_URL").ok().filter(|url| !url.is_empty()) {
            return Ok(TestRedis { url, backend: Backend::External });
        }
        match RedisServer::start().await {
            Ok(server) => Ok(TestRedis { url: server.url(), backend: Backend::Owned(server) }),
            #[cfg(feature = "docker")]
            Err(HarnessError::NoRedis) => start_docker().await,
            Err(e) => Err(e),
        }
    }

    /// The URL to connect to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server process when this harness started one (not for `REDIS_URL`
    /// or Docker), e.g. to kill and restart it.
    pub fn owned_server(&self) -> Option<&RedisServer> {
        match &self.backend {
            Backend::Owned(server) => Some(server),
            _ => None,
        }
    }

    /// Mutable access to the owned server, see [`owned_server`](Self::owned_server).
    pub fn owned_server_mut(&mut self) -> Option<&mut RedisServer> {
        match &mut self.backend {
            Backend::Owned(server) => Some(server),
            _ => None,
        }
    }
}

/// Starts a Redis container. Without a Docker engine testcontainers fails at
/// once with a bare socket error, so the error says what to do instead.
#[cfg(feature = "docker")]
async fn start_docker() -> Result<TestRedis, HarnessError> {
    use testcontainers::runners::AsyncRunner;
    use testcontainers::ImageExt;
    use testcontainers_modules::redis::{Redis, REDIS_PORT};

    let docker_err = |e: testcontainers::TestcontainersError| {
        HarnessError::Docker(format!(
            "no redis-server on PATH, and starting a redis:{DOCKER_REDIS_TAG} container failed ({e}); is a Docker \
             engine running and its socket reachable? Otherwise install redis-server (apt-get install -y \
             redis-server), set REDIS_SERVER_BIN, or set REDIS_URL to an external server"
        ))
    };
    let container = Redis::default().with_tag(DOCKER_REDIS_TAG).start().await.map_err(docker_err)?;
    let host = container.get_host().await.map_err(docker_err)?;
    let port = container.get_host_port_ipv4(REDIS_PORT).await.map_err(docker_err)?;
    Ok(TestRedis {
        url: format!("redis://{host}:{port}"),
        backend: Backend::Docker { _container: Box::new(container) },
    })
}

/// A key prefix unique to one test, `t-<prefix>-<8 hex digits>`, so parallel
/// tests sharing a server never see each other's keys.
pub fn unique_namespace(prefix: &str) -> String {
    format!("t-{prefix}-{:08x}", rand::thread_rng().gen::<u32>())
}

/// Connects a fred [`Client`] to `url` (standalone Redis).
pub async fn connect(url: &str) -> Result<Client, HarnessError> {
    let client = Builder::from_config(Config::from_url(url)?).build()?;
    client.init().await?;
    Ok(client)
}

/// All keys named `<ns>:*` on the (standalone) server at `url`, via `SCAN`.
/// Names that are not UTF-8 are converted lossily.
pub async fn keys_in_namespace(url: &str, ns: &str) -> Result<Vec<String>, HarnessError> {
    let client = connect(url).await?;
    let pattern = format!("{}:*", escape_glob(ns));
    let mut keys = Vec::new();
    let mut cursor = String::from("0");
    let result = async {
        loop {
            let (next, page): (String, Vec<Bytes>) =
                client.scan_page(cursor.clone(), pattern.clone(), Some(1000), None).await?;
            keys.extend(page.iter().map(|key| String::from_utf8_lossy(key).into_owned()));
            if next == "0" {
                return Ok::<_, HarnessError>(());
            }
            cursor = next;
        }
    }
    .await;
    // Close the connection even when the scan failed.
    let _ = client.quit().await;
    result.map(|()| keys)
}

/// Escapes the glob characters of `MATCH` so a namespace matches literally.
fn escape_glob(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `REDIS_SERVER_BIN` if set, else `redis-server` on `PATH`.
fn find_redis_server() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("REDIS_SERVER_BIN").filter(|bin| !bin.is_empty()) {
        // Used as given, so a wrong path fails loudly when spawned.
        return Some(bin.into());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join("redis-server")).find(|bin| bin.is_file())
}

/// A fresh directory under the system temp dir, unique to this server.
fn make_temp_dir() -> io::Result<PathBuf> {
    loop {
        let dir = std::env::temp_dir().join(format!(
            "sluicegate-redis-{}-{:016x}",
            std::process::id(),
            rand::thread_rng().gen::<u64>()
        ));
        // create_dir (not _all) fails on an existing dir, so it is ours alone.
        match fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// A random port in [`PORT_RANGE`] that can be bound right now, along with its
/// cluster bus port. We pick it ourselves rather than binding port 0 because
/// the OS hands out ports from the ephemeral range, which may exceed 55535
/// and is shared with outgoing connections. Someone may still take the port
/// before redis binds it; callers retry with another port then.
fn free_port() -> io::Result<u16> {
    let mut rng = rand::thread_rng();
    for _ in 0..100 {
        let port = rng.gen_range(PORT_RANGE);
        let bindable = |p: u16| TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_ok();
        if bindable(port) && bindable(port + CLUSTER_BUS_OFFSET) {
            return Ok(port);
        }
    }
    Err(io::Error::new(io::ErrorKind::AddrInUse, format!("no free port found in {PORT_RANGE:?}")))
}

/// Asks whoever listens on `port` for `PING` and its process id. Returns the
/// pid only if it answered `PONG`, i.e. it accepts commands (a server still
/// replaying its AOF answers `-LOADING`). Checking the pid guards against
/// talking to another test's server that got the port when ours could not.
async fn probe(port: u16) -> Option<u32> {
    let exchange = async {
        let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
        stream.write_all(b"PING\r\nINFO server\r\n").await?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).await?;
        if line.trim_end() != "+PONG" {
            return Ok(None);
        }
        line.clear();
        reader.read_line(&mut line).await?;
        // INFO replies with a bulk string: `$<len>\r\n<body>\r\n`.
        let Some(len) = line.trim_end().strip_prefix('$').and_then(|n| n.parse::<usize>().ok()) else {
            return Ok(None);
        };
        let mut body = vec![0; len];
        reader.read_exact(&mut body).await?;
        let pid = String::from_utf8_lossy(&body)
            .lines()
            .find_map(|l| l.strip_prefix("process_id:").and_then(|p| p.trim().parse().ok()));
        Ok::<_, io::Error>(pid)
    };
    match tokio::time::timeout(Duration::from_secs(1), exchange).await {
        Ok(Ok(pid)) => pid,
        _ => None,
    }
}

/// The log written since byte `offset`, i.e. by the latest run.
fn read_log_from(path: &Path, offset: u64) -> String {
    let mut buf = Vec::new();
    let read = fs::File::open(path).and_then(|mut f| {
        f.seek(SeekFrom::Start(offset))?;
        f.read_to_end(&mut buf)
    });
    match read {
        Ok(_) => String::from_utf8_lossy(&buf).into_owned(),
        Err(_) => String::new(),
    }
}

/// The last [`LOG_TAIL_LINES`] lines of the log, or why it cannot be read.
fn log_tail(path: &Path) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fred::prelude::ClientLike;

    /// PING through fred, proving the URL works for a real client too.
    async fn ping(url: &str) -> Result<String, HarnessError> {
        let client = connect(url).await?;
        let pong: String = client.ping(None).await?;
        client.quit().await?;
        Ok(pong)
    }

    #[tokio::test]
    async fn start_ping_kill() -> Result<(), HarnessError> {
        let mut server = RedisServer::start().await?;
        assert!(server.is_running());
        assert!(server.port() < 55_535);
        assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
        assert_eq!(ping(&server.url()).await?, "PONG");
        assert!(server.log_path().is_file());

        server.kill()?;
        assert!(!server.is_running());
        assert_eq!(server.pid(), None);
        assert!(ping(&server.url()).await.is_err());

        let dir = server.dir().to_path_buf();
        drop(server);
        assert!(!dir.exists(), "drop removes the temp dir");
        Ok(())
    }

    #[tokio::test]
    async fn aof_write_survives_kill_9() -> Result<(), HarnessError> {
        let mut server = RedisServer::builder().aof_always(true).start().await?;
        let port = server.port();
        let client = connect(&server.url()).await?;
        let () = client.set("survivor", "still here", None, None, false).await?;
        client.quit().await?;

        server.kill()?;
        server.restart().await?;
        assert_eq!(server.port(), port, "restart keeps the port");

        let client = connect(&server.url()).await?;
        let value: Option<String> = client.get("survivor").await?;
        client.quit().await?;
        assert_eq!(value.as_deref(), Some("still here"));
        Ok(())
    }

    #[tokio::test]
    async fn stop_then_restart_without_aof_loses_data() -> Result<(), HarnessError> {
        let mut server = RedisServer::start().await?;
        let client = connect(&server.url()).await?;
        let () = client.set("gone", "soon", None, None, false).await?;
        client.quit().await?;

        server.stop()?;
        assert!(!server.is_running());
        server.restart().await?;
        assert!(server.is_running());

        let client = connect(&server.url()).await?;
        let value: Option<String> = client.get("gone").await?;
        client.quit().await?;
        assert_eq!(value, None, "persistence is off by default");
        Ok(())
    }

    #[tokio::test]
    async fn concurrent_servers_get_different_ports() -> Result<(), HarnessError> {
        let (a, b) = tokio::join!(RedisServer::start(), RedisServer::start());
        let (a, b) = (a?, b?);
        assert_ne!(a.port(), b.port());
        assert_ne!(a.dir(), b.dir());
        assert_eq!(ping(&a.url()).await?, "PONG");
        assert_eq!(ping(&b.url()).await?, "PONG");
        Ok(())
    }

    #[tokio::test]
    async fn forced_port_in_use_fails_with_log_tail() -> Result<(), HarnessError> {
        let first = RedisServer::start().await?;
        let second = RedisServer::builder().port(first.port()).start().await;
        match second {
            Err(HarnessError::StartFailed { log_tail, .. }) => {
                assert!(log_tail.contains(ADDR_IN_USE), "log tail: {log_tail}");
            }
            other => panic!("expected StartFailed, got {other:?}"),
        }
        Ok(())
    }

    #[tokio::test]
    async fn unix_socket_and_extra_arg() -> Result<(), HarnessError> {
        let server = RedisServer::builder().unix_socket(true).extra_arg("databases", "4").start().await?;
        let sock = server.unix_socket_path().ok_or(HarnessError::NoRedis)?;
        let mut stream = tokio::net::UnixStream::connect(&sock).await?;
        stream.write_all(b"CONFIG GET databases\r\n").await?;
        let mut reply = vec![0; 64];
        let n = stream.read(&mut reply).await?;
        let reply = String::from_utf8_lossy(&reply[..n]);
        assert!(reply.contains("databases") && reply.contains("\r\n4\r\n"), "reply: {reply:?}");
        Ok(())
    }

    #[tokio::test]
    async fn namespaces_isolate_keys() -> Result<(), HarnessError> {
        let redis = TestRedis::start().await?;
        let ns = unique_namespace("scan");
        assert!(ns.starts_with("t-scan-") && ns.len() == "t-scan-".len() + 8, "{ns}");
        let other = unique_namespace("scan");
        assert_ne!(ns, other);

        let client = connect(redis.url()).await?;
        for i in 0..2500 {
            let () = client.set(format!("{ns}:k{i}"), i, None, None, false).await?;
        }
        let () = client.set(format!("{other}:k"), 1, None, None, false).await?;
        let mut keys = keys_in_namespace(redis.url(), &ns).await?;
        keys.sort();
        assert_eq!(keys.len(), 2500);
        assert!(keys.iter().all(|k| k.starts_with(&format!("{ns}:"))));
        assert_eq!(keys_in_namespace(redis.url(), &other).await?, vec![format!("{other}:k")]);
        // Unescaped, `<ns minus 2 chars>*` would match all of ns's keys.
        let glob = format!("{}*", &ns[..ns.len() - 2]);
        assert!(keys_in_namespace(redis.url(), &glob).await?.is_empty(), "globs are escaped");

        // Leave a shared REDIS_URL server clean.
        keys.push(format!("{other}:k"));
        let _: i64 = client.del(keys).await?;
        assert!(keys_in_namespace(redis.url(), &ns).await?.is_empty());
        client.quit().await?;
        Ok(())
    }

    #[test]
    fn escape_glob_escapes_specials() {
        assert_eq!(escape_glob("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
