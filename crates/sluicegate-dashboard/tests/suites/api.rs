// The body of tests/api.rs: written once, run against a single Redis and a 3-master Redis
// Cluster (`per_topology!` runs it once for each).

use std::time::{Duration, Instant};

use serde_json::Value;
use sluicegate_dashboard::DashboardOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{env, get_json, http, post_json, producer, serve, worker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_answer_json_and_bad_input_gets_a_status_and_a_message_naming_it() {
    let env = env(TOPOLOGY, "dash-api").await;
    let ns = env.config.namespace_str().to_owned();
    let p = producer(&env.config).await;
    let a = p.request().id("a-1").unwrap().priority(40).unwrap().concurrency(2).unwrap().submit(0..10u64).await.unwrap();
    let served = serve(&env.config, DashboardOptions::new()).await;
    let addr = served.addr;

    let (s, config) = get_json(addr, "/api/config", &[]).await;
    assert_eq!((s, &config["namespace"], &config["actions"]), (200, &Value::from(ns.clone()), &Value::Bool(false)));
    let (s, ov) = get_json(addr, "/api/overview", &[]).await;
    assert_eq!(s, 200, "{ov}");
    assert_eq!(ov["tokens"]["drift"], 0, "{ov}");
    assert_eq!(ov["tokens"]["waiting"], 2, "{ov}");
    assert_eq!(ov["recent"]["requests"][0]["id"], "a-1", "{ov}");
    let (s, page) = get_json(addr, "/api/requests?state=queued&priority=40&limit=5", &[]).await;
    assert_eq!((s, page["requests"].as_array().unwrap().len()), (200, 1), "{page}");
    let (s, st) = get_json(addr, "/api/requests/a-1", &[]).await;
    assert_eq!((s, &st["state"], &st["total"]), (200, &Value::from("queued"), &Value::from(10)), "{st}");
    let (s, tokens) = get_json(addr, "/api/requests/a-1/tokens", &[]).await;
    assert_eq!((s, &tokens["expected"], &tokens["queued"]), (200, &Value::from(2), &Value::from(2)), "{tokens}");
    assert_eq!(tokens["tokens"][0]["state"], "queued", "{tokens}");
    let (s, audit) = get_json(addr, "/api/tokens", &[]).await;
    assert_eq!((s, &audit["totals"]["drift"], &audit["unfinished"]), (200, &Value::from(0), &Value::from(1)), "{audit}");
    assert_eq!(audit["requests"][0]["drift"], 0, "{audit}");
    let (s, dead) = get_json(addr, "/api/requests/a-1/dead", &[]).await;
    assert_eq!((s, &dead["total"]), (200, &Value::from(0)), "{dead}");
    let (s, _) = get_json(addr, "/api/workers", &[]).await;
    assert_eq!(s, 200);
    let (s, metrics) = http(addr, "GET", "/metrics", &[], "").await;
    assert_eq!(s, 200);
    assert!(metrics.contains(&format!("sluicegate_token_capacity{{namespace=\"{ns}\"}} 2")), "{metrics}");

    // Tenant groups: each one in use or configured, its limit, tokens, rate and waiting work.
    let (s, g) = get_json(addr, "/api/groups", &[]).await;
    assert_eq!((s, &g["groups"], &g["default_limit"]), (200, &serde_json::json!([]), &Value::from(10)), "{g}");
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    admin.set_group("tenant-a", 3).await.unwrap();
    admin.set_group_rate("tenant-a", Some((5, Duration::from_secs(1)))).await.unwrap();
    p.request().id("g-1").unwrap().priority(40).unwrap().concurrency(2).unwrap().group("tenant-a").unwrap().submit(0..4u64).await.unwrap();
    let (s, g) = get_json(addr, "/api/groups", &[]).await;
    assert_eq!((s, g["groups"].as_array().map(Vec::len)), (200, Some(1)), "{g}");
    let t = &g["groups"][0];
    assert_eq!((&t["name"], &t["limit"], &t["configured"], &t["held"]), (&Value::from("tenant-a"), &Value::from(3), &Value::Bool(true), &Value::from(0)), "{g}");
    assert_eq!((&t["rate"], &t["waiting"]), (&serde_json::json!({"n": 5, "per_ms": 1000}), &serde_json::json!([[40, 2]])), "{g}");
    assert_eq!(t["queued"].as_u64().unwrap() + t["parked"].as_u64().unwrap(), 3, "its limit of group tokens, none held: {g}");
    let (s, one) = get_json(addr, "/api/groups/tenant-a", &[]).await;
    assert_eq!((s, &one), (200, t), "{one}");
    let (s, idle) = get_json(addr, "/api/groups/nobody", &[]).await;
    assert_eq!((s, &idle["limit"], &idle["configured"]), (200, &Value::from(10), &Value::Bool(false)), "{idle}");
    let (s, e) = get_json(addr, "/api/groups/a%20b", &[]).await;
    assert_eq!(s, 400, "{e}");
    assert!(e["error"].as_str().unwrap().contains("a group name is 1 to 64"), "{e}");

    // Bad input: a status and a message that names the problem.
    let (s, e) = get_json(addr, "/api/requests/nobody", &[]).await;
    assert_eq!(s, 404, "{e}");
    assert!(e["error"].as_str().unwrap().contains("no request with id \"nobody\""), "{e}");
    let long = "x".repeat(2000);
    let (s, e) = get_json(addr, &format!("/api/requests/{long}"), &[]).await;
    assert_eq!(s, 400, "{e}");
    assert!(e["error"].as_str().unwrap().contains("invalid request id"), "{e}");
    for (query, names) in [
        ("priority=100", "priority 100"),
        ("state=done", "unknown state \"done\""),
        ("older_than=soon", "older_than \"soon\""),
        ("cursor=zzz", "not a list cursor"),
        ("limit=0", "1 to 1000"),
        ("colour=red", "unknown parameter \"colour\""),
    ] {
        let (s, e) = get_json(addr, &format!("/api/requests?{query}"), &[]).await;
        assert_eq!(s, 400, "{query}: {e}");
        assert!(e["error"].as_str().unwrap().contains(names), "{query}: {e}");
    }
    let (s, e) = get_json(addr, "/api/requests/a-1/dead?limit=0", &[]).await;
    assert_eq!(s, 400, "{e}");
    let (s, e) = get_json(addr, "/api/no-such-thing", &[]).await;
    assert_eq!(s, 404, "{e}");
    assert!(e["error"].as_str().unwrap().contains("/api/no-such-thing"), "{e}");

    // Read-only: every action is refused, and nothing changes.
    for action in ["cancel", "requeue", "purge", "reprioritize"] {
        let (s, e) = post_json(addr, &format!("/api/requests/a-1/{action}"), &[], "{\"priority\": 50}").await;
        assert_eq!(s, 403, "{action}: {e}");
        assert!(e["error"].as_str().unwrap().contains("read-only"), "{e}");
    }
    let (s, _) = post_json(addr, "/api/pause", &[], "{}").await;
    assert_eq!(s, 403);
    assert_eq!(get_json(addr, "/api/requests/a-1", &[]).await.1["state"], "queued");
    a.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_change_requests_and_only_the_right_token_gets_in() {
    let env = env(TOPOLOGY, "dash-act").await;
    let p = producer(&env.config).await;
    p.request().id("b-1").unwrap().priority(40).unwrap().submit(0..10u64).await.unwrap();
    let served = serve(&env.config, DashboardOptions::new().allow_actions(true).token("s3cret")).await;
    let addr = served.addr;
    let auth = [("Authorization", "Bearer s3cret")];

    // Without the token, or with a wrong one: 401, for the API, /metrics and the actions alike.
    for path in ["/api/config", "/api/requests/b-1", "/metrics"] {
        assert_eq!(get_json(addr, path, &[]).await.0, 401, "{path}");
        assert_eq!(get_json(addr, path, &[("Authorization", "Bearer wrong")]).await.0, 401, "{path}");
    }
    let (s, e) = post_json(addr, "/api/requests/b-1/cancel", &[("Authorization", "Bearer nope")], "{}").await;
    assert_eq!(s, 401, "{e}");
    assert!(e["error"].as_str().unwrap().contains("wrong token"), "{e}");
    let (s, _) = http(addr, "GET", "/", &[], "").await;
    assert_eq!(s, 303, "a browser is sent to the login form");
    // The login form: a wrong token is refused, the right one sets a session cookie.
    let form = [("Content-Type", "application/x-www-form-urlencoded")];
    assert_eq!(http(addr, "POST", "/login", &form, "token=guess").await.0, 401);
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = "token=s3cret";
    let request = format!("POST /login HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await.unwrap();
    assert!(reply.starts_with("HTTP/1.1 303"), "{reply}");
    let cookie = reply.lines().find_map(|l| l.strip_prefix("set-cookie: ")).unwrap();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    let session = cookie.split(';').next().unwrap().to_owned();
    assert_eq!(get_json(addr, "/api/config", &[("Cookie", &session)]).await.0, 200);
    assert_eq!(get_json(addr, "/api/config", &[("Cookie", "sluicegate_session=forged")]).await.0, 401);

    // Actions with the token.
    let (s, e) = post_json(addr, "/api/requests/b-1/reprioritize", &auth, "{\"priority\": 120}").await;
    assert_eq!(s, 400, "{e}");
    assert!(e["error"].as_str().unwrap().contains("priority 120"), "{e}");
    let (s, r) = post_json(addr, "/api/requests/b-1/reprioritize", &auth, "{\"priority\": 70}").await;
    assert_eq!((s, &r["from"], &r["to"]), (200, &Value::from(40), &Value::from(70)), "{r}");
    p.request().id("b-2").unwrap().group("tenant-b").unwrap().submit(0..2u64).await.unwrap();
    let (s, e) = post_json(addr, "/api/requests/b-2/reprioritize", &auth, "{\"priority\": 70}").await;
    assert_eq!(s, 409, "{e}");
    assert_eq!(e["error"], "refused: a request in a tenant group keeps the priority it was submitted with", "{e}");
    let (s, e) = post_json(addr, "/api/requests/b-1/purge", &auth, "{}").await;
    assert_eq!(s, 409, "an unfinished request is not purged: {e}");
    let (s, r) = post_json(addr, "/api/requests/b-1/cancel", &auth, "{}").await;
    assert_eq!((s, &r["cancelled"]), (200, &Value::Bool(true)), "{r}");
    assert_eq!(get_json(addr, "/api/requests/b-1", &auth).await.1["state"], "cancelled");
    let (s, r) = post_json(addr, "/api/requests/b-1/cancel", &auth, "{}").await;
    assert_eq!((s, &r["cancelled"], &r["already_finished"]), (200, &Value::Bool(false), &Value::from("cancelled")), "{r}");
    let (s, e) = post_json(addr, "/api/requests/b-1/requeue", &auth, "{}").await;
    assert_eq!(s, 409, "{e}");
    let (s, r) = post_json(addr, "/api/requests/b-1/purge", &auth, "{}").await;
    assert_eq!((s, &r["purged"]), (200, &Value::Bool(true)), "{r}");
    assert_eq!(get_json(addr, "/api/requests/b-1", &auth).await.0, 404);
    assert_eq!(post_json(addr, "/api/requests/b-1/purge", &auth, "{}").await.0, 404);
    let (s, e) = http(addr, "POST", "/api/requests/b-1/cancel", &auth, "{}").await;
    assert_eq!(s, 415, "an action takes JSON only: {e}");
    let (s, r) = post_json(addr, "/api/pause", &auth, "{\"priority\": 7}").await;
    assert_eq!((s, &r["paused"]["priorities"][0]), (200, &Value::from(7)), "{r}");
    let (s, r) = post_json(addr, "/api/resume", &auth, "{}").await;
    assert_eq!((s, &r["paused"]["priorities"]), (200, &serde_json::json!([])), "{r}");

    // Dead letters: listed with their payload, and requeued.
    let _w = worker(&env.config, 5, 2).await;
    let c = p.request().id("c-1").unwrap().submit([1u64, u64::MAX, 3]).await.unwrap();
    let _ = c.wait::<u64>().await;
    let (s, dead) = get_json(addr, "/api/requests/c-1/dead", &auth).await;
    assert_eq!((s, &dead["total"]), (200, &Value::from(1)), "{dead}");
    assert_eq!(dead["dead"][0]["index"], 1, "{dead}");
    assert_eq!(dead["dead"][0]["payload"], Value::from(u64::MAX), "{dead}");
    assert!(dead["dead"][0]["error"]["error"].as_str().unwrap().contains("dead letter"), "{dead}");
    let (s, e) = get_json(addr, "/api/requests/c-1/dead?index=7", &auth).await;
    assert_eq!(s, 404, "{e}");
    let (s, r) = post_json(addr, "/api/requests/c-1/requeue", &auth, "{}").await;
    assert_eq!((s, &r["requeued"]), (200, &Value::from(1)), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_stream_sends_readings_and_completion_events() {
    let env = env(TOPOLOGY, "dash-live").await;
    let served = serve(&env.config, DashboardOptions::new()).await;
    let mut stream = tokio::net::TcpStream::connect(served.addr).await.unwrap();
    stream.write_all(b"GET /api/live HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n").await.unwrap();
    let _w = worker(&env.config, 5, 2).await;
    let p = producer(&env.config).await;
    let handle = p.request().id("d-1").unwrap().submit(0..3u64).await.unwrap();
    handle.wait::<u64>().await.unwrap();
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut buf = vec![0u8; 64 * 1024];
    while !(seen.contains("event: overview") && seen.contains("event: completion") && seen.contains("\"id\":\"d-1\"")) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no reading and completion of d-1 within 15 s: {seen}");
        if let Ok(Ok(n)) = tokio::time::timeout(left, stream.read(&mut buf)).await {
            assert!(n > 0, "the stream ended: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
    assert!(seen.contains("content-type: text/event-stream"), "{seen}");
    let (_, events) = get_json(served.addr, "/api/events", &[]).await;
    assert_eq!(events["events"][0]["id"], "d-1", "{events}");
    assert_eq!(events["events"][0]["state"], "completed", "{events}");
    let (_, st) = get_json(served.addr, "/api/requests/d-1", &[]).await;
    assert_eq!(st["completion"]["state"], "completed", "{st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_show_what_their_slots_hold_tokens_their_lease_and_events_are_replayed() {
    let env = env(TOPOLOGY, "dash-slots").await;
    let _w = worker(&env.config, 300, 2).await;
    let p = producer(&env.config).await;
    // Finished before the dashboard starts: its event is replayed from the retained ones.
    p.request().id("e-0").unwrap().submit(0..2u64).await.unwrap().wait::<u64>().await.unwrap();
    let served = serve(&env.config, DashboardOptions::new()).await;
    let addr = served.addr;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, events) = get_json(addr, "/api/events", &[]).await;
        assert_eq!(s, 200, "{events}");
        if events["events"].as_array().is_some_and(|e| !e.is_empty()) {
            assert_eq!(events["events"][0]["id"], "e-0", "{events}");
            assert!(events["events"][0]["at_ms"].as_u64().unwrap() > 1_700_000_000_000, "{events}");
            break;
        }
        assert!(Instant::now() < deadline, "the retained event of e-0 was not replayed: {events}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let slow = p.request().id("w-1").unwrap().concurrency(2).unwrap().own_stream(true).submit(0..8u64).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let busy = loop {
        let (s, workers) = get_json(addr, "/api/workers", &[]).await;
        assert_eq!(s, 200, "{workers}");
        let w = &workers["workers"][0];
        assert_eq!(w["version"], env!("CARGO_PKG_VERSION"), "{workers}");
        let busy: Vec<Value> = w["busy"].as_array().cloned().unwrap_or_default();
        if busy.iter().any(|b| b["request"] == "w-1") {
            break busy;
        }
        assert!(Instant::now() < deadline, "no slot was seen holding a token of w-1: {workers}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for b in &busy {
        assert!(b["slot"].as_str().unwrap().contains('/'), "{b}");
        assert!(b["token"].as_u64().unwrap() < 2, "{b}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, tokens) = get_json(addr, "/api/requests/w-1/tokens", &[]).await;
        assert_eq!(s, 200, "{tokens}");
        let held: Vec<&Value> = tokens["tokens"].as_array().unwrap().iter().filter(|t| t["state"] == "held").collect();
        if let Some(t) = held.first() {
            let lease = t["lease_expires_ms"].as_u64().unwrap_or_else(|| panic!("a held token without its lease: {tokens}"));
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
            // The lease runs from the worker's last beat: in the future, within about a lease.
            assert!(lease + 1_000 > now && lease < now + 120_000, "lease {lease}, now {now}: {tokens}");
            break;
        }
        assert!(Instant::now() < deadline, "no held token of w-1 seen: {tokens}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    slow.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_tally_is_read_every_tally_interval_and_the_readings_between_show_no_drift() {
    let env = env(TOPOLOGY, "dash-tally").await;
    let p = producer(&env.config).await;
    // More than 1,000 records: the tally is read once per tally interval, not at every reading.
    futures::future::try_join_all(
        (0..1_001).map(|_| async { p.request().own_stream(true).submit([1u64]).await.map(drop) }),
    )
    .await
    .unwrap();
    let served = serve(&env.config, DashboardOptions::new().tally_interval(Duration::from_secs(3600))).await;
    let (s, first) = get_json(served.addr, "/api/overview", &[]).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!((&first["tokens"]["drift"], &first["tokens"]["tally_age_ms"]), (&Value::from(0), &Value::from(0)), "{}", first["tokens"]);
    assert_eq!(first["tokens"]["capacity"], 1_001, "{}", first["tokens"]);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (_, second) = get_json(served.addr, "/api/overview", &[]).await;
    assert_eq!(second["tokens"]["drift"], Value::Null, "{}", second["tokens"]);
    assert!(second["tokens"]["tally_age_ms"].as_u64().unwrap() >= 20, "{}", second["tokens"]);
    assert_eq!(second["tokens"]["capacity"], 1_001, "the last tally is carried: {}", second["tokens"]);
    assert_eq!(second["stats"]["tally"]["records_read"], first["stats"]["tally"]["records_read"]);
}

/// A request's graph: two steps each way from it, each node with its state, every link between
/// the nodes shown; bounded by its limit; a neighbour whose retention ran out shows as gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_graph_is_its_neighbourhood_two_steps_each_way_and_bounded() {
    let env = env(TOPOLOGY, "dash-graph").await;
    let p = producer(&env.config).await;
    // A chain g-a -> g-b -> ... -> g-f, and g-x after g-a too. No worker: g-a stays queued and
    // the others wait.
    let mut handles = Vec::new();
    for id in ["g-a", "g-b", "g-c", "g-d", "g-e", "g-f"] {
        let mut request = p.request().id(id).unwrap();
        if let Some(up) = handles.last().map(|h: &sluicegate::RequestHandle| h.id().clone()) {
            request = request.after([up]);
        }
        handles.push(request.submit([1u64]).await.unwrap());
    }
    p.request().id("g-x").unwrap().after([handles[0].id().clone()]).submit([1u64]).await.unwrap();
    let served = serve(&env.config, DashboardOptions::new()).await;
    let addr = served.addr;
    let nodes = |g: &Value| -> Vec<(String, i64, String)> {
        g["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                (
                    n["id"].as_str().unwrap().into(),
                    n["level"].as_i64().unwrap(),
                    n["state"].as_str().unwrap().into(),
                )
            })
            .collect()
    };
    let edges = |g: &Value| -> Vec<(String, String, Value)> {
        let mut e: Vec<(String, String, Value)> = g["edges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (e["from"].as_str().unwrap().into(), e["to"].as_str().unwrap().into(), e["ended"].clone())
            })
            .collect();
        e.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        e
    };
    let owned = |v: &[(&str, i64, &str)]| -> Vec<(String, i64, String)> {
        v.iter().map(|(id, l, s)| ((*id).into(), *l, (*s).into())).collect()
    };
    let link = |from: &str, to: &str, ended: Value| (from.to_owned(), to.to_owned(), ended);

    // Two steps up and two down from g-c; g-f (three down) and g-x (a sibling) are not in it.
    let (s, g) = get_json(addr, "/api/requests/g-c/graph", &[]).await;
    assert_eq!(s, 200, "{g}");
    let want = [
        ("g-c", 0, "waiting"),
        ("g-b", -1, "waiting"),
        ("g-d", 1, "waiting"),
        ("g-a", -2, "queued"),
        ("g-e", 2, "waiting"),
    ];
    assert_eq!(nodes(&g), owned(&want), "{g}");
    let chain = vec![
        link("g-a", "g-b", Value::Null),
        link("g-b", "g-c", Value::Null),
        link("g-c", "g-d", Value::Null),
        link("g-d", "g-e", Value::Null),
    ];
    assert_eq!(edges(&g), chain, "{g}");
    assert_eq!(
        (&g["id"], &g["depth"], &g["truncated"]),
        (&Value::from("g-c"), &Value::from(2), &Value::Bool(false)),
        "{g}"
    );
    // g-a's downstreams: both shown from it.
    let (_, g) = get_json(addr, "/api/requests/g-a/graph?depth=1", &[]).await;
    assert_eq!(g["nodes"].as_array().unwrap().len(), 3, "{g}");
    assert_eq!(g["nodes"][0]["downstreams"], 2, "{g}");
    // Bounded: a limit keeps the nearest, one side after the other, and says it cut.
    let (_, g) = get_json(addr, "/api/requests/g-c/graph?limit=3", &[]).await;
    assert_eq!(
        nodes(&g),
        owned(&[("g-c", 0, "waiting"), ("g-b", -1, "waiting"), ("g-d", 1, "waiting")]),
        "{g}"
    );
    assert_eq!(g["truncated"], true, "{g}");
    let (_, g) = get_json(addr, "/api/requests/g-c/graph?limit=2&depth=1", &[]).await;
    assert_eq!(
        (g["nodes"].as_array().unwrap().len(), edges(&g)),
        (2, vec![link("g-b", "g-c", Value::Null)]),
        "{g}"
    );
    for (query, names) in [
        ("limit=101", "limit \"101\""),
        ("depth=3", "depth \"3\""),
        ("depth=0", "depth \"0\""),
        ("colour=red", "unknown parameter \"colour\""),
    ] {
        let (s, e) = get_json(addr, &format!("/api/requests/g-c/graph?{query}"), &[]).await;
        assert_eq!(s, 400, "{query}: {e}");
        assert!(e["error"].as_str().unwrap().contains(names), "{query}: {e}");
    }
    assert_eq!(get_json(addr, "/api/requests/nobody/graph", &[]).await.0, 404);
    let (_, page) = get_json(addr, "/api/requests?state=waiting", &[]).await;
    let mut waiting: Vec<&str> =
        page["requests"].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap()).collect();
    waiting.sort_unstable();
    assert_eq!(waiting, ["g-b", "g-c", "g-d", "g-e", "g-f", "g-x"], "{page}");

    // g-a cancelled: its downstreams fail with it. Then purged: it is gone, and shows so.
    handles[0].cancel().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while get_json(addr, "/api/requests/g-b", &[]).await.1["state"] != "failed" {
        assert!(Instant::now() < deadline, "g-b did not fail with its cancelled upstream");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let admin = sluicegate::Admin::connect(&env.config).await.unwrap();
    assert!(admin.purge(handles[0].id()).await.unwrap());
    let (s, g) = get_json(addr, "/api/requests/g-b/graph?depth=1", &[]).await;
    assert_eq!(s, 200, "{g}");
    assert_eq!(nodes(&g), owned(&[("g-b", 0, "failed"), ("g-a", -1, "gone"), ("g-c", 1, "failed")]), "{g}");
    assert_eq!(
        (&g["nodes"][0]["reason"], &g["nodes"][1]["found"]),
        (&Value::from("upstream:g-a"), &Value::Bool(false)),
        "{g}"
    );
    assert_eq!(
        edges(&g),
        vec![link("g-a", "g-b", Value::from("cancelled")), link("g-b", "g-c", Value::from("failed"))],
        "{g}"
    );
}
