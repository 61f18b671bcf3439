//! Throwaway Redis servers for tests and benchmarks.
//!
//! What is offered:
//!
//! * [`RedisServer`] runs its own `redis-server` process on a free port of
//!   127.0.0.1, in its own temporary directory, and can kill, stop and restart
//!   it (on the same port and directory, so an AOF is replayed). Use it when a
//!   test needs to crash the server.
//! * [`TestRedis`] is what an ordinary integration test asks for: the server
//!   named by `REDIS_URL` if set, else a [`RedisServer`], else (with the
//!   `docker` feature) a Redis container, else [`HarnessError::NoRedis`]
//!   explaining how to get one.
//! * [`RedisCluster`] is a Redis Cluster made of such servers (3 masters by
//!   default, optionally with replicas), or the external cluster named by
//!   `REDIS_CLUSTER_URLS`; any node can be killed and restarted.
//! * [`TestBackend`] picks either by [`Topology`] (`Single` or `Cluster`), so
//!   one test body can run against both; [`Topology::from_env`] reads
//!   `SLUICEGATE_TEST_TOPOLOGY` for a CI matrix.
//!
//! * A [`RedisCluster`] can also change its topology under load: a graceful
//!   [`failover`](RedisCluster::failover) to a replica, waiting for a killed
//!   master's replica to be promoted
//!   ([`wait_for_promotion`](RedisCluster::wait_for_promotion)), and moving a
//!   slot to another master step by step
//!   ([`begin_slot_migration`](RedisCluster::begin_slot_migration), then
//!   [`SlotMigration`]) or at once ([`move_slot`](RedisCluster::move_slot)).
//!
//! Tests that share one external server should put their keys under
//! [`unique_namespace`] and can inspect them with [`keys_in_namespace`]
//! (which scans every master when given a `redis-cluster://` URL);
//! [`command_calls`] reads a node's `INFO commandstats`, [`error_counts`] its
//! `INFO errorstats` (which redirections it sent).
//!
//! The process control here (`kill -TERM`, unix sockets) assumes a Unix host.
//!
//! ```no_run
//! # async fn demo() -> Result<(), sluicegate_testkit::HarnessError> {
//! use sluicegate_testkit::{RedisServer, TestRedis};
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

pub mod proxy;
pub mod tls;

