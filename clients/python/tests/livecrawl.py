"""What the live Scrapy tests share: the operator's metrics, and a crawl (`crawl.py`) in a process of its own."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any, Dict, Optional

import httpx

METRICS = os.environ.get("EGRESS_METRICS", "")


def answer(handler: Any, status: int, headers: Dict[str, str], body: str) -> None:
    """Writes an HTML page (`body` inside `<html><body>`) with `status` and `headers` from a BaseHTTPRequestHandler."""
    data = f"<html><body>{body}</body></html>".encode()
    handler.send_response(status)
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.send_header("Content-Type", "text/html")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def metric(prefix: str) -> float:
    """The sum of the operator's samples whose line starts with `prefix` (a name, or a name and labels)."""
    text = httpx.get(f"{METRICS}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def api_requests() -> float:
    """Every request the discovery API has answered."""
    return metric("egress_discovery_requests_total{")


def outcome(name: str) -> float:
    """Requests crawlers reported with outcome `name` (ok, failed, banned, throttled)."""
    return metric(f'egress_discovery_request_outcomes_total{{outcome="{name}"}}')


def crawl(
    start: str,
    settings: Optional[Dict[str, Any]] = None,
    sessions: int = 4,
    timeout: float = 300,
    env: Optional[Dict[str, str]] = None,
) -> dict:
    """Runs `crawl.py` from `start` with `settings` over its own (and `env` over this process's environment), and
    returns what it wrote: pages, stats, the close reason and how long after opening the spider closed."""
    here = pathlib.Path(__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        output = pathlib.Path(tmp) / "crawl.json"
        done = subprocess.run(
            [sys.executable, str(here / "crawl.py"), start, str(output)],
            env={
                **os.environ,
                "PYTHONPATH": str(here.parent / "src"),
                "CRAWL_SETTINGS": json.dumps(settings or {}),
                "CRAWL_SESSIONS": str(sessions),
                **(env or {}),
            },
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(output.read_text())
