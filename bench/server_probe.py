"""What the bench asks a running server before it measures: is it up, how many weight bytes a
step reads, has its background read of the weights finished. Any OpenAI-style server answers
``/health``; the two gauges are trillm's own, and a peer without them answers None or nothing."""

from __future__ import annotations

import subprocess
import sys
import time

from trillm.bench.prometheus import scrape


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    """Poll ``/health`` until 200; ``SystemExit`` if the server process dies or never gets there."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


def server_step_bytes(url: str) -> int | None:
    """The server's ``trillm:model_weight_bytes_per_step`` gauge (None from servers without it)."""
    import httpx

    value = scrape(httpx.get(url + "/metrics", timeout=10).text).get("model_weight_bytes_per_step")
    return None if value is None else int(value)


def wait_weights_read(url: str, timeout: float = 600) -> None:
    """Until the server's background read of its weights is done (``trillm:weights_pending_bytes`` 0):
    a GGUF file's pages are read and moved into huge pages after start, and a run measured meanwhile
    shares the cores and the memory with that copy (an 8B file: ~17 s of slower steps)."""
    import httpx

    began = time.monotonic()
    while time.monotonic() - began < timeout:
        pending = scrape(httpx.get(url + "/metrics", timeout=10).text).get("weights_pending_bytes")
        if not pending:
            if time.monotonic() - began > 1:
                print(f"[bench] the server's weights read in after {time.monotonic() - began:.0f} s", file=sys.stderr)
            return
        time.sleep(0.5)
    print("[bench] the server still reads its weights; measuring anyway", file=sys.stderr)
