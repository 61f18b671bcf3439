//! Calling the functions library: loading it, and the one raw FCALL every typed call goes through.

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};

use super::{library_source, Func, LIBRARY_NAME};
use crate::config::Config;
use crate::error::{retry_not_executed, Error, Result};
use crate::store::Store;

/// Connects (see `Store::connect`) and loads the functions library.
pub(crate) async fn connect(config: &Config) -> Result<Store> {
    let store = Store::connect(config).await?;
    store.load_library().await?;
    Ok(store)
}

impl Store {
    /// Loads (or replaces) the functions library. A user whose ACL does not allow
    /// `FUNCTION LOAD` relies on it being loaded already (by an operator, or another component);
    /// if it is not, the first call says so.
    pub(crate) async fn load_library(&self) -> Result<()> {
        #[cfg(test)]
        let code = if self.gate.is_some() { super::checker_library_source() } else { library_source() };
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
            // At maxmemory every write is refused, a library load too: reads, and the read-only
            // functions, still work with the library already there (the first write says why).
            Err(e) if e.details().starts_with("OOM") => {
                tracing::debug!("Redis is at its maxmemory: using the functions library already loaded");
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

fn is_missing_function(e: &fred::error::Error) -> bool {
    let d = e.details();
    d.contains("Function not found") || d.contains("NOSCRIPT")
}