/// Writes a test suite once and runs it on both topologies.
///
/// `per_topology!(include!("suites/core.rs"););` in a test crate's root puts the suite's tests
/// in a module `single` (one redis-server) and a module `cluster` (a 3-master Redis Cluster) of
/// the same test binary, so `cargo test --test integration core::cluster::` runs one of them. Inside, the
/// constant `TOPOLOGY` names the module's [`Topology`]; pass it to [`TestBackend::start`]. The
/// suite sees its parent's items (`use super::*`), so helper modules declared beside the macro
/// are reachable as `crate::support::...`.
#[macro_export]
macro_rules! per_topology {
    (@on $module:ident, $topology:ident, $($suite:tt)*) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            #[allow(dead_code)]
            const TOPOLOGY: $crate::Topology = $crate::Topology::$topology;

            $($suite)*
        }
    };
    ($($suite:tt)*) => {
        $crate::per_topology!(@on single, Single, $($suite)*);
        $crate::per_topology!(@on cluster, Cluster, $($suite)*);
    };
}

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::{Builder, Client, ClientLike, ClusterInterface, Config, KeysInterface, Value};
use fred::types::{ClusterHash, CustomCommand, InfoKind, Key};
use futures::TryStreamExt;
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
/// Ports we pick from. With their cluster bus ports (+10000) below the Linux
/// ephemeral range (32768+), so that neither an outgoing connection nor a
/// listener on port 0 (another suite's server, which takes no lock of
/// [`lock_port`]) holds a bus port while its node is down between a kill and a
/// restart.
const PORT_RANGE: std::ops::Range<u16> = 10_000..22_768;
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
/// `--cluster-node-timeout` of every [`RedisCluster`] node: short, so a
/// killed master is failed over (or marked down) within seconds.
const CLUSTER_NODE_TIMEOUT_MS: u64 = 2_000;
/// Masters of a [`RedisCluster`] unless the builder says otherwise.
const DEFAULT_MASTERS: usize = 3;
/// Hash slots of a Redis Cluster.
const CLUSTER_SLOTS: u32 = 16_384;
/// How long `redis-cli --cluster create`, and then the wait for every node to
/// agree the cluster is ok, may each take.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between cluster readiness probes.
const CLUSTER_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Names an external cluster instead of local processes.
const CLUSTER_URLS_ENV: &str = "REDIS_CLUSTER_URLS";
/// Selects the [`Topology`] in [`Topology::from_env`].
const TOPOLOGY_ENV: &str = "SLUICEGATE_TEST_TOPOLOGY";
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
         REDIS_URL to an external server, or build with --features sluicegate-testkit/docker where Docker runs"
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
    /// A [`RedisCluster`] did not form or did not become healthy in time.
    #[error("redis cluster failed: {reason}\n{details}")]
    ClusterFailed {
        /// What went wrong.
        reason: String,
        /// The node that was not ready, `redis-cli` output, node log tails.
        details: String,
    },
    /// A harness setting (builder option, environment variable) is invalid.
    #[error("invalid test harness setting: {0}")]
    Config(String),
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
    /// Started as a node of a [`RedisCluster`] (set only by the cluster builder).
    cluster_node: bool,
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
        let mut server = RedisServer { bin, dir, port: 0, reserved: false, opts: self, child: None };
        let forced = server.opts.port;
        let mut attempts = 0;
        loop {
            attempts += 1;
            server.port = match forced {
                Some(port) => port,
                None => {
                    server.release_port();
                    let port = free_port()?;
                    server.reserved = true;
                    port
                }
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
    /// Whether `port` (and its bus port) is in [`RESERVED_PORTS`] on our behalf.
    reserved: bool,
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
        if self.opts.cluster_node {
            opt("cluster-enabled", "yes".into());
            opt("cluster-config-file", self.dir.join("nodes.conf").into());
            opt("cluster-node-timeout", CLUSTER_NODE_TIMEOUT_MS.to_string().into());
            // Replicas sync at once instead of after the default 5 s wait for
            // more replicas to share the transfer.
            opt("repl-diskless-sync-delay", "0".into());
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

    /// Gives our port back to [`free_port`] (after the process is gone).
    fn release_port(&mut self) {
        if std::mem::take(&mut self.reserved) {
            release_port(self.port);
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; the process is gone either way
        // once the test process exits, and the dir is only temp space.
        let _ = self.kill();
        self.release_port();
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

/// Options for a [`RedisCluster`]; get one from [`RedisCluster::builder`].
#[derive(Debug, Clone)]
pub struct RedisClusterBuilder {
    masters: usize,
    replicas: usize,
    node: RedisServerBuilder,
}

impl Default for RedisClusterBuilder {
    fn default() -> Self {
        Self {
            masters: DEFAULT_MASTERS,
            replicas: 0,
            node: RedisServerBuilder { cluster_node: true, ..RedisServerBuilder::default() },
        }
    }
}

impl RedisClusterBuilder {
    /// Number of masters (default 3, the least `redis-cli --cluster create` accepts).
    pub fn masters(mut self, n: usize) -> Self {
        self.masters = n;
        self
    }

    /// Replicas per master (default 0). Replicas make failover possible: a
    /// killed master is replaced by its replica after the node timeout (2 s).
    pub fn replicas_per_master(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }

    /// AOF with `appendfsync always` on every node, see
    /// [`RedisServerBuilder::aof_always`] (default off).
    pub fn aof_always(mut self, on: bool) -> Self {
        self.node = self.node.aof_always(on);
        self
    }

    /// Adds `--key value` to every node's command line, after the cluster
    /// options, so e.g. `extra_arg("cluster-node-timeout", "5000")` overrides
    /// the default 2000 ms.
    pub fn extra_arg(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.node = self.node.extra_arg(key, value);
        self
    }

    /// Starts `masters × (1 + replicas)` nodes on free ports (always local
    /// processes; [`RedisCluster::start`] honours `REDIS_CLUSTER_URLS`), joins
    /// them with `redis-cli --cluster create`, and waits until every node
    /// reports `cluster_state:ok` with all 16384 slots assigned and every
    /// replica in sync.
    pub async fn start(self) -> Result<RedisCluster, HarnessError> {
        if self.masters < 3 {
            return Err(HarnessError::Config(format!(
                "a cluster needs at least 3 masters, {} asked for",
                self.masters
            )));
        }
        let total = self.masters * (1 + self.replicas);
        let starts = (0..total).map(|_| self.node.clone().start());
        // Dropping `nodes` (also on error) kills every node.
        let nodes = futures::future::try_join_all(starts).await?;
        let addrs: Vec<(String, u16)> = nodes.iter().map(|n| (HOST.to_owned(), n.port())).collect();
        let cluster =
            RedisCluster { addrs, nodes, expected: Some(Expected { nodes: total, masters: self.masters }) };
        cluster.create(self.replicas).await?;
        cluster.wait_until_ok(CLUSTER_TIMEOUT).await?;
        Ok(cluster)
    }
}

/// Node and master counts a cluster we built must reach before it is ready.
#[derive(Debug, Clone, Copy)]
struct Expected {
    nodes: usize,
    masters: usize,
}

/// A Redis Cluster for tests: local `redis-server` processes started by
/// [`RedisCluster::builder`], or an external cluster named by
/// `REDIS_CLUSTER_URLS` (see [`RedisCluster::start`]).
///
/// Every node runs on 127.0.0.1 with `--cluster-enabled yes`, its own
/// directory and `nodes.conf`, `--cluster-node-timeout 2000` and persistence
/// off (unless [`RedisClusterBuilder::aof_always`]). Dropping it kills every
/// node and removes their directories.
///
/// ```no_run
/// # async fn demo() -> Result<(), sluicegate_testkit::HarnessError> {
/// use sluicegate_testkit::RedisCluster;
///
/// let mut cluster = RedisCluster::builder().replicas_per_master(1).start().await?;
/// let config = sluicegate::Config::new(cluster.url()); // redis-cluster://127.0.0.1:p1?node=...
/// let masters = cluster.masters().await?; // redis:// URLs of the current masters
/// let i = cluster.urls().iter().position(|u| *u == masters[0]).expect("a node of ours");
/// let node = cluster.node_mut(i).expect("a local cluster");
/// node.kill()?; // its replica takes over after the node timeout
/// node.restart().await?; // same port and nodes.conf: it rejoins (as a replica now)
/// cluster.wait_until_ok(std::time::Duration::from_secs(30)).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct RedisCluster {
    /// Every node's address, in the order of [`nodes`](Self::node_mut).
    addrs: Vec<(String, u16)>,
    /// The processes, index-aligned with `addrs`; empty for an external cluster.
    nodes: Vec<RedisServer>,
    /// `None` for an external cluster, whose shape we do not know.
    expected: Option<Expected>,
}

impl RedisCluster {
    /// Options for a local cluster; finish with [`RedisClusterBuilder::start`].
    pub fn builder() -> RedisClusterBuilder {
        RedisClusterBuilder::default()
    }

    /// The cluster at `REDIS_CLUSTER_URLS` (comma-separated `host:port`, a
    /// `redis://` prefix is allowed; nothing is started, share it via
    /// [`unique_namespace`]) when that variable is set, else a local 3-master
    /// cluster without replicas.
    pub async fn start() -> Result<RedisCluster, HarnessError> {
        match std::env::var(CLUSTER_URLS_ENV).ok().filter(|v| !v.trim().is_empty()) {
            Some(list) => Self::external(&list).await,
            None => Self::builder().start().await,
        }
    }

    /// An existing cluster given as a comma-separated `host:port` list (any
    /// subset of its nodes), once every listed node reports `cluster_state:ok`.
    pub async fn external(list: &str) -> Result<RedisCluster, HarnessError> {
        let addrs = parse_host_ports(list)?;
        let cluster = RedisCluster { addrs, nodes: Vec::new(), expected: None };
        cluster.wait_until_ok(CLUSTER_TIMEOUT).await?;
        Ok(cluster)
    }

    /// Whether this is an external cluster (no processes to control).
    pub fn is_external(&self) -> bool {
        self.nodes.is_empty()
    }

    /// `redis://host:port` of every node (masters and replicas as created, or
    /// as listed for an external cluster), index-aligned with
    /// [`node_mut`](Self::node_mut).
    pub fn urls(&self) -> Vec<String> {
        self.addrs.iter().map(|(host, port)| format!("redis://{host}:{port}")).collect()
    }

    /// `redis-cluster://h1:p1?node=h2:p2&node=...` naming every node, as
    /// sluicegate's `Config` and fred's `Config::from_url` take it.
    pub fn url(&self) -> String {
        let mut addrs = self.addrs.iter().map(|(host, port)| format!("{host}:{port}"));
        let mut url = format!("redis-cluster://{}", addrs.next().unwrap_or_default());
        for (i, addr) in addrs.enumerate() {
            url.push(if i == 0 { '?' } else { '&' });
            url.push_str("node=");
            url.push_str(&addr);
        }
        url
    }

    /// Node `i` (see [`urls`](Self::urls)) of a local cluster; `None` for an
    /// external cluster or an index out of range.
    pub fn node(&self, i: usize) -> Option<&RedisServer> {
        self.nodes.get(i)
    }

    /// Mutable node `i`, to [`kill`](RedisServer::kill),
    /// [`stop`](RedisServer::stop) or [`restart`](RedisServer::restart) it. A
    /// restart reuses the port and directory, so the node reads its
    /// `nodes.conf` and rejoins; follow it with
    /// [`wait_until_ok`](Self::wait_until_ok).
    pub fn node_mut(&mut self, i: usize) -> Option<&mut RedisServer> {
        self.nodes.get_mut(i)
    }

    /// `redis://host:port` of the current masters that serve slots, sorted,
    /// as one reachable node's `CLUSTER NODES` sees them (this changes after
    /// a failover).
    pub async fn masters(&self) -> Result<Vec<String>, HarnessError> {
        let mut last_err = None;
        for (host, port) in self.live_addrs() {
            match raw_command(&host, port, &["CLUSTER", "NODES"]).await {
                Ok(Ok(text)) => return Ok(parse_masters(&text)),
                Ok(Err(e)) => last_err = Some(format!("{host}:{port}: {e}")),
                Err(e) => last_err = Some(format!("{host}:{port}: {e}")),
            }
        }
        Err(HarnessError::ClusterFailed {
            reason: "no node answered CLUSTER NODES".into(),
            details: last_err.unwrap_or_default(),
        })
    }

    /// Waits until every running node reports `cluster_state:ok` with all
    /// 16384 slots assigned and ok, knows every node and sees every master
    /// (for clusters built here), and every replica's link to its master is
    /// up and synced.
    pub async fn wait_until_ok(&self, timeout: Duration) -> Result<(), HarnessError> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut not_ready = None;
            for (host, port) in self.live_addrs() {
                if let Err(why) = node_ready(&host, port, self.expected).await {
                    not_ready = Some(format!("{host}:{port}: {why}"));
                    break;
                }
            }
            let Some(why) = not_ready else { return Ok(()) };
            if Instant::now() >= deadline {
                return Err(HarnessError::ClusterFailed {
                    reason: format!("not ready within {timeout:?}"),
                    details: format!("{why}\n{}", self.log_tails()),
                });
            }
            tokio::time::sleep(CLUSTER_POLL_INTERVAL).await;
        }
    }

    /// Joins the fresh nodes with `redis-cli --cluster create`.
    async fn create(&self, replicas: usize) -> Result<(), HarnessError> {
        let cli = find_redis_cli().ok_or(HarnessError::NoRedis)?;
        let mut cmd = tokio::process::Command::new(&cli);
        cmd.arg("--cluster").arg("create");
        cmd.args(self.addrs.iter().map(|(host, port)| format!("{host}:{port}")));
        cmd.arg("--cluster-replicas").arg(replicas.to_string()).arg("--cluster-yes");
        cmd.stdin(Stdio::null()).kill_on_drop(true);
        let failed = |reason: String, details: String| HarnessError::ClusterFailed { reason, details };
        let output = match tokio::time::timeout(CLUSTER_TIMEOUT, cmd.output()).await {
            Ok(Ok(output)) => output,
            Ok(Err(e)) => return Err(failed(format!("cannot run {}: {e}", cli.display()), String::new())),
            Err(_) => {
                return Err(failed(
                    format!("redis-cli --cluster create took over {CLUSTER_TIMEOUT:?}"),
                    self.log_tails(),
                ))
            }
        };
        if !output.status.success() {
            return Err(failed(
                format!("redis-cli --cluster create exited with {}", output.status),
                format!(
                    "{}{}\n{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr),
                    self.log_tails()
                ),
            ));
        }
        Ok(())
    }

    /// Addresses of the nodes that should be up: all of an external cluster,
    /// the running ones of a local cluster.
    fn live_addrs(&self) -> Vec<(String, u16)> {
        if self.nodes.is_empty() {
            return self.addrs.clone();
        }
        self.nodes.iter().filter(|n| n.pid().is_some()).map(|n| (HOST.to_owned(), n.port())).collect()
    }

    /// The end of every local node's log, for errors.
    fn log_tails(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("--- redis log of node {} ---\n{}", n.port(), log_tail(&n.log_path())))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Topology changes: failovers and slot migrations, for tests that change a
/// cluster under load. Slot ownership spreads by gossip, so each change waits
/// until every running node agrees on it and reports the cluster ok.
impl RedisCluster {
    /// The index (see [`urls`](Self::urls)) of the node at `url`
    /// (`redis://host:port`), `None` if it is not one of ours.
    pub fn node_index(&self, url: &str) -> Option<usize> {
        let (host, port) = url_host_port(url).ok()?;
        self.addrs.iter().position(|(h, p)| *h == host && *p == port)
    }

    /// `redis://host:port` of the master serving `slot`, as the first running
    /// node that answers `CLUSTER NODES` sees it. Right after a change nodes
    /// may disagree; [`wait_for_slot_owner`](Self::wait_for_slot_owner) waits
    /// until all agree.
    pub async fn master_of_slot(&self, slot: u16) -> Result<String, HarnessError> {
        let nodes = self.any_cluster_nodes().await?;
        slot_owner(&nodes, slot).map(|n| n.url.clone()).ok_or_else(|| HarnessError::ClusterFailed {
            reason: format!("no healthy master serves slot {slot}"),
            details: nodes_summary(&nodes),
        })
    }

    /// `redis://host:port` of the healthy replicas of the master at `master`,
    /// sorted, as the first running node that answers sees them.
    pub async fn replicas_of(&self, master: &str) -> Result<Vec<String>, HarnessError> {
        let nodes = self.any_cluster_nodes().await?;
        let Some(id) = nodes.iter().find(|n| n.url == master).map(|n| n.id.clone()) else {
            return Err(HarnessError::ClusterFailed {
                reason: format!("{master} is not a node of this cluster"),
                details: nodes_summary(&nodes),
            });
        };
        let mut replicas: Vec<String> = nodes
            .iter()
            .filter(|n| n.healthy() && n.flags.iter().any(|f| f == "slave") && n.master_id == id)
            .map(|n| n.url.clone())
            .collect();
        replicas.sort();
        Ok(replicas)
    }

    /// A graceful manual failover of the master at `master`: `CLUSTER
    /// FAILOVER` (no option) is sent to its first replica, which waits until
    /// it has every write the master acknowledged (the master pauses its
    /// writers meanwhile) and then takes over; the old master becomes its
    /// replica. Waits until every running node agrees and the cluster is ok,
    /// and returns the new master's `redis://host:port`.
    pub async fn failover(&self, master: &str, timeout: Duration) -> Result<String, HarnessError> {
        let deadline = Instant::now() + timeout;
        let nodes = self.any_cluster_nodes().await?;
        let slot = nodes.iter().find(|n| n.url == master).and_then(|n| n.slots.first()).map(|r| r.0);
        let Some(slot) = slot else {
            return Err(HarnessError::ClusterFailed {
                reason: format!("{master} is not a master serving slots"),
                details: nodes_summary(&nodes),
            });
        };
        let Some(replica) = self.replicas_of(master).await?.into_iter().next() else {
            return Err(HarnessError::Config(format!(
                "{master} has no healthy replica to fail over to (RedisClusterBuilder::replicas_per_master)"
            )));
        };
        let (host, port) = url_host_port(&replica)?;
        ok_reply(&host, port, &["CLUSTER", "FAILOVER"]).await?;
        self.wait_for_slot_owner(slot, &replica, deadline.saturating_duration_since(Instant::now())).await?;
        Ok(replica)
    }

    /// Waits until every running node says the master at `owner` serves
    /// `slot`, and then until the cluster is ok
    /// ([`wait_until_ok`](Self::wait_until_ok)), all within `timeout`.
    pub async fn wait_for_slot_owner(
        &self,
        slot: u16,
        owner: &str,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let deadline = Instant::now() + timeout;
        self.wait_for_agreed_owner(slot, deadline, |o| o == owner, &format!("{owner} to serve slot {slot}"))
            .await?;
        self.wait_until_ok(deadline.saturating_duration_since(Instant::now())).await
    }

    /// After the master at `old` was killed: waits until every running node
    /// agrees that another master (its promoted replica) serves `slot`, and
    /// the cluster is ok, all within `timeout`. Returns the new master's
    /// `redis://host:port`. Promotion takes the node timeout (2 s) plus an
    /// election.
    pub async fn wait_for_promotion(
        &self,
        slot: u16,
        old: &str,
        timeout: Duration,
    ) -> Result<String, HarnessError> {
        let deadline = Instant::now() + timeout;
        let what = format!("a master other than {old} to serve slot {slot}");
        let new = self.wait_for_agreed_owner(slot, deadline, |o| o != old, &what).await?;
        self.wait_until_ok(deadline.saturating_duration_since(Instant::now())).await?;
        Ok(new)
    }

    /// Starts moving `slot` from the master serving it to the master at `to`,
    /// the way `redis-cli --cluster reshard` does: `CLUSTER SETSLOT <slot>
    /// IMPORTING` on `to`, then `MIGRATING` on the owner. Until
    /// [`SlotMigration::finish`], the owner still serves the keys it holds and
    /// answers `-ASK` for the keys it does not; a command naming several keys
    /// of the slot of which some are missing gets `-TRYAGAIN`, on either node.
    pub async fn begin_slot_migration(&self, slot: u16, to: &str) -> Result<SlotMigration, HarnessError> {
        let from = self.master_of_slot(slot).await?;
        if from == to {
            return Err(HarnessError::Config(format!("slot {slot} is served by {to} already")));
        }
        let source = url_host_port(&from)?;
        let target = url_host_port(to)?;
        let source_id = ok_reply(&source.0, source.1, &["CLUSTER", "MYID"]).await?;
        let target_id = ok_reply(&target.0, target.1, &["CLUSTER", "MYID"]).await?;
        let slot_arg = slot.to_string();
        ok_reply(&target.0, target.1, &["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &source_id]).await?;
        ok_reply(&source.0, source.1, &["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &target_id]).await?;
        Ok(SlotMigration { slot, source, target, target_id })
    }

    /// Moves `slot` to the master at `to` in one go:
    /// [`begin_slot_migration`](Self::begin_slot_migration), then
    /// [`SlotMigration::finish`].
    pub async fn move_slot(&self, slot: u16, to: &str, timeout: Duration) -> Result<(), HarnessError> {
        self.begin_slot_migration(slot, to).await?.finish(self, timeout).await
    }

    /// Every healthy node's `CLUSTER NODES` lines, from the first running
    /// node that answers.
    async fn any_cluster_nodes(&self) -> Result<Vec<NodeLine>, HarnessError> {
        let mut last_err = String::new();
        for (host, port) in self.live_addrs() {
            match raw_command(&host, port, &["CLUSTER", "NODES"]).await {
                Ok(Ok(text)) => return Ok(parse_node_lines(&text)),
                Ok(Err(e)) => last_err = format!("{host}:{port}: {e}"),
                Err(e) => last_err = format!("{host}:{port}: {e}"),
            }
        }
        Err(HarnessError::ClusterFailed {
            reason: "no node answered CLUSTER NODES".into(),
            details: last_err,
        })
    }

    /// Polls every running node's `CLUSTER NODES` until all name the same
    /// healthy master for `slot` and `accept` takes it; returns it.
    async fn wait_for_agreed_owner(
        &self,
        slot: u16,
        deadline: Instant,
        accept: impl Fn(&str) -> bool,
        what: &str,
    ) -> Result<String, HarnessError> {
        loop {
            let mut owners = BTreeSet::new();
            let mut why = String::new();
            for (host, port) in self.live_addrs() {
                match raw_command(&host, port, &["CLUSTER", "NODES"]).await {
                    Ok(Ok(text)) => {
                        let nodes = parse_node_lines(&text);
                        let owner = slot_owner(&nodes, slot).map(|n| n.url.clone());
                        if owner.is_none() {
                            why = format!("{host}:{port} sees no healthy owner:\n{}", nodes_summary(&nodes));
                        }
                        owners.insert(owner);
                    }
                    Ok(Err(e)) => why = format!("{host}:{port}: {e}"),
                    Err(e) => why = format!("{host}:{port}: {e}"),
                }
            }
            if let (1, Some(Some(owner))) = (owners.len(), owners.first()) {
                if accept(owner) && why.is_empty() {
                    return Ok(owner.clone());
                }
            }
            if Instant::now() >= deadline {
                return Err(HarnessError::ClusterFailed {
                    reason: format!("timed out waiting for {what}; the nodes name {owners:?}"),
                    details: format!("{why}\n{}", self.log_tails()),
                });
            }
            tokio::time::sleep(CLUSTER_POLL_INTERVAL).await;
        }
    }
}

/// A slot on its way from one master to another; see
/// [`RedisCluster::begin_slot_migration`].
#[derive(Debug)]
pub struct SlotMigration {
    slot: u16,
    source: (String, u16),
    target: (String, u16),
    target_id: String,
}

impl SlotMigration {
    /// The slot being moved.
    pub fn slot(&self) -> u16 {
        self.slot
    }

    /// `redis://host:port` of the master the slot is leaving.
    pub fn source(&self) -> String {
        format!("redis://{}:{}", self.source.0, self.source.1)
    }

    /// `redis://host:port` of the master the slot is moving to.
    pub fn target(&self) -> String {
        format!("redis://{}:{}", self.target.0, self.target.1)
    }

    /// Moves up to `max` of the slot's keys still on the source to the target
    /// with one `MIGRATE ... KEYS` (atomic per call: each key is either on
    /// the source or on the target). Returns how many it moved: 0 once the
    /// source holds none.
    pub async fn migrate_keys(&self, max: usize) -> Result<usize, HarnessError> {
        let client = connect(&self.source()).await?;
        let moved = async {
            let keys: Vec<Bytes> = client.cluster_get_keys_in_slot(self.slot, max as u64).await?;
            self.migrate_with(&client, keys).await
        }
        .await;
        let _ = client.quit().await;
        moved
    }

    /// Moves the named keys (of this slot) that are still on the source to
    /// the target with one `MIGRATE ... KEYS`, e.g. to split a group of keys
    /// that scripts use together. Returns how many were on the source.
    pub async fn migrate(&self, keys: &[&str]) -> Result<usize, HarnessError> {
        let client = connect(&self.source()).await?;
        let moved = async {
            let present: i64 = client.exists(keys.to_vec()).await?;
            let keys = keys.iter().map(|k| Bytes::copy_from_slice(k.as_bytes())).collect();
            self.migrate_with(&client, keys).await?;
            Ok::<_, HarnessError>(usize::try_from(present).unwrap_or(0))
        }
        .await;
        let _ = client.quit().await;
        moved
    }

    /// `MIGRATE host port "" 0 5000 KEYS ...` on the source; keys it does
    /// not hold are skipped (it answers `NOKEY` when it holds none).
    async fn migrate_with(&self, client: &Client, keys: Vec<Bytes>) -> Result<usize, HarnessError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let n = keys.len();
        let mut args: Vec<Value> = vec![
            self.target.0.as_str().into(),
            i64::from(self.target.1).into(),
            "".into(),
            0.into(),
            5_000.into(),
            "KEYS".into(),
        ];
        args.extend(keys.into_iter().map(Value::Bytes));
        let migrate = CustomCommand::new_static("MIGRATE", ClusterHash::Random, false);
        let _: Value = client.custom(migrate, args).await?;
        Ok(n)
    }

    /// Moves every key left on the source, then assigns the slot to the
    /// target with `CLUSTER SETSLOT <slot> NODE` on the target, the source and
    /// every other master (the order `redis-cli` uses), and waits until every
    /// running node agrees and the cluster is ok, all within `timeout`.
    /// Clients then get `-MOVED` for the slot from the source, and clients
    /// blocked there on one of its keys are unblocked with `-MOVED` too.
    pub async fn finish(self, cluster: &RedisCluster, timeout: Duration) -> Result<(), HarnessError> {
        let deadline = Instant::now() + timeout;
        let slot_arg = self.slot.to_string();
        let assign = ["CLUSTER", "SETSLOT", slot_arg.as_str(), "NODE", self.target_id.as_str()];
        loop {
            while self.migrate_keys(100).await? > 0 {}
            ok_reply(&self.target.0, self.target.1, &assign).await?;
            // The source refuses while it still holds keys of the slot (one may have been written
            // since the last MIGRATE): move those and try again.
            match raw_command(&self.source.0, self.source.1, &assign).await? {
                Ok(_) => break,
                Err(e) if e.contains("still hold keys") && Instant::now() < deadline => {}
                Err(e) => {
                    return Err(HarnessError::ClusterFailed {
                        reason: format!("CLUSTER SETSLOT {slot_arg} NODE on the source {}", self.source()),
                        details: e,
                    })
                }
            }
        }
        for master in cluster.masters().await? {
            if master != self.source() && master != self.target() {
                let (host, port) = url_host_port(&master)?;
                ok_reply(&host, port, &assign).await?;
            }
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        cluster.wait_for_slot_owner(self.slot, &self.target(), remaining).await
    }
}

/// One line of a `CLUSTER NODES` reply.
#[derive(Debug, Clone)]
struct NodeLine {
    id: String,
    /// `redis://ip:port`
    url: String,
    flags: Vec<String>,
    /// The id of its master, for a replica; `-` otherwise.
    master_id: String,
    /// Slot ranges it serves (migration entries in brackets are left out).
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn healthy(&self) -> bool {
        !self.flags.iter().any(|f| matches!(f.as_str(), "fail" | "fail?" | "handshake" | "noaddr"))
    }
}

fn parse_node_lines(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let addr = fields.get(1)?.split(['@', ',']).next()?;
            let slots = fields
                .iter()
                .skip(8)
                .filter(|f| !f.starts_with('['))
                .filter_map(|f| match f.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => f.parse().ok().map(|s| (s, s)),
                })
                .collect();
            Some(NodeLine {
                id: (*fields.first()?).to_owned(),
                url: format!("redis://{addr}"),
                flags: fields.get(2)?.split(',').map(str::to_owned).collect(),
                master_id: (*fields.get(3)?).to_owned(),
                slots,
            })
        })
        .collect()
}

/// The healthy master that serves `slot`.
fn slot_owner(nodes: &[NodeLine], slot: u16) -> Option<&NodeLine> {
    nodes.iter().find(|n| {
        n.healthy()
            && n.flags.iter().any(|f| f == "master")
            && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
    })
}

/// `url flags slots` per node, for error messages.
fn nodes_summary(nodes: &[NodeLine]) -> String {
    nodes
        .iter()
        .map(|n| format!("{} {} {:?}", n.url, n.flags.join(","), n.slots))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `(host, port)` of a `redis://host:port` URL.
fn url_host_port(url: &str) -> Result<(String, u16), HarnessError> {
    let bad = || HarnessError::Config(format!("{url:?} is not redis://host:port"));
    let addr = url.strip_prefix("redis://").ok_or_else(bad)?.trim_end_matches('/');
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    Ok((host.to_owned(), port.parse().map_err(|_| bad())?))
}

/// [`raw_command`], with a Redis error reply turned into an error naming the command.
async fn ok_reply(host: &str, port: u16, args: &[&str]) -> Result<String, HarnessError> {
    raw_command(host, port, args).await?.map_err(|e| HarnessError::ClusterFailed {
        reason: format!("{} on {host}:{port} failed", args.join(" ")),
        details: e,
    })
}

/// Why the node at `host:port` is not (yet) a healthy member of the cluster.
async fn node_ready(host: &str, port: u16, expected: Option<Expected>) -> Result<(), String> {
    let info = match raw_command(host, port, &["CLUSTER", "INFO"]).await {
        Ok(Ok(text)) => text,
        Ok(Err(e)) => return Err(format!("CLUSTER INFO: {e}")),
        Err(e) => return Err(format!("CLUSTER INFO: {e}")),
    };
    let field = |name: &str| info_field(&info, name).unwrap_or_default();
    let slots = CLUSTER_SLOTS.to_string();
    if field("cluster_state") != "ok" {
        return Err(format!("cluster_state:{}", field("cluster_state")));
    }
    for name in ["cluster_slots_assigned", "cluster_slots_ok"] {
        if field(name) != slots {
            return Err(format!("{name}:{}", field(name)));
        }
    }
    if let Some(expected) = expected {
        if field("cluster_known_nodes") != expected.nodes.to_string() {
            return Err(format!(
                "cluster_known_nodes:{} of {}",
                field("cluster_known_nodes"),
                expected.nodes
            ));
        }
        if field("cluster_size") != expected.masters.to_string() {
            return Err(format!("cluster_size:{} of {}", field("cluster_size"), expected.masters));
        }
    }
    let repl = match raw_command(host, port, &["INFO", "replication"]).await {
        Ok(Ok(text)) => text,
        Ok(Err(e)) => return Err(format!("INFO replication: {e}")),
        Err(e) => return Err(format!("INFO replication: {e}")),
    };
    if info_field(&repl, "role") == Some("slave") {
        let link = info_field(&repl, "master_link_status").unwrap_or_default();
        let syncing = info_field(&repl, "master_sync_in_progress").unwrap_or_default();
        if link != "up" || syncing != "0" {
            return Err(format!("replica: master_link_status:{link} master_sync_in_progress:{syncing}"));
        }
    }
    Ok(())
}

/// The value of `name:value` in an INFO-style reply.
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')).map(str::trim)
}

/// `redis://ip:port` of each master with slots in a `CLUSTER NODES` reply.
fn parse_masters(nodes: &str) -> Vec<String> {
    let mut masters: Vec<String> = nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags: Vec<&str> = fields.get(2)?.split(',').collect();
            let healthy = flags.contains(&"master")
                && !flags.iter().any(|f| matches!(*f, "fail" | "fail?" | "handshake" | "noaddr"));
            // Fields 8.. are slot ranges; a master without any serves nothing.
            if !healthy || fields.len() <= 8 {
                return None;
            }
            // `ip:port@cport[,hostname]`
            let addr = fields.get(1)?.split(['@', ',']).next()?;
            Some(format!("redis://{addr}"))
        })
        .collect();
    masters.sort();
    masters
}

/// `host:port` pairs from a comma-separated list; a `redis://` prefix and a
/// trailing `/` are allowed.
fn parse_host_ports(list: &str) -> Result<Vec<(String, u16)>, HarnessError> {
    let bad = |entry: &str| {
        HarnessError::Config(format!("{CLUSTER_URLS_ENV}: {entry:?} is not host:port (in {list:?})"))
    };
    let addrs = list
        .split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let addr = entry.strip_prefix("redis://").unwrap_or(entry).trim_end_matches('/');
            let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad(entry))?;
            let port = port.parse::<u16>().map_err(|_| bad(entry))?;
            if host.is_empty() {
                return Err(bad(entry));
            }
            Ok((host.to_owned(), port))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if addrs.is_empty() {
        return Err(HarnessError::Config(format!("{CLUSTER_URLS_ENV} names no node")));
    }
    Ok(addrs)
}

/// Which Redis deployment a test runs against; see [`TestBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topology {
    /// One Redis: [`TestRedis`] (`REDIS_URL` or a local server).
    Single,
    /// A Redis Cluster: [`RedisCluster::start`] (`REDIS_CLUSTER_URLS` or 3
    /// local masters).
    Cluster,
}

