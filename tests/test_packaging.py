"""The wheel installs one top-level package, ``trillm``: ``kernels`` or ``api`` alone would
collide with other distributions (the PyPI ``kernels`` package is imported by transformers)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.slow


def test_the_wheel_holds_only_the_trillm_package(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("api", "bench", "engine", "kernels"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("trillm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"trillm"}
    for module in (
        "trillm/api/app.py",
        "trillm/engine/engine.py",
        "trillm/kernels/cpu_decode.c",
        "trillm/bench/run.py",
        "trillm/engine/configs/llama-3-8b.json",
    ):
        assert module in names, module
    assert "trillm/__init__.py" in names  # ``from trillm import LLM``: engine/offline/toplevel/__init__.py
    for init in ROOT.glob("*/**/__init__.py"):  # every subpackage of the source tree is in the wheel
        relative = init.relative_to(ROOT)
        if relative.parent == Path("engine/offline/toplevel"):
            continue  # that one is ``trillm`` itself
        if relative.parts[0] in ("api", "bench", "engine", "kernels"):
            assert f"trillm/{relative.as_posix()}" in names, relative
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "trillm = trillm.api.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_the_readme_layout_table_names_every_package_folder():
    readme = (ROOT / "README.md").read_text()
    folders = [p.parent.relative_to(ROOT) for p in ROOT.glob("*/__init__.py")]
    folders += [p.parent.relative_to(ROOT) for p in ROOT.glob("engine/*/__init__.py")]
    assert len(folders) >= 6
    for folder in folders:
        if folder.parts[0] != "tests":
            assert f"| `{folder.as_posix()}/` |" in readme, folder
