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

#[path = "support/chaos.rs"]
mod chaos;
#[path = "support/proxy.rs"]
mod proxy;

use std::time::Duration;

use chaos::{Fault, Scenario};

// Ignored: it reveals a real failure, intermittently (2 of 9 runs on 2 cores; the others pass in
// ~17 s with lost=0). After the master holding `{<ns>.q0}` was SIGKILLed and restarted (AOF
// `appendfsync always`, cluster ok again ~3.6 s after the kill), either
// (a) a request submitted before the kill, whose keys hash to that same master, vanished:
//     `RequestHandle::wait()` returned `Error` "no request with id "…" (never submitted, or its
//     results expired)" from ~5 s (one retention) after the restart on, its meta hash, its `active`
//     entry and any completion event were gone, and a worker's heartbeat then logged "lease lost;
//     cancelling its handler" for it; nothing completed it (seed 2642576437949552328); or
// (b) every `wait()` returned Completed, but both `Listener`s missed the same one completion
//     (heard 99/100; seed 9422434357987601527): its `finish_index` event was never read.
// Diagnosis (seed 18113354059280940284, case (a)): the request's meta lived on a surviving master;
// a worker wrote its terminal record ("request finished state=completed") just after the restart,
// then every client stalled ~6.5 s (the worker's next log line, its leases lost, came 6.6 s later)
// while fred reconnected to the restarted node. That is longer than the harness's 5 s retention:
// the terminal record expired before `wait()` read it, and `finish_index` (event XADD + `active`
// ZREM on the `{<ns>.q0}` master) never landed, so recovery's census later found the request
// "gone" and dropped its `active` entry WITHOUT emitting the completion event. With a 20 s
// retention the run passed 4 of 4. Two things to fix in sluicegate: the census's "gone" branch
// loses the event of a request that finished but whose `finish_index` was missed; and a ~6 s
// stall of every client on one master's restart.
// Run it with `cargo test --test chaos_cluster -- --ignored --nocapture` (diagnosis on failure).
#[ignore = "sluicegate loses a request or a completion event when the token-shard master restarts; see the comment"]
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
