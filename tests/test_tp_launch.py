"""``--tp 2`` launched as users launch it across machines: two ``trillm serve`` processes on this
one, each a "node" of one rank, meeting over gloo on loopback. Node 0 serves the OpenAI API with
the same greedy replies as a one-rank server; when node 1 dies, node 0 fails fast, non-zero."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from trillm.bench.server_probe import wait_healthy
from trillm.engine.processes import free_port

from tests.server import MODEL, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def _node(rank: int, master_port: int, http_port: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "trillm.api.cli", "serve", "--dtype", "float32", "--num-pages", "64"]
    command += ["--tp", "2", "--nnodes", "2", "--node-rank", str(rank), "--master-port", str(master_port)]
    command += ["--port", str(http_port), "--dist-timeout", "20"]
    return subprocess.Popen(command, env=os.environ.copy(), stderr=subprocess.PIPE if rank == 0 else None)


async def _replies(base_url: str) -> list[tuple[str, str]]:
    """Each question greedily, not streamed and streamed."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", timeout=120)
    out = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        out.append((whole.choices[0].message.content or "", "".join(pieces)))
    await client.close()
    return out


async def test_two_nodes_serve_tp_1s_replies_and_node_0_fails_fast_when_node_1_dies(model_parts):
    async with running_server(model_parts) as one:
        expected = await _replies(one.url)
    master, http = free_port(), free_port()
    nodes = [_node(0, master, http), _node(1, master, http)]
    url = f"http://127.0.0.1:{http}"
    try:
        wait_healthy(url, nodes[0], timeout=180)
        assert await _replies(url) == expected
        assert all(whole == streamed for whole, streamed in expected)

        body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = []
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    nodes[1].send_signal(signal.SIGKILL)
                    killed = time.monotonic()
        assert lines[-1] == "data: [DONE]", lines[-2:]  # the stream got its end
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
        # The stream ended (it did not hang), and node 0 exits non-zero, saying why.
        try:
            code = nodes[0].wait(timeout=30)
        except subprocess.TimeoutExpired:
            nodes[0].kill()
            code = None
        assert nodes[0].stderr is not None
        log = nodes[0].stderr.read().decode()
        assert code not in (0, None), log[-3000:]
        assert time.monotonic() - killed < 30
        assert "tensor-parallel" in log, log[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
            node.wait()


def test_ctrl_c_to_the_process_group_drains_and_stops_every_rank():
    """Ctrl-C reaches every process of the group: the worker ranks leave the stop to rank 0, which
    drains, tells them to stop (even though it was cancelled) and exits 0, leaving no process."""
    port = free_port()
    command = [sys.executable, "-m", "trillm.api.cli", "serve", "--dtype", "float32", "--num-pages", "64"]
    proc = subprocess.Popen([*command, "--tp", "2", "--port", str(port)], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=180)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(proc.pid), "a rank outlived the server"
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
