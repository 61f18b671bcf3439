//! Configuration shared by producers, workers and listeners.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::request::{InvalidValue, Namespace};

/// The most token shards a configuration may name ([`Config::token_shards`]).
pub(crate) const MAX_TOKEN_SHARDS: u32 = 1024;

/// Where Redis is, which namespace to use, and the timings of the protocol.
///
/// Producers, workers and listeners of one system must agree on the namespace; the timings may
/// differ per process. Setters take and return `self`:
/// ```
/// use std::time::Duration;
/// use sluicegate::Config;
/// let config = Config::new("redis://127.0.0.1:6379")
///     .namespace("thumbnails")
///     .retention(Duration::from_secs(3600));
/// ```
#[derive(Clone, Debug)]
pub struct Config {
    pub(crate) url: String,
    /// Validated when set; an invalid one is reported when a component connects.
    pub(crate) namespace: std::result::Result<Namespace, InvalidValue>,
    pub(crate) retention: Duration,
    pub(crate) lease: Duration,
    pub(crate) heartbeat: Duration,
    pub(crate) loading_ttl: Duration,
    pub(crate) recovery_interval: Duration,
    pub(crate) census_interval: Duration,
    pub(crate) wait_poll: Duration,
    pub(crate) window_poll: Duration,
    pub(crate) unresponsive: Duration,
    pub(crate) token_shards: u32,
    pub(crate) lane_tokens: u32,
    pub(crate) tls_ca_file: Option<PathBuf>,
    pub(crate) tls_client_cert: Option<(PathBuf, PathBuf)>,
    /// How long the stats by stage are kept; `None`: the retention.
    pub(crate) stats_retention: Option<Duration>,
    pub(crate) stats_flush: Duration,
    /// Load the test build of the library, whose clock tests move (`test-clock` feature only).
    #[cfg(feature = "test-clock")]
    pub(crate) test_clock: bool,
    /// Finishers leave the releases their finishes owe to recovery, as if each died right after
    /// its finish (`test-clock` feature only).
    #[cfg(feature = "test-clock")]
    pub(crate) test_no_inline_release: bool,
}

/// The URL used when neither the caller nor `REDIS_URL` names one.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

