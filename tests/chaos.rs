//! The chaos suite (issue 3, faults of CONTRACT.md): 200 requests, 10,000 sub-requests, limits 1 to
//! 4, four worker *processes* of four slots, against a redis-server of the test's own, under one
//! fault per test. Each test prints its figures and fails on any broken promise: a lost
//! sub-request, a limit exceeded, a request without exactly one terminal record, a listener that
//! missed or repeated a completion, a token unaccounted for, a key left after retention.
//!
//! ```text
//! cargo test --test chaos -- --nocapture                   # the three runs, one after the other
//! SLUICEGATE_SOAK=1 cargo test --test chaos -- --nocapture  # 1000 requests per run, 4 restarts
//! SLUICEGATE_CHAOS_SKIP=kill,cut cargo test --test chaos    # leave faults out (checks the harness)
//! SLUICEGATE_CHAOS_SEED=42 ...                              # replay a workload
//! cargo test --test chaos cluster -- --nocapture           # the cluster run alone
//! ```

#![allow(unreachable_pub)]

#[path = "support/census.rs"]
mod census;
#[path = "support/chaos.rs"]
mod chaos;
#[path = "support/logs.rs"]
mod logs;

use std::time::Duration;

use chaos::{skipped, Fault, Scenario};
use sluicegate_testkit::proxy::ProxyChaos;

/// The runs take all the machine (four worker processes, Redis, the test): one at a time, or they
/// would starve each other's heartbeats. A tokio mutex, because the guard is held across awaits
/// and a failed test must not poison it for the others.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn run_and_check(name: &str, fault: Fault) {
    let _turn = ONE_AT_A_TIME.lock().await;
    let figures = chaos::run(Scenario::acceptance(name, fault)).await;
    println!("{figures}");
    figures.assert_passed();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_workers_lose_nothing() {
    if skipped("kill") {
        return run_and_check("kill(skipped)", Fault::None).await;
    }
    let every = Duration::from_millis(200)..=Duration::from_millis(500);
    run_and_check("kill", Fault::KillWorkers { every }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_connection_cuts_lose_nothing() {
    let cuts = !skipped("cut");
    let plan = ProxyChaos {
        every: Duration::from_millis(100)..=Duration::from_millis(300),
        cut_share: if cuts { 0.5 } else { 0.0 },
        // Below the lease (1.5 s) minus a heartbeat (0.3 s), with room for a slow machine: a
        // longer stall would fence the stalled worker legitimately.
        stall: Duration::from_millis(50)..=Duration::from_millis(500),
    };
    run_and_check(if cuts { "cut" } else { "cut(stalls only)" }, Fault::Proxy(plan)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_redis_restart_loses_nothing() {
    if skipped("restart") {
        return run_and_check("restart(skipped)", Fault::None).await;
    }
    // In the middle: once 30% of the requests are done (a soak run restarts four times).
    let at = if chaos::soak() { vec![0.2, 0.4, 0.6, 0.8] } else { vec![0.3] };
    run_and_check("restart", Fault::RedisRestart { at }).await;
}

/// The same checks on a 3-master Redis Cluster, every node with AOF `appendfsync always`: once 30%
/// of the requests are done, the master owning the token lists' slot (`{<ns>.q0}`) is SIGKILLed and
/// restarted 1.5 s later (100 requests, 5,000 sub-requests; the soak mode runs the full 200).
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
    // A waiter whose request lives on the killed master cannot read it until the cluster is ok
    // again (about 4 s, more beside other tests), and its backoff then adds up to 2 s: a request
    // finished just before the kill could expire unread at the default 5 s. That is the likeliest
    // reading of one CI run whose waiter found its request unknown (not reproduced since; the
    // run now says at once whether the listeners heard such a request finish).
    scenario.retention = Duration::from_secs(20);
    let _turn = ONE_AT_A_TIME.lock().await;
    let figures = chaos::run(scenario).await;
    println!("{figures}");
    figures.assert_passed();
}