impl Topology {
    /// Both topologies, for a test that loops over them.
    pub const ALL: [Topology; 2] = [Topology::Single, Topology::Cluster];

    /// `SLUICEGATE_TEST_TOPOLOGY` (`single` or `cluster`, default `single`):
    /// lets CI run a whole suite once per topology.
    pub fn from_env() -> Result<Topology, HarnessError> {
        match std::env::var(TOPOLOGY_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse(),
            _ => Ok(Topology::Single),
        }
    }

    /// `"single"` or `"cluster"`.
    pub fn name(self) -> &'static str {
        match self {
            Topology::Single => "single",
            Topology::Cluster => "cluster",
        }
    }
}

impl std::str::FromStr for Topology {
    type Err = HarnessError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "single" | "standalone" => Ok(Topology::Single),
            "cluster" => Ok(Topology::Cluster),
            other => Err(HarnessError::Config(format!(
                "unknown topology {other:?} (in {TOPOLOGY_ENV}?): expected \"single\" or \"cluster\""
            ))),
        }
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A Redis of either [`Topology`] behind one interface, so an integration
/// test can be written once and run against both:
///
/// ```no_run
/// # async fn demo() -> Result<(), sluicegate_testkit::HarnessError> {
/// use sluicegate_testkit::{unique_namespace, TestBackend, Topology};
///
/// let backend = TestBackend::start(Topology::from_env()?).await?;
/// let ns = unique_namespace("demo");
/// let config = sluicegate::Config::new(backend.url()).namespace(&ns);
/// // ... run producers and workers with `config` ...
/// assert!(backend.keys_in_namespace(&ns).await?.is_empty());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct TestBackend {
    url: String,
    inner: BackendKind,
}

