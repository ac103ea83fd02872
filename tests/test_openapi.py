"""``/openapi.json`` against the live server: schemathesis-generated requests never get a 500,
every 4xx has the error shape, 200 replies match their schemas, and the server still serves."""

from __future__ import annotations

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers import wait_idle
from tests.server import MODEL, QUESTION, client, in_thread

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLES_PER_OPERATION = 20


def _cap_lengths(body: object) -> None:
    """Generated max_tokens can be huge, and chat without one runs to the context (a Responses body
    without max_output_tokens too); a few tokens exercise the same code paths."""
    if isinstance(body, dict):
        if "input" in body and body.get("max_output_tokens") is None:
            body["max_output_tokens"] = 3
        elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 3
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 3:
                body[key] = 3


def _content_type(response) -> str:
    value = response.headers.get("content-type", "")
    return value[0] if isinstance(value, list) else value


def _fuzz(url: str) -> dict[str, set[int]]:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    document = schema.raw_schema
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        responses = operation.definition.raw["responses"]

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case) -> None:
            _cap_lengths(case.body)
            response = case.call(base_url=url, timeout=120)
            seen.setdefault(operation.label, set()).add(response.status_code)  # noqa: B023 (called in the loop)
            assert response.status_code < 500, (case.body, response.text[:500])
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            elif _content_type(response).startswith("application/json"):
                schema_ref = responses["200"]["content"]["application/json"]["schema"]["$ref"]  # noqa: B023
                ref = schema_ref.rsplit("/", 1)[1]
                jsonschema.validate(response.json(), document["components"]["schemas"][ref])

        check()  # runs here, inside this iteration, so the loop variables it reads are this operation's
    return seen


async def test_schemathesis_finds_no_server_errors(server):
    seen = await in_thread(_fuzz, server.url)
    operations = {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /tokenize"}
    assert operations | {"GET /v1/models", "GET /v1/models/{model}"} <= set(seen)
    assert 200 in seen["GET /v1/models/{model}"]
    assert any(200 in codes for label, codes in seen.items() if label.startswith("POST /v1/"))
    await wait_idle(server.engine, timeout=30)
    reply = await in_thread(client(server).chat.completions.create, model=MODEL, messages=QUESTION, max_tokens=4)
    assert reply.choices[0].message.content
