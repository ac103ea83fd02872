"""The top-level ``kernels/`` folder is found as ``kernels`` by any Python started in the
repository root, the name of Hugging Face's ``kernels`` package, which transformers depends on
(5.25 on) and imports. Imported so, ours must hand the name to that package where it is
installed and otherwise read as "not that package" (no ``__version__``), even from a Python
without trillm's dependencies."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def requirement_closure(name: str) -> set[str]:
    """The distributions ``name`` needs (no extras), itself included, as installed here."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def site_of(distributions: set[str], into: Path) -> Path:
    """A folder holding links to just these distributions' files (modules and metadata)."""
    into.mkdir()
    for name in distributions:
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (into / top).exists() and top != "__pycache__":
                (into / top).symlink_to(source)
    return into


@pytest.mark.parametrize("namesake", [True, False], ids=["hf-kernels-installed", "no-hf-kernels"])
def test_transformers_imports_from_the_repository_root_without_our_dependencies(tmp_path, namesake):
    needed = requirement_closure("transformers")
    assert "attrs" not in needed and "torch" not in needed, needed
    if namesake:
        needed |= requirement_closure("kernels")
    else:
        needed.discard("kernels")
    site = site_of(needed, tmp_path / "site")
    probe = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('attrs') is None, 'attrs is importable: the test proves nothing'\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is importable: the test proves nothing'\n"
        f"assert importlib.util.find_spec('kernels').origin.startswith({str(ROOT / 'kernels')!r}), 'not shadowed'\n"
        "from transformers import AutoTokenizer, LlamaConfig\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert LlamaConfig().model_type == 'llama'\n"
        "assert AutoTokenizer.__name__ == 'AutoTokenizer'\n"
        "import kernels\n"
        "print('kernels from:', kernels.__file__)\n"
        "print('kernels available:', is_kernels_available())\n"
    )
    # -S: no site-packages (so no attrs, no torch, no trillm); "" (the cwd, the root) first on sys.path.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ours = str(ROOT / "kernels")
    if namesake:
        assert re.search(r"kernels available: True", done.stdout), done.stdout
        assert f"kernels from: {ours}" not in done.stdout, done.stdout
    else:
        assert re.search(r"kernels available: False", done.stdout), done.stdout
        assert f"kernels from: {ours}" in done.stdout, done.stdout