#[derive(Debug)]
enum BackendKind {
    Single(TestRedis),
    Cluster(RedisCluster),
}

impl TestBackend {
    /// A [`TestRedis`] for [`Topology::Single`], a [`RedisCluster::start`]
    /// for [`Topology::Cluster`].
    pub async fn start(topology: Topology) -> Result<TestBackend, HarnessError> {
        Ok(match topology {
            Topology::Single => {
                let redis = TestRedis::start().await?;
                TestBackend { url: redis.url().to_owned(), inner: BackendKind::Single(redis) }
            }
            Topology::Cluster => {
                let cluster = RedisCluster::start().await?;
                TestBackend { url: cluster.url(), inner: BackendKind::Cluster(cluster) }
            }
        })
    }

    /// Which topology this is.
    pub fn topology(&self) -> Topology {
        match self.inner {
            BackendKind::Single(_) => Topology::Single,
            BackendKind::Cluster(_) => Topology::Cluster,
        }
    }

    /// The URL for sluicegate's `Config::new`: `redis://...` or
    /// `redis-cluster://...`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// All keys `<ns>:*`, on every master of a cluster; see [`keys_in_namespace`].
    pub async fn keys_in_namespace(&self, ns: &str) -> Result<Vec<String>, HarnessError> {
        keys_in_namespace(&self.url, ns).await
    }

