//! Windows the randomized checker cannot reach: its steps are far apart (it checks the whole
//! namespace after each), so what happens only when calls fall in one millisecond is tested here,
//! with the protocol's calls sent back to back.

use std::time::Duration;

use fred::types::Value;

use crate::keys::home_shard;
use crate::protocol::lane::{cancel, submit, LaneCancelled};
use crate::protocol::listing;
use crate::protocol::submit::NewRequest;
use crate::request::{Priority, RequestId};
use crate::store::Store;

/// A whole single-part request as a producer submits it to its lane with the defaults (limit 1,
/// one attempt, listed, generated nonce "n"), on one token shard.
fn small<'a>(id: &'a RequestId, key_id: &'a str) -> NewRequest<'a> {
    NewRequest {
        id,
        key_id,
        priority: Priority::DEFAULT,
        concurrency: crate::request::Concurrency::new(1).expect("a limit of 1"),
        max_attempts: 1,
        timeout: None,
        backoff_base: Duration::from_millis(1000),
        backoff_max: Duration::from_millis(60_000),
        nonce: "n",
        fail_fast: false,
        shards: 1,
        deadline: 0,
        window: 0,
        discard: false,
        tags: &[],
        listed: true,
        trace: "",
        finish_within: None,
        rate: None,
        upstreams: &[],
        run_after_failure: false,
        group: None,
    }
}

/// A small request cancelled, purged and submitted again under its id at once, all in one
/// millisecond here (four calls, no producer round trips between them), leaves its part in the
/// lane. The request that took the id gets a lifecycle of its own, so the old part is acked
/// away unrun when handed out (its lifecycle is not live) and never runs as the new one's part:
/// each request ends with the result of its own payload. With lifecycles of created ms * 1000
/// alone, the old part ran as the new one's and its result was the new request's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_submitted_again_under_an_id_purged_in_its_millisecond_runs_only_its_own_part() {
    let redis = sluicegate_testkit::TestRedis::start().await.unwrap();
    let ns = sluicegate_testkit::unique_namespace("lane-again");
    let config = crate::Config::new(redis.url()).namespace(ns.as_str()).token_shards(1);
    let store = Store::connect(&config).await.unwrap();
    let encode = |v: u64| Value::Bytes(rmp_serde::to_vec(&v).unwrap().into());
    let (mut same_ms, mut ids) = (0, Vec::new());
    for n in 0..300u64 {
        let id = RequestId::new(format!("again-{n}")).unwrap();
        let key_id = id.key_id();
        let req = small(&id, &key_id);
        let shard = home_shard(&key_id, config.token_shards);
        let old = submit(&store, &req, vec![encode(1000 + n)]).await.unwrap();
        assert!(matches!(cancel(&store, shard, &key_id).await.unwrap(), LaneCancelled::Now { .. }));
        assert!(listing::purge_lane(&store, shard, &key_id).await.unwrap());
        let new = submit(&store, &req, vec![encode(n)]).await.unwrap();
        assert_ne!(old, new, "{id}: the request that took the id has the purged one's lifecycle");
        let ms = |lc: &str| lc[..lc.len() - 3].to_owned();
        same_ms += u32::from(ms(&old) == ms(&new));
        ids.push(id);
        if same_ms >= 20 {
            break;
        }
    }
    // The window this test is about was reached: both submits in one millisecond.
    assert!(same_ms > 0, "no request was submitted again within the millisecond of the one purged");
    struct Echo;
    #[async_trait::async_trait]
    impl crate::Handler for Echo {
        type Input = u64;
        type Output = u64;
        async fn handle(&self, _: crate::Context, v: u64) -> std::result::Result<u64, crate::HandlerError> {
            Ok(v)
        }
    }
    let worker = crate::Worker::builder(&config, Echo).slots(2).build().await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(worker.run_until(stop.clone().cancelled_owned()));
    let producer = crate::Producer::connect(&config).await.unwrap();
    for (n, id) in ids.iter().enumerate() {
        let done = producer.handle(id.clone()).wait_timeout::<u64>(Duration::from_secs(30)).await.unwrap();
        assert_eq!(
            done.into_outputs().unwrap(),
            vec![n as u64],
            "{id} ran the part of the request it replaced"
        );
    }
    stop.cancel();
    running.await.unwrap().unwrap();
}

