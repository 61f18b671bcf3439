//! The connection to Redis: client set-up, version check, the clients for blocking and pub/sub,
//! and the hook through which the randomized checker holds every call. The functions library and
//! the calls into it are `protocol`'s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fred::clients::SubscriberClient;
use fred::prelude::*;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::keys::Keys;

/// The oldest Redis with everything sluicegate uses (Redis Functions, FUNCTION LOAD REPLACE).
pub(crate) const MIN_REDIS: (u32, u32) = (7, 0);

/// A connected, checked Redis plus the key schema of one namespace.
///
/// Cheap to clone: clones share one multiplexed connection, on which fred pipelines the commands of
/// concurrent tasks. Blocking commands never go on it (see [`Store::blocking_client`]).
#[derive(Clone)]
pub(crate) struct Store {
    pub(crate) client: Client,
    pub(crate) keys: Keys,
    pub(crate) config: Config,
    /// Calls that failed, counted by `call` (a worker shares it among its connections and
    /// reports it as `WorkerMetrics::redis_errors`).
    pub(crate) failed_calls: Arc<AtomicU64>,
    /// The randomized protocol checker's hold on every call (test builds only): see `crate::check`.
    #[cfg(test)]
    pub(crate) gate: Option<std::sync::Arc<crate::check::gate::Gate>>,
}

impl Store {
    /// Connects and refuses servers older than Redis 7.0. `protocol::connect` also loads the
    /// functions library.
    pub(crate) async fn connect(config: &Config) -> Result<Self> {
        config.validate()?;
        let namespace = config.validated_namespace()?;
        let client = new_client(config)?;
        // (A failed `init` closes its connection task itself.)
        client.init().await.map_err(|e| connect_error(&config.url, e))?;
        hang_up_unless(&client, check_version(&client).await).await?;
        let store = Self {
            client,
            keys: Keys::new(&namespace, config.token_shards),
            config: config.clone(),
            failed_calls: Arc::default(),
            #[cfg(test)]
            gate: None,
        };
        Ok(store)
    }

