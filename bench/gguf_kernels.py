"""Time the GGUF block matmul per type beside dense float32 and the Q4_1 / Q8_0 kernels.

    python -m trillm.bench.gguf_kernels --shape 1536x576 --rows 1,8,64 [--tiles]

For each type, a random valid weight [N, K] times x [M, K]: microseconds per call, the weight
bytes read per second (at one row, the bound a decode step meets) and the ratio to dense
float32 ``torch.mm``. Run on an idle machine; threads: ``torch.get_num_threads()``.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trillm.kernels import amx_tiles, cpu_gguf, cpu_matmul
from trillm.kernels.gguf_blocks import BLOCK_TYPES, GGUFWeight, repacked, row_bytes


def random_weight(name: str, N: int, K: int) -> GGUFWeight:
    """Random bytes with small float16 scales in every scale field (``tests/test_gguf_kernels``'s recipe)."""
    kind = BLOCK_TYPES[name]
    rng = np.random.default_rng(0)
    if kind.values == 1:
        raw = rng.standard_normal((N, K)).astype(np.float16).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(N, row_bytes(kind, K)), dtype=np.uint8)
        blocks = raw.reshape(N, -1, kind.bytes)
        if name == "MXFP4":  # power-of-two scales of 2^-10 .. 2^-5: random bytes gave subnormal products,
            blocks[..., 0] = rng.integers(118, 124, size=blocks.shape[:2], dtype=np.uint8)  # ~100 cycles each
        else:
            for offset in {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,)}.get(name, (0, 2)):
                values = rng.uniform(-0.05, 0.05, size=blocks.shape[:2]).astype(np.float16)
                blocks[..., offset : offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return GGUFWeight(kind, torch.from_numpy(np.ascontiguousarray(raw).reshape(N, -1)), K)


def call_times(fn: Callable[[], object], repeat: int = 30) -> list[float]:
    """Seconds of ``repeat`` calls of ``fn``, after one untimed (builds, first touches)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def seconds(fn: Callable[[], object], repeat: int = 30) -> float:
    return float(np.median(call_times(fn, repeat)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1536x576", help="N x K of the weight")
    parser.add_argument("--rows", default="1,8,64", help="rows of x (M), comma-separated")
    parser.add_argument("--types", default=",".join(sorted(BLOCK_TYPES)))
    parser.add_argument(
        "--tiles", action="store_true", help="also each form on AMX bfloat16 tiles (kernels/amx_tiles), where they run"
    )
    args = parser.parse_args()
    N, K = (int(v) for v in args.shape.split("x"))
    rows = [int(m) for m in args.rows.split(",")]
    print(f"weight {N}x{K}, {torch.get_num_threads()} threads, cpu_matmul SIMD: {cpu_matmul.simd()}")
    print(
        f"{'type':>8} {'path':>10} " + " ".join(f"{'M=' + str(m) + ' us':>12} {'GB/s':>6} {'x f32':>6}" for m in rows)
    )
    dense = torch.randn(K, N)
    xs = {m: torch.randn(m, K) for m in rows}
    base = {m: seconds(functools.partial(torch.mm, xs[m], dense)) for m in rows}
    print(
        f"{'F32':>8} {'torch.mm':>10} "
        + " ".join(f"{base[m] * 1e6:12.1f} {N * K * 4 / base[m] / 1e9:6.1f} {1:6.2f}" for m in rows)
    )
    for name in args.types.split(","):
        weight = random_weight(name, N, K)
        forms: list[tuple[str, Any]] = [("cpu_gguf", weight)]
        packed = repacked(weight)
        if packed is not weight:
            forms.append(("cpu_matmul", packed))
        if args.tiles and amx_tiles.available() and amx_tiles.handles(packed):
            forms.append(("amx_tiles", packed))
        kernels = {"cpu_gguf": cpu_gguf.matmul, "cpu_matmul": cpu_matmul.matmul, "amx_tiles": amx_tiles.matmul}
        for path, w in forms:
            cells = []
            for m in rows:
                x = xs[m]
                fn = lambda x=x, w=w, k=kernels[path]: k(x, w)  # noqa: E731
                t = seconds(fn)
                cells.append(f"{t * 1e6:12.1f} {w.nbytes / t / 1e9:6.1f} {base[m] / t:6.2f}")
            print(f"{name:>8} {path:>10} " + " ".join(cells))


if __name__ == "__main__":
    main()
