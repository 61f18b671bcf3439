//! The dashboard in a real browser: headless Chromium driven through WebDriver (chromedriver).
//!
//! It needs Debian's `chromium` and `chromium-driver` (`./test.sh` installs them); `CHROMEDRIVER`
//! and `CHROME_BIN` name other binaries. Without them the test fails and says so: it never passes
//! without having looked. Screenshots go to `target/dashboard-screenshots/`.

#![allow(unreachable_pub, clippy::unwrap_used)]

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use sluicegate_dashboard::DashboardOptions;
use sluicegate_testkit::Topology;

use crate::support::{env, get_json, post_json, producer, serve, worker};

/// How long the browser may take to show something.
const PATIENCE: Duration = Duration::from_secs(15);

/// Finds `name` as given by `var`, at `default`, or on PATH.
fn binary(var: &str, default: &str, name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(var).filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    if Path::new(default).exists() {
        return PathBuf::from(default);
    }
    let on_path = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|dir| dir.join(name)).find(|p| p.exists()));
    on_path.unwrap_or_else(|| {
        panic!(
            "the browser test needs {name} and found none (not at {default}, not on PATH, {var} unset): \
             run ./test.sh, which installs Debian's chromium and chromium-driver, or \
             `apt-get install -y chromium chromium-driver`, or set {var}"
        )
    })
}

/// chromedriver on a free port; killed on drop, with the browser profiles it was given.
struct Driver {
    child: Child,
    url: String,
    profiles: std::sync::Mutex<Vec<PathBuf>>,
}

impl Driver {
    fn start() -> Self {
        let driver = binary("CHROMEDRIVER", "/usr/bin/chromedriver", "chromedriver");
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(&driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {} (CHROMEDRIVER, or run ./test.sh to install chromium-driver): {e}",
                    driver.display()
                )
            });
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "{} did not listen on port {port} within 10 s",
                driver.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, url: format!("http://127.0.0.1:{port}"), profiles: std::sync::Mutex::default() }
    }

    async fn browser(&self) -> Client {
        let chrome = binary("CHROME_BIN", "/usr/bin/chromium", "chromium");
        // A profile of its own: two browsers on one profile would stop one another.
        let profile = std::env::temp_dir().join(sluicegate_testkit::unique_namespace("sluicegate-browser"));
        self.profiles.lock().unwrap().push(profile.clone());
        let caps = json!({
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chrome,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                    "--window-size=1280,900", format!("--user-data-dir={}", profile.display()),
                ],
            },
        });
        let Value::Object(caps) = caps else { unreachable!() };
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("chromedriver could not start {}: {e}", chrome.display()))
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for profile in self.profiles.get_mut().map(std::mem::take).unwrap_or_default() {
            let _ = std::fs::remove_dir_all(profile);
        }
    }
}

fn screenshots() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    let dir = target.join("dashboard-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn shot(browser: &Client, name: &str) {
    let png = browser.screenshot().await.unwrap();
    std::fs::write(screenshots().join(format!("{name}.png")), png).unwrap();
}