impl Config {
    /// A configuration for the Redis at `url` (`redis://[user:password@]host:port[/db]`,
    /// `rediss://` for TLS, `redis+unix:///path/to/socket`).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            namespace: Ok(Namespace::default()),
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(2),
            heartbeat: Duration::from_millis(500),
            loading_ttl: Duration::from_secs(3600),
            recovery_interval: Duration::from_millis(200),
            census_interval: Duration::from_secs(60),
            wait_poll: Duration::from_secs(2),
            window_poll: Duration::from_millis(50),
            unresponsive: Duration::from_secs(10),
            token_shards: 1,
            lane_tokens: 64,
            tls_ca_file: None,
            tls_client_cert: None,
            stats_retention: None,
            stats_flush: Duration::from_secs(5),
            #[cfg(feature = "test-clock")]
            test_clock: false,
            #[cfg(feature = "test-clock")]
            test_no_inline_release: false,
        }
    }

    /// The Redis named by the `REDIS_URL` environment variable, else [`DEFAULT_REDIS_URL`].
    pub fn from_env() -> Self {
        Self::new(std::env::var("REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned()))
    }

    /// The namespace: the prefix of every key (default `sluicegate`). 1 to 64 characters from
    /// `A-Z a-z 0-9 _ . -`; an invalid one makes connecting fail with [`Error::Config`] naming it.
    pub fn namespace(mut self, ns: impl Into<String>) -> Self {
        self.namespace = Namespace::new(ns);
        self
    }

    /// How long results and terminal records stay readable after a request finishes (default 24 h).
    pub fn retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// How long the stats by stage (`Admin::stats_since`) are kept: each minute's counts expire
    /// this long after they were last added to. Default: the [`retention`](Self::retention) (24 h).
    /// Zero: producers and workers of this configuration count nothing.
    pub fn stats_retention(mut self, d: Duration) -> Self {
        self.stats_retention = Some(d);
        self
    }

    /// How often producers and workers add what they counted for the stats by stage to Redis
    /// (default 5 s): one call each per interval, whatever the load; a worker also adds its
    /// counts when it stops. What a process counted since its last flush is lost if it is killed.
    pub fn stats_flush_interval(mut self, d: Duration) -> Self {
        self.stats_flush = d;
        self
    }

    /// How long a worker may go unheard before it is declared dead (default 2 s): then other
    /// workers take back the tokens its slots held and run their sub-requests again. A worker's
    /// heartbeat runs on a thread of its own, so handlers that are slow or keep the CPU busy never
    /// starve it; only a process that is gone, frozen or cut off from Redis for this long is
    /// declared dead (its late results are then refused, see `docs/architecture.md`).
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = d;
        self
    }

    /// How often a worker beats (default 500 ms): renews its registration, takes its share of
    /// noticing dead workers, and checks that its slots still hold their tokens (a cancelled
    /// request's handlers are told within this time). Must be well below the lease.
    pub fn heartbeat(mut self, d: Duration) -> Self {
        self.heartbeat = d;
        self
    }

    /// How long a request may stay half-written before its keys expire (default 1 h): the bound on
    /// what a producer that dies mid-submit leaves behind.
    pub fn loading_ttl(mut self, d: Duration) -> Self {
        self.loading_ttl = d;
        self
    }

    /// How often a worker looks for recovery work that has fallen due (default 200 ms): delayed
    /// requests whose time has come, a request whose producer died between its two last calls,
    /// and the backstop census below. One cheap call per token shard.
    pub fn recovery_interval(mut self, d: Duration) -> Self {
        self.recovery_interval = d;
        self
    }

    /// Every request not yet finished is looked at by recovery at least this often (default
    /// 60 s), whatever else happens: the backstop for what no event announces (an element lost
    /// with a failover's asynchronous replication, say). Its cost grows with the number of active
    /// requests: about one call per request and interval, spread over the workers.
    pub fn census_interval(mut self, d: Duration) -> Self {
        self.census_interval = d;
        self
    }

    /// How often a waiting producer re-reads the terminal record in case a completion message was
    /// missed during a reconnect (default 2 s).
    pub fn wait_poll(mut self, d: Duration) -> Self {
        self.wait_poll = d;
        self
    }

    /// How often a producer whose streamed request's window (`RequestBuilder::window`) is
    /// full asks how many of its parts are still unsettled (default 50 ms): a shorter poll refills
    /// the window sooner, at one cheap read-only call per poll.
    /// ```
    /// let config = sluicegate::Config::from_env().window_poll(std::time::Duration::from_millis(20));
    /// ```
    pub fn window_poll(mut self, d: Duration) -> Self {
        self.window_poll = d;
        self
    }

    /// A connection whose oldest command has waited this long for its reply is presumed dead
    /// (a stalled network, a frozen server): it is closed and re-opened, and its commands are
    /// re-sent (default 10 s). Must exceed every blocking wait (a worker's `idle_poll`).
    pub fn unresponsive_timeout(mut self, d: Duration) -> Self {
        self.unresponsive = d;
        self
    }

    /// How many token shards (default 1): each shard has its own hash tag `{<ns>.q<s>}`, its own
    /// 100 priority lists and its own index of active requests, so that on a Redis Cluster the
    /// token traffic spreads over the masters that own the shards' slots. A request's tokens are
    /// spread over the shards; a worker slot serves the shards in turn, so priority is strict
    /// within a shard and holds across shards only within a bound (docs/architecture.md, "Shards").
    /// 1 to 1024. Each request records the number it was submitted with, so a later change
    /// never strands its tokens; raise it on workers first, then on producers, and lower it only
    /// after the namespace has drained (workers serve shards `0..S` of their own setting).
    pub fn token_shards(mut self, shards: u32) -> Self {
        self.token_shards = shards;
        self
    }

    /// Small requests (at most 64 parts and 64 KB of payloads, given whole, not delayed) share a
    /// lane per priority and token shard instead of each taking a stream of its own: one round
    /// trip to submit, a few hundred bytes each in Redis (docs/architecture.md, "Lanes"). A lane
    /// has `n` tokens, which it keeps: at most `n` sub-requests of a priority's small requests run
    /// at once on one shard (each request's own limit holds too). Set on producers, when a lane is
    /// first created; 0 turns lanes off (every request takes its own stream). Default 64, at most
    /// 10,000.
    pub fn lane_tokens(mut self, n: u32) -> Self {
        self.lane_tokens = n;
        self
    }

    /// For `rediss://` URLs: trust the CA certificates of this PEM file (a private CA, a
    /// self-signed server) instead of the system's roots. Read when a component connects; a
    /// missing or unreadable file, or one without certificates, is an [`Error::Config`].
    pub fn tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls_ca_file = Some(path.into());
        self
    }

    /// For `rediss://` URLs: present this client certificate chain (PEM) and its private key
    /// (PEM: PKCS#8, PKCS#1 or SEC1) to a server that requires mutual TLS
    /// (`tls-auth-clients yes`).
    pub fn tls_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls_client_cert = Some((cert.into(), key.into()));
        self
    }

    /// Tests only (`test-clock` feature): components of this configuration load a build of the
    /// functions library whose clock a test moves ([`set_test_clock`](crate::set_test_clock)),
    /// and load it without replacing one already loaded, which would reset that clock. Never for
    /// a deployment.
    #[cfg(feature = "test-clock")]
    #[doc(hidden)]
    pub fn test_clock(mut self, on: bool) -> Self {
        self.test_clock = on;
        self
    }

    /// Tests only (`test-clock` feature): a finish whose request has downstreams does not run
    /// their release itself, as if its finisher died right after the finish; recovery runs it
    /// from the outbox. Never for a deployment.
    #[cfg(feature = "test-clock")]
    #[doc(hidden)]
    pub fn test_no_inline_release(mut self, on: bool) -> Self {
        self.test_no_inline_release = on;
        self
    }

    /// The CA file set with [`Config::tls_ca_file`], if any.
    pub fn tls_ca_file_path(&self) -> Option<&Path> {
        self.tls_ca_file.as_deref()
    }

    /// The number of token shards ([`Config::token_shards`]).
    pub fn token_shard_count(&self) -> u32 {
        self.token_shards
    }

    /// The lease: how long a worker may go unheard before it is declared dead.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// The Redis URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The namespace as configured; empty if the one given is invalid (connecting says why).
    pub fn namespace_str(&self) -> &str {
        self.namespace.as_ref().map_or("", Namespace::as_str)
    }

    pub(crate) fn validated_namespace(&self) -> Result<Namespace> {
        Ok(self.namespace.clone()?)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        self.validated_namespace()?;
        let positive = [
            ("retention", self.retention),
            ("lease", self.lease),
            ("heartbeat", self.heartbeat),
            ("loading_ttl", self.loading_ttl),
            ("recovery_interval", self.recovery_interval),
            ("census_interval", self.census_interval),
            ("wait_poll", self.wait_poll),
            ("window_poll", self.window_poll),
            ("unresponsive_timeout", self.unresponsive),
            ("stats_flush_interval", self.stats_flush),
        ];
        for (name, d) in positive {
            if d.as_millis() == 0 {
                return Err(Error::Config(format!("{name} must be at least 1 ms")));
            }
        }
        if !(1..=MAX_TOKEN_SHARDS).contains(&self.token_shards) {
            return Err(Error::Config(format!(
                "token_shards must be from 1 to 1024, not {}",
                self.token_shards
            )));
        }
        if self.lane_tokens > 10_000 {
            return Err(Error::Config(format!(
                "lane_tokens must be from 0 to 10000, not {}",
                self.lane_tokens
            )));
        }
        if self.heartbeat.saturating_mul(2) > self.lease {
            return Err(Error::Config(format!(
                "heartbeat ({:?}) must be at most half the lease ({:?}), or a worker that misses one beat is \
                 declared dead",
                self.heartbeat, self.lease
            )));
        }
        Ok(())
    }
}

/// The Redis at [`DEFAULT_REDIS_URL`] with every default setting; unlike
/// [`Config::from_env`], it does not read the environment.
impl Default for Config {
    fn default() -> Self {
        Self::new(DEFAULT_REDIS_URL)
    }
}

impl Config {
    /// How long a token may wait queued before recovery checks that its element is in its list
    /// (and the margin for clock differences between Redis masters, whose times epochs are): two
    /// leases.
    pub(crate) fn grace(&self) -> Duration {
        self.lease.saturating_mul(2)
    }

    /// How long the stats by stage are kept (zero: none are counted).
    pub(crate) fn stats_keep(&self) -> Duration {
        self.stats_retention.unwrap_or(self.retention)
    }
}

/// Milliseconds of a duration as Redis arguments want them.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
