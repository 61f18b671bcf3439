"""Adding and replacing schedules from Python (``Admin.schedule_add``/``schedule_replace``, the
Rust ``Admin::schedule_add``/``schedule_replace``; docs/operations.md, "Schedules"): the spec is
stored as the Rust ``ScheduleSpec`` stores it, checked as the Rust checks it (cron patterns by a
port of croner's parser, time zones by the IANA names), read back by the CLI as the same spec, and
fired by a Rust worker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from sluicegate import Admin, InvalidRequest, InvalidSchedule, Producer, ScheduleExists
from sluicegate import _cron

from conftest import CLI
from conftest import cli as run_cli

needs_cli = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} is missing: cargo build -p sluicegate-cli")

#: A spec with every option (the parts: {"a": 1}, "x", 42), and its stored form.
FULL: Dict[str, Any] = dict(
    time_zone="Europe/Rome", catch_up=3, priority=70, concurrency=2, max_attempts=3, backoff=0.5, backoff_max=10,
    timeout=30, delay=2, tags=["team:x"], fail_fast=True,
)
FULL_JSON = (
    '{"cron":"*/5 * * * *","tz":"Europe/Rome","missed":"catch-up","catch_up":3,"request":{"parts":'
    '["gaFhAQ==","oXg=","Kg=="],"priority":70,"limit":2,"max_attempts":3,"backoff_ms":500,"backoff_max_ms":10000,'
    '"timeout_ms":30000,"delay_ms":2000,"tags":["team:x"],"fail_fast":true,"own_stream":false,"unlisted":false}}'
)
PARTS: List[Any] = [{"a": 1}, "x", 42]


def stored(admin: Admin, name: str) -> str:
    return admin.protocol.conn.client.hget(admin.protocol.keys.schedules(), name).decode()


def test_a_schedule_is_stored_as_the_rust_spec_and_added_again_or_replaced(server: Any, ns: str) -> None:
    admin = Admin(server.url, ns)
    admin.schedule_add("full", "*/5 * * * *", PARTS, **FULL)
    assert stored(admin, "full") == FULL_JSON
    s = admin.schedule("full")
    assert (s.cron, s.time_zone, s.missed, s.parts, s.priority, s.tags, s.paused_ms, s.next_ms) == (
        "*/5 * * * *", "Europe/Rome", "catch-up 3", 3, 70, ["schedule:full", "team:x"], None, None
    )
    # The defaults, as the Rust ScheduleSpec has them (the spec.rs test's part "a" is "oWE=").
    admin.schedule_add("plain", "@hourly", ["a"])
    assert stored(admin, "plain") == (
        '{"cron":"@hourly","missed":"skip","request":{"parts":["oWE="],"priority":50,"limit":1,"max_attempts":1,'
        '"backoff_ms":1000,"backoff_max_ms":60000,"delay_ms":0,"tags":[],"fail_fast":false,"own_stream":false,'
        '"unlisted":false}}'
    )
    # Discarding is written only when set, as the Rust template does (src/schedule/spec.rs).
    admin.schedule_add("quiet", "@hourly", ["a"], discard_results=True)
    assert stored(admin, "quiet") == (
        '{"cron":"@hourly","missed":"skip","request":{"parts":["oWE="],"priority":50,"limit":1,"max_attempts":1,'
        '"backoff_ms":1000,"backoff_max_ms":60000,"delay_ms":0,"tags":[],"fail_fast":false,"own_stream":false,'
        '"unlisted":false,"discard_results":true}}'
    )
    assert admin.schedule("quiet").discard_results and not admin.schedule("full").discard_results
    admin.schedule_remove("quiet")
    # The very same spec again changes nothing; another one under the name is refused ...
    gen = admin.protocol.conn.client.hget(admin.protocol.keys.schedule_state("full"), "gen")
    admin.schedule_add("full", "*/5 * * * *", PARTS, **FULL)
    assert admin.protocol.conn.client.hget(admin.protocol.keys.schedule_state("full"), "gen") == gen
    with pytest.raises(ScheduleExists, match='schedule "full" exists with another spec'):
        admin.schedule_add("full", "*/5 * * * *", PARTS, **{**FULL, "priority": 71})
    assert stored(admin, "full") == FULL_JSON
    # ... unless replaced: active from now, with the new template.
    admin.schedule_pause("full")
    admin.schedule_replace("full", "0 * * * *", ["b"], unlisted=True)
    s = admin.schedule("full")
    assert (s.cron, s.time_zone, s.missed, s.parts, s.tags, s.paused_ms) == ("0 * * * *", None, "skip", 1, [], None)
    admin.schedule_replace("new", "@daily", [1])
    assert [s.name for s in admin.schedules()] == ["full", "new", "plain"]


BAD = [
    (dict(name="a@b"), InvalidSchedule, "invalid schedule name \"a@b\""),
    (dict(cron="61 * * * *"), InvalidSchedule,
     'invalid cron "61 * * * *": Component error: Number out of bounds.'),
    (dict(cron="every day"), InvalidSchedule,
     "invalid cron \"every day\": Invalid pattern: Pattern must have between 5 and 7 fields."),
    (dict(cron="*/5 * * * mon-fry"), InvalidSchedule,
     "invalid cron \"*/5 * * * mon-fry\": Pattern contains illegal characters: CronPattern contains illegal "
     "character 'F' in part '1-FRY'"),
    (dict(cron="0 0 30 2 *"), InvalidSchedule, 'cron "0 0 30 2 *" never fires'),
    (dict(time_zone="Europe/Atlantis"), InvalidSchedule,
     'unknown time zone "Europe/Atlantis": use an IANA name such as Europe/Rome or America/New_York'),
    (dict(catch_up=0), InvalidSchedule, "catch-up 0 is out of range: use 1 to 100"),
    (dict(catch_up=101), InvalidSchedule, "catch-up 101 is out of range: use 1 to 100"),
    (dict(priority=100), InvalidRequest, "priority 100 is out of range: use 0 (lowest) to 99 (highest)"),
    (dict(priority=50.5), InvalidRequest, "priority 50.5 is out of range"),
    (dict(concurrency=0), InvalidRequest, "concurrency 0 is out of range: use 1 to 10000"),
    (dict(max_attempts=0), InvalidSchedule, "max_attempts 0 is out of range: use 1 to 1000"),
    (dict(backoff=2, backoff_max=1), InvalidSchedule, "backoff base 2000 ms exceeds its cap 1000 ms"),
    (dict(timeout=0), InvalidSchedule, "a timeout must be longer than zero"),
    (dict(delay=-1), InvalidSchedule, "a delay is a number of seconds of at least 0, not -1"),
    (dict(tags=["a b"]), InvalidRequest, 'invalid tag "a b": a tag is 1 to 64 characters'),
    (dict(tags=[f"t{i}" for i in range(16)]), InvalidSchedule,
     "a schedule's request carries at most 15 tags besides its schedule:<name>"),
    (dict(parts=[]), InvalidSchedule, 'schedule "s" has no parts: a request needs at least one'),
    (dict(unlisted=True, tags=["x"]), InvalidSchedule, "an unlisted schedule's requests cannot carry tags"),
    (dict(unlisted=True, own_stream=True), InvalidSchedule,
     "only a small request can be unlisted: at most 64 parts and 64 KB, not delayed, not own_stream"),
    (dict(unlisted=True, parts=list(range(65))), InvalidSchedule, "only a small request can be unlisted"),
    (dict(parts=["x" * (1 << 20)]), InvalidSchedule, 'schedule "s" takes 1398328 bytes: at most 1048576'),
]


@pytest.mark.parametrize("bad,error,message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_a_bad_schedule_is_refused_in_the_rust_words_and_nothing_is_stored(
    server: Any, ns: str, bad: Dict[str, Any], error: type, message: str
) -> None:
    admin = Admin(server.url, ns)
    args: Dict[str, Any] = dict(name="s", cron="* * * * *", parts=[1])
    args.update(bad)
    name, cron, parts = args.pop("name"), args.pop("cron"), args.pop("parts")
    for add in (admin.schedule_add, admin.schedule_replace):
        with pytest.raises(error) as e:
            add(name, cron, parts, **args)
        assert message in str(e.value)
    assert admin.schedules() == []


@pytest.mark.parametrize(
    "pattern",
    ["* * * * *", "*/10 * * * * *", "0 0 0 1 1 * 2030", "@yearly", "@WEEKLY", "0 9 * * MON-FRI", "0 0 L * *",
     "0 0 LW * *", "0 0 15W * *", "0 0 * * 5L", "0 0 * * FRI#2", "0 0 13 * +FRI", "0 0 ? JAN-MAR SUN",
     "0 0 29 2 *", "0 0 1 1 * * 2999-3001/2", "  1,2,3  4-5/1 * * 7 "],
)
def test_croners_patterns_are_taken(pattern: str) -> None:
    _cron.check(pattern)


@pytest.mark.parametrize(
    "pattern,why",
    [("", "CronPattern cannot be an empty string."),
     ("* * * *", "Invalid pattern: Pattern must have between 5 and 7 fields."),
     ("*/0 * * * *", "Component error: Step cannot be zero."),
     ("5/5 * * * *", 'Component error: Invalid step syntax: single number steps like "5/5" are not allowed.'),
     ("0 0 * * 1#6", "Component error: Nth specifier out of bounds."),
     ("0 0 5-1 * *", "Component error: Range out of bounds."),
     ("0 0 L * L#2", "Component error: Invalid number."),
     ("0 0 0W * *", "Component error: Day for closest weekday out of bounds."),
     ("0 0 * * * * 5001", "Component error: Number out of bounds."),
     ("0 0 31 4 *", None), ("0 0 30 2 +MON", None), ("0 0 1 1 * * 1", None)],
)
def test_croners_refusals_say_what_croner_says(pattern: str, why: Any) -> None:
    with pytest.raises(ValueError) as e:
        _cron.check(pattern)
    if why is None:
        assert str(e.value) == f"cron {_cron.rust_quoted(pattern)} never fires"
    else:
        assert str(e.value).startswith(f"invalid cron {_cron.rust_quoted(pattern)}: {why}")


# ----- interop with the Rust CLI (target/debug/sluicegate) -----


def cli(server: Any, ns: str, *args: str) -> subprocess.CompletedProcess:
    return run_cli(server.url, ns, *args)


@needs_cli
def test_the_cli_reads_a_python_schedule_as_the_very_spec_it_would_store(server: Any, ns: str, tmp_path: Path) -> None:
    admin = Admin(server.url, ns)
    admin.schedule_add("full", "*/5 * * * *", PARTS, **FULL)
    src = tmp_path / "parts.txt"
    src.write_text("".join(json.dumps(p) + "\n" for p in PARTS))
    flags = ["--cron", "*/5 * * * *", "--tz", "Europe/Rome", "--missed", "catch-up", "--catch-up", "3", "--",
             "--priority", "70", "--concurrency", "2", "--max-attempts", "3", "--backoff", "500ms", "--backoff-max",
             "10s", "--timeout", "30s", "--delay", "2s", "--fail-fast", "--tag", "team:x", str(src)]
    # The same spec from the CLI: "changes nothing" (with another, it would be refused: exit 2).
    out = cli(server, ns, "schedule", "add", "full", *flags)
    assert out.returncode == 0, out.stderr
    other = [("71" if f == "70" else f) for f in flags]
    out = cli(server, ns, "schedule", "add", "full", *other)
    assert out.returncode == 2 and 'schedule "full" exists with another spec' in out.stderr
    # And under another name, the CLI stores the very text Python did.
    assert cli(server, ns, "schedule", "add", "twin", *flags).returncode == 0
    assert stored(admin, "twin") == stored(admin, "full") == FULL_JSON
    out = cli(server, ns, "--json", "schedule", "list")
    assert out.returncode == 0, out.stderr
    listed = {s["name"]: s for s in map(json.loads, out.stdout.splitlines())}
    py = admin.schedule("full")
    for f in ("cron", "time_zone", "missed", "added_ms", "paused_ms", "last_ms", "owed_ms", "parts", "priority",
              "tags"):
        assert listed["full"][f] == getattr(py, f), f
    assert listed["full"]["next_ms"] > py.added_ms  # (the Rust Admin computes it; Python says None)


@needs_cli
def test_the_cli_refuses_what_python_refuses_in_the_same_words(server: Any, ns: str, tmp_path: Path) -> None:
    admin = Admin(server.url, ns)
    src = tmp_path / "parts.txt"
    src.write_text("1\n")
    for pattern, zone in (("61 * * * *", None), ("*/5 * * * mon-fry", None), ("0 0 30 2 *", None),
                          ("5/5 * * * *", None), ("* * * * *", "Europe/Atlantis"), ("0 0 * * 1#6", "UTC")):
        with pytest.raises(InvalidSchedule) as e:
            admin.schedule_add("s", pattern, [1], time_zone=zone)
        out = cli(server, ns, "schedule", "add", "s", "--cron", pattern, *(["--tz", zone] if zone else []), "--",
                  str(src))
        assert out.returncode == 2 and str(e.value) in out.stderr, (str(e.value), out.stderr)


@needs_cli
def test_a_python_schedule_is_fired_by_a_rust_worker(server: Any, ns: str, tmp_path: Path) -> None:
    script = tmp_path / "double.py"
    script.write_text("import json, sys\nprint(json.dumps(2 * json.loads(sys.stdin.read())))\n")
    admin = Admin(server.url, ns)
    admin.schedule_add("every-second", "* * * * * *", [1, 2], concurrency=2, tags=["py"])
    proc = subprocess.Popen(
        [str(CLI), "--redis", server.url, "--namespace", ns, "--lease", "1500ms", "--heartbeat", "300ms",
         "worker", "--exec", f"{sys.executable} {script}", "--slots", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while (last := admin.schedule("every-second").last_ms) is None:
            assert time.monotonic() < deadline, "the schedule never fired"
            time.sleep(0.05)
        done = Producer(server.url, ns).wait(f"every-second@{last}", timeout=20)
        assert (done.state, done.results) == ("completed", [2, 4])
        assert admin.status(f"every-second@{last}").tags == ["schedule:every-second", "py"]
    finally:
        admin.schedule_remove("every-second")
        proc.terminate()
        proc.wait(15)