/// A slot that offered a hand-off and withdraws its offer (`untake`) after a submit handed it a
/// lane's token it never read leaves that token's record to recovery (`<holder>/lost/<take>`):
/// the token is held, its first batch handed out, and nothing else would find it before recovery's
/// backstop, every census interval (60 s by default, where the contract promises a lease plus a
/// recovery interval). The slot reclaims it at once (`recovery::reclaim_untaken`): the record
/// ends and the token is back on its list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_token_handed_to_an_offer_withdrawn_unread_is_back_on_its_list_at_once() {
    use crate::protocol::tokens;
    use fred::prelude::{HashesInterface, ListInterface};
    let redis = sluicegate_testkit::TestRedis::start().await.unwrap();
    let ns = sluicegate_testkit::unique_namespace("withdrawn");
    let config = crate::Config::new(redis.url()).namespace(ns.as_str()).token_shards(1);
    let store = Store::connect(&config).await.unwrap();
    let (holder, shard) = ("w1/0", 0);
    // An offering take that finds nothing: the slot's next take (2) is offered a hand-off.
    let took = tokens::take(
        &store,
        shard,
        holder,
        "w1",
        1,
        None,
        false,
        4,
        Priority::MIN,
        Some((2, Duration::from_secs(30))),
        None,
    )
    .await
    .unwrap();
    assert!(matches!(took, tokens::Take::Empty), "the offering take took something");
    let id = RequestId::new("handed").unwrap();
    let key_id = id.key_id();
    let req = small(&id, &key_id);
    submit(&store, &req, vec![Value::Bytes(rmp_serde::to_vec(&7u64).unwrap().into())]).await.unwrap();
    let (held, list) = (store.keys.held(shard), store.keys.token_list(shard, Priority::DEFAULT));
    let record: Option<String> = store.client.hget(held.as_str(), holder).await.unwrap();
    // `<key id>|<k>|<epoch>|<take id>|<list>`: the hand-off stands for the slot's take 2.
    assert_eq!(
        record.as_deref().and_then(|r| r.split('|').nth(3)),
        Some("2"),
        "the hand-off is not recorded"
    );
    let queued: u64 = store.client.llen(list.as_str()).await.unwrap();
    assert_eq!(queued, 0, "the token was pushed, not handed");

    // The slot withdraws its offer without reading the hand-off.
    assert!(tokens::untake(&store, shard, holder, 2).await.unwrap());
    let lost = format!("{holder}/lost/2");
    let kept: Option<String> = store.client.hget(held.as_str(), lost.as_str()).await.unwrap();
    assert!(kept.is_some(), "the lane token's record is not kept for recovery");
    let metrics = crate::worker::WorkerMetrics::default();
    crate::worker::recovery::reclaim_untaken(&store, &metrics, shard, holder, 2).await.unwrap();
    let kept: Option<String> = store.client.hget(held.as_str(), lost.as_str()).await.unwrap();
    assert!(kept.is_none(), "the record is left for recovery's backstop");
    let queued: u64 = store.client.llen(list.as_str()).await.unwrap();
    assert_eq!(queued, 1, "the lane's token is not back on its list");
}

/// A request of one part handed out without its record (its token's running marks name it),
/// cancelled while its part runs, purged, and submitted again under its id, then cancelled again
/// before any hand-out: the second cancel must not take the first request's running mark for the
/// new one's (marks name the lifecycle), or the new request's entry would be handed out and its
/// cancelled part would start. Here every call is sent back to back, as the checker's steps cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_request_of_an_id_whose_earlier_request_still_runs_never_starts() {
    use crate::protocol::tokens::{self, Next, Take};
    let redis = sluicegate_testkit::TestRedis::start().await.unwrap();
    let ns = sluicegate_testkit::unique_namespace("marks-again");
    let config = crate::Config::new(redis.url()).namespace(ns.as_str()).token_shards(1);
    let store = Store::connect(&config).await.unwrap();
    let encode = |v: u64| Value::Bytes(rmp_serde::to_vec(&v).unwrap().into());
    let id = RequestId::new("again").unwrap();
    let key_id = id.key_id();
    let req = small(&id, &key_id);
    let take = |holder: &'static str| {
        let store = store.clone();
        async move {
            let took = tokens::take(&store, 0, holder, holder, 1, None, false, 4, Priority::MIN, None, None)
                .await
                .unwrap();
            match took {
                Take::Took(t) => match t.acquired {
                    Some(Next::Run(entries, _)) => entries,
                    _ => Vec::new(),
                },
                _ => Vec::new(),
            }
        }
    };
    submit(&store, &req, vec![encode(1)]).await.unwrap();
    let first = take("w1/0").await;
    assert_eq!(first.len(), 1, "the first request's part is not handed out");
    assert!(matches!(cancel(&store, 0, &key_id).await.unwrap(), LaneCancelled::Now { .. }));
    assert!(listing::purge_lane(&store, 0, &key_id).await.unwrap());
    submit(&store, &req, vec![encode(2)]).await.unwrap();
    assert!(matches!(cancel(&store, 0, &key_id).await.unwrap(), LaneCancelled::Now { .. }));
    let second = take("w2/0").await;
    assert!(second.is_empty(), "the cancelled request's part was handed out: {second:?}");
}