    /// The single server, for [`Topology::Single`].
    pub fn single(&self) -> Option<&TestRedis> {
        match &self.inner {
            BackendKind::Single(redis) => Some(redis),
            BackendKind::Cluster(_) => None,
        }
    }

    /// Mutable single server (e.g. to kill it), for [`Topology::Single`].
    pub fn single_mut(&mut self) -> Option<&mut TestRedis> {
        match &mut self.inner {
            BackendKind::Single(redis) => Some(redis),
            BackendKind::Cluster(_) => None,
        }
    }

    /// The cluster, for [`Topology::Cluster`].
    pub fn cluster(&self) -> Option<&RedisCluster> {
        match &self.inner {
            BackendKind::Cluster(cluster) => Some(cluster),
            BackendKind::Single(_) => None,
        }
    }

    /// Mutable cluster (e.g. to kill a node), for [`Topology::Cluster`].
    pub fn cluster_mut(&mut self) -> Option<&mut RedisCluster> {
        match &mut self.inner {
            BackendKind::Cluster(cluster) => Some(cluster),
            BackendKind::Single(_) => None,
        }
    }
}

/// A key prefix unique to one test, `t-<prefix>-<8 hex digits>`, so parallel
/// tests sharing a server never see each other's keys.
pub fn unique_namespace(prefix: &str) -> String {
    format!("t-{prefix}-{:08x}", rand::thread_rng().gen::<u32>())
}

