//! Calling the functions library: loading it, and the one raw FCALL every typed call goes through.

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};

use super::{library_revision, library_source, Func, LIBRARY_NAME, PROTOCOL_VERSION};
use crate::config::Config;
use crate::error::{retry_not_executed, Error, Result};
use crate::store::Store;

/// Connects (see `Store::connect`) and loads the functions library.
pub(crate) async fn connect(config: &Config) -> Result<Store> {
    let store = Store::connect(config).await?;
    let loaded = store.load_library().await;
    crate::store::hang_up_unless(&store.client, loaded).await?;
    Ok(store)
}

impl Store {
    /// Loads the functions library, unless the one loaded (on every master of a cluster) is of
    /// this build's revision or a newer one (`sg2_revision`; docs/operations.md, "Upgrades"): an
    /// older component that connects after a newer one keeps the newer library rather than
    /// replacing it with its own, and a connect does not make Redis compile the library again
    /// (a `FUNCTION LOAD` of it blocks Redis for about 13 ms on this project's test machine).
    /// A user whose ACL does not allow `FUNCTION LOAD` relies on it being loaded already (by an
    /// operator, or another component); if it is not, the first call says so.
    pub(crate) async fn load_library(&self) -> Result<()> {
        self.load_library_asking(true).await
    }

    /// Loads the functions library without asking which revision is loaded: after a call found
    /// it missing, the master that lacks it may be one the cluster state this client cached does
    /// not name yet, which the question would not reach.
    async fn reload_library(&self) -> Result<()> {
        self.load_library_asking(false).await
    }

    /// [`load_library`](Self::load_library) when `ask_revision`, else
    /// [`reload_library`](Self::reload_library).
    async fn load_library_asking(&self, ask_revision: bool) -> Result<()> {
        #[cfg(feature = "test-clock")]
        if self.config.test_clock {
            return self.load_test_clock_library().await;
        }
        // (The checker's library differs from the one of its revision by its clock: loaded always.)
        #[cfg(test)]
        let code = if self.gate.is_some() { Some(super::checker_library_source()) } else { None };
        #[cfg(not(test))]
        let code = None;
        let code = match code {
            Some(code) => code,
            None if !ask_revision => library_source(),
            None => {
                let ours = library_revision();
                match self.loaded_revision().await {
                    Some(loaded) if loaded >= ours => {
                        if loaded > ours {
                            tracing::debug!(
                                loaded,
                                ours,
                                "a newer revision of the functions library is loaded; using it"
                            );
                        }
                        return Ok(());
                    }
                    _ => library_source(),
                }
            }
        };
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
            // At maxmemory every write is refused, a library load too: reads, and the read-only
            // functions, still work with the library already there (the first write says why).
            Err(e) if e.details().starts_with("OOM") => {
                tracing::debug!("Redis is at its maxmemory: using the functions library already loaded");
                Ok(())
            }
            other => other.map_err(Error::from),
        }
    }

    /// The revision of the library loaded (the oldest of the masters' on a cluster), or `None`
    /// when one has none: no library, one from before revisions, or a reply that says nothing
    /// (then the caller loads its own, as every connect did before revisions).
    async fn loaded_revision(&self) -> Option<u64> {
        if self.client.is_clustered() && self.client.cached_cluster_state().is_none() {
            // Which masters there are is not known yet: each may lack it.
            return None;
        }
        let name = format!("sg{PROTOCOL_VERSION}_revision");
        let mut oldest: Option<u64> = None;
        for node in self.masters() {
            let cmd = CustomCommand::new("FCALL_RO", ClusterHash::Random, false);
            let args: Vec<Value> = vec![name.as_str().into(), 0.into()];
            let revision: std::result::Result<u64, _> = match &node {
                Some(server) => self.client.with_cluster_node(server.clone()).custom(cmd, args).await,
                None => self.client.custom(cmd, args).await,
            };
            let revision = revision.ok()?;
            oldest = Some(oldest.map_or(revision, |o| o.min(revision)));
        }
        oldest
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
                self.reload_library().await?;
                self.fcall_once(func, keys, args).await.map_err(|e| {
                    if is_missing_function(&e) {
                        Error::Config(format!(
                            "the sluicegate functions library ({}) is not loaded on this Redis, and this user may \
                             not load it (FUNCTION LOAD): connect once as a user that may",
                            LIBRARY_NAME
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
        // The read-only functions go as FCALL_RO: they then run while Redis is at its maxmemory too.
        let name = if func.read_only() { "FCALL_RO" } else { "FCALL" };
        let cmd = CustomCommand::new(name, slot.map_or(ClusterHash::Random, ClusterHash::Custom), false);
        let mut all: Vec<Value> = Vec::with_capacity(2 + keys.len() + args.len());
        all.push(func.fcall_name().into());
        all.push((keys.len() as i64).into());
        all.extend(keys.iter().map(|k| Value::from(*k)));
        all.extend(args);
        self.client.custom::<Value, Value>(cmd, all).await
    }
}

impl Store {
    /// Every master of a cluster (`Some`), or the one server (`None`).
    fn masters(&self) -> Vec<Option<fred::types::config::Server>> {
        match self.client.cached_cluster_state() {
            Some(state) if self.client.is_clustered() => {
                state.unique_primary_nodes().into_iter().map(Some).collect()
            }
            _ => vec![None],
        }
    }
}

/// The test build of the library (`Config::test_clock`), loaded on every master without REPLACE:
/// one loaded already (by another component of the test) keeps the clock the test set.
#[cfg(feature = "test-clock")]
impl Store {
    async fn load_test_clock_library(&self) -> Result<()> {
        let code = super::library::test_clock_library_source();
        for node in self.masters() {
            let loaded = match &node {
                Some(server) => {
                    self.client
                        .with_cluster_node(server.clone())
                        .function_load::<Value, _>(false, code.clone())
                        .await
                }
                None => self.client.function_load::<Value, _>(false, code.clone()).await,
            };
            match loaded {
                Err(e) if e.details().contains("already exists") => {}
                other => {
                    other?;
                }
            }
        }
        Ok(())
    }

    /// Sets the test clock on every master (`sg2_test_clock`): from now on Redis time runs `speed`
    /// times as fast as real time, after a jump of `jump_ms`. Returns the Redis time of the first
    /// master after the change.
    pub(crate) async fn set_test_clock(&self, speed: f64, jump_ms: i64) -> Result<i64> {
        let name = format!("sg{}_test_clock", super::PROTOCOL_VERSION);
        let args: Vec<Value> = vec![name.into(), 0.into(), speed.to_string().into(), jump_ms.into()];
        let mut first = None;
        for node in self.masters() {
            let cmd = CustomCommand::new("FCALL", ClusterHash::Random, false);
            let now: i64 = match &node {
                Some(server) => {
                    self.client.with_cluster_node(server.clone()).custom(cmd, args.clone()).await?
                }
                None => self.client.custom(cmd, args.clone()).await?,
            };
            first.get_or_insert(now);
        }
        first.ok_or_else(|| Error::Config("no Redis master to set the test clock on".into()))
    }
}

fn is_missing_function(e: &fred::error::Error) -> bool {
    let d = e.details();
    d.contains("Function not found") || d.contains("NOSCRIPT")
}