    /// Runs one Redis call `op` of a transition. In production it is simply awaited; under the
    /// randomized checker (test builds) the gate decides when it runs and what fault it meets (a
    /// lost reply, a re-send, the caller's death). Every call that producers, slots, recovery and
    /// operators make goes through here (`fcall` too).
    pub(crate) async fn call<T, F, Fut>(&self, what: &str, key: &str, op: F) -> Result<T>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        #[cfg(test)]
        if let Some(gate) = &self.gate {
            return gate.run(what, key, op).await;
        }
        let _ = (what, key);
        let result = op().await;
        if let Err(Error::Redis(e)) = &result {
            // The library's refusals (`SG*`) are answers, not failures.
            if !e.is_library_refusal() {
                self.failed_calls.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// How many independent calls of one transition may be in flight at once: `n`, or one under
    /// the checker, which needs every actor to make one call at a time.
    pub(crate) fn concurrency(&self, n: usize) -> usize {
        #[cfg(test)]
        if self.gate.is_some() {
            return 1;
        }
        n
    }

    /// Whether choices that depend on timing or chance (batch sizes, backoff jitter) must be made
    /// deterministically, so that a checker run replays from its seed.
    pub(crate) fn deterministic(&self) -> bool {
        #[cfg(test)]
        if self.gate.is_some() {
            return true;
        }
        false
    }

    /// Under the checker, whether the take running now hands back what follows its first batch's
    /// first part, as a first batch past its budget does (`Op::Take::cut`, `slot::first_budget`).
    pub(crate) fn cuts_first_batch(&self) -> bool {
        #[cfg(test)]
        if let Some(gate) = &self.gate {
            return gate.cuts();
        }
        false
    }

    /// Under the checker, whether the take running now finds its worker's holds filling its slots
    /// (`Op::Take::room`, `worker::bound`): it makes room as an unreserved slot does then.
    pub(crate) fn checker_makes_room(&self) -> bool {
        #[cfg(test)]
        if let Some(gate) = &self.gate {
            return gate.rooms();
        }
        false
    }

    /// Under the checker, the batch size and quantum (parts) of the take running now, when it was
    /// drawn wide (`Op::Take::wide`); `None` otherwise, for the worker's own.
    pub(crate) fn checker_batches(&self) -> Option<(u32, u32)> {
        #[cfg(test)]
        if let Some(gate) = &self.gate {
            return gate.batches();
        }
        None
    }

    /// A store for the randomized checker: every call goes through `gate`. Its library, loaded by
    /// `load_library`, is the checker's (a virtual clock).
    #[cfg(test)]
    pub(crate) async fn for_checker(
        config: &Config,
        gate: std::sync::Arc<crate::check::gate::Gate>,
    ) -> Result<Self> {
        let client = new_client(config)?;
        client.init().await.map_err(|e| connect_error(&config.url, e))?;
        let namespace = config.validated_namespace()?;
        let store = Self {
            client,
            keys: Keys::new(&namespace, config.token_shards),
            config: config.clone(),
            failed_calls: Arc::default(),
            gate: Some(gate),
        };
        Ok(store)
    }

    /// A client of its own, for a loop that blocks (BRPOP, XREAD BLOCK): a blocked connection
    /// stalls every command queued behind it, so blocking never shares the pipelined client.
    pub(crate) async fn blocking_client(&self) -> Result<Client> {
        let client = self.client.clone_new();
        client.init().await.map_err(|e| connect_error(&self.config.url, e))?;
        Ok(client)
    }

    /// A pub/sub client that re-subscribes by itself after a reconnect.
    pub(crate) async fn subscriber(&self) -> Result<SubscriberClient> {
        let sub = Builder::from_config(client_config(&self.config)?)
            .set_policy(reconnect_policy())
            .build_subscriber_client()?;
        sub.init().await.map_err(|e| connect_error(&self.config.url, e))?;
        sub.manage_subscriptions();
        Ok(sub)
    }
}

/// `ready`, after closing `client` if it is an error: a client connected (`init`) whose set-up
/// failed after is dropped by its caller, while fred's task for its connection would go on.
pub(crate) async fn hang_up_unless<C: ClientLike, T>(client: &C, ready: Result<T>) -> Result<T> {
    if ready.is_err() {
        let _ = client.quit().await;
    }
    ready
}

/// The fred configuration of `config`: its URL, and for `rediss://` the TLS settings. Every client
/// of a component is built from this (the blocking ones are clones of the pipelined one).
fn client_config(config: &Config) -> Result<fred::prelude::Config> {
    #[allow(unused_mut)]
    let mut fred_config = fred::prelude::Config::from_url(&config.url)
        .map_err(|e| Error::Config(format!("redis URL {:?} is malformed: {}", config.url, e.details())))?;
    let custom_tls = config.tls_ca_file.is_some() || config.tls_client_cert.is_some();
    #[cfg(feature = "tls")]
    if custom_tls {
        if fred_config.tls.is_none() {
            // Not the URL itself: it may carry a password.
            return Err(Error::Config(
                "a TLS CA file or client certificate is set, but the Redis URL does not use TLS (rediss://)"
                    .into(),
            ));
        }
        fred_config.tls = crate::tls::connector(config)?.map(Into::into);
    }
    #[cfg(not(feature = "tls"))]
    if custom_tls {
        return Err(Error::Config("TLS settings need sluicegate built with the `tls` feature".into()));
    }
    Ok(fred_config)
}

fn reconnect_policy() -> ReconnectPolicy {
    // Retry forever (a worker outlives a Redis restart), 100 ms doubling to 1 s. The cap is short
    // because fred rebuilds a clustered client's connections as a whole: while one master is down
    // every command of the client waits, until the first attempt after that master is back. With a
    // 5 s cap a 1.5 s master restart stalled every client ~6.5 s (tests/chaos.rs); with
    // 1 s the stall exceeds the outage by about a second. One connect a second is cheap for Redis.
    ReconnectPolicy::new_exponential(0, 100, 1_000, 2)
}

fn new_client(config: &Config) -> Result<Client> {
    let client = Builder::from_config(client_config(config)?)
        .set_policy(reconnect_policy())
        .with_connection_config(|c| {
            c.connection_timeout = Duration::from_secs(5);
            // Without this a stalled connection (no RST) leaves every call on it, blocking or
            // not, waiting forever.
            c.unresponsive.max_timeout = Some(config.unresponsive);
            c.unresponsive.interval = (config.unresponsive / 4).max(Duration::from_millis(50));
            // Redirections are handed back, not followed: fred 10.1 follows `-ASK` (a slot mid-
            // migration) by sending ASKING out of band and taking the next reply on that
            // connection as its answer, which shifts the replies of every command pipelined there
            // (callers get other commands' replies), and it re-sends the redirected command to
            // the old owner, which kills the client after three bounces. With 0 fred refreshes
            // its slot map on `-MOVED` and fails the command with "Too many redirections." (it
            // did not run: see `error::not_executed`). `fcall` (protocol/call.rs) re-sends such calls; the
            // other commands go through their usual error paths. tests/cluster_topology.rs.
            c.max_redirections = 0;
        })
        .build()?;
    Ok(client)
}

fn connect_error(url: &str, e: fred::error::Error) -> Error {
    Error::from(fred::error::Error::new(
        e.kind().clone(),
        format!("cannot connect to {url}: {}", e.details()),
    ))
}

async fn check_version(client: &Client) -> Result<()> {
    let info: String = client.info(Some(fred::types::InfoKind::Server)).await?;
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map(|v| v.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    if !version_at_least(&version, MIN_REDIS) {
        return Err(Error::UnsupportedRedis { found: version, needed: "7.0" });
    }
    Ok(())
}

fn version_at_least(version: &str, (major, minor): (u32, u32)) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    found >= (major, minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_older_than_7_0_are_refused() {
        assert!(version_at_least("7.0.15", MIN_REDIS));
        assert!(version_at_least("7.2.4", MIN_REDIS));
        assert!(version_at_least("10.0.0", MIN_REDIS));
        assert!(!version_at_least("6.2.14", MIN_REDIS));
        assert!(!version_at_least("unknown", MIN_REDIS));
    }
}