/// Runs `script` (a function body returning a value) until it returns something truthy.
async fn until(browser: &Client, what: &str, script: &str) -> Value {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let v = browser.execute(script, vec![]).await.unwrap();
        if !(v.is_null() || v == Value::Bool(false) || v == json!(0) || v == json!("")) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Clicks the element `css` finds; again if a new reading replaced it meanwhile.
async fn click(browser: &Client, css: &str) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let clicked = match browser.find(Locator::Css(css)).await {
            Ok(element) => element.click().await,
            Err(e) => Err(e),
        };
        match clicked {
            Ok(()) => return,
            Err(e) => assert!(Instant::now() < deadline, "cannot click {css}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The page was not reloaded since the marker was set.
async fn assert_not_reloaded(browser: &Client) {
    let marker = browser.execute("return window.__testMarker || null", vec![]).await.unwrap();
    assert_eq!(marker, json!("set before"), "the page reloaded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_sees_a_request_progress_live_and_cancels_it() {
    let driver = Driver::start();
    let env = env(Topology::Single, "browser").await;
    let served = serve(&env.config, DashboardOptions::new().allow_actions(true)).await;
    let browser = driver.browser().await;
    let result = async {
        browser.goto(&served.url("/")).await.unwrap();
        browser.wait().at_most(PATIENCE).for_element(Locator::Css("#recent")).await.unwrap();
        browser.execute("window.__testMarker = 'set before'", vec![]).await.unwrap();

        // Submitted while the page is open: it appears, and its progress moves, without a reload.
        let _w = worker(&env.config, 60, 2).await;
        let p = producer(&env.config).await;
        p.request().id("import-2026-11").unwrap().priority(60).unwrap().concurrency(1).unwrap().tag("customer:42").unwrap().submit(0..400u64).await.unwrap();
        let other = p.request().id("nightly-report").unwrap().priority(20).unwrap().concurrency(2).unwrap().submit(0..30u64).await.unwrap();
        let row = "document.querySelector('#recent tr[data-id=\"import-2026-11\"] .progress')";
        let first: u64 = until(&browser, "the request appears with parts done", &format!("const p = {row}; return p && Number(p.dataset.done)")).await.as_u64().unwrap();
        let moved = until(&browser, "its progress moves", &format!("const p = {row}; return p && Number(p.dataset.done) > {first} && Number(p.dataset.done)")).await;
        assert!(moved.as_u64().unwrap() > first);
        assert_not_reloaded(&browser).await;
        other.wait::<u64>().await.unwrap();
        until(&browser, "the chart shows the completions", "const c = document.querySelector('#throughput-chart'); const r = document.querySelector('#recent tr[data-id=\"nightly-report\"]'); return c && Number(c.dataset.peak) > 0 && r && r.textContent.includes('completed')").await;
        shot(&browser, "overview").await;
        // The Workers page names the request a busy slot runs (import-2026-11 runs one part at a
        // time for 24 s).
        let slot_runs = "return [...document.querySelectorAll('#slots a')].some(a => a.textContent === 'import-2026-11')";
        // The token audit lists the tenant groups: one configured, not in use yet.
        sluicegate::Admin::connect(&env.config).await.unwrap().set_group("tenant-a", 4).await.unwrap();
        let audit = "const g = document.querySelector('#groups tr[data-name=\"tenant-a\"]'); \
            return document.querySelector('#main table') !== null && g !== null && g.children[1].textContent === '4'";
        for (page, ready) in [("#/tokens", audit), ("#/workers", slot_runs)] {
            browser.execute(&format!("location.hash = '{page}'"), vec![]).await.unwrap();
            until(&browser, page, ready).await;
            shot(&browser, page.trim_start_matches("#/")).await;
        }
        browser.execute("location.hash = '#/'", vec![]).await.unwrap();
        browser.wait().at_most(PATIENCE).for_element(Locator::Css("#recent tr[data-id=\"import-2026-11\"] a")).await.unwrap();

        // Its detail, opened from the row.
        click(&browser, "#recent tr[data-id=\"import-2026-11\"] a").await;
        until(&browser, "the detail page opens", "const e = document.querySelector('#request-id'); return e && e.textContent === 'import-2026-11'").await;
        until(&browser, "its tokens show", "return document.querySelector('#tokens') !== null").await;
        assert_not_reloaded(&browser).await;
        shot(&browser, "request-detail").await;

        // Cancel: the button asks once more, then the state turns cancelled.
        click(&browser, "#action-cancel button").await;
        until(&browser, "the button asks to confirm", "return document.querySelector('#action-cancel button').textContent.startsWith('Confirm')").await;
        // Still armed after a reading or two.
        tokio::time::sleep(Duration::from_millis(600)).await;
        click(&browser, "#action-cancel button").await;
        until(&browser, "the state turns cancelled", "const e = document.querySelector('#request-state'); return e && e.textContent.includes('cancelled')").await;
        assert_not_reloaded(&browser).await;
        shot(&browser, "request-cancelled").await;

        for (page, ready) in [("#/events", "table"), ("#/requests", "#filters")] {
            browser.execute(&format!("location.hash = '{page}'"), vec![]).await.unwrap();
            until(&browser, page, &format!("return document.querySelector('#main {ready}') !== null")).await;
            tokio::time::sleep(Duration::from_millis(400)).await;
            shot(&browser, page.trim_start_matches("#/")).await;
        }
        let events = browser.find(Locator::Css("#main")).await.unwrap().text().await.unwrap();
        assert!(events.contains("import-2026-11") && events.contains("nightly-report"), "{events}");
        assert_not_reloaded(&browser).await;
    }
    .await;
    browser.close().await.unwrap();
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_dashboard_hides_and_refuses_actions_and_wants_its_token() {
    let driver = Driver::start();
    let env = env(Topology::Single, "browser-ro").await;
    let p = producer(&env.config).await;
    let upstream = p.request().id("waiting-1").unwrap().submit(0..5u64).await.unwrap();
    p.request().id("after-1").unwrap().after([upstream.id().clone()]).submit(0..2u64).await.unwrap();
    let served = serve(&env.config, DashboardOptions::new().token("let-me-in")).await;
    let browser = driver.browser().await;
    let result = async {
        // Sent to the login form; a wrong token is refused, the right one lets the browser in.
        browser.goto(&served.url("/#/request/waiting-1")).await.unwrap();
        browser.wait().at_most(PATIENCE).for_element(Locator::Css("#token")).await.unwrap();
        browser.find(Locator::Css("#token")).await.unwrap().send_keys("guess").await.unwrap();
        browser.find(Locator::Css("#login")).await.unwrap().click().await.unwrap();
        browser.wait().at_most(PATIENCE).for_element(Locator::Css(".error")).await.unwrap();
        shot(&browser, "login-refused").await;
        browser.find(Locator::Css("#token")).await.unwrap().send_keys("let-me-in").await.unwrap();
        browser.find(Locator::Css("#login")).await.unwrap().click().await.unwrap();
        until(&browser, "the overview after login", "const m = document.querySelector('#mode'); return m && m.textContent === 'read-only'").await;
        browser.execute("location.hash = '#/request/waiting-1'", vec![]).await.unwrap();
        until(&browser, "the detail page", "const e = document.querySelector('#request-state'); return e && e.textContent.includes('queued')").await;
        let buttons = browser.execute("return document.querySelectorAll('#main button').length", vec![]).await.unwrap();
        assert_eq!(buttons, json!(0), "a read-only dashboard shows no action");
        shot(&browser, "read-only-detail").await;

        // Its dependencies: the graph draws it and the request submitted after it, a click away.
        let graph = "const d = document.querySelector('#dag .node[data-id=\"after-1\"]'); \
            return document.querySelectorAll('#dag .node').length === 2 \
            && document.querySelectorAll('#dag .edge').length === 1 \
            && d !== null && d.dataset.state === 'waiting' \
            && document.querySelector('#dag .node.root').dataset.id === 'waiting-1'";
        until(&browser, "the graph of waiting-1 and its downstream", graph).await;
        shot(&browser, "request-graph").await;
        click(&browser, "#dag .node[data-id=\"after-1\"]").await;
        let downstream = "const e = document.querySelector('#request-id'); \
            const s = document.querySelector('#request-state'); \
            const u = document.querySelector('#upstreams tr[data-id=\"waiting-1\"]'); \
            return e && e.textContent === 'after-1' && s.textContent.includes('waiting') \
            && u && u.textContent.includes('not yet') \
            && document.querySelector('#dag .node.root').dataset.id === 'after-1'";
        until(&browser, "the downstream's page, waiting for waiting-1", downstream).await;
        shot(&browser, "request-waiting").await;
    }
    .await;
    browser.close().await.unwrap();
    // The API refuses what the page hides, and a wrong token.
    let (s, e) = post_json(
        served.addr,
        "/api/requests/waiting-1/cancel",
        &[("Authorization", "Bearer let-me-in")],
        "{}",
    )
    .await;
    assert_eq!(s, 403, "{e}");
    let (s, _) =
        get_json(served.addr, "/api/requests/waiting-1", &[("Authorization", "Bearer let-me-out")]).await;
    assert_eq!(s, 401);
    result
}

/// Not a test: how docs/img/dashboard.png is made. Point it at a running dashboard and it saves
/// the overview, once the page has drawn a reading, as target/dashboard-screenshots/readme.png:
/// `SLUICEGATE_DASHBOARD_URL=http://127.0.0.1:8080/ cargo test -p sluicegate-dashboard --test browser -- --ignored readme`.
#[tokio::test]
#[ignore]
async fn readme_screenshot() {
    let url =
        std::env::var("SLUICEGATE_DASHBOARD_URL").expect("SLUICEGATE_DASHBOARD_URL names the dashboard");
    let driver = Driver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();
    until(&browser, "a reading", "return document.querySelector('#recent') !== null").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    shot(&browser, "readme").await;
    browser.close().await.unwrap();
}
