"""The two ways users launch trillm, as real processes: ``hypercorn -k trio`` and ``trillm serve``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from trillm.bench.server_probe import wait_healthy
from trillm.engine.processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"


def test_hypercorn_cli_with_environment_settings():
    """Also at ``TRILLM_TP=2``: Hypercorn's workers are daemonic processes, which Python forbids to
    start children unless asked otherwise (``engine.processes.children_allowed``)."""
    port = free_port()
    env = {**os.environ, "TRILLM_NUM_PAGES": "64", "TRILLM_SERVED_MODEL_NAME": "smol", "TRILLM_DTYPE": "float32"}
    env["TRILLM_TP"] = "2"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "-k", "trio", "-b", f"127.0.0.1:{port}", "trillm.api.app:create_app()"],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=180)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "smol"
        metrics = httpx.get(url + "/metrics").text
        assert 'trillm:kv_cache_total_pages{model_name="smol"} 64.0' in metrics
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # Grammars compile in processes forked by a zygote, which a daemonic worker may start too.
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "guided_regex": "[0-9]{3}"},
        )
        assert r.status_code == 200 and re.fullmatch("[0-9]{3}", r.json()["choices"][0]["message"]["content"]), r.text
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_trillm_serve_sigterm_ends_open_streams_with_a_final_chunk():
    port = free_port()
    env = {**os.environ, "TRILLM_NUM_PAGES": "64"}
    command = [sys.executable, "-m", "trillm.api.cli", "serve", "--port", str(port), "--dtype", "float32"]
    proc = subprocess.Popen([*command, "--shutdown-timeout", "0"], env=env)  # no drain (tests/test_drain.py)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=180)
        events = []
        body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 5:
                    proc.send_signal(signal.SIGTERM)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
