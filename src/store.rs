//! The connection to Redis: client set-up, version check, and calls into the functions library.

use std::time::Duration;

use fred::clients::SubscriberClient;
use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};

use crate::config::Config;
use crate::error::{retry_not_executed, Error, Result};
use crate::keys::Keys;
use crate::protocol::{library_source, Func};

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
    /// The randomized protocol checker's hold on every call (test builds only): see `crate::check`.
    #[cfg(test)]
    pub(crate) gate: Option<std::sync::Arc<crate::check::gate::Gate>>,
}

impl Store {
    /// Connects, refuses servers older than Redis 7.0, and loads the functions library.
    pub(crate) async fn connect(config: &Config) -> Result<Self> {
        config.validate()?;
        let namespace = config.validated_namespace()?;
        let client = new_client(config)?;
        client.init().await.map_err(|e| connect_error(&config.url, e))?;
        check_version(&client).await?;
        let store = Self {
            client,
            keys: Keys::new(&namespace, config.token_shards),
            config: config.clone(),
            #[cfg(test)]
            gate: None,
        };
        store.load_library().await?;
        Ok(store)
    }

    /// Runs one Redis call `op` of a transition. In production it is simply awaited; under the
    /// randomized checker (test builds) the gate decides when it runs and what fault it meets (a
    /// lost reply, a re-send, the caller's death). Every call that producers, slots, recovery and
    /// operators make goes through here or through [`fcall`](Self::fcall).
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
        op().await
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

    /// A store for the randomized checker: every call goes through `gate`, and the library loaded
    /// is the checker's (a virtual clock).
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
            gate: Some(gate),
        };
        store.load_library().await?;
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

    /// Loads (or replaces) the functions library. A user whose ACL does not allow
    /// `FUNCTION LOAD` relies on it being loaded already (by an operator, or another component);
    /// if it is not, the first call says so.
    async fn load_library(&self) -> Result<()> {
        #[cfg(test)]
        let code =
            if self.gate.is_some() { crate::protocol::checker_library_source() } else { library_source() };
        #[cfg(not(test))]
        let code = library_source();
        let loaded = if self.client.is_clustered() {
            self.client.function_load_cluster::<(), _>(true, code).await
        } else {
            self.client.function_load::<Value, _>(true, code).await.map(|_| ())
        };
        match loaded {
            Err(e) if e.details().starts_with("NOPERM") => {
                tracing::debug!("not allowed to load the functions library; using the one loaded");
                Ok(())
            }
            other => other.map_err(Error::from),
        }
    }

    /// Calls one function of the library. `keys` must share a hash tag: the call is routed to the
    /// slot of the first key. The call is sent as a plain pipelined command (fred would otherwise
    /// treat FCALL as blocking and serialise it); a library missing after a FUNCTION FLUSH or a
    /// failover to an empty node is loaded again and the call retried once.
    ///
    /// A call refused because its slot is moving (`TRYAGAIN` while the slot's keys are split over
    /// two masters, or a `MOVED`/`ASK` our clients do not follow, see
    /// [`not_executed`](crate::error::not_executed)) did not run, so it is re-sent until it runs
    /// or `unresponsive_timeout` has passed ([`retry_not_executed`]). Without this a slot
    /// migration failed every `acquire`, `ack`, `census` and submit that touched the slot (an
    /// `ack` or `acquire` then waited a lease for recovery).
    pub(crate) async fn fcall(&self, func: Func, keys: &[&str], args: Vec<Value>) -> Result<Value> {
        let first = keys.first().copied().unwrap_or_default();
        self.call(func.local_name(), first, || {
            retry_not_executed(func.local_name(), self.config.unresponsive, || {
                self.fcall_loaded(func, keys, args.clone())
            })
        })
        .await
    }

    /// [`fcall`](Self::fcall) without the retry on a moving slot.
    async fn fcall_loaded(&self, func: Func, keys: &[&str], args: Vec<Value>) -> Result<Value> {
        match self.fcall_once(func, keys, args.clone()).await {
            Err(e) if is_missing_function(&e) => {
                tracing::info!(function = func.local_name(), "functions library missing; loading it again");
                self.load_library().await?;
                self.fcall_once(func, keys, args).await.map_err(|e| {
                    if is_missing_function(&e) {
                        Error::Config(format!(
                            "the sluicegate functions library ({}) is not loaded on this Redis, and this user may \
                             not load it (FUNCTION LOAD): connect once as a user that may",
                            crate::protocol::LIBRARY_NAME
                        ))
                    } else {
                        Error::from(e)
                    }
                })
            }
            other => other.map_err(Error::from),
        }
    }

    async fn fcall_once(
        &self,
        func: Func,
        keys: &[&str],
        args: Vec<Value>,
    ) -> Result<Value, fred::error::Error> {
        let slot = keys.first().map(|k| fred::util::redis_keyslot(k.as_bytes()));
        let cmd = CustomCommand::new("FCALL", slot.map_or(ClusterHash::Random, ClusterHash::Custom), false);
        let mut all: Vec<Value> = Vec::with_capacity(2 + keys.len() + args.len());
        all.push(func.fcall_name().into());
        all.push((keys.len() as i64).into());
        all.extend(keys.iter().map(|k| Value::from(*k)));
        all.extend(args);
        self.client.custom::<Value, Value>(cmd, all).await
    }
}

fn is_missing_function(e: &fred::error::Error) -> bool {
    let d = e.details();
    d.contains("Function not found") || d.contains("NOSCRIPT")
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
            // did not run: see `error::not_executed`). `Store::fcall` re-sends such calls; the
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
