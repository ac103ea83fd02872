"""``--dp 2``: the router alone, then two replica processes behind one real ``trillm serve``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from trillm.bench.server_probe import wait_healthy
from trillm.engine.config import EngineConfig
from trillm.engine.processes import free_port
from trillm.engine.replicas.router import PrefixRouter, prefix_hashes

from tests.server import MODEL

PAGE = 4


def test_prefix_hashes_name_whole_prefixes():
    a, b = prefix_hashes(list(range(10)), PAGE), prefix_hashes([*range(8), 99], PAGE)
    assert len(a) == 2 and a == b  # only whole pages, and the same pages give the same names
    assert prefix_hashes([1, *range(1, 8)], PAGE)[1] != a[1]  # a prefix's name covers all of it


def test_a_shared_prefix_goes_where_it_went_before_unless_that_replica_is_busy():
    router = PrefixRouter(2, PAGE, slack=2)
    shared = list(range(12))
    first = router.choose(shared + [100], [0, 0], [True, True])
    assert router.choose(shared + [101], [1, 0], [True, True]) == first  # busier by 1, within the slack
    assert router.affinity_hits == 1
    assert router.choose(shared + [102], [3, 0] if first == 0 else [0, 3], [True, True]) != first  # too busy
    other = router.choose([50] * 12, [0, 0], [True, True])  # no prefix anywhere: spread (fewest routed)
    assert router.routed == [2, 2] and other in (0, 1)


def test_no_match_goes_to_the_least_loaded_live_replica_and_a_dead_one_gets_nothing():
    router = PrefixRouter(3, PAGE)
    assert router.choose([1] * 8, [5, 2, 7], [True, True, True]) == 1
    assert router.choose([1] * 8, [5, 0, 7], [True, False, True]) == 0  # its prefix's holder is dead
    router.forget(0)
    assert router.match(0, prefix_hashes([1] * 8, PAGE)) == 0
    with pytest.raises(ValueError):
        router.choose([1], [0, 0, 0], [False, False, False])


def test_replicas_span_one_machine():
    with pytest.raises(ValueError, match="dp with nnodes"):
        EngineConfig(dp=2, tp=2, nnodes=2)


def _metric(text: str, name: str, replica: str) -> float:
    found = re.search(rf'^trillm:{name}{{model_name="[^"]*",replica="{replica}"}} (\S+)$', text, re.M)
    assert found, f"{name} for replica {replica!r} not in /metrics"
    return float(found.group(1))


def _per_replica(url: str, name: str) -> list[float]:
    text = httpx.get(url + "/metrics").text
    return [_metric(text, name, str(i)) for i in range(2)]


def _wait_for(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.e2e
@pytest.mark.slow
def test_two_replicas_share_work_route_by_prefix_free_pages_and_survive_a_death(tmp_path: Path):
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "trillm.api.cli", "serve", "--dp", "2", "--port", str(port)]
    command += ["--dtype", "float32", "--num-pages", "64", "--max-num-seqs", "8"]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, env=os.environ.copy(), stderr=log_file)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=60)

    def complete(prompt: str, max_tokens: int = 4) -> dict:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        return r.json()

    try:
        wait_healthy(url, proc, timeout=180)
        # its card weighs both replicas (each ~106 MiB of weights; --models-memory reads this)
        assert http.get(f"/v1/models/{MODEL}").json()["memory_bytes"] > 2 * 100 * 2**20
        # Distinct prompts, several at once: both replicas take work.
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda i: complete(f"Story number {i}: " + "once upon a time " * 8, 8), range(6)))
        assert all(tokens > 0 for tokens in _per_replica(url, "prompt_tokens_total"))

        # One long shared prefix, then different endings: all go where the prefix is cached.
        shared = "You are a helpful assistant who answers in one word. " * 6
        hits_before = _per_replica(url, "prefix_cache_hits_total")
        for i in range(5):
            complete(shared + f"Question {i}: what colour is the sky?")
        _wait_for(lambda: sum(_per_replica(url, "prefix_cache_hits_total")) > sum(hits_before))
        gained = [a - b for a, b in zip(_per_replica(url, "prefix_cache_hits_total"), hits_before)]
        assert sorted(gained)[0] == 0 and sorted(gained)[1] >= 4 * 32, gained  # one replica, four hits

        # Streams cancelled mid-way: every page comes back, on each replica's own books.
        body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        for _ in range(4):
            with http.stream("POST", "/v1/completions", json=body) as response:
                for i, _line in enumerate(response.iter_lines()):
                    if i == 6:
                        break

        def idle() -> bool:
            free = _per_replica(url, "kv_cache_free_pages")
            cached = _per_replica(url, "kv_cache_evictable_pages")
            return [f + c for f, c in zip(free, cached)] == _per_replica(url, "kv_cache_total_pages")

        _wait_for(idle)
        assert sum(_per_replica(url, "num_requests_aborted_total")) >= 4
        # /flush_cache reaches both.
        assert http.post("/flush_cache").status_code == 200
        _wait_for(lambda: _per_replica(url, "kv_cache_evictable_pages") == [0, 0])

        # A replica dies under an open stream: that stream ends in error, the service keeps answering.
        with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "doomed"}) as response:
            lines = []
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    log = log_path.read_text()
                    replica = re.search(r"request doomed: engine requests dp(\d)-", log).group(1)  # type: ignore[union-attr]
                    pid = re.search(rf"\[replica {replica}\] .*serving as process (\d+)", log).group(1)  # type: ignore[union-attr]
                    os.kill(int(pid), signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "error"
        for i in range(4):
            assert complete(f"Still there? {i}")["choices"][0]["text"] is not None
        assert http.get("/health").status_code == 200
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)  # and it still stops cleanly
        assert proc.wait(timeout=60) == 0
    finally:
        http.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
