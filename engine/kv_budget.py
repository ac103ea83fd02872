"""How big the KV pool is: the pages asked for, the budget given, or one that follows the memory free.

By default (no ``--kv-cache-mb``, no ``--num-pages``) the pool is sized when the engine starts,
with the weights already in memory: room for one sequence of the whole context (and at least
``AUTO_FLOOR``), but never more than ``AUTO_SHARE`` of the memory then available nor
``AUTO_CAP`` (vLLM's default KV space on CPUs); replicas and ranks on one CPU divide that share.
The context length then follows from the pool (``Engine``). A budget given that the memory
cannot hold is refused in one line, as is a machine too full for even a small pool.
"""

from __future__ import annotations

import attrs

from trillm.engine.config import EngineConfig

MiB, GiB = 2**20, 2**30
AUTO_SHARE = 0.25  # of the memory available once the weights are in
AUTO_CAP = 4 * GiB
AUTO_FLOOR = 512 * MiB  # the pool of a server that is not told, where memory allows
MIN_TOKENS = 256  # a pool that holds fewer tokens than this serves nothing useful


class KVBudgetError(ValueError):
    """The pool asked for, or the smallest useful one, does not fit in the memory available."""


@attrs.frozen
class KVPlan:
    num_pages: int
    pool_bytes: int  # num_pages whole pages
    reason: str  # for the start-up log: where the size came from


def plan_kv_pool(
    config: EngineConfig, bytes_per_token: int, context_len: int, available: int | None, sharers: int = 1
) -> KVPlan:
    """The pool for a model of ``bytes_per_token`` (every layer's K and V) and ``context_len``
    tokens of context; ``available``: bytes of memory free now (None where unknown), which
    ``sharers`` engines (``--dp`` replicas on one CPU) size their pools from at once."""
    page_bytes = bytes_per_token * config.page_size
    free = f"{available / GiB:.1f} GiB available" if available is not None else "memory available unknown"
    if config.num_pages is not None:
        return KVPlan(config.num_pages, config.num_pages * page_bytes, "--num-pages")
    if config.kv_cache_bytes is not None:
        if available is not None and config.kv_cache_bytes > available:
            raise KVBudgetError(
                f"--kv-cache-mb {config.kv_cache_bytes // MiB}: a KV pool of {config.kv_cache_bytes / GiB:.1f} GiB "
                f"does not fit; {free} with the weights loaded"
            )
        pages = max(1, config.kv_cache_bytes // page_bytes)
        return KVPlan(pages, pages * page_bytes, "--kv-cache-mb")
    full = context_len * bytes_per_token
    wanted = min(AUTO_CAP, max(AUTO_FLOOR, full))
    budget, why = wanted, "one full context" if full >= AUTO_FLOOR else f"at least {AUTO_FLOOR // MiB} MiB"
    if wanted == AUTO_CAP and full > AUTO_CAP:
        why = f"capped at {AUTO_CAP // GiB} GiB"
    share = AUTO_SHARE / max(1, sharers)
    if available is not None and share * available < wanted:
        budget, why = int(share * available), f"{share:.0%} of the memory available"
        if sharers > 1:
            why += f", shared by {sharers} replicas"
        smallest = MIN_TOKENS * bytes_per_token
        if budget < smallest:
            raise KVBudgetError(
                f"no room for a KV pool: {MIN_TOKENS} tokens of it take {smallest / MiB:.0f} MiB, and "
                f"{share:.0%} of the {free} with the weights loaded is {budget / MiB:.0f} MiB"
            )
    pages = max(1, budget // page_bytes)
    return KVPlan(pages, pages * page_bytes, f"auto: {why}; {free}")
