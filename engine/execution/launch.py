"""The top of ``execution/``: start the tensor-parallel ranks, join their group, then load.

Rank 0 is the serving process: the Trio front end, the scheduler, the page books and
the sampler. The other ranks only compute: each loads its shard, builds the same
``ModelRunner`` over its own KV heads, then runs whatever step rank 0 sends
(``parallel/channel.py``), until rank 0 sends the end. They join in the forward's
collectives; rank 0 alone reads the logits.

Ranks are numbered ``node_rank * per_node + local``; this machine's ranks other than
its first are spawned processes. On node 0 the first rank is the server; on other
nodes it is a worker too (``trillm serve --node-rank 1 ...`` serves no HTTP).
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

import attrs
import torch.distributed as dist

from trillm.engine.config import EngineConfig
from trillm.engine.execution.loading import LoadPlan, choose_device, choose_model_dtype, load_planned, plan_load
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.execution.parallel.channel import StepChannel
from trillm.engine.execution.parallel.group import TensorParallel
from trillm.engine.execution.parallel.sharding import partition
from trillm.engine.execution.parallel.topology import Topology, join_group, rank_device
from trillm.engine.execution.shape import ModelShape
from trillm.engine.processes import children_allowed, ignore_stop_signals, join_or_kill
from trillm.engine.step import HEARTBEAT, RunnerSetup

log = logging.getLogger("trillm.engine")


class Ranks:
    """This machine's spawned ranks, as rank 0 (or a node's first rank) sees them."""

    def __init__(self, config: EngineConfig, topology: Topology) -> None:
        self.topology = topology
        context = multiprocessing.get_context("spawn")
        first = topology.first_rank
        self.processes = [
            context.Process(target=rank_main, args=(config, topology, rank), name=f"trillm-rank-{rank}", daemon=True)
            for rank in range(first + 1, first + topology.per_node)
        ]
        with children_allowed():
            for process in self.processes:
                process.start()

    def dead(self) -> list[tuple[str, int | None]]:
        """The spawned ranks that have exited, with their exit codes."""
        return [(p.name, p.exitcode) for p in self.processes if not p.is_alive()]

    def join(self, timeout: float) -> None:
        """Stop waiting for the spawned ranks, then leave the group this process joined: a later
        engine in the same process (an offline ``LLM``, a test) joins a new one."""
        join_or_kill(self.processes, timeout)
        if dist.is_initialized():
            dist.destroy_process_group()


@attrs.frozen
class Launched:
    """What the engine is built from: the model (rank 0's shard under ``--tp``), its tokenizer and
    EOS ids, and the ranks this process started (None alone), which the engine watches and stops."""

    model: DecoderModel
    tokenizer: Any
    eos_ids: frozenset[int]
    ranks: Ranks | None = None


def launch(config: EngineConfig) -> Launched:
    """The serving rank's start (slow; call from a thread): alone, load the model; with ``--tp`` > 1,
    first spawn this machine's other ranks (with the dtype chosen here), join the group, then
    load this rank's part."""
    plan = plan_load(config)
    if config.tp == 1:
        return Launched(*load_planned(plan))
    topology = Topology.of(config)
    config = attrs.evolve(config, dtype=plan.dtype.name, master_port=topology.master_port)
    ranks = Ranks(config, topology)
    try:
        return Launched(*_join_and_load(attrs.evolve(plan, config=config), topology, 0), ranks)
    except BaseException:
        ranks.join(0.0)  # a start that fails leaves no rank behind
        raise


def _join_and_load(plan: LoadPlan, topology: Topology, rank: int) -> tuple[DecoderModel, Any, frozenset[int]]:
    """Rank ``rank`` on its device, in the group, then its shard loaded."""
    device = rank_device(plan.device, topology, rank)
    groups = join_group(topology, rank, device)
    shape = ModelShape.from_config(plan.model_config)
    tp = TensorParallel(partition(shape, topology.size, rank), groups.compute, shape.vocab_size, groups.steps)
    return load_planned(attrs.evolve(plan, device=device), tp)


def rank_main(config: EngineConfig, topology: Topology, rank: int) -> None:
    """A rank that only computes (the body of each spawned process, and of node k's first rank).

    It ignores SIGINT and SIGTERM (a Ctrl-C or a service manager signals the whole process
    group): rank 0 drains, then tells it to stop; without rank 0 it stops at ``dist_timeout``."""
    ignore_stop_signals()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    model, _, _ = _join_and_load(plan_load(config), topology, rank)
    channel = StepChannel(model.tp.steps)
    setup: RunnerSetup = channel.receive()
    runner = ModelRunner(
        model, setup.num_pages, setup.page_size, config.forward_threads, setup.graph_batch, setup.max_model_len
    )
    log.info("rank %d ready: %d KV pages of %d heads", rank, setup.num_pages, model.shape.num_kv_heads)
    while (inputs := channel.receive()) is not None:
        if inputs != HEARTBEAT:
            runner.execute_logits(inputs)
    dist.destroy_process_group()


def serve_node(config: EngineConfig) -> None:
    """``trillm serve --node-rank K`` (K > 0): this machine's ranks compute for node 0's server
    until it stops them; no HTTP here. Returns when they are done."""
    topology = Topology.of(config)
    # The model is downloaded and converted once, here, before this node's ranks read it.
    config = attrs.evolve(config, dtype=choose_model_dtype(config, choose_device(config)).name)
    ranks = Ranks(config, topology)
    try:
        rank_main(config, topology, topology.first_rank)
    finally:
        ranks.join(10.0)