/// Connects a fred [`Client`] to `url`: a standalone Redis (`redis://`), or a
/// cluster (`redis-cluster://`, e.g. [`RedisCluster::url`]).
pub async fn connect(url: &str) -> Result<Client, HarnessError> {
    let client = Builder::from_config(Config::from_url(url)?).build()?;
    client.init().await?;
    Ok(client)
}

/// All keys named `<ns>:*` at `url`, via `SCAN`: on the server of a
/// `redis://` URL, or on every master of a `redis-cluster://` URL (such as
/// [`RedisCluster::url`]). Names that are not UTF-8 are converted lossily.
pub async fn keys_in_namespace(url: &str, ns: &str) -> Result<Vec<String>, HarnessError> {
    let client = connect(url).await?;
    let pattern = format!("{}:*", escape_glob(ns));
    let mut keys = Vec::new();
    let mut cursor = String::from("0");
    let result = async {
        if client.is_clustered() {
            // SCAN on each primary of fred's (fresh) view of the cluster.
            let found: Vec<Key> =
                client.scan_cluster_buffered(pattern.clone(), Some(1000), None).try_collect().await?;
            keys.extend(found.iter().map(|key| String::from_utf8_lossy(key.as_bytes()).into_owned()));
            return Ok(());
        }
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

/// How many times the server at `url` (`redis://`, one node) has run each
/// command since its start or last `CONFIG RESETSTAT`, from `INFO
/// commandstats`: lower-case name (`fcall`, `brpop`, `client|setname`) to
/// `calls`. Commands run inside scripts and functions are counted too.
pub async fn command_calls(url: &str) -> Result<BTreeMap<String, u64>, HarnessError> {
    let client = connect(url).await?;
    let info: Result<String, _> = client.info(Some(InfoKind::CommandStats)).await;
    let _ = client.quit().await;
    Ok(parse_commandstats(&info?))
}

/// How many error replies of each kind the server at `url` (`redis://`, one
/// node) has sent since its start or last `CONFIG RESETSTAT`, from `INFO
/// errorstats`: the error's first word (`MOVED`, `ASK`, `TRYAGAIN`,
/// `UNBLOCKED`, `ERR`, ...) to its count. Shows which redirections clients
/// met during a topology change.
pub async fn error_counts(url: &str) -> Result<BTreeMap<String, u64>, HarnessError> {
    let (host, port) = url_host_port(url)?;
    let info = ok_reply(&host, port, &["INFO", "errorstats"]).await?;
    Ok(info
        .lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("errorstat_")?.split_once(':')?;
            let count = stats.split(',').find_map(|kv| kv.strip_prefix("count="))?.parse().ok()?;
            Some((name.to_owned(), count))
        })
        .collect())
}

/// `cmdstat_<name>:calls=<n>,usec=...` lines to `name -> n`.
fn parse_commandstats(info: &str) -> BTreeMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.split(',').find_map(|kv| kv.strip_prefix("calls="))?.parse().ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
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

/// `REDIS_CLI_BIN` if set, else `redis-cli` next to the `redis-server` in use,
/// else `redis-cli` on `PATH`.
fn find_redis_cli() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("REDIS_CLI_BIN").filter(|bin| !bin.is_empty()) {
        return Some(bin.into());
    }
    let sibling = find_redis_server().and_then(|server| Some(server.parent()?.join("redis-cli")));
    if let Some(cli) = sibling.filter(|cli| cli.is_file()) {
        return Some(cli);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join("redis-cli")).find(|bin| bin.is_file())
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