/// A producer's finalize whose reply was lost is sent again (the store re-sends a call after
/// a reconnect): the copy answers as the first call did, for a request still running and for
/// one the first call finished, where it was refused as not open before. An operator's
/// finalize (no nonce) of a finalized request is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_finalize_sent_again_answers_as_the_first_did() {
    let redis = sluicegate_testkit::TestRedis::start().await.unwrap();
    let ns = sluicegate_testkit::unique_namespace("finalize-again");
    let config = crate::Config::new(redis.url()).namespace(ns.as_str());
    let producer = crate::Producer::connect(&config).await.unwrap();
    let store = &producer.store;
    let admin = crate::Admin::connect(&config).await.unwrap();

    // Parts left: open, and open again.
    let mut running = producer.request().open().await.unwrap();
    running.add(vec![1u64, 2]).await.unwrap();
    let (key_id, nonce) = (running.key_id.clone(), running.nonce.clone());
    crate::shards::finalize(store, &key_id, &nonce).await.unwrap();
    crate::shards::finalize(store, &key_id, &nonce).await.expect("a re-sent finalize of a running request");
    let id = running.handle().id().clone();
    assert!(matches!(admin.finalize(&id).await, Err(crate::Error::NotOpen(_))));
    assert_eq!(admin.status(&id).await.unwrap().state, crate::RequestState::Queued);

    // Nothing left: the first call finishes it, and the copy finds it finished.
    let empty = producer.request().open().await.unwrap();
    let (key_id, nonce) = (empty.key_id.clone(), empty.nonce.clone());
    let handle = empty.handle().clone();
    crate::shards::finalize(store, &key_id, &nonce).await.unwrap();
    crate::shards::finalize(store, &key_id, &nonce).await.expect("a re-sent finalize of a finished request");
    let done = handle.wait::<u64>().await.unwrap();
    assert_eq!((done.state, done.total), (crate::RequestState::Completed, 0));
    assert!(matches!(admin.finalize(handle.id()).await, Err(crate::Error::NotOpen(_))));
}

/// A take whose reply its slot never saw is undone at the slot's clean stop (`untake`): the token
/// goes back on its list and, that list having been empty, the push is announced on the shard's
/// `up` channel as every push onto an empty list is, so that slots holding a lower priority give
/// way at their batch's end, not at their quantum's (before, the untake announced nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_an_untake_puts_back_on_an_empty_list_is_announced() {
    use crate::protocol::tokens;
    use fred::prelude::{EventInterface, ListInterface, PubsubInterface};
    let redis = sluicegate_testkit::TestRedis::start().await.unwrap();
    let ns = sluicegate_testkit::unique_namespace("untake-up");
    let config = crate::Config::new(redis.url()).namespace(ns.as_str()).token_shards(1);
    let producer = crate::Producer::connect(&config).await.unwrap();
    let store = producer.store.clone();
    let urgent = Priority::new(90).unwrap();
    // Its own stream: its token is an element of the list, not a lane's.
    producer.request().own_stream(true).priority(90).unwrap().submit(vec![1u64]).await.unwrap();
    let (holder, shard) = ("w1/0", 0);
    let took = tokens::take(&store, shard, holder, "w1", 1, None, false, 4, Priority::MIN, None, None)
        .await
        .unwrap();
    assert!(matches!(took, tokens::Take::Took(_)), "the request's token was not taken");
    let list = store.keys.token_list(shard, urgent);
    let queued: u64 = store.client.llen(list.as_str()).await.unwrap();
    assert_eq!(queued, 0, "the token is still on its list");

    let sub = store.subscriber().await.unwrap();
    let mut heard = sub.message_rx();
    let up = store.keys.up_channel(shard);
    sub.subscribe(up.as_str()).await.unwrap();
    // The subscription is the server's once it counts it (the reply may come after the call).
    for _ in 0..500 {
        let counts: Vec<(String, i64)> = store.client.pubsub_numsub(up.as_str()).await.unwrap();
        if counts.first().is_some_and(|(_, n)| *n == 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(tokens::untake(&store, shard, holder, 1).await.unwrap());
    let queued: u64 = store.client.llen(list.as_str()).await.unwrap();
    assert_eq!(queued, 1, "the token is not back on its list");
    let message = tokio::time::timeout(Duration::from_secs(5), heard.recv())
        .await
        .expect("the token put back on an empty list was not announced on the shard's `up` channel")
        .unwrap();
    assert_eq!(message.value.as_string().as_deref(), Some("90"), "announced with another priority");
}
