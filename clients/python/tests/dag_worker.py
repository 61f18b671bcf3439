"""A Python worker for the DAG that tests/python_client.rs submits with the Rust producer.

    python dag_worker.py URL NAMESPACE

Each part ``{"n", "upstreams", "fail"}`` (the Rust suite's ``Step``) returns ``n`` plus every result
of each of its upstreams, read with ``ctx.upstream``; a part with ``fail`` fails permanently. Runs
until SIGTERM (or it is killed).
"""

from __future__ import annotations

import sys
from typing import Any, Dict

from sluicegate import PartError, PermanentError, Worker


def handle(ctx: Any, step: Dict[str, Any]) -> int:
    total = int(step["n"])
    for up in step["upstreams"]:
        for r in ctx.upstream(up):
            if isinstance(r, PartError):
                raise PermanentError(f"upstream part failed: {r}")
            total += r
    if step.get("fail"):
        raise PermanentError("a step chosen to fail")
    return total


def main() -> None:
    url, namespace = sys.argv[1], sys.argv[2]
    Worker(url, handle, slots=4, namespace=namespace, lease=1.5, heartbeat=0.3, recovery_interval=0.2,
           census_interval=1.0, idle_poll=0.25).run()


if __name__ == "__main__":
    main()
