// The body of tests/cli.rs: written once, run against a single Redis
// and a 3-master Redis Cluster (`per_topology!` runs it once for each).

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sluicegate_testkit::{keys_in_namespace, unique_namespace, TestBackend};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

/// Short leases and a quick recovery, so that the tests never wait for the defaults.
const FAST: [&str; 6] = ["--lease", "2s", "--heartbeat", "300ms", "--recovery-interval", "300ms"];

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name).display().to_string()
}

/// A test's own Redis (single or a cluster, as `TOPOLOGY` says), namespace and scratch directory.
struct Sg {
    redis: TestBackend,
    ns: String,
    dir: PathBuf,
    runtime: tokio::runtime::Runtime,
}

impl Sg {
    fn new(name: &str) -> Self {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let redis = runtime.block_on(TestBackend::start(TOPOLOGY)).unwrap_or_else(|e| panic!("{e}"));
        let ns = unique_namespace(name);
        let dir = std::env::temp_dir().join(format!("sluicegate-cli-{ns}"));
        fs::create_dir_all(&dir).unwrap();
        Self { redis, ns, dir, runtime }
    }

    /// `sluicegate --redis <ours> --namespace <ours> <FAST...>`, untouched by the caller's env.
    fn command(&self) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.env_remove("REDIS_URL")
            .env_remove("SLUICEGATE_NAMESPACE")
            .args(["--redis", self.redis.url(), "--namespace", &self.ns])
            .args(FAST);
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command().args(args).stdin(Stdio::null()).output().unwrap()
    }

    fn run_with_input(&self, args: &[&str], input: &[u8]) -> Output {
        let mut child = self
            .command()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        child.wait_with_output().unwrap()
    }

    fn file(&self, name: &str, content: &[u8]) -> String {
        let path = self.dir.join(name);
        fs::write(&path, content).unwrap();
        path.display().to_string()
    }

    /// `sluicegate worker --exec <exec>`, its stderr kept in a file for the test to read.
    fn worker(&self, exec: &str, extra: &[&str]) -> WorkerProcess {
        let log = self.dir.join(format!("worker-{}.log", rand_suffix()));
        let child = self
            .command()
            .args(["worker", "--exec", exec, "--slots", "2"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        WorkerProcess { child, log }
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.run(&all);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Waits until `n` workers have registered, so that work can reach all of them.
    fn wait_for_workers(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.json(&["stats"])["workers"].as_array().map_or(0, Vec::len) < n {
            assert!(Instant::now() < deadline, "{n} workers did not register within 10 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn keys(&self) -> Vec<String> {
        self.runtime.block_on(keys_in_namespace(self.redis.url(), &self.ns)).unwrap()
    }
}

impl Drop for Sg {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn rand_suffix() -> String {
    unique_namespace("w")
}

struct WorkerProcess {
    child: Child,
    log: PathBuf,
}

impl WorkerProcess {
    /// SIGTERM, as a supervisor stops it; returns its stderr after asserting a clean exit 0.
    fn stop(mut self) -> String {
        let term = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(term.success());
        let deadline = Instant::now() + Duration::from_secs(15);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "worker did not stop within 15 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        let log = fs::read_to_string(&self.log).unwrap();
        assert_eq!(status.code(), Some(0), "worker exit after SIGTERM; its stderr:\n{log}");
        log
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        // A failed test must not leave workers behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).unwrap()
}

/// Asserts a failure: exit `code`, and stderr exactly `error: <message>` on one line.
fn assert_fails(out: &Output, code: i32, message: &str) {
    assert_eq!(stderr(out), format!("error: {message}\n"), "stderr");
    assert_eq!(out.status.code(), Some(code), "exit code; stderr: {}", stderr(out));
}

/// Like `assert_fails`, for a message of which `fragment` is a part.
fn fails_with(out: &Output, code: i32, fragment: &str) {
    assert!(stderr(out).starts_with("error: ") && stderr(out).contains(fragment), "stderr: {}", stderr(out));
    assert_eq!(out.status.code(), Some(code), "exit code; stderr: {}", stderr(out));
}

/// "succeeded" and "retried" counts from a worker's closing line.
fn worker_counts(log: &str) -> (u64, u64) {
    let line = log
        .lines()
        .find(|l| l.starts_with("worker stopped:"))
        .unwrap_or_else(|| panic!("no closing line in:\n{log}"));
    let num = |word: &str| -> u64 {
        let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
        let at = words.iter().position(|w| *w == word).unwrap();
        words[at - 1].parse().unwrap()
    };
    (num("succeeded"), num("retried"))
}

#[test]
fn a_thousand_lines_through_two_exec_workers_come_back_upper_cased_line_for_line() {
    let sg = Sg::new("cli-upper");
    let lines: String = (0..1000).map(|i| format!("line {i:04}: the quick brown fox, {}\n", i * 7)).collect();
    let input = sg.file("lines.txt", lines.as_bytes());
    let upper = fixture("upper.sh");
    let a = sg.worker(&upper, &[]);
    let b = sg.worker(&upper, &[]);
    sg.wait_for_workers(2);

    let started = Instant::now();
    let out = sg.run(&["submit", "--concurrency", "3", "--wait", "--raw", &input]);
    let took = started.elapsed();
    assert!(out.status.success(), "submit --wait: {}", stderr(&out));
    assert_eq!(stdout(&out), lines.to_uppercase(), "the output is the upper-cased file, line for line");
    assert!(
        stderr(&out).starts_with("submitted "),
        "stderr has the id, not a progress bar: {:?}",
        stderr(&out)
    );

    let (a_done, _) = worker_counts(&a.stop());
    let (b_done, _) = worker_counts(&b.stop());
    assert_eq!(a_done + b_done, 1000);
    assert!(a_done > 0 && b_done > 0, "both workers took part: {a_done} + {b_done}");
    eprintln!("1000 sub-requests through two --exec workers in {took:?}");
}

#[test]
fn a_request_that_discards_its_results_prints_its_counts_and_status_says_so() {
    let sg = Sg::new("cli-discard");
    let input = sg.file("lines.txt", b"a\nb\nc\n");
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    sg.wait_for_workers(1);

    let out = sg.run(&["submit", "--id", "quiet", "--discard-results", "--wait", "--raw", &input]);
    assert!(out.status.success(), "submit --discard-results --wait: {}", stderr(&out));
    assert_eq!(stdout(&out), "", "no result is kept, so none is printed");
    assert!(
        stderr(&out).contains("quiet completed: 3 sub-requests, results discarded"),
        "stderr gives the counts: {:?}",
        stderr(&out)
    );
    let status = stdout(&sg.run(&["status", "quiet"]));
    assert!(status.contains("results      discarded"), "{status}");
    assert!(status.contains("3 total, 3 done, 0 failed"), "{status}");
    let json: serde_json::Value = serde_json::from_str(&stdout(&sg.run(&["--json", "status", "quiet"]))).unwrap();
    assert_eq!(json["discard_results"], true, "{json}");
    // The same without the flag: its results come back.
    let kept = sg.run(&["submit", "--wait", "--raw", &input]);
    assert_eq!(stdout(&kept), "A\nB\nC\n");
    let (done, _) = worker_counts(&worker.stop());
    assert_eq!(done, 6);
}

#[test]
fn a_script_failing_odd_lines_twice_completes_on_the_third_attempt_with_attempts_in_status() {
    let sg = Sg::new("cli-flaky");
    let lines: String = (1..=10).map(|i| format!("\"word {i}\"\n")).collect();
    let input = sg.file("words.txt", lines.as_bytes());
    let submit = sg.run(&[
        "submit",
        "--id",
        "flaky-1",
        "--concurrency",
        "4",
        "--max-attempts",
        "3",
        "--backoff",
        "300ms",
        "--backoff-max",
        "600ms",
        &input,
    ]);
    assert_eq!(
        (stdout(&submit), submit.status.code()),
        ("flaky-1\n".to_owned(), Some(0)),
        "{}",
        stderr(&submit)
    );
    let worker = sg.worker(&fixture("flaky.sh"), &[]);

    // Watch the status while it runs: the failed attempts are visible until they succeed.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut most_attempts_seen = 0;
    let mut a_second_attempt_error = None;
    let last = loop {
        let status = sg.json(&["status", "flaky-1"]);
        most_attempts_seen = most_attempts_seen.max(status["max_attempts_seen"].as_u64().unwrap());
        if let Some(e) = status["errors"].as_array().unwrap().iter().find(|e| e["error"]["attempts"] == 2) {
            a_second_attempt_error = Some(e.clone());
        }
        if status["state"] != "running" && status["state"] != "queued" {
            break status;
        }
        assert!(Instant::now() < deadline, "not finished within 20 s: {status}");
        std::thread::sleep(Duration::from_millis(40));
    };
    assert_eq!(last["state"], "completed", "{last}");
    assert_eq!((last["done"].as_u64(), last["failed"].as_u64()), (Some(10), Some(0)));
    assert!(most_attempts_seen >= 2, "status showed the attempt counts while it ran");
    // And after completion: the parts that needed retries, and how many attempts they took.
    assert_eq!(last["max_attempts_seen"].as_u64(), Some(3), "{last}");
    assert_eq!(last["succeeded_after_retry"].as_u64(), Some(5), "{last}");
    let error = a_second_attempt_error.expect("an error record of a second attempt was visible");
    assert_eq!(error["index"].as_u64().unwrap() % 2, 0, "only odd lines (even indexes) fail: {error}");
    let message = error["error"]["error"].as_str().unwrap();
    assert!(
        message.contains("flaky.sh exited with 1: flaky: line ")
            && message.ends_with(", attempt 2 fails on purpose"),
        "the error says which attempt failed, with the script's stderr: {message}"
    );

    let human = stdout(&sg.run(&["status", "flaky-1"]));
    assert!(human.contains("state        completed"), "{human}");
    let results = sg.run(&["results", "flaky-1"]);
    assert!(results.status.success(), "{}", stderr(&results));
    assert_eq!(stdout(&results), lines.to_uppercase(), "JSON strings, upper-cased, in order");

    let (succeeded, retried) = worker_counts(&worker.stop());
    assert_eq!((succeeded, retried), (10, 10), "5 odd lines x 2 failed attempts were retried");
}

/// The worker's urgent slot (`--urgent`, for priorities 90 and up by default): a request of
/// priority 95 runs while both slots run a long command; with `--urgent off` it waits for one of
/// them to end.
#[test]
fn an_urgent_request_runs_beside_busy_slots_in_the_urgent_slot_unless_it_is_off() {
    let sg = Sg::new("cli-urgent");
    let script = sg.file("slow.sh", b"#!/bin/sh\nread x\ncase \"$x\" in *slow*) sleep 20;; esac\necho \"$x\"\n");
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let state = |id: &str| sg.json(&["status", id])["state"].as_str().unwrap_or_default().to_owned();
    for urgent in ["90", "off"] {
        let worker = sg.worker(&script, &["--urgent", urgent, "--shutdown-grace", "1s"]);
        let slow = format!("slow-{urgent}");
        let args = ["submit", "--id", &slow, "--priority", "10", "--concurrency", "2", "--own-stream"];
        let out = sg.run_with_input(&args, b"\"slow\"\n\"slow\"\n");
        assert!(out.status.success(), "{}", stderr(&out));
        let deadline = Instant::now() + Duration::from_secs(10);
        while sg.json(&["status", &slow])["running"].as_u64() != Some(2) {
            assert!(Instant::now() < deadline, "the two slots did not start the slow commands");
            std::thread::sleep(Duration::from_millis(50));
        }
        let now = format!("now-{urgent}");
        let out = sg.run_with_input(&["submit", "--id", &now, "--priority", "95"], b"\"now\"\n");
        assert!(out.status.success(), "{}", stderr(&out));
        let deadline = Instant::now() + Duration::from_secs(if urgent == "off" { 2 } else { 10 });
        while state(&now) != "completed" && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let (ran, slow_running) = (state(&now), sg.json(&["status", &slow])["running"].as_u64());
        match urgent {
            "off" => assert_eq!(ran, "queued", "with --urgent off, the urgent request waits for a slot"),
            _ => assert_eq!(ran, "completed", "the urgent slot runs it at once"),
        }
        assert_eq!(slow_running, Some(2), "both slow commands still run");
        // (Cancelled, so that the next round's slots find only its own request.)
        assert!(sg.run(&["cancel", &slow]).status.success());
        worker.stop();
    }
}

#[test]
fn a_permanent_failure_fails_the_request_and_requeue_after_the_fix_completes_it() {
    let sg = Sg::new("cli-requeue");
    let fixed = sg.dir.join("fixed");
    let script = sg.file(
        "fragile.sh",
        format!(
            "#!/bin/sh\nif [ \"$SLUICEGATE_INDEX\" = 1 ] && [ ! -e '{}' ]; then echo 'bad input' >&2; exit 100; fi\ncat\n",
            fixed.display()
        )
        .as_bytes(),
    );
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let worker = sg.worker(&script, &[]);

    let out = sg.run_with_input(
        &["submit", "--id", "frag", "--max-attempts", "5", "--wait"],
        b"{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n",
    );
    assert_eq!(out.status.code(), Some(1), "a failed request exits 1: {}", stderr(&out));
    let printed = stdout(&out);
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0], "{\"n\":1}");
    let failed: Value = serde_json::from_str(lines[1]).unwrap();
    assert_eq!(failed["attempts"], 1, "exit 100 is not retried: {failed}");
    assert_eq!(failed["permanent"], true);
    assert!(
        failed["error"].as_str().unwrap().ends_with("exited with 100 (permanent): bad input"),
        "{failed}"
    );
    let last_line = stderr(&out).lines().last().unwrap_or_default().to_owned();
    assert!(
        last_line.starts_with("error: request frag failed: 1 of 3 sub-requests failed (first: #1: "),
        "{last_line}"
    );

    // The dead letter, with its payload decoded to JSON.
    let dead = sg.json(&["dead", "frag"]);
    assert_eq!((dead["index"].clone(), dead["attempts"].clone()), (Value::from(1), Value::from(1)), "{dead}");
    assert_eq!((dead["payload"].clone(), dead["permanent"].clone()), (serde_json::json!({"n": 2}), Value::Bool(true)));
    assert!(dead["error"].as_str().unwrap().ends_with("bad input"), "{dead}");
    let human = stdout(&sg.run(&["dead", "frag"]));
    let lines: Vec<&str> = human.lines().collect();
    assert!(lines[0].starts_with("#1  attempt 1, permanent: ") && lines[0].ends_with("bad input"), "{human}");
    assert_eq!(lines[1..], ["    payload: {\"n\":2}", "1 dead-lettered sub-request of frag"], "{human}");
    assert_fails(&sg.run(&["dead", "nope"]), 4, "no request with id \"nope\" (never submitted, or its results expired)");

    fs::write(&fixed, b"").unwrap();
    let requeue = sg.run(&["requeue", "frag"]);
    assert_eq!(stdout(&requeue), "requeued 1 dead-lettered sub-request of frag\n", "{}", stderr(&requeue));
    let results = sg.run(&["--json", "results", "--wait", "frag"]);
    assert!(results.status.success(), "{}", stderr(&results));
    assert_eq!(
        stdout(&results),
        "{\"index\":0,\"ok\":{\"n\":1}}\n{\"index\":1,\"ok\":{\"n\":2}}\n{\"index\":2,\"ok\":{\"n\":3}}\n"
    );
    let events = stdout(&sg.run(&["events"]));
    let states: Vec<&str> = events.lines().map(|l| l.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(states, ["failed", "completed"], "{events}");
    worker.stop();
}

#[test]
fn cancel_timeout_and_not_finished_yet() {
    let sg = Sg::new("cli-cancel");
    // No worker yet: the request waits.
    let queued = sg.run_with_input(&["submit", "--id", "later"], b"a\nb\n");
    assert!(queued.status.success(), "{}", stderr(&queued));
    assert_fails(
        &sg.run(&["results", "later"]),
        5,
        "request later has not finished yet; use `sluicegate results --wait later` or `sluicegate status later`",
    );
    // Waiting with no worker in the namespace says so, once, naming the namespace.
    let mut waiting = sg.command();
    waiting.args(["results", "--wait", "later"]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let waiting = waiting.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(stdout(&sg.run(&["cancel", "later"])), "cancelled later\n");
    let waited = waiting.wait_with_output().unwrap();
    let warning = format!("warning: no worker is registered in namespace \"{}\"", sg.ns);
    assert_eq!(stderr(&waited).matches(&warning).count(), 1, "{}", stderr(&waited));
    assert_eq!(sg.json(&["cancel", "later"])["cancelled"], false, "a second cancel finds it finished");
    let results = sg.run(&["results", "later"]);
    assert_eq!(results.status.code(), Some(1));
    assert!(stderr(&results).ends_with("error: request later was cancelled\n"), "{}", stderr(&results));

    // A command that outlives --timeout is killed and the attempt fails (retryably).
    let worker = sg.worker("sleep 10", &["--timeout", "300ms"]);
    sg.wait_for_workers(1);
    let started = Instant::now();
    let slow = sg.run_with_input(&["submit", "--wait"], b"1\n");
    assert!(started.elapsed() < Duration::from_secs(5), "the timeout killed the command");
    assert!(!stderr(&slow).contains("warning"), "a worker is registered: {}", stderr(&slow));
    assert_eq!(slow.status.code(), Some(1));
    let failed: Value = serde_json::from_slice(&slow.stdout).unwrap();
    assert_eq!(failed["error"], "sleep 10 timed out after 300ms and was killed");
    assert_eq!(failed["permanent"], false);

    let events: Vec<Value> =
        stdout(&sg.run(&["--json", "events"])).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(events.len(), 2);
    assert_eq!((events[0]["id"].as_str(), events[0]["state"].as_str()), (Some("later"), Some("cancelled")));
    assert_eq!(events[1]["state"], "failed");
    worker.stop();
}

#[test]
fn streamed_input_runs_while_open_and_a_dead_producers_request_can_be_finalized() {
    let sg = Sg::new("cli-stream");
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    let status = |id: &str| sg.json(&["status", id]);
    let wait_until = |id: &str, done: u64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // Unknown until the producer has connected and opened it.
            let out = sg.run(&["--json", "status", id]);
            let s: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            if s["done"] == done {
                return s;
            }
            assert!(Instant::now() < deadline, "{id} did not reach {done} done: {s} {}", stderr(&out));
            std::thread::sleep(Duration::from_millis(30));
        }
    };

    // A line is processed while the input is still open; the request completes at its end.
    let mut producer = sg
        .command()
        .args(["submit", "--stream", "--id", "s1", "--concurrency", "2", "--wait", "--raw"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = producer.stdin.take().unwrap();
    input.write_all(b"one\n").unwrap();
    input.flush().unwrap();
    let s = wait_until("s1", 1);
    assert_eq!((&s["open"], &s["state"]), (&Value::Bool(true), &Value::from("running")), "{s}");
    input.write_all(b"two\n").unwrap();
    drop(input);
    let out = producer.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "ONE\nTWO\n");

    // A producer killed mid-stream leaves an open request that an operator finalizes.
    let mut producer = sg
        .command()
        .args(["submit", "--stream", "--id", "s2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut input = producer.stdin.take().unwrap();
    input.write_all(b"a\n").unwrap();
    input.flush().unwrap();
    wait_until("s2", 1);
    producer.kill().unwrap();
    let out = producer.wait_with_output().unwrap();
    assert_eq!(stdout(&out), "s2\n", "a streamed request's id is printed when it opens");
    assert!(stdout(&sg.run(&["status", "s2"])).contains("open         yes"));
    let finalized = sg.run(&["finalize", "s2"]);
    assert_eq!(
        stdout(&finalized),
        "finalized s2: it completes once its sub-requests are done\n",
        "{}",
        stderr(&finalized)
    );
    assert_eq!(stdout(&sg.run(&["results", "--wait", "--raw", "s2"])), "A\n");

    // A bad line mid-stream cancels the request: a half request must not complete as whole.
    let out = sg.run_with_input(&["submit", "--stream", "--id", "s3"], b"fine\nbad \xff\n");
    assert_fails(
        &out,
        2,
        "line 2 is not valid UTF-8 (invalid byte at column 5); request s3 was cancelled after 1 sub-request",
    );
    assert_eq!(status("s3")["state"], "cancelled");
    worker.stop();
}

#[test]
fn a_delayed_request_does_not_start_before_its_time() {
    let sg = Sg::new("cli-delay");
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    let started = Instant::now();
    let id = stdout(&sg.run_with_input(&["submit", "--delay", "1500ms"], b"later\n")).trim().to_owned();
    assert_eq!(sg.json(&["status", &id])["state"], "scheduled");
    let out = sg.run(&["results", "--wait", "--raw", &id]);
    assert_eq!(stdout(&out), "LATER\n", "{}", stderr(&out));
    let status = sg.json(&["status", &id]);
    let waited = status["started_ms"].as_u64().unwrap() - status["created_ms"].as_u64().unwrap();
    assert!(waited >= 1500, "started {waited} ms after it was submitted");
    assert!(started.elapsed() < Duration::from_secs(10));
    worker.stop();
}

#[test]
fn a_request_submitted_after_others_waits_for_them_and_fails_with_one_that_fails_unless_told_to_run() {
    let sg = Sg::new("cli-dag");
    let submit = |args: &[&str], input: &[u8]| {
        let out = sg.run_with_input(args, input);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    };
    // No worker yet: the upstream stays queued, and its downstream waits for it, visibly.
    submit(&["submit", "--id", "up-a"], b"alpha\n");
    submit(&["submit", "--id", "down-b", "--after", "up-a"], b"beta\n");
    let b = sg.json(&["status", "down-b"]);
    assert_eq!(b["state"], "waiting", "{b}");
    assert_eq!(b["upstreams"], serde_json::json!([{"id": "up-a", "ended": null}]), "{b}");
    assert_eq!(sg.json(&["status", "up-a"])["downstreams"], serde_json::json!(["down-b"]));
    let human = stdout(&sg.run(&["status", "down-b"]));
    assert!(human.contains("state        waiting\n"), "{human}");
    assert!(human.contains("\nupstreams (it runs after them; it fails if one does not complete):\n  up-a: not ended yet\n"), "{human}");
    let human = stdout(&sg.run(&["status", "up-a"]));
    assert!(human.contains("\ndownstreams (they run after it):\n  down-b\n"), "{human}");
    let listed: Vec<Value> = stdout(&sg.run(&["--json", "list", "--state", "waiting"]))
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|v| v.get("id").cloned())
        .collect();
    assert_eq!(listed, ["down-b"], "only the downstream is waiting");

    // What cannot be waited for is refused in one line, and nothing is kept.
    assert_fails(
        &sg.run_with_input(&["submit", "--id", "down-x", "--after", "no-such-request"], b"x\n"),
        4,
        "--after \"no-such-request\": that request is unknown (never submitted, or its retention ran out); nothing was submitted",
    );
    assert_eq!(sg.run(&["status", "down-x"]).status.code(), Some(4), "nothing of down-x was kept");
    // (Refused by the command line: no input is read.)
    fails_with(&sg.run(&["submit", "--after", "up-a", "--stream"]), 2, "cannot be used with");
    fails_with(&sg.run(&["submit", "--on-upstream-failure", "run"]), 2, "--after <ID>");

    // An upstream that fails: the downstream that fails with it never runs, the one told to run
    // does. The script notes every request it runs.
    let ran = sg.dir.join("ran");
    let script = sg.file(
        "fails.sh",
        format!(
            "#!/bin/sh\necho \"$SLUICEGATE_REQUEST_ID\" >> '{}'\np=$(cat)\n\
             case \"$p\" in *fail*) echo 'bad input' >&2; exit 100;; esac\n\
             printf '%s\\n' \"$p\" | tr '[:lower:]' '[:upper:]'\n",
            ran.display()
        )
        .as_bytes(),
    );
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    submit(&["submit", "--id", "up-f"], b"fail\n");
    submit(&["submit", "--id", "down-g", "--after", "up-f"], b"gamma\n");
    let run_anyway = ["submit", "--id", "down-h", "--after", "up-f", "--after", "up-a", "--on-upstream-failure", "run"];
    submit(&run_anyway, b"eta\n");
    let worker = sg.worker(&script, &[]);

    let out = sg.run(&["results", "--wait", "--raw", "down-b"]);
    assert_eq!(stdout(&out), "BETA\n", "{}", stderr(&out));
    let b = sg.json(&["status", "down-b"]);
    assert_eq!(b["state"], "completed", "{b}");
    assert_eq!(b["upstreams"], serde_json::json!([{"id": "up-a", "ended": "completed"}]), "{b}");
    let out = sg.run(&["results", "--wait", "down-g"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).ends_with(
            "error: request down-g failed: its upstream up-f did not complete, so it did not run (see `sluicegate status up-f`)\n"
        ),
        "{}",
        stderr(&out)
    );
    let g = sg.json(&["status", "down-g"]);
    assert_eq!((&g["state"], &g["reason"]), (&Value::from("failed"), &Value::from("upstream:up-f")), "{g}");
    assert_eq!(g["upstreams"], serde_json::json!([{"id": "up-f", "ended": "failed"}]), "{g}");
    let human = stdout(&sg.run(&["status", "down-g"]));
    assert!(human.contains("reason       upstream:up-f (upstream up-f did not complete"), "{human}");
    let out = sg.run(&["results", "--wait", "--raw", "down-h"]);
    assert_eq!(stdout(&out), "ETA\n", "{}", stderr(&out));
    let h = sg.json(&["status", "down-h"]);
    let ups = serde_json::json!([{"id": "up-f", "ended": "failed"}, {"id": "up-a", "ended": "completed"}]);
    assert_eq!(h["upstreams"], ups, "{h}");
    worker.stop();
    let ran = fs::read_to_string(&ran).unwrap();
    assert!(!ran.lines().any(|l| l == "down-g"), "a downstream of a failed upstream ran: {ran}");
}

#[test]
fn a_tenant_group_is_set_listed_and_shown_and_runs_its_requests_at_most_limit_at_once() {
    let sg = Sg::new("cli-groups");
    // Refused, each in one line naming the problem, and nothing is set.
    assert_fails(
        &sg.run(&["group", "set", "a b", "--limit", "2"]),
        2,
        "a group name is 1 to 64 ASCII letters, digits, '.', '_' or '-', not \"a b\"",
    );
    fails_with(&sg.run(&["group", "set", "t-1", "--limit", "0"]), 2, "invalid value '0' for '--limit <N>': 0 is not in 1..=10000");
    fails_with(&sg.run(&["group", "set", "t-1", "--limit", "10001"]), 2, "10001 is not in 1..=10000");
    fails_with(&sg.run(&["group", "set", "t-1"]), 2, "<--limit <N>|--rate <N/DURATION>|--no-rate>");
    fails_with(&sg.run(&["group", "set", "t-1", "--rate", "fast"]), 2, "\"fast\" is not a rate (examples: 100/s");
    fails_with(&sg.run(&["group", "set", "t-1", "--rate", "1/s", "--no-rate"]), 2, "cannot be used with");
    assert_fails(
        &sg.run(&["group", "set", "t-1", "--rate", "0/s", "--limit", "2"]),
        2,
        "a rate is 1 to 1000000 parts per 1 ms to a day, not 0 per 1s",
    );
    assert_fails(&sg.run(&["group", "show", "x/y"]), 2, "a group name is 1 to 64 ASCII letters, digits, '.', '_' or '-', not \"x/y\"");
    assert_fails(
        &sg.run_with_input(&["submit", "--group", "a/b"], b"x\n"),
        2,
        "--group: a group name is 1 to 64 ASCII letters, digits, '.', '_' or '-', not \"a/b\"",
    );
    fails_with(&sg.run(&["submit", "--group", "t-1", "--unlisted"]), 2, "'--group <NAME>' cannot be used with '--unlisted'");
    assert_eq!(stdout(&sg.run(&["group", "list"])).lines().count(), 1, "only the header: nothing was set");

    // Set, then shown and listed.
    let set = sg.json(&["group", "set", "t-1", "--limit", "1", "--rate", "50/1s"]);
    let want = serde_json::json!({
        "name": "t-1", "shard": 0, "limit": 1, "configured": true, "held": 0, "queued": 0, "parked": 0,
        "rate_waiting": 0, "rate": {"n": 50, "per_ms": 1000}, "waiting": [],
    });
    assert_eq!(set, want);
    assert_eq!(sg.json(&["group", "show", "t-1"]), want);
    let unset = sg.json(&["group", "show", "nobody"]);
    assert_eq!((&unset["limit"], &unset["configured"]), (&Value::from(10), &Value::Bool(false)), "{unset}");

    // Two requests in the group, no worker yet: their tokens wait in its queues, by priority.
    let out = sg.run_with_input(&["submit", "--group", "t-1", "--id", "grp-a", "--concurrency", "3"], b"a\nb\nc\nd\n");
    assert!(out.status.success(), "{}", stderr(&out));
    let out = sg.run_with_input(&["submit", "--group", "t-1", "--id", "grp-b", "--priority", "60"], b"e\n");
    assert!(out.status.success(), "{}", stderr(&out));
    let shown = stdout(&sg.run(&["group", "show", "t-1"]));
    assert_eq!(
        shown,
        "group        t-1\nlimit        1 (set by an operator)\nshard        0\n\
         tokens       0 held, 1 queued, 0 parked, 0 waiting for the rate\n\
         rate         at most 50 started per 1s\nwaiting      1 at priority 60, 3 at priority 50\n"
    );
    let table = stdout(&sg.run(&["group", "list"]));
    assert_eq!(
        table,
        "NAME                     LIMIT CONFIGURED  HELD QUEUED PARKED RATE-WAITING RATE         WAITING\n\
         t-1                          1 yes            0      1      0            0 50/1s        p60:1 p50:3\n"
    );
    let listed = stdout(&sg.run(&["--json", "group", "list"]));
    assert_eq!(listed.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["name"].clone()).collect::<Vec<_>>(), ["t-1"]);
    // A grouped request keeps its priority.
    assert_fails(&sg.run(&["reprioritize", "grp-a", "90"]), 2, "refused: a request in a tenant group keeps the priority it was submitted with");

    // A worker of 2 slots runs them, one sub-request at a time: the group's limit.
    let log = sg.dir.join("runs.log");
    let script = sg.file(
        "logged.sh",
        format!(
            "#!/bin/sh\necho start >> '{log}'\nsleep 0.05\necho end >> '{log}'\nexec tr '[:lower:]' '[:upper:]'\n",
            log = log.display()
        )
        .as_bytes(),
    );
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let worker = sg.worker(&script, &[]);
    let out = sg.run(&["results", "--wait", "--raw", "grp-a"]);
    assert_eq!(stdout(&out), "A\nB\nC\nD\n", "{}", stderr(&out));
    let out = sg.run(&["results", "--wait", "--raw", "grp-b"]);
    assert_eq!(stdout(&out), "E\n", "{}", stderr(&out));
    worker.stop();
    let (mut running, mut most) = (0, 0);
    for line in fs::read_to_string(&log).unwrap().lines() {
        running += if line == "start" { 1 } else { -1 };
        most = most.max(running);
    }
    assert_eq!(most, 1, "the group's limit is 1");
    let after = sg.json(&["group", "set", "t-1", "--no-rate"]);
    assert_eq!((&after["held"], &after["rate"], &after["waiting"]), (&Value::from(0), &Value::Null, &serde_json::json!([])), "{after}");
}

#[test]
fn a_deadline_kills_the_running_command_and_ends_the_request_failed() {
    let sg = Sg::new("cli-deadline");
    let worker = sg.worker(&fixture("sleepy.sh"), &[]);
    let started = Instant::now();
    let out = sg.run_with_input(&["submit", "--deadline", "+1500ms", "--concurrency", "2"], b"quick\nsleep\nsleep\n");
    let id = stdout(&out).trim().to_owned();
    assert_eq!(sg.json(&["status", &id])["reason"], serde_json::Value::Null);
    // Ended at its deadline, its sleeping commands killed: not after their 30 s.
    let out = sg.run(&["results", "--wait", &id]);
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    assert_ne!(out.status.code(), Some(0), "{}", stderr(&out));
    let status = sg.json(&["status", &id]);
    assert_eq!((status["state"].as_str(), status["reason"].as_str()), (Some("failed"), Some("deadline")), "{status}");
    let (dl, finished) = (status["deadline_ms"].as_u64().unwrap(), status["finished_ms"].as_u64().unwrap());
    assert!(finished >= dl && finished < dl + 1_000, "finished {} ms after its deadline", finished - dl);
    assert!(stdout(&sg.run(&["status", &id])).contains("reason       deadline"));
    fails_with(&sg.run(&["requeue", &id]), 2, "ended at its deadline");
    // A deadline that is not a time, or has passed: nothing is submitted.
    fails_with(&sg.run(&["submit", "--deadline", "tomorrow"]), 2, "+10m");
    fails_with(
        &sg.run_with_input(&["submit", "--deadline", "2001-01-01T00:00:00Z"], b"x\n"),
        2,
        "the deadline has passed",
    );
    worker.stop();
}

#[test]
fn bad_input_is_one_line_naming_the_problem() {
    let sg = Sg::new("cli-bad");

    // Unreachable Redis: a port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("redis://127.0.0.1:{port}");
    let out = Command::new(BIN).args(["--redis", &url, "stats"]).output().unwrap();
    assert_fails(&out, 3, &format!("cannot connect to Redis at {url}: Connection refused"));

    // A server that accepts but never answers: bounded by --connect-timeout.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let out =
        Command::new(BIN).args(["--redis", &url, "--connect-timeout", "300ms", "stats"]).output().unwrap();
    assert_fails(&out, 3, &format!("cannot connect to Redis at {url}: no answer within 300ms (is it running? see --redis or REDIS_URL)"));

    // A password in the URL never reaches stderr.
    let out = Command::new(BIN)
        .args(["--redis", &format!("redis://app:s3cret@127.0.0.1:{port}"), "stats"])
        .output()
        .unwrap();
    assert_fails(
        &out,
        3,
        &format!("cannot connect to Redis at redis://app:***@127.0.0.1:{port}: Connection refused"),
    );

    // A malformed URL.
    let out = Command::new(BIN).args(["--redis", "localhost:6379", "stats"]).output().unwrap();
    assert_fails(
        &out,
        2,
        "invalid configuration: redis URL \"localhost:6379\" is malformed: Invalid or missing host.",
    );

    // Unknown ids, for every command that takes one.
    for cmd in ["status", "cancel", "results", "requeue"] {
        assert_fails(
            &sg.run(&[cmd, "no-such-id"]),
            4,
            "no request with id \"no-such-id\" (never submitted, or its results expired)",
        );
    }

    // A command that cannot start: missing, and not executable.
    let out = sg.run(&["worker", "--exec", "./no/such/handler.sh --fast"]);
    assert_fails(
        &out,
        2,
        "cannot start \"./no/such/handler.sh\": ./no/such/handler.sh: No such file or directory (os error 2)",
    );
    assert_fails(
        &sg.run(&["worker", "--exec", "no-such-program-xyz"]),
        2,
        "cannot start \"no-such-program-xyz\": not found in PATH",
    );
    let plain = sg.file("plain.sh", b"#!/bin/sh\ncat\n");
    assert_fails(
        &sg.run(&["worker", "--exec", &plain]),
        2,
        &format!("cannot start {plain:?}: {plain} is not executable (chmod +x it)"),
    );

    // A line that is not UTF-8: nothing is submitted.
    let out = sg.run_with_input(&["submit", "--id", "utf"], b"fine\nalso fine\nab\xffcd\n");
    assert_fails(&out, 2, "line 3 is not valid UTF-8 (invalid byte at column 3); nothing was submitted");
    assert_eq!(stdout(&out), "");
    assert_fails(
        &sg.run(&["status", "utf"]),
        4,
        "no request with id \"utf\" (never submitted, or its results expired)",
    );

    // An oversized payload, from a file: nothing is submitted either.
    let big = sg.file("big.txt", format!("small\n{}\n", "x".repeat(2000)).as_bytes());
    let out = sg.run(&["submit", "--id", "big", "--max-payload-bytes", "1000", &big]);
    assert_fails(
        &out,
        2,
        "line 2 is longer than the payload limit of 1000 bytes (--max-payload-bytes); nothing was submitted",
    );
    assert!(
        sg.keys().iter().all(|k| !k.contains(":r:")),
        "refused requests left keys behind: {:?}",
        sg.keys()
    );

    // Empty input, a missing file, an out-of-range priority, an id in use.
    assert_fails(
        &sg.run_with_input(&["submit"], b""),
        2,
        "the input has no lines: a request needs at least one sub-request",
    );
    assert_fails(
        &sg.run(&["submit", "/no/such/file"]),
        2,
        "cannot read /no/such/file: No such file or directory (os error 2)",
    );
    assert_fails(
        &sg.run_with_input(&["submit", "--priority", "100"], b"x\n"),
        2,
        "invalid request: priority 100 is out of range: use 0 (lowest) to 99 (highest)",
    );
    assert!(sg.run_with_input(&["submit", "--id", "taken"], b"x\n").status.success());
    assert_fails(
        &sg.run_with_input(&["submit", "--id", "taken"], b"x\n"),
        2,
        "request id \"taken\" is already in use; choose another --id or wait until its retention ends",
    );

    assert_fails(
        &sg.run(&["worker", "--exec", "true", "--slots", "2", "--reserve", "2:90"]),
        2,
        "invalid configuration: reserve(2, ..) keeps 2 of the worker's 2 slots: at least one must take every priority",
    );
    fails_with(
        &sg.run(&["worker", "--exec", "true", "--reserve", "1:100"]),
        2,
        "a priority is from 1 to 99 here, not 100",
    );

    // Usage errors are clap's, with exit 2.
    fails_with(&sg.run(&["worker", "--exec", "true", "--reserve", "2"]), 2, "`2` is not N:P");
    for p in ["0", "100", "soon"] {
        let says = format!("`{p}` is neither a priority from 1 to 99 nor `off`");
        fails_with(&sg.run(&["worker", "--exec", "true", "--urgent", p]), 2, &says);
    }
    let out = sg.run(&["submit", "--concurrency", "many"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).starts_with("error: invalid value 'many' for '--concurrency <CONCURRENCY>'"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn stats_since_shows_each_priority_s_stages_as_the_work_went() {
    let sg = Sg::new("cli-stage-stats");
    let out = sg.run(&["stats", "--since", "1h"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).ends_with("\nnothing counted in this window\n"), "{}", stdout(&out));
    let worker = sg.worker(&fixture("flaky.sh"), &[]);
    sg.wait_for_workers(1);
    // Priority 60: lines 1 and 3 fail twice, then succeed: completed, 4 retried, 4 succeeded.
    let out = sg.run_with_input(
        &["submit", "--priority", "60", "--max-attempts", "3", "--backoff", "10ms", "--wait"],
        b"a\nb\nc\nd\n",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // Priority 20: line 1 fails both of its attempts: failed, 1 retried, 1 dead-lettered.
    let out = sg.run_with_input(
        &["submit", "--priority", "20", "--max-attempts", "2", "--backoff", "10ms", "--wait"],
        b"x\ny\n",
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    // The worker adds its last counts as it stops.
    worker.stop();
    let out = sg.run(&["stats", "--since", "1h"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let block = |priority: &str| -> Vec<(String, u64)> {
        let start = text.find(&format!("\npriority {priority}\n")).unwrap_or_else(|| panic!("{text}"));
        text[start + 1..]
            .lines()
            .skip(1)
            .take(8)
            .map(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                assert!(words[2].ends_with("/s"), "{l}");
                (words[0].to_owned(), words[1].parse().unwrap())
            })
            .collect()
    };
    let named = |counts: [u64; 8]| -> Vec<(String, u64)> {
        ["submitted", "started", "completed", "failed", "succeeded", "retried", "dead-lettered", "fenced"]
            .iter()
            .map(|n| (*n).to_owned())
            .zip(counts)
            .collect()
    };
    assert_eq!(block("60"), named([1, 1, 1, 0, 4, 4, 0, 0]), "{text}");
    assert_eq!(block("20"), named([1, 1, 0, 1, 1, 1, 1, 0]), "{text}");
    assert!(text.find("priority 60") < text.find("priority 20"), "highest first: {text}");
    // Every attempt was timed: 8 runs at priority 60, 3 at 20; one wait and duration per request.
    for (line, samples) in [("run time", 8), ("queue wait", 1), ("duration", 1)] {
        let found = text.lines().find(|l| l.trim_start().starts_with(line)).unwrap();
        assert!(found.contains(" p50 ") && found.contains(" p99 "), "{found}");
        let sample_word = if samples == 1 { "sample" } else { "samples" };
        assert!(found.ends_with(&format!("({samples} {sample_word})")), "{found}");
    }
    // --json: the same, with every histogram's buckets and the minutes as stored.
    let json = sg.json(&["stats", "--since", "1h"]);
    let p20 = &json["priorities"][1];
    assert_eq!((p20["priority"].clone(), p20["dead_lettered"].clone()), (Value::from(20), Value::from(1)), "{json}");
    let runs: u64 = p20["run_time"]["buckets"].as_array().unwrap().iter().map(|b| b["count"].as_u64().unwrap()).sum();
    assert_eq!(runs, 3, "{json}");
    assert!(!json["minutes"].as_array().unwrap().is_empty(), "{json}");
    // Plain `stats` is as it was.
    assert!(stdout(&sg.run(&["stats"])).starts_with("active requests  0\n"));
    assert_fails(&sg.run(&["stats", "--since", "40d"]), 2, "--since must be more than 0s and at most 31 days");
}

#[test]
fn pause_holds_a_submitted_request_until_resume_and_stats_and_status_say_so() {
    let sg = Sg::new("cli-pause");
    let paused = sg.json(&["pause"]);
    assert_eq!(paused["all"], true, "{paused}");
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    sg.wait_for_workers(1);
    let input = sg.file("in.txt", b"held back\n");
    let out = sg.run(&["submit", "--id", "held", &input]);
    assert!(out.status.success(), "submit while paused: {}", stderr(&out));
    std::thread::sleep(Duration::from_millis(1500)); // longer than the worker's idle poll
    let out = sg.run(&["stats"]);
    assert!(stdout(&out).contains("paused           the whole namespace"), "{}", stdout(&out));
    let status = sg.json(&["status", "held"]);
    assert_eq!((status["paused"].clone(), status["done"].clone()), (Value::Bool(true), Value::from(0)), "{status}");
    let out = sg.run(&["resume"]);
    assert_eq!(stdout(&out), "paused           nothing\n");
    let out = sg.run(&["results", "--wait", "--raw", "held"]);
    assert_eq!(stdout(&out), "HELD BACK\n", "{}", stderr(&out));
    let out = sg.run(&["pause", "--priority", "100"]);
    assert_fails(&out, 2, "invalid request: priority 100 is out of range: use 0 (lowest) to 99 (highest)");
    worker.stop();
}

#[test]
fn reprioritize_moves_a_waiting_request_and_refuses_lane_finished_and_unknown_ones_clearly() {
    let sg = Sg::new("cli-repri");
    assert_eq!(sg.json(&["pause"])["all"], true);
    // More than 64 lines: the request has a stream of its own (a small one takes its lane).
    let lines: String = (0..100).map(|n| format!("line {n}\n")).collect();
    let input = sg.file("in.txt", lines.as_bytes());
    let out = sg.run(&["submit", "--id", "big", "--priority", "10", "--concurrency", "2", &input]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = sg.run(&["reprioritize", "big", "80"]);
    assert_eq!(
        stdout(&out),
        "big: priority 10 -> 80; 2 waiting tokens moved now; tokens held by workers move when handed back\n",
        "{}",
        stderr(&out)
    );
    let again = sg.json(&["reprioritize", "big", "80"]);
    assert_eq!((again["from"].clone(), again["to"].clone(), again["moved"].clone()), (10.into(), 80.into(), 0.into()), "{again}");
    assert_eq!(sg.json(&["status", "big"])["priority"], 80);
    let waiting = sg.json(&["stats"])["tokens_waiting"].clone();
    let by_priority: Vec<(Value, Value)> =
        waiting.as_array().unwrap().iter().map(|p| (p["priority"].clone(), p["tokens"].clone())).collect();
    assert_eq!(by_priority, [(80.into(), 2.into())], "{waiting}");

    assert!(sg.run_with_input(&["submit", "--id", "small"], b"one line\n").status.success());
    let refused = sg.run(&["reprioritize", "small", "90"]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(stderr(&refused).starts_with("error: refused: request \"small\" is a small request that shares the lane of priority 50"), "{}", stderr(&refused));
    // A small request of its own stream can change its priority.
    assert!(sg.run_with_input(&["submit", "--id", "small-own", "--own-stream"], b"one line\n").status.success());
    let out = sg.run(&["reprioritize", "small-own", "90"]);
    assert!(stdout(&out).starts_with("small-own: priority 50 -> 90; 1 waiting token moved now"), "{} {}", stdout(&out), stderr(&out));
    fails_with(&sg.run_with_input(&["submit", "--own-stream", "--unlisted"], b"x\n"), 2, "--own-stream");
    assert_fails(&sg.run(&["reprioritize", "nope", "5"]), 4, "no request with id \"nope\" (never submitted, or its results expired)");
    let out = sg.run(&["reprioritize", "big", "100"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("100 is not in 0..=99"), "{}", stderr(&out));

    sg.run(&["resume"]);
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    let out = sg.run(&["results", "--wait", "--raw", "big"]);
    let upper: String = (0..100).map(|n| format!("LINE {n}\n")).collect();
    assert_eq!(stdout(&out), upper, "{}", stderr(&out));
    let out = sg.run(&["results", "--wait", "--raw", "small-own"]);
    assert_eq!(stdout(&out), "ONE LINE\n", "{}", stderr(&out));
    assert_fails(
        &sg.run(&["reprioritize", "big", "5"]),
        2,
        "refused: request \"big\" has already finished (completed): its priority can no longer change",
    );
    worker.stop();
}

#[test]
fn purge_all_asks_for_yes_refuses_while_a_worker_runs_and_then_leaves_no_key() {
    let sg = Sg::new("cli-purge");
    assert!(sg.run_with_input(&["submit", "--id", "gone"], b"a\nb\n").status.success());
    assert_fails(
        &sg.run(&["purge", "--all"]),
        2,
        &format!("purge deletes everything of namespace \"{}\": add --yes to confirm", sg.ns),
    );
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    sg.wait_for_workers(1);
    let refused = sg.run(&["purge", "--all", "--yes"]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(stderr(&refused).contains("1 worker(s) are registered"), "{}", stderr(&refused));
    worker.stop();
    let out = sg.run(&["purge", "--all", "--yes"]);
    assert!(stdout(&out).starts_with(&format!("purged namespace {}: ", sg.ns)), "{}", stderr(&out));
    assert!(sg.keys().is_empty(), "{:?}", sg.keys());
    assert_fails(&sg.run(&["status", "gone"]), 4, "no request with id \"gone\" (never submitted, or its results expired)");
}

#[test]
fn list_filters_by_tag_and_state_track_marks_and_purge_removes_finished_requests() {
    let sg = Sg::new("cli-list");
    for (id, tag) in [("a", "blue"), ("b", "red"), ("c", "blue")] {
        let out = sg.run_with_input(&["submit", "--id", id, "--tag", tag, "--tag", "all"], b"x\n");
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let ids = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["--json", "list"];
        all.extend_from_slice(args);
        let out = sg.run(&all);
        assert!(out.status.success(), "{}", stderr(&out));
        let lines: Vec<Value> = stdout(&out).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert!(lines.last().unwrap().get("cursor").is_some(), "a page ends with its cursor");
        lines[..lines.len() - 1].iter().map(|r| r["id"].as_str().unwrap().to_owned()).collect()
    };
    assert_eq!(ids(&[]), ["c", "b", "a"]);
    assert_eq!(ids(&["--tag", "blue"]), ["c", "a"]);
    assert_eq!(ids(&["--state", "queued", "--limit", "2"]), ["c", "b"]);
    let table = stdout(&sg.run(&["list", "--tag", "red"]));
    assert!(table.starts_with("ID ") && table.contains("queued") && table.contains("0/0/1") && table.contains("red,all"), "{table}");
    assert!(sg.run(&["track", "b"]).status.success());
    assert_eq!(ids(&["--tracked"]), ["b"]);
    assert!(stdout(&sg.run(&["status", "b"])).contains("tags         red, all (tracked)"));
    fails_with(&sg.run(&["purge", "a"]), 2, "refused: request \"a\" has not finished");
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    let out = sg.run(&["results", "--wait", "a"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _ = sg.run(&["results", "--wait", "b"]);
    let _ = sg.run(&["results", "--wait", "c"]);
    worker.stop();
    assert_eq!(ids(&["--state", "completed"]), ["c", "b", "a"]);
    assert!(sg.run(&["purge", "a"]).status.success());
    fails_with(&sg.run(&["status", "a"]), 4, "no request with id \"a\"");
    fails_with(&sg.run(&["purge", "--state", "completed"]), 2, "add --yes to confirm");
    let purged = sg.json(&["purge", "--state", "completed", "--older-than", "0s", "--yes"]);
    assert_eq!(purged["purged"], 2, "{purged}");
    assert!(ids(&[]).is_empty());
    fails_with(&sg.run(&["list", "--state", "done"]), 2, "unknown state \"done\"");
    fails_with(&sg.run_with_input(&["submit", "--tag", "two words"], b"x\n"), 2, "invalid tag \"two words\"");
}

/// `--token-shards N` (or `SLUICEGATE_TOKEN_SHARDS`): requests submitted over three shards are
/// all listed, and a worker serving three shards runs every one of them; without it, the tool
/// sees shard 0 only, but still finds each by id.
#[test]
fn token_shards_let_the_tool_list_and_serve_every_shard_of_a_sharded_namespace() {
    let sg = Sg::new("cli-shards");
    let ids: Vec<String> = (0..12).map(|n| format!("r{n}")).collect();
    for id in &ids {
        let out = sg.run_with_input(&["--token-shards", "3", "submit", "--id", id], b"x\n");
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let listed = |args: &[&str]| -> usize {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--json", "list"]);
        let out = sg.run(&all);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out).lines().count() - 1
    };
    assert_eq!(listed(&["--token-shards", "3"]), 12, "every shard's requests are listed");
    assert!(listed(&[]) < 12, "one shard's only, without the setting");
    for id in &ids {
        let out = sg.run(&["--json", "status", id]);
        assert!(out.status.success(), "status {id} without the setting: {}", stderr(&out));
    }
    let worker = sg.worker(&fixture("upper.sh"), &["--token-shards", "3"]);
    for id in &ids {
        let out = sg.run(&["results", "--wait", id]);
        assert!(out.status.success(), "{id}: {}", stderr(&out));
    }
    worker.stop();
    fails_with(&sg.run(&["--token-shards", "0", "list"]), 2, "token_shards must be from 1 to 1024");
}

/// `GET /metrics` from `addr`, by hand (HTTP/1.0: the body runs to the end of the connection).
fn scrape(addr: &str) -> (String, String) {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: sluicegate\r\n\r\n").unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

/// Checks the OpenMetrics text format line by line: `# HELP|TYPE|UNIT name ...` comments,
/// samples `name{label="value",...} number`, and `# EOF` last.
fn assert_openmetrics(text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.last(), Some(&"# EOF"), "{text}");
    let name_ok = |n: &str| {
        !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    for line in &lines[..lines.len() - 1] {
        if let Some(comment) = line.strip_prefix("# ") {
            let mut words = comment.splitn(3, ' ');
            let kind = words.next().unwrap();
            assert!(matches!(kind, "HELP" | "TYPE" | "UNIT"), "{line}");
            assert!(name_ok(words.next().unwrap_or_default()), "{line}");
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        assert!(value.parse::<f64>().is_ok() || value == "+Inf", "value of {line}");
        let name = series.split('{').next().unwrap();
        assert!(name_ok(name), "{line}");
        if let Some(labels) = series.strip_prefix(name).filter(|l| !l.is_empty()) {
            let inner = labels.strip_prefix('{').and_then(|l| l.strip_suffix('}')).unwrap_or_else(|| panic!("{line}"));
            for pair in inner.split(',') {
                let (k, v) = pair.split_once('=').unwrap_or_else(|| panic!("{line}"));
                assert!(name_ok(k) && v.starts_with('"') && v.ends_with('"'), "{line}");
            }
        }
    }
}

#[test]
fn a_worker_serves_metrics_that_count_the_work_it_did_as_openmetrics() {
    let sg = Sg::new("cli-metrics");
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let worker = sg.worker(&fixture("sleepy.sh"), &["--metrics-addr", &addr]);
    sg.wait_for_workers(1);
    let lines: String = (0..12).map(|i| format!("line {i}\n")).collect();
    let out = sg.run_with_input(&["submit", "--concurrency", "3", "--wait"], lines.as_bytes());
    assert!(out.status.success(), "{}", stderr(&out));
    // A second request, cancelled while its one part runs: its hold is lost once.
    let out = sg.run_with_input(&["submit", "--id", "slow", "--concurrency", "1"], b"sleep\n");
    assert!(out.status.success(), "{}", stderr(&out));
    let deadline = Instant::now() + Duration::from_secs(10);
    let busy = format!("sluicegate_slots_busy{{namespace=\"{}\"}} 1", sg.ns);
    while !scrape(&addr).1.lines().any(|l| l == busy) {
        assert!(Instant::now() < deadline, "the slow part never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(sg.run(&["cancel", "slow"]).status.success());
    let lost = |text: &str| text.lines().any(|l| l == format!("sluicegate_leases_lost_total{{namespace=\"{}\"}} 1", sg.ns));
    while !lost(&scrape(&addr).1) {
        assert!(Instant::now() < deadline, "the lost hold was not counted:\n{}", scrape(&addr).1);
        std::thread::sleep(Duration::from_millis(50));
    }
    let (head, text) = scrape(&addr);
    assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
    assert_openmetrics(&text);
    let ns = &sg.ns;
    for sample in [
        format!("sluicegate_subrequests_total{{namespace=\"{ns}\",outcome=\"succeeded\"}} 12"),
        format!("sluicegate_subrequests_total{{namespace=\"{ns}\",outcome=\"dead_lettered\"}} 0"),
        format!("sluicegate_run_seconds_count{{namespace=\"{ns}\"}} 13"),
        format!("sluicegate_run_seconds_bucket{{le=\"+Inf\",namespace=\"{ns}\"}} 13"),
        format!("sluicegate_slots_busy{{namespace=\"{ns}\"}} 0"),
        // Two requests started, each once; one hold lost; no call failed.
        format!("sluicegate_queue_wait_seconds_count{{namespace=\"{ns}\"}} 2"),
        format!("sluicegate_queue_wait_seconds_bucket{{le=\"+Inf\",namespace=\"{ns}\"}} 2"),
        format!("sluicegate_leases_lost_total{{namespace=\"{ns}\"}} 1"),
        format!("sluicegate_redis_errors_total{{namespace=\"{ns}\"}} 0"),
    ] {
        assert!(text.lines().any(|l| l == sample), "{sample} not in:\n{text}");
    }
    worker.stop();
    // A port already taken is a start-up error that names the flag.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = sg.run(&["worker", "--exec", "cat", "--metrics-addr", &addr]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("(--metrics-addr)"), "{}", stderr(&out));
}

#[test]
fn metrics_serves_the_namespaces_backlog_workers_and_pauses_as_openmetrics() {
    let sg = Sg::new("cli-ns-metrics");
    let lines: String = (0..100).map(|i| format!("{i}\n")).collect();
    for _ in 0..2 {
        let out = sg.run_with_input(&["submit", "--priority", "80", "--concurrency", "2"], lines.as_bytes());
        assert!(out.status.success(), "{}", stderr(&out));
    }
    assert!(sg.run(&["pause", "--priority", "80"]).status.success());
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let log = sg.dir.join("metrics.log");
    let child = sg
        .command()
        .args(["metrics", "--listen", &addr])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let server = WorkerProcess { child, log };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "metrics never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (head, text) = scrape(&addr);
    assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "{head}\n{text}");
    assert_openmetrics(&text);
    let ns = &sg.ns;
    for sample in [
        format!("sluicegate_tokens_waiting{{namespace=\"{ns}\",priority=\"80\"}} 4"),
        format!("sluicegate_requests_active{{namespace=\"{ns}\"}} 2"),
        format!("sluicegate_workers{{namespace=\"{ns}\"}} 0"),
        format!("sluicegate_paused{{namespace=\"{ns}\",scope=\"80\"}} 1"),
        format!("sluicegate_tokens_held{{namespace=\"{ns}\"}} 0"),
        format!("sluicegate_requests{{namespace=\"{ns}\",state=\"unfinished\"}} 2"),
        format!("sluicegate_requests{{namespace=\"{ns}\",state=\"failed\"}} 0"),
        format!("sluicegate_token_capacity{{namespace=\"{ns}\"}} 4"),
        format!("sluicegate_tokens_parked{{namespace=\"{ns}\"}} 0"),
        format!("sluicegate_dead_letters{{namespace=\"{ns}\"}} 0"),
        format!("sluicegate_tally_complete{{namespace=\"{ns}\"}} 1"),
    ] {
        assert!(text.lines().any(|l| l == sample), "{sample} not in:\n{text}");
    }
    let memory = format!("sluicegate_redis_memory_bytes{{namespace=\"{ns}\"}} ");
    let used = text.lines().find_map(|l| l.strip_prefix(memory.as_str())).and_then(|v| v.parse::<u64>().ok());
    assert!(used.is_some_and(|b| b > 100_000), "{memory} not in:\n{text}");
    let oldest = format!("sluicegate_oldest_waiting_seconds{{namespace=\"{ns}\",priority=\"80\"}} ");
    assert!(text.lines().any(|l| l.starts_with(&oldest)), "{oldest} not in:\n{text}");
    server.stop();
}

#[test]
fn dashboard_wants_a_token_beyond_loopback_and_serves_its_api_and_logs_actions() {
    let sg = Sg::new("cli-dashboard");
    let out = sg.run(&["dashboard", "--listen", "0.0.0.0:1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--token"), "{}", stderr(&out));
    let out = sg.run_with_input(&["submit", "--id", "dash-1", "--concurrency", "2"], b"1\n2\n3\n");
    assert!(out.status.success(), "{}", stderr(&out));
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let log = sg.dir.join("dashboard.log");
    let child = sg
        .command()
        .args(["dashboard", "--listen", &addr, "--allow-actions", "--token", "t0k"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let server = WorkerProcess { child, log };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "the dashboard never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let exchange = |request: String| {
        use std::io::Read;
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        reply
    };
    let reply = exchange("GET /api/config HTTP/1.0\r\nAuthorization: Bearer t0k\r\n\r\n".into());
    assert!(reply.starts_with("HTTP/1.0 200"), "{reply}");
    assert!(reply.contains(&format!("\"namespace\":\"{}\"", sg.ns)), "{reply}");
    let reply = exchange("GET /api/config HTTP/1.0\r\nAuthorization: Bearer nope\r\n\r\n".into());
    assert!(reply.starts_with("HTTP/1.0 401"), "{reply}");
    let reply = exchange(
        "POST /api/requests/dash-1/cancel HTTP/1.0\r\nAuthorization: Bearer t0k\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}".into(),
    );
    assert!(reply.starts_with("HTTP/1.0 200"), "{reply}");
    assert_eq!(sg.json(&["status", "dash-1"])["state"], "cancelled");
    let log = server.stop();
    assert!(log.contains("dashboard action") && log.contains("cancel") && log.contains("bearer token"), "{log}");
}

/// Whether process `pid` runs (a zombie, dead but not yet reaped, does not).
fn running(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit(") ").next().is_some_and(|rest| !rest.starts_with('Z')))
}

/// Waits up to 5 s for a pid file the command wrote, then for that process to be gone.
fn assert_ends(file: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let pid = loop {
        if let Some(pid) = fs::read_to_string(file).ok().and_then(|t| t.trim().parse::<u32>().ok()) {
            break pid;
        }
        assert!(Instant::now() < deadline, "{what}: the command never wrote {}", file.display());
        std::thread::sleep(Duration::from_millis(20));
    };
    while running(pid) {
        assert!(Instant::now() < deadline, "{what}: the grandchild {pid} outlived its command");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_exec_commands_background_children_end_with_it_on_exit_timeout_and_cancel() {
    let sg = Sg::new("cli-group");
    let dir = sg.dir.display().to_string();
    // Starts a long sleep in the background (holding stdout open), notes its pid, and then exits
    // (line "exit"), or waits for it (any other line).
    let script = sg.file(
        "spawner.sh",
        format!(
            "#!/bin/sh\nread line\nsleep 30 &\necho $! > {dir}/grandchild-$SLUICEGATE_REQUEST_ID\n\
             if [ \"$line\" = '\"exit\"' ]; then echo '\"left one behind\"'; exit 0; fi\nwait\n"
        )
        .as_bytes(),
    );
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let worker = sg.worker(&script, &["--timeout", "2s"]);
    sg.wait_for_workers(1);
    // The command exits at once: its result comes back (the grandchild's open stdout does not
    // hold it) and the grandchild ends.
    let out = sg.run_with_input(&["submit", "--id", "exits", "--wait", "--raw"], b"exit\n");
    assert_eq!(stdout(&out), "left one behind\n", "{}", stderr(&out));
    assert_ends(&sg.dir.join("grandchild-exits"), "exit");
    // The command outlives its timeout: killed with its grandchild.
    let out = sg.run_with_input(&["submit", "--id", "slow", "--wait"], b"wait\n");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_ends(&sg.dir.join("grandchild-slow"), "timeout");
    // The request is cancelled while its command runs: killed with its grandchild.
    assert!(sg.run_with_input(&["submit", "--id", "cancelled"], b"wait\n").status.success());
    let file = sg.dir.join("grandchild-cancelled");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !file.exists() {
        assert!(Instant::now() < deadline, "the cancelled request's command never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(stdout(&sg.run(&["cancel", "cancelled"])), "cancelled cancelled\n");
    assert_ends(&file, "cancel");
    // The timeout is the sub-request's failure; the cancel is not.
    let log = worker.stop();
    assert!(log.contains("1 succeeded, 0 retried, 1 dead-lettered"), "{log}");
    assert!(log.contains("cancelling its handler"), "{log}");
}

#[test]
fn a_schedule_added_from_submit_arguments_fires_each_second_and_pauses_resumes_and_goes() {
    let sg = Sg::new("cli-sched");
    let input = sg.file("parts.txt", b"hello\nworld\n");
    let added = sg.json(&[
        "schedule", "add", "each-second", "--cron", "* * * * * *", "--missed", "catch-up", "--catch-up", "5", "--",
        "--priority", "70", "--tag", "team:ops", "--max-attempts", "2", &input,
    ]);
    assert_eq!(added["name"], "each-second");
    assert_eq!((added["parts"].as_u64(), added["priority"].as_u64()), (Some(2), Some(70)));
    assert_eq!(added["missed"], "catch-up 5");
    assert_eq!(added["tags"], serde_json::json!(["schedule:each-second", "team:ops"]));
    // The same again is no change; another spec under the name is refused.
    let again = sg.run(&["schedule", "add", "each-second", "--cron", "* * * * * *", "--missed", "catch-up", "--catch-up", "5", "--",
        "--priority", "70", "--tag", "team:ops", "--max-attempts", "2", &input]);
    assert!(again.status.success(), "{}", stderr(&again));
    let other = sg.run(&["schedule", "add", "each-second", "--cron", "*/2 * * * * *", "--", &input]);
    fails_with(&other, 2, "schedule \"each-second\" exists with another spec");
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    // Every tick's request is submitted with the template, and runs.
    let deadline = Instant::now() + Duration::from_secs(20);
    let done = loop {
        let out = sg.run(&["--json", "list", "--tag", "schedule:each-second", "--state", "completed"]);
        let rows: Vec<Value> =
            stdout(&out).lines().map(|l| serde_json::from_str(l).unwrap()).filter(|v: &Value| v.get("id").is_some()).collect();
        if rows.len() >= 2 {
            break rows;
        }
        assert!(Instant::now() < deadline, "no two ticks completed within 20 s");
        std::thread::sleep(Duration::from_millis(200));
    };
    let id = done[0]["id"].as_str().unwrap();
    let (name, tick) = id.split_once('@').unwrap();
    assert_eq!(name, "each-second");
    assert_eq!(tick.parse::<u64>().unwrap() % 1000, 0, "{id}");
    assert_eq!((done[0]["priority"].as_u64(), done[0]["total"].as_u64()), (Some(70), Some(2)));
    assert_eq!(stdout(&sg.run(&["results", id])), "\"HELLO\"\n\"WORLD\"\n", "the parts' results");
    let paused = sg.run(&["schedule", "pause", "each-second"]);
    assert_eq!(stdout(&paused), "paused schedule each-second\n");
    assert_eq!(stdout(&sg.run(&["schedule", "pause", "each-second"])), "schedule each-second was paused already\n");
    let listed = sg.json(&["schedule", "list"]);
    assert_eq!((listed["name"].as_str(), listed["next_ms"].as_u64()), (Some("each-second"), None));
    assert!(listed["paused_ms"].as_u64().is_some(), "{listed}");
    let table = stdout(&sg.run(&["schedule", "list"]));
    assert!(table.lines().nth(1).is_some_and(|l| l.starts_with("each-second") && l.contains("paused since")), "{table}");
    assert_eq!(stdout(&sg.run(&["schedule", "resume", "each-second"])), "resumed schedule each-second\n");
    assert_eq!(stdout(&sg.run(&["schedule", "remove", "each-second"])), "removed schedule each-second (its requests stay)\n");
    assert_fails(&sg.run(&["schedule", "remove", "each-second"]), 4, "no schedule named \"each-second\"");
    assert_fails(&sg.run(&["schedule", "pause", "nope"]), 4, "no schedule named \"nope\"");
    assert_eq!(stdout(&sg.run(&["schedule", "list"])).lines().count(), 1, "only the header is left");
    worker.stop();
}

#[test]
fn a_schedule_whose_requests_discard_their_results_fires_them_so() {
    let sg = Sg::new("cli-sched-quiet");
    let input = sg.file("parts.txt", b"hello\nworld\n");
    let added = sg.json(&["schedule", "add", "quiet", "--cron", "* * * * * *", "--", "--discard-results", &input]);
    assert_eq!(added["discard_results"], true, "{added}");
    let worker = sg.worker(&fixture("upper.sh"), &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let id = loop {
        let out = sg.run(&["--json", "list", "--tag", "schedule:quiet", "--state", "completed"]);
        let row = stdout(&out).lines().map(|l| serde_json::from_str::<Value>(l).unwrap()).find(|v| v.get("id").is_some());
        if let Some(row) = row {
            break row["id"].as_str().unwrap().to_owned();
        }
        assert!(Instant::now() < deadline, "no tick completed within 20 s");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(stdout(&sg.run(&["schedule", "remove", "quiet"])), "removed schedule quiet (its requests stay)\n");
    let status = stdout(&sg.run(&["status", &id]));
    assert!(status.contains("results      discarded"), "{status}");
    worker.stop();
}

#[test]
fn a_bad_schedule_is_one_line_naming_the_problem() {
    let sg = Sg::new("cli-sched-bad");
    let input = sg.file("parts.txt", b"x\n");
    let add = |name: &str, extra: &[&str], template: &[&str]| {
        let mut args = vec!["schedule", "add", name, "--cron", "*/5 * * * *"];
        args.extend_from_slice(extra);
        args.push("--");
        args.extend_from_slice(template);
        sg.run(&args)
    };
    fails_with(&add("a@b", &[], &[&input]), 2, "invalid schedule name \"a@b\"");
    fails_with(&sg.run(&["schedule", "add", "x", "--cron", "61 * * * *", "--", &input]), 2, "invalid cron \"61 * * * *\"");
    fails_with(&add("x", &["--tz", "Mars/Base"], &[&input]), 2, "unknown time zone \"Mars/Base\"");
    fails_with(&add("x", &["--missed", "catch-up"], &[&input]), 2, "--missed catch-up needs --catch-up N");
    fails_with(&add("x", &["--missed", "catch-up", "--catch-up", "101"], &[&input]), 2, "catch-up 101 is out of range");
    fails_with(&add("x", &[], &["--id", "fixed", &input]), 2, "cannot take --id");
    fails_with(&add("x", &[], &["--stream", &input]), 2, "cannot take --stream");
    fails_with(&add("x", &[], &["--after", "a-request", &input]), 2, "cannot take --after");
    fails_with(&add("x", &[], &["--group", "tenant", &input]), 2, "cannot take --group");
    fails_with(&add("x", &[], &["--priority", "120", &input]), 2, "priority 120 is out of range");
    fails_with(&add("x", &[], &["--no-such-option", &input]), 2, "the request after `--`");
    let empty = sg.file("empty.txt", b"");
    fails_with(&add("x", &[], &[&empty]), 2, "the input has no lines");
    fails_with(&add("x", &[], &["/no/such/file"]), 2, "cannot read /no/such/file");
    assert_eq!(stdout(&sg.run(&["schedule", "list"])).lines().count(), 1, "nothing was added");
}

#[test]
fn every_command_has_help_with_an_example() {
    let commands =
        [
        "submit", "worker", "status", "finalize", "cancel", "requeue", "dead", "purge", "stats", "pause", "resume", "metrics", "results",
        "events", "schedule", "schedule add", "group", "group set", "group list", "group show",
    ];
    for cmd in commands {
        let out = Command::new(BIN).args(cmd.split(' ')).arg("--help").output().unwrap();
        assert!(out.status.success());
        assert!(stdout(&out).contains("Example:\n  sluicegate "), "{cmd} --help:\n{}", stdout(&out));
    }
}

/// A worker sent SIGTERM while Redis is unreachable (crashed, cut off) stops within its shutdown
/// grace plus 5 s, and says what it could not hand back; other workers reclaim that once
/// its registration expires, as after a crash. (It used to keep retrying forever.)
#[test]
fn a_worker_sent_sigterm_while_redis_is_unreachable_stops_and_says_what_it_left() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut redis = runtime.block_on(sluicegate_testkit::RedisServer::start()).unwrap();
    let ns = unique_namespace("noredis");
    let dir = std::env::temp_dir().join(format!("sluicegate-cli-{ns}"));
    fs::create_dir_all(&dir).unwrap();
    let base = |args: &[&str]| {
        let mut cmd = Command::new(BIN);
        cmd.env_remove("REDIS_URL").args(["--redis", &redis.url(), "--namespace", &ns]).args(FAST).args(args);
        cmd
    };
    let log = dir.join("worker.log");
    let mut worker = base(&["worker", "--exec", "sleep 30", "--slots", "1", "--shutdown-grace", "1s"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let submitted = base(&["submit", "--id", "held"]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    {
        let mut submitted = submitted;
        submitted.stdin.take().unwrap().write_all(b"\"x\"\n").unwrap();
        assert!(submitted.wait().unwrap().success());
    }
    // Until the worker's slot holds the request's token, running its command.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = base(&["--json", "status", "held"]).output().unwrap();
        let status: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        // (A lane request's status does not count its running parts: its state says it started.)
        if status["running"].as_u64() == Some(1) || status["state"].as_str() == Some("running") {
            break;
        }
        assert!(Instant::now() < deadline, "the worker never took the request: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(50));
    }
    redis.kill().unwrap();
    let term = Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap();
    assert!(term.success());
    let sent = Instant::now();
    // The grace (1 s), then 5 s for the slots' hand-backs and the last calls together, and 3 s of
    // room for the process to end on a busy machine.
    let limit = Duration::from_secs(9);
    let status = loop {
        if let Some(status) = worker.try_wait().unwrap() {
            break status;
        }
        if sent.elapsed() > limit {
            let _ = worker.kill();
            panic!("the worker was still running {limit:?} after SIGTERM; its stderr:\n{}", fs::read_to_string(&log).unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = fs::read_to_string(&log).unwrap();
    assert!(stderr.contains("without handing back"), "it says what it could not hand back:\n{stderr}");
    assert!(status.success() || status.code().is_some(), "{status:?}");
    let _ = fs::remove_dir_all(&dir);
}
