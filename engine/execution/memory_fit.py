"""Does a folder's model fit in memory? Answered from the safetensors headers, before any weight is read.

A checkpoint that cannot fit would otherwise be read for minutes and then die by the kernel's
OOM killer, with no word of why; the safetensors header says every tensor's shape, so the
bytes it takes in the dtype served are known at once (GGUF files: ``gguf_support``).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from trillm.engine.execution.gguf_support import UnsupportedModel, available_memory


def _headers(folder: Path) -> list[dict]:
    headers = []
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        headers.append({name: t for name, t in header.items() if name != "__metadata__"})
    return headers


def folder_elements(folder: Path) -> int:
    """Values in every float tensor of the folder's ``*.safetensors`` files (their headers only)."""
    return sum(math.prod(t["shape"]) for h in _headers(folder) for t in h.values() if t["dtype"] != "U8")


def folder_packed_bytes(folder: Path) -> int:
    """Bytes of the folder's packed tensors (uint8: gpt-oss's MXFP4 blocks and scales), kept as they are."""
    return sum(math.prod(t["shape"]) for h in _headers(folder) for t in h.values() if t["dtype"] == "U8")


def check_folder_fits(folder: Path, dtype_bytes: int, available: int | None = None) -> None:
    """Refuse, in one line, weights that decoded to ``dtype_bytes``-byte values would not fit in the
    memory available (default: this machine's MemAvailable). Packed tensors are MXFP4 (the only
    kind read): 17 bytes (16 of values, 1 of scale) hold 32 values."""
    free = available_memory() if available is None else available
    if free is None:
        return
    need = (folder_elements(folder) + folder_packed_bytes(folder) * 32 // 17) * dtype_bytes
    if need > free:
        raise UnsupportedModel(
            f"{folder}: its weights in {8 * dtype_bytes}-bit floats take {need / 2**30:.1f} GiB; "
            f"{free / 2**30:.1f} GiB of memory is available"
        )
