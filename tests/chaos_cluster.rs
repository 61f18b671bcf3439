//! The chaos suite on a 3-master Redis Cluster (issue 6): 100 requests, 5,000 sub-requests, limits
//! 1 to 4, four worker *processes* of four slots pointed at the cluster, every node with AOF
//! `appendfsync always`. Once 30% of the requests are done, the master owning the token lists'
//! slot (`{<ns>.q0}`) is SIGKILLed and restarted 1.5 s later. Afterwards the same checks as the
//! single-Redis runs of tests/chaos.rs: every request terminal exactly once, nothing lost (the
//! data was persisted, docs/operations.md), no limit exceeded, every token accounted for, no key
//! left after retention on any master.
//!
//! ```text
//! cargo test --test chaos_cluster -- --nocapture
//! ```

#![allow(unreachable_pub)]

#[path = "support/census.rs"]
mod census;
#[path = "support/chaos.rs"]
mod chaos;
#[path = "support/proxy.rs"]
mod proxy;

use std::time::Duration;

use chaos::{Fault, Scenario};

// History: this run once failed about 1 in 4 (a completion event lost, or a record expired before
// `wait()` read it). The master's restart stalled every client ~6.5 s (fred rebuilds a clustered
// client's connections as a whole, and the reconnect delay had grown to 5 s), longer than the 5 s
// retention, and a request whose finishing worker stalled between its terminal ack and
// `finish_index` had its record expire first; recovery then dropped it without its event. Fixed by
// holding a finished request's keys until its event is written (`seal`, docs/architecture.md) and by
// capping the reconnect delay at 1 s; tests/suites/recovery.rs covers the first deterministically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_cluster_master_restart_loses_nothing() {
    let fault = Fault::ClusterMasterRestart { at: 0.3, down: Duration::from_millis(1500) };
    let mut scenario = Scenario::acceptance("cluster-restart", fault);
    if !chaos::soak() {
        scenario.requests = 100;
    }
    let figures = chaos::run(scenario).await;
    println!("{figures}");
    figures.assert_passed();
}
