//! The dashboard's JSON API on its own, as a script uses it: status codes, clear refusals, the
//! live stream, actions and auth.
//!
//! One binary, two topologies: `single::` runs the suite on one redis-server, `cluster::` on a
//! 3-master Redis Cluster.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

sluicegate_testkit::per_topology!(include!("suites/api.rs"););

/// On a redis-server of its own: the test counts the commands it runs.
mod cost {
    use std::time::Duration;

    use sluicegate::Config;
    use sluicegate_dashboard::DashboardOptions;
    use sluicegate_testkit::{command_calls, RedisServer};
    use tokio::io::AsyncWriteExt;

    use crate::support::serve;

    async fn calls_during(url: &str, d: Duration) -> u64 {
        let before: u64 = command_calls(url).await.unwrap().values().sum();
        tokio::time::sleep(d).await;
        let after: u64 = command_calls(url).await.unwrap().values().sum();
        after - before
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_browsers_cost_redis_what_one_does() {
        let server = RedisServer::start().await.unwrap();
        let config = Config::new(server.url()).namespace("cost");
        let served = serve(&config, DashboardOptions::new()).await;
        let mut viewers = Vec::new();
        let watch = || async {
            let mut s = tokio::net::TcpStream::connect(served.addr).await.unwrap();
            s.write_all(b"GET /api/live HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
            s
        };
        viewers.push(watch().await);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let one = calls_during(&server.url(), Duration::from_secs(2)).await;
        for _ in 0..9 {
            viewers.push(watch().await);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ten = calls_during(&server.url(), Duration::from_secs(2)).await;
        assert!(one > 0, "one browser is served readings");
        assert!(ten <= one * 3 / 2 + 10, "one browser: {one} commands in 2 s, ten: {ten}");
        drop(viewers);
    }
}
