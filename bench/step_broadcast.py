"""How long rank 0 takes to hand one step's inputs to the other tensor-parallel ranks.

Two ways over gloo on this machine, for a decode step of 32 rows (each with a
1,024-token context) and a prefill step of 512 tokens: ``broadcast_object_list``
(pickle, then one broadcast of the size and one of the bytes), and one broadcast of a
fixed 64 KiB buffer holding the pickle, a second only when it does not fit (``StepChannel``). Run:
``python -m trillm.bench.step_broadcast``; it prints microseconds per step (median).
"""

from __future__ import annotations

import pickle
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trillm.engine import CpuMetadata, DecodeRows, PrefillSpan, StepChannel, StepInputs, Topology, free_port, join_group

ROUNDS = 300


def decode_step(rows: int = 32, context: int = 1024, page: int = 16) -> StepInputs:
    pages = context // page
    meta = CpuMetadata(
        slot_mapping=torch.arange(rows) * context,
        decodes=(),
        prefills=(),
        decode_rows=DecodeRows(
            None,
            torch.arange(rows * pages, dtype=torch.int32).view(rows, pages),
            torch.full((rows,), context, dtype=torch.int32),
        ),
    )
    return StepInputs(torch.arange(rows), torch.full((rows,), context - 1), meta, torch.arange(rows), ())


def prefill_step(tokens: int = 512, page: int = 16) -> StepInputs:
    span = PrefillSpan(0, tokens, torch.arange(tokens // page), tokens, None)
    meta = CpuMetadata(slot_mapping=torch.arange(tokens), decodes=(), prefills=(span,))
    return StepInputs(torch.arange(tokens), torch.arange(tokens), meta, torch.tensor([tokens - 1]), ())


def _rank(rank: int, port: int, results: mp.Queue) -> None:
    groups = join_group(Topology(2, 1, 0, "127.0.0.1", port, 60.0), rank, torch.device("cpu"))
    channel = StepChannel(groups.steps)
    for name, step in (("decode 32 rows", decode_step()), ("prefill 512 tokens", prefill_step())):
        for how in ("broadcast_object_list", "StepChannel (one buffer)"):
            times = []
            for _ in range(ROUNDS):
                dist.barrier()
                started = time.perf_counter()
                if how == "broadcast_object_list":
                    box = [step if rank == 0 else None]
                    dist.broadcast_object_list(box, src=0)
                elif rank == 0:
                    channel.send(step)
                else:
                    channel.receive()
                times.append(time.perf_counter() - started)
            if rank == 1:
                results.put((name, how, statistics.median(times) * 1e6, len(pickle.dumps(step))))
    dist.destroy_process_group()


def main() -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    print(f"{'step':<20} {'transport':<24} {'us/step (received)':>18} {'pickle bytes':>13}")
    while not results.empty():
        name, how, micros, size = results.get()
        print(f"{name:<20} {how:<24} {micros:>18.0f} {size:>13}")


if __name__ == "__main__":
    main()
