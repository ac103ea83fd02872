"""Time the CPU decode-attention kernel per KV cache form (``--kv-cache-dtype``) on model-shaped heads.

    python -m trillm.bench.decode_attention --heads 9:3:64 --seqs 32 --tokens 200 [--march haswell]

One layer's call over ``--seqs`` sequences of ``--tokens`` cached tokens each, pages scattered
through the pool as a server's are: milliseconds per call (best of ``--repeat``) and the cache
bytes it reads per second, for a float32, float16 and bfloat16 cache. ``--march`` builds the kernel
for another instruction set (``haswell``: the AVX2 version, where this CPU runs it), as the test
suite's portable variant does. Threads: ``torch.get_num_threads()``. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import ctypes
import functools

import torch

from trillm.bench.gguf_kernels import call_times
from trillm.kernels import cpu_build, cpu_decode

FORMS = (torch.float32, torch.float16, torch.bfloat16)


def paged(
    seqs: int, tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, page: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, caches, block tables and lengths: each sequence's pages a shuffled share of the pool."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-tokens // page)
    pages = seqs * per_seq
    q = torch.randn(seqs, heads, dim, generator=gen)
    k = torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pages, page, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(pages, generator=gen).view(seqs, per_seq).to(torch.int32)
    return q, k, v, tables, torch.full((seqs,), tokens, dtype=torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="9:3:64", help="query heads:kv heads:head dim (SmolLM2; Gemma 3: 4:1:256)")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--march", default="", help="build for this -march instead (haswell: the AVX2 version)")
    args = parser.parse_args()
    heads, kv_heads, dim = (int(p) for p in args.heads.split(":"))
    if args.march:
        lib = ctypes.CDLL(str(cpu_build._build("cpu_decode", ("-fno-math-errno", f"-march={args.march}"))))
        cpu_decode._KERNEL.declare(lib)
        cpu_decode._library = lambda: lib
    build = f"-march={args.march}" if args.march else "this CPU's build"
    print(f"decode attention, {args.seqs} x {args.tokens} tokens, heads {args.heads}, {build}")
    print("| cache | ms a call | cache GB/s |")
    print("|---|---:|---:|")
    for dtype in FORMS:
        inputs = paged(args.seqs, args.tokens, heads, kv_heads, dim, dtype)
        call = functools.partial(cpu_decode.decode_attention, *inputs, dim**-0.5)
        ms = 1e3 * min(call_times(call, args.repeat))
        read = 2 * args.seqs * args.tokens * kv_heads * dim * dtype.itemsize
        print(f"| {str(dtype).removeprefix('torch.')} | {ms:.3f} | {read / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