/// Ports (client and cluster bus) held by the live [`RedisServer`]s of this
/// process, including servers that are killed and will be restarted on the
/// same port, each with its lock file (see [`lock_port`]). This stops one test
/// from picking a port (or a bus port) of another test's server, e.g. while
/// that server is down between a kill and a restart: tests in this process
/// through the map, tests in other processes (a test runner that runs test
/// binaries or single tests side by side) through the lock.
static RESERVED_PORTS: Mutex<BTreeMap<u16, PortLock>> = Mutex::new(BTreeMap::new());

fn reserved_ports() -> std::sync::MutexGuard<'static, BTreeMap<u16, PortLock>> {
    RESERVED_PORTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A port's lock across test processes (see [`lock_port`]): its lock file, or
/// nothing where lock files cannot be made (the reservation is then this
/// process's alone, as it was before tests ran in processes of their own).
type PortLock = Option<fs::File>;

/// Takes `port`'s lock file in a directory of the temp dir shared by every test
/// process of this user: `None` while another process holds it. The lock is an
/// advisory file lock, so it goes when its holder exits, however it exits; the
/// files stay behind, empty.
fn lock_port(port: u16) -> Option<PortLock> {
    // Per user: another user's directory (root's, from a CI run) is not writable.
    let user = std::env::var("USER").or_else(|_| std::env::var("LOGNAME")).unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("sluicegate-test-ports-{user}"));
    let file = fs::create_dir_all(&dir).and_then(|()| {
        OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(port.to_string()))
    });
    let Ok(file) = file else { return Some(None) };
    // fs4's, not std's `File::try_lock` (Rust 1.89): the workspace builds on Rust 1.80.
    match fs4::fs_std::FileExt::try_lock_exclusive(&file) {
        Ok(true) => Some(Some(file)),
        Ok(false) => None,
        Err(_) => Some(None),
    }
}

/// A random port in [`PORT_RANGE`] that can be bound right now, along with its
/// cluster bus port; both are reserved (see [`RESERVED_PORTS`]) until
/// [`release_port`]. We pick it ourselves rather than binding port 0 because
/// the OS hands out ports from the ephemeral range, which may exceed 55535
/// and is shared with outgoing connections. A process that does not take
/// the locks (a redis-server of someone else's) may still take the port before
/// redis binds it; callers retry with another port then.
pub(crate) fn free_port() -> io::Result<u16> {
    let mut rng = rand::thread_rng();
    let mut reserved = reserved_ports();
    for _ in 0..100 {
        let port = rng.gen_range(PORT_RANGE);
        let bus = port + CLUSTER_BUS_OFFSET;
        if reserved.contains_key(&port) || reserved.contains_key(&bus) {
            continue;
        }
        let (Some(port_lock), Some(bus_lock)) = (lock_port(port), lock_port(bus)) else {
            continue;
        };
        let bindable = |p: u16| TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_ok();
        if bindable(port) && bindable(bus) {
            reserved.insert(port, port_lock);
            reserved.insert(bus, bus_lock);
            return Ok(port);
        }
    }
    Err(io::Error::new(io::ErrorKind::AddrInUse, format!("no free port found in {PORT_RANGE:?}")))
}

