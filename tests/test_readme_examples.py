"""The README's Python examples run as written against a real server (only the URL differs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.server import in_thread

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[1] / "README.md"


async def test_readme_python_examples_run(server):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    code = "\n".join(blocks).replace("http://127.0.0.1:8000/v1", server.base_url)
    namespace: dict = {}
    await in_thread(lambda: exec(compile(code, "README.md", "exec"), namespace))
    assert namespace["city"].population >= 0 and namespace["city"].name
    assert namespace["reply"].tool_calls and namespace["answer"].choices[0].message.content
