"""Where a tensor-parallel rank sits and how it meets the others: the topology, the groups,
and the checks made once they have met.

Ranks are numbered ``node_rank * per_node + local``. Each joins the default group (gloo on
CPUs, NCCL on GPUs) and makes two more: the one the forward's collectives run in
(``group.TensorParallel``) and a gloo one rank 0 sends each step over (``channel.StepChannel``).
"""

from __future__ import annotations

import datetime
from typing import Any

import attrs
import torch
import torch.distributed as dist

from trillm.engine.config import EngineConfig
from trillm.engine.processes import free_port

START_TIMEOUT = 600.0  # seconds the ranks may take to start and load (a large model, a slow disk)


class WorkerDied(RuntimeError):
    """A tensor-parallel rank exited or stopped answering: the group cannot compute any more."""


@attrs.frozen
class Topology:
    """Where this process sits: its rank among ``size``, and how to meet the others."""

    size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    timeout: float

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.per_node

    @classmethod
    def of(cls, config: EngineConfig) -> Topology:
        """``config``'s topology (``EngineConfig`` has checked that the ranks split over the nodes)."""
        port = config.master_port or (free_port() if config.nnodes == 1 else 0)
        if not port:
            raise ValueError("--master-port is needed to launch over several nodes")
        return cls(config.tp, config.nnodes, config.node_rank, config.master_addr, port, config.dist_timeout)


@attrs.frozen
class RankGroups:
    """The two groups a rank uses after it joined: the forward's collectives, and the steps'."""

    compute: Any
    steps: Any  # gloo, also on GPUs: the step's inputs are made on the CPU


def join_group(topology: Topology, rank: int, device: torch.device) -> RankGroups:
    """This process as ``rank`` of the default group (gloo on CPUs, NCCL on GPUs), whose time limit
    covers start-up (spawning, loading); returns the group the forward's collectives run in and
    the one steps are broadcast over: both limited to ``--dist-timeout``, so that a rank that
    hangs while serving is noticed that soon."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{topology.master_addr}:{topology.master_port}",
        rank=rank,
        world_size=topology.size,
        timeout=datetime.timedelta(seconds=max(START_TIMEOUT, topology.timeout)),
    )
    # Every rank makes both, in the same order.
    limit = datetime.timedelta(seconds=topology.timeout)
    compute = dist.new_group(backend=backend, timeout=limit)
    steps = dist.new_group(backend="gloo", timeout=limit)
    return RankGroups(compute, steps)


def rank_device(device: torch.device, topology: Topology, rank: int) -> torch.device:
    """Each rank of a node on its own GPU; CPUs share the machine."""
    if device.type != "cuda":
        return device
    local = torch.device("cuda", rank - topology.first_rank)
    torch.cuda.set_device(local)
    return local


def check_same_model(mine: str) -> None:
    """Every rank loaded the same model, or none serves: a mismatch is a startup error on rank 0."""
    prints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, mine)
    odd = [rank for rank, p in enumerate(prints) if p != prints[0]]
    if odd:
        raise RuntimeError(f"tensor-parallel ranks {odd} loaded a different model than rank 0 (checkpoint or config)")
