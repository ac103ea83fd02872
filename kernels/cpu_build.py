"""Build a plain-C kernel from ``kernels/`` on first use and load it with ctypes.

Plain C with OpenMP compiles in about a second with the system compiler, so no torch
extension toolchain is needed. ``ctypes.CDLL`` releases the GIL for each call, so the
event loop keeps running while a worker thread computes.

The shared object goes to ``kernels/`` in the cache folder (``use_cache_dir``; the
engine passes its ``cache_dir`` setting there, default ``~/.cache/trillm``),
named after the source and keyed by the source and header text, compiler, flags and CPU; it is
compiled into a temporary file and renamed into place, so concurrent builders never
see half a library. A library that cannot be built or loaded is logged once and
reported as None, so callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("trillm.kernels")

KERNELS_DIR = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)  # expf; not -ffast-math: GCC 12 then links crtfastmath, which flushes denormals process-wide

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


DEFAULT_CACHE_DIR = Path.home() / ".cache" / "trillm"
_cache_root = [DEFAULT_CACHE_DIR]


def use_cache_dir(root: Path) -> None:
    """Build into ``root/kernels`` from now on (the engine's ``cache_dir`` setting)."""
    _cache_root[0] = root


def _cache_dir() -> Path:
    return _cache_root[0] / "kernels"


def _cpu_id() -> str:
    """Model name and flags: ``-march=native`` code must not run on another CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(keep[:2])


def _build(name: str, extra_flags: tuple[str, ...]) -> Path:
    """Compile ``kernels/<name>.c`` into the cache unless an identical build is there already."""
    source_path = KERNELS_DIR / f"{name}.c"
    compiler = shlex.split(os.environ.get("CC") or "cc")
    flags = (*FLAGS, *extra_flags)
    source = source_path.read_bytes()
    headers = b"".join(h.read_bytes() for h in sorted(KERNELS_DIR.glob("*.h")))  # what the sources #include
    key = hashlib.sha256(
        b"\0".join([source, headers, " ".join([*compiler, *flags, *LIBS]).encode(), _cpu_id().encode()])
    )
    target = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [*compiler, *flags, "-o", tmp, str(source_path), *LIBS]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed: {done.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is as good as ours
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str, declare: Callable[[ctypes.CDLL], None], extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` built and loaded once per process, or None (reason logged once).

    ``declare`` sets the ``argtypes``/``restype`` of the library's functions; it runs once,
    before the library is handed out. ``extra_flags`` go after ``FLAGS`` (and into the key).
    """
    with _lock:
        if name not in _loaded:
            lib = None
            try:
                lib = ctypes.CDLL(str(_build(name, extra_flags)))
                declare(lib)
            except (OSError, RuntimeError) as error:
                lib = None
                log.warning("CPU kernel %s unavailable: %s", name, error)
            _loaded[name] = lib
        return _loaded[name]


class CKernel:
    """The entry points of one C source: built and loaded on first use, declared from
    ``signatures`` (function name -> argtypes, all returning ``restype``), and looked up
    once, since the calls at decode sizes take microseconds."""

    def __init__(
        self, name: str, signatures: dict[str, list], restype: object, extra_flags: tuple[str, ...] = ()
    ) -> None:
        self.name = name
        self.signatures = signatures
        self.restype = restype
        self.extra_flags = extra_flags
        self._functions: tuple | None = None

    def declare(self, lib: ctypes.CDLL) -> None:
        """Set argtypes/restype on ``lib`` (also on a library a test built itself)."""
        for function, argtypes in self.signatures.items():
            fn = getattr(lib, function)
            fn.argtypes = argtypes
            fn.restype = self.restype

    def library(self) -> ctypes.CDLL | None:
        return load(self.name, self.declare, self.extra_flags)

    def available(self) -> bool:
        """Whether the library could be built and loaded here (e.g. False without a compiler)."""
        return self.library() is not None

    def functions(self) -> tuple:
        """The functions in ``signatures`` order; RuntimeError if the library could not be built."""
        if self._functions is None:
            lib = self.library()
            if lib is None:
                raise RuntimeError(f"the CPU kernel {self.name} could not be built; see the trillm.kernels log")
            self._functions = tuple(getattr(lib, function) for function in self.signatures)
        return self._functions
