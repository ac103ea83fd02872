"""``trillm.engine`` is the engine's public face: every name in ``__all__`` resolves from its
declared home, the type checker sees the same homes, and importing the package costs nothing."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import trillm.engine as face

INIT = Path(__file__).resolve().parent.parent / "engine" / "__init__.py"


def type_checking_homes() -> dict[str, str]:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in engine/__init__.py."""
    (block,) = [n for n in ast.parse(INIT.read_text()).body if isinstance(n, ast.If)]
    homes = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            assert alias.asname == alias.name, "re-exported as itself, for the type checker"
            homes[alias.name] = node.module.removeprefix("trillm.engine.")
    return homes


def test_every_public_name_resolves_from_the_home_the_type_checker_sees():
    assert type_checking_homes() == face._HOME_OF
    assert len(face.__all__) == len(set(face.__all__))
    for name in face.__all__:
        value = getattr(face, name)
        module = sys.modules[f"trillm.engine.{face._HOME_OF[name]}"]
        assert getattr(module, name) is value, name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchThing"):
        face.NoSuchThing  # noqa: B018


def test_importing_the_face_loads_no_engine_module():
    probe = (
        "import sys, trillm.engine\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('trillm.engine.') or m == 'torch')\n"
        "assert not loaded, loaded\n"
        "from trillm.engine import EngineConfig\n"
        "assert 'trillm.engine.engine' not in sys.modules and 'trillm.engine.config' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
