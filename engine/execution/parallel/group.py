"""The collectives a tensor-parallel forward pass needs, over one ``torch.distributed`` group.

A model holds a ``TensorParallel``; with one rank (``SINGLE``) every method is the
identity, so the layer code reads the same with and without parallelism. Every rank
calls the same collectives in the same order, since every rank runs the same step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trillm.engine.execution.parallel.sharding import Partition, even_ranges


class TensorParallel:
    """Rank ``part.rank`` of ``part.size`` in ``group`` (None: the default group)."""

    def __init__(
        self, part: Partition | None = None, group: Any = None, vocab_size: int = 0, steps: Any = None
    ) -> None:
        """``steps``: the group rank 0 sends each step over (``topology.RankGroups.steps``)."""
        self.part = part
        self.steps = steps
        self.rank = part.rank if part else 0
        self.size = part.size if part else 1
        self.group = group
        self.vocab_size = vocab_size
        # Every rank's slice of the vocabulary, padded to the longest for one all_gather.
        self._vocab_sizes = [len(r) for r in even_ranges(vocab_size, self.size)] if part else [vocab_size]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (the partial outputs of a row-parallel projection)."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the embedding, whose rows ``part.vocab`` this rank holds as ``table``: each
        rank looks up its own ids, zeros elsewhere, and the all-reduce adds the one true row to zeros."""
        if self.size == 1 or self.part is None:
            return table[ids]
        local = ids - self.part.vocab.start
        mine = (local >= 0) & (local < len(self.part.vocab))
        rows = table[local.clamp(0, len(self.part.vocab) - 1)] * mine.unsqueeze(1).to(table.dtype)
        return self.all_reduce(rows)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[S, local vocabulary] on each rank -> [S, vocabulary] (every rank gets it; rank 0 samples)."""
        if self.size == 1:
            return logits
        pad = self._vocab_sizes[0] - logits.shape[1]  # the first slice is the longest
        padded = torch.nn.functional.pad(logits, (0, pad)) if pad else logits.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:, :n] for p, n in zip(parts, self._vocab_sizes)], dim=1)


SINGLE = TensorParallel()
