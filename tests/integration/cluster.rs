//! sluicegate on a Redis Cluster: a local 3-master cluster from `RedisCluster` (or the one named by
//! `REDIS_CLUSTER_URLS`), fred talking to it, and one end-to-end run of producer, worker and listener,
//! with the per-master command counts printed (the token hot spot of issue 6).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use fred::prelude::{ClientLike, ClusterInterface, KeysInterface};
use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Listener, Producer, Worker};
use sluicegate_testkit::{command_calls, connect, keys_in_namespace, unique_namespace, RedisCluster};
use tokio_util::sync::CancellationToken;

const REQUESTS: u64 = 20;
const PARTS: u64 = 20;

async fn cluster() -> RedisCluster {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    RedisCluster::start().await.unwrap_or_else(|e| panic!("{e}"))
}

/// `redis://host:port` of the master serving `key`, from fred's view of the cluster.
fn owner(client: &fred::prelude::Client, key: &str) -> String {
    let slot = fred::util::redis_keyslot(key.as_bytes());
    let state = client.cached_cluster_state().expect("a clustered client knows the slots");
    format!("redis://{}", state.get_server(slot).expect("every slot is served"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_forms_and_fred_reads_and_writes_keys_in_every_slot_range() {
    let cluster = cluster().await;
    let masters = cluster.masters().await.unwrap();
    assert!(masters.len() >= 3, "masters: {masters:?}");
    let url = cluster.url();
    assert!(url.starts_with("redis-cluster://"), "{url}");

    let client = connect(&url).await.unwrap();
    assert!(client.is_clustered());
    let ns = unique_namespace("clform");
    // Keys under different hash tags land in different slots, hence on different masters.
    let keys: Vec<String> = (0..30).map(|i| format!("{ns}:{{tag{i}}}:k")).collect();
    for (i, key) in keys.iter().enumerate() {
        let () = client.set(key.as_str(), i as i64, None, None, false).await.unwrap();
    }
    for (i, key) in keys.iter().enumerate() {
        let value: Option<i64> = client.get(key.as_str()).await.unwrap();
        assert_eq!(value, Some(i as i64), "{key}");
    }
    let slots: BTreeSet<u16> = keys.iter().map(|k| fred::util::redis_keyslot(k.as_bytes())).collect();
    assert!(slots.len() > 20, "distinct slots: {}", slots.len());

    // Each master holds some of them, and the cluster-wide scan finds all of them.
    let owners: BTreeSet<String> = keys.iter().map(|k| owner(&client, k)).collect();
    assert_eq!(owners, masters.iter().cloned().collect::<BTreeSet<_>>(), "30 tags cover every master");
    for master in &masters {
        let on_node = keys_in_namespace(master, &ns).await.unwrap();
        let expected = keys.iter().filter(|k| owner(&client, k) == *master).count();
        assert_eq!(on_node.len(), expected, "keys on {master}");
    }
    let mut found = keys_in_namespace(&url, &ns).await.unwrap();
    found.sort();
    let mut expected = keys.clone();
    expected.sort();
    assert_eq!(found, expected);

    let _: i64 = futures::future::try_join_all(keys.iter().map(|k| client.del::<i64, _>(k.as_str())))
        .await
        .unwrap()
        .into_iter()
        .sum();
    assert!(keys_in_namespace(&url, &ns).await.unwrap().is_empty());
    client.quit().await.unwrap();
}

/// Doubles its input.
struct Double;

#[async_trait]
impl Handler for Double {
    type Input = u64;
    type Output = u64;

    async fn handle(&self, _ctx: Context, n: u64) -> Result<u64, HandlerError> {
        Ok(n * 2)
    }
}

/// Commands of interest per master, from `INFO commandstats`.
async fn command_snapshot(masters: &[String]) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut all = BTreeMap::new();
    for master in masters {
        all.insert(master.clone(), command_calls(master).await.unwrap());
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_run_end_to_end_on_the_cluster_and_leave_nothing_behind() {
    let cluster = cluster().await;
    let masters = cluster.masters().await.unwrap();
    let ns = unique_namespace("cl");
    let config = Config::new(cluster.url())
        .namespace(ns.clone())
        .retention(Duration::from_secs(1))
        .lease(Duration::from_secs(5))
        .heartbeat(Duration::from_secs(1))
        .wait_poll(Duration::from_millis(500));
    let before = command_snapshot(&masters).await;

    let worker = Worker::builder(&config, Double)
        .slots(4)
        .idle_poll(Duration::from_millis(100))
        .build()
        .await
        .unwrap_or_else(|e| panic!("Worker::build on the cluster: {e}"));
    let stop = CancellationToken::new();
    let signal = stop.clone();
    let worker = tokio::spawn(worker.run_until(async move { signal.cancelled().await }));

    let mut listener =
        Listener::connect(&config).await.unwrap_or_else(|e| panic!("Listener::connect on the cluster: {e}"));
    let producer =
        Producer::connect(&config).await.unwrap_or_else(|e| panic!("Producer::connect on the cluster: {e}"));
    let started = Instant::now();
    let mut handles = Vec::new();
    for r in 0..REQUESTS {
        let limit = 1 + (r % 4) as u32;
        let parts = (0..PARTS).map(|i| r * 1000 + i);
        let h = producer
            .request()
            .concurrency(limit)
            .unwrap()
            .submit(parts)
            .await
            .unwrap_or_else(|e| panic!("submit of request {r} on the cluster: {e}"));
        handles.push(h);
    }
    for (r, h) in (0..REQUESTS).zip(&handles) {
        let done = h
            .wait_timeout::<u64>(Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("wait for request {r} ({}) on the cluster: {e}", h.id()));
        let outputs = done.into_outputs().unwrap();
        let expected: Vec<u64> = (0..PARTS).map(|i| (r * 1000 + i) * 2).collect();
        assert_eq!(outputs, expected, "results of request {r}");
    }
    let elapsed = started.elapsed();

    let mut seen = BTreeSet::new();
    while seen.len() < handles.len() {
        let event = tokio::time::timeout(Duration::from_secs(5), listener.next())
            .await
            .unwrap_or_else(|_| panic!("listener saw only {} of {} completions", seen.len(), handles.len()))
            .unwrap();
        assert!(seen.insert(event.id.to_string()), "duplicate completion {}", event.id);
    }
    let expected: BTreeSet<String> = handles.iter().map(|h| h.id().to_string()).collect();
    assert_eq!(seen, expected);

    stop.cancel();
    worker.await.unwrap().unwrap();
    drop(listener);
    drop(producer);
    let after = command_snapshot(&masters).await;

    // (c) The commands each master served for this run (other tests' traffic too on a shared cluster).
    let client = connect(&cluster.url()).await.unwrap();
    let token_owner = owner(&client, &format!("{ns}:{{{ns}.q0}}:active"));
    client.quit().await.unwrap();
    println!(
        "cluster run: {REQUESTS} requests x {PARTS} parts in {elapsed:?}; token keys {{{ns}.q0}} on {token_owner}"
    );
    for master in &masters {
        let delta = |cmd: &str| {
            let get = |m: &BTreeMap<String, BTreeMap<String, u64>>| {
                m.get(master).and_then(|c| c.get(cmd)).copied().unwrap_or(0)
            };
            get(&after) - get(&before)
        };
        let tokens = if *master == token_owner { "  <- token lists" } else { "" };
        println!(
            "  {master}: fcall={} brpop={} lpush={} rpush={} xadd={} xreadgroup={}{tokens}",
            delta("fcall"),
            delta("brpop"),
            delta("lpush"),
            delta("rpush"),
            delta("xadd"),
            delta("xreadgroup"),
        );
    }

    // After the retention (1 s) nothing of the namespace is left on any master.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let keys = keys_in_namespace(&cluster.url(), &ns).await.unwrap();
        if keys.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "keys left after retention: {keys:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
