"""``/openapi.json`` against the live server, fuzzed by schemathesis with all its checks: no 5xx,
every response (status, content type, headers, body) as the document publishes it, valid data
accepted and invalid data refused, and the server still serves afterwards (issue 13).

Sized to about a minute on a quiet machine: generation requests are capped to one token, which
exercises the same code paths as many."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import positive_data_acceptance
from schemathesis.generation import GenerationMode

from tests.helpers import wait_idle
from tests.server import MODEL, QUESTION, client, in_thread

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLES_PER_OPERATION = int(os.environ.get("TRILLM_FUZZ_EXAMPLES", "12"))  # per mode: valid, then invalid


def _cap_lengths(body: object) -> None:
    """Generated max_tokens can be huge, and chat without one runs to the context (a Responses body
    without max_output_tokens too); one token exercises the same code paths."""
    if not isinstance(body, dict):
        return
    if "input" in body and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 1
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            body[key] = 1


def _fuzz(url: str) -> dict[str, set[int]]:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(mode))
            def check(case) -> None:
                _cap_lengths(case.body)
                # Every check but one: the schema cannot say "exactly one of `messages` or `prompt`", "n x prompts
                # <= 128" or "prompt + max_tokens within the context", so valid-looking data may get a 400 (which
                # must still name the field, below).
                response = case.call_and_validate(base_url=url, timeout=120, excluded_checks=[positive_data_acceptance])
                if response.status_code == 400:
                    assert response.json()["error"]["message"], response.text
                seen.setdefault(operation.label, set()).add(response.status_code)  # noqa: B023 (called in the loop)

            try:
                check()  # runs here, inside this iteration, so the loop variables it reads are this operation's
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body): GET /health, /metrics, ...
                assert mode is GenerationMode.NEGATIVE and not operation.body
    return seen


async def test_schemathesis_finds_nothing(server):
    seen = await in_thread(_fuzz, server.url)
    operations = {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /tokenize"}
    operations |= {"POST /v1/messages", "POST /v1/messages/count_tokens"}
    assert operations | {"GET /v1/models", "GET /v1/models/{model}"} <= set(seen)
    assert 200 in seen["GET /v1/models/{model}"]
    assert any(200 in codes for label, codes in seen.items() if label.startswith("POST /v1/")), seen
    assert all(400 in seen[label] for label in operations), seen
    await wait_idle(server.engine, timeout=30)
    reply = await in_thread(client(server).chat.completions.create, model=MODEL, messages=QUESTION, max_tokens=4)
    assert reply.choices[0].message.content