/// Undoes the reservation of [`free_port`], dropping the locks.
pub(crate) fn release_port(port: u16) {
    let mut reserved = reserved_ports();
    reserved.remove(&port);
    reserved.remove(&(port + CLUSTER_BUS_OFFSET));
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

/// Sends one command on a fresh connection to `host:port` and returns the
/// reply as text (a simple or bulk string, or an integer); a Redis error
/// reply is `Ok(Err(message))`. A tiny RESP client for health probes, where
/// a fred client (with its own connection management) would be overkill.
async fn raw_command(host: &str, port: u16, args: &[&str]) -> io::Result<Result<String, String>> {
    let exchange = async {
        let mut request = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            request.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            request.extend_from_slice(arg.as_bytes());
            request.extend_from_slice(b"\r\n");
        }
        let mut stream = TcpStream::connect((host, port)).await?;
        stream.write_all(&request).await?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).await?;
        let line = line.trim_end_matches(['\r', '\n']);
        let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("unexpected reply {line:?}"));
        let mut chars = line.chars();
        let kind = chars.next().ok_or_else(bad)?;
        let rest = chars.as_str();
        match kind {
            '+' | ':' => Ok(Ok(rest.to_owned())),
            '-' => Ok(Err(rest.to_owned())),
            '$' => {
                let len: i64 = rest.parse().map_err(|_| bad())?;
                let Ok(len) = usize::try_from(len) else {
                    return Ok(Ok(String::new())); // $-1: nil
                };
                let mut body = vec![0; len + 2];
                reader.read_exact(&mut body).await?;
                body.truncate(len);
                Ok(Ok(String::from_utf8_lossy(&body).into_owned()))
            }
            _ => Err(bad()),
        }
    };
    tokio::time::timeout(Duration::from_secs(2), exchange).await.map_err(|_| {
        io::Error::new(io::ErrorKind::TimedOut, format!("no reply from {host}:{port} within 2 s"))
    })?
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
    use fred::prelude::{ClientLike, ServerInterface};

    /// PING through fred, proving the URL works for a real client too.
    async fn ping(url: &str) -> Result<String, HarnessError> {
        let client = connect(url).await?;
        let pong: String = client.ping(None).await?;
        client.quit().await?;
        Ok(pong)
    }

    /// A port's lock is held by one open file at a time (another process's, or this one's), so
    /// a test process never picks a port another one holds, and it is free once dropped.
    #[test]
    fn a_held_port_lock_is_refused_until_dropped() {
        let (port, lock) = loop {
            let port = free_port().unwrap();
            release_port(port);
            if let Some(Some(lock)) = lock_port(port) {
                break (port, lock);
            }
        };
        assert!(lock_port(port).is_none(), "a second lock of {port} while the first is held");
        drop(lock);
        assert!(lock_port(port).is_some(), "{port} is free once its lock is dropped");
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

    /// The masters holding at least one of `keys`, by `DBSIZE` on each.
    async fn masters_with_keys(cluster: &RedisCluster) -> Result<usize, HarnessError> {
        let mut with_keys = 0;
        for url in cluster.masters().await? {
            let client = connect(&url).await?;
            let size: u64 = client.dbsize().await?;
            client.quit().await?;
            with_keys += usize::from(size > 0);
        }
        Ok(with_keys)
    }

    #[tokio::test]
    async fn two_clusters_form_in_parallel_and_keys_are_scanned_on_every_master() -> Result<(), HarnessError>
    {
        let (a, b) = tokio::join!(RedisCluster::builder().start(), RedisCluster::builder().start());
        let (a, b) = (a?, b?);
        let ports = |c: &RedisCluster| c.urls().into_iter().collect::<BTreeSet<_>>();
        assert!(ports(&a).is_disjoint(&ports(&b)), "{:?} / {:?}", a.urls(), b.urls());
        for cluster in [&a, &b] {
            assert!(!cluster.is_external());
            assert_eq!(cluster.urls().len(), 3);
            let mut urls = cluster.urls();
            urls.sort();
            assert_eq!(cluster.masters().await?, urls);
            let addrs: Vec<String> =
                cluster.urls().iter().map(|u| u.trim_start_matches("redis://").to_owned()).collect();
            let expected = format!("redis-cluster://{}?node={}&node={}", addrs[0], addrs[1], addrs[2]);
            assert_eq!(cluster.url(), expected);
        }

        let ns = unique_namespace("cscan");
        let client = connect(&a.url()).await?;
        assert!(client.is_clustered());
        for i in 0..300 {
            let () = client.set(format!("{ns}:k{i}"), i, None, None, false).await?;
        }
        let value: Option<i64> = client.get(format!("{ns}:k299")).await?;
        assert_eq!(value, Some(299));
        client.quit().await?;
        let keys = keys_in_namespace(&a.url(), &ns).await?;
        assert_eq!(keys.len(), 300);
        assert_eq!(masters_with_keys(&a).await?, 3, "300 keys spread over all 3 masters");
        assert!(keys_in_namespace(&b.url(), &ns).await?.is_empty());
        // On one node only, the scan sees that node's share.
        let one = keys_in_namespace(&a.urls()[0], &ns).await?;
        assert!(!one.is_empty() && one.len() < 300, "{}", one.len());
        Ok(())
    }

    #[tokio::test]
    async fn a_killed_master_rejoins_after_restart() -> Result<(), HarnessError> {
        let mut cluster = RedisCluster::builder().start().await?;
        let before = cluster.masters().await?;
        let node = cluster.node_mut(1).ok_or(HarnessError::NoRedis)?;
        let port = node.port();
        node.kill()?;
        assert!(cluster.masters().await.is_ok(), "the other nodes still answer");
        let node = cluster.node_mut(1).ok_or(HarnessError::NoRedis)?;
        node.restart().await?;
        assert_eq!(node.port(), port);
        cluster.wait_until_ok(Duration::from_secs(20)).await?;
        assert_eq!(cluster.masters().await?, before, "same masters: it kept its slots via nodes.conf");
        Ok(())
    }

    #[tokio::test]
    async fn a_replica_takes_over_a_killed_master_which_rejoins_as_replica() -> Result<(), HarnessError> {
        let mut cluster = RedisCluster::builder().replicas_per_master(1).start().await?;
        assert_eq!(cluster.urls().len(), 6);
        let masters = cluster.masters().await?;
        assert_eq!(masters.len(), 3);
        let victim = cluster.urls().iter().position(|u| *u == masters[0]).ok_or(HarnessError::NoRedis)?;
        cluster.node_mut(victim).ok_or(HarnessError::NoRedis)?.kill()?;
        // Failover takes the node timeout (2 s) plus an election; until the others notice, the
        // cluster still says ok with the dead master in place, so ok alone is not the end of it.
        let deadline = Instant::now() + Duration::from_secs(20);
        let after = loop {
            cluster.wait_until_ok(Duration::from_secs(20)).await?;
            let after = cluster.masters().await?;
            if !after.contains(&masters[0]) || Instant::now() > deadline {
                break after;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(after.len(), 3, "{after:?}");
        assert!(!after.contains(&masters[0]), "{after:?}");

        cluster.node_mut(victim).ok_or(HarnessError::NoRedis)?.restart().await?;
        cluster.wait_until_ok(Duration::from_secs(20)).await?;
        assert_eq!(cluster.masters().await?, after, "the old master came back as a replica");
        Ok(())
    }

    #[tokio::test]
    async fn backend_serves_either_topology() -> Result<(), HarnessError> {
        for topology in Topology::ALL {
            let backend = TestBackend::start(topology).await?;
            assert_eq!(backend.topology(), topology);
            assert_eq!(backend.cluster().is_some(), topology == Topology::Cluster);
            assert_eq!(backend.single().is_some(), topology == Topology::Single);
            let ns = unique_namespace("backend");
            let client = connect(backend.url()).await?;
            assert_eq!(client.is_clustered(), topology == Topology::Cluster, "{}", backend.url());
            let keys: Vec<String> = (0..20).map(|i| format!("{ns}:{i}")).collect();
            for key in &keys {
                let () = client.set(key.as_str(), 1, None, None, false).await?;
            }
            let mut found = backend.keys_in_namespace(&ns).await?;
            found.sort();
            let mut expected = keys.clone();
            expected.sort();
            assert_eq!(found, expected, "{topology}");
            for key in keys {
                let _: i64 = client.del(key).await?;
            }
            client.quit().await?;
        }
        Ok(())
    }

    #[test]
    fn topology_names_parse() {
        assert_eq!("cluster".parse::<Topology>().ok(), Some(Topology::Cluster));
        assert_eq!(" Single ".parse::<Topology>().ok(), Some(Topology::Single));
        assert!("sentinel".parse::<Topology>().is_err());
        assert_eq!(Topology::Cluster.to_string(), "cluster");
    }

    #[test]
    fn host_port_lists_parse() -> Result<(), HarnessError> {
        assert_eq!(
            parse_host_ports("10.0.0.1:7000, redis://node-b:7001/ ,")?,
            vec![("10.0.0.1".to_owned(), 7000), ("node-b".to_owned(), 7001)]
        );
        assert!(parse_host_ports("host").is_err());
        assert!(parse_host_ports(":7000").is_err());
        assert!(parse_host_ports("h:99999").is_err());
        assert!(parse_host_ports(" , ").is_err());
        Ok(())
    }

    #[test]
    fn cluster_nodes_reply_gives_healthy_masters_with_slots() {
        let reply = "\
a1 127.0.0.1:30002@40002,host-b master - 0 1 2 connected 5461-10922
a2 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460
a3 127.0.0.1:30003@40003 master,fail - 0 1 3 disconnected 10923-16383
a4 127.0.0.1:30004@40004 slave a1 0 1 2 connected
a5 127.0.0.1:30005@40005 master - 0 1 5 connected 10923-16383
a6 127.0.0.1:30006@40006 master - 0 1 0 connected
";
        assert_eq!(
            parse_masters(reply),
            ["redis://127.0.0.1:30001", "redis://127.0.0.1:30002", "redis://127.0.0.1:30005"]
        );
    }

    #[test]
    fn cluster_nodes_lines_give_slot_owners_and_replicas() {
        let reply = "\
a1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460 [5461->-a2]
a2 127.0.0.1:30002@40002,host-b master - 0 1 2 connected 5461-10922 [5461-<-a1]
a3 127.0.0.1:30003@40003 master,fail - 0 1 3 disconnected 10923-16382
a4 127.0.0.1:30004@40004 slave a3 0 1 4 connected
a5 127.0.0.1:30005@40005 master - 0 1 5 connected 16383
";
        let nodes = parse_node_lines(reply);
        assert_eq!(nodes.len(), 5);
        assert_eq!(nodes[0].slots, [(0, 5460)], "migration entries are left out");
        assert_eq!(nodes[3].master_id, "a3");
        let owner = |slot| slot_owner(&nodes, slot).map(|n| n.url.as_str());
        assert_eq!(owner(0), Some("redis://127.0.0.1:30001"));
        assert_eq!(owner(5461), Some("redis://127.0.0.1:30002"), "the source still owns a migrating slot");
        assert_eq!(owner(12000), None, "a failed master serves nothing");
        assert_eq!(owner(16383), Some("redis://127.0.0.1:30005"));
        assert_eq!(url_host_port("redis://127.0.0.1:30002").ok(), Some(("127.0.0.1".to_owned(), 30002)));
        assert!(url_host_port("127.0.0.1:30002").is_err());
    }

    #[test]
    fn commandstats_parse() {
        let info = "# Commandstats\r\n\
                    cmdstat_fcall:calls=12,usec=340,usec_per_call=28.33,rejected_calls=0,failed_calls=1\r\n\
                    cmdstat_client|setname:calls=3,usec=1\r\n";
        let calls = parse_commandstats(info);
        assert_eq!(calls.get("fcall"), Some(&12));
        assert_eq!(calls.get("client|setname"), Some(&3));
        assert_eq!(calls.len(), 2);
    }

    #[test]
    fn escape_glob_escapes_specials() {
        assert_eq!(escape_glob("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
