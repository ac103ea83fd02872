"""The ranks of a tensor-parallel group: starting them, feeding them each step, watching them.

Rank 0 is the serving process: the Trio front end, the scheduler, the page books and
the sampler. The other ranks only compute: each loads its shard, builds the same
``ModelRunner`` over its own KV heads, then runs whatever step rank 0 broadcasts,
until rank 0 broadcasts the end. They join in the forward's collectives; rank 0
alone reads the logits.

What crosses each step is the step's inputs (token ids, positions, the backend's
attention metadata, the logits rows): one pickled buffer of a few kilobytes
(``StepChannel``). The sequences' sampling state (generators, grammar matchers) never does.

Ranks are numbered ``node_rank * per_node + local``; this machine's ranks other than
its first are spawned processes. On node 0 the first rank is the server; on other
nodes it is a worker too (``trillm serve --node-rank 1 ...`` serves no HTTP).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import pickle
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from trillm.engine.config import EngineConfig

log = logging.getLogger("trillm.engine")


def ignore_stop_signals() -> None:
    """For processes that their parent stops (ranks, replicas): the signals are the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


START_TIMEOUT = 600.0  # seconds the ranks may take to start and load (a large model, a slow disk)


def join_group(topology: Topology, rank: int, device: torch.device) -> Any:
    """This process as ``rank`` of the default group (gloo on CPUs, NCCL on GPUs), whose time limit
    covers start-up (spawning, loading); returns the group the forward's collectives run in, and
    makes the one steps are broadcast over: both limited to ``--dist-timeout``, so that a rank
    that hangs while serving is noticed that soon."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{topology.master_addr}:{topology.master_port}",
        rank=rank,
        world_size=topology.size,
        timeout=datetime.timedelta(seconds=max(START_TIMEOUT, topology.timeout)),
    )
    global _step_group
    # Every rank makes both, in the same order.
    limit = datetime.timedelta(seconds=topology.timeout)
    compute = dist.new_group(backend=backend, timeout=limit)
    _step_group = dist.new_group(backend="gloo", timeout=limit)
    return compute


_step_group: Any = None  # the gloo group steps are broadcast over (``join_group`` makes it)


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


# Sent by an idle rank 0 every ``dist_timeout / 4``: the others' wait for the next step would time
# out otherwise, and a rank that died is noticed even while no request runs.
HEARTBEAT = "heartbeat"


class StepChannel:
    """Rank 0 -> every other rank: a setup once, then each step's inputs, then None (stop).

    A message is pickled into one fixed buffer broadcast over a gloo group of its own (on
    GPUs too: the inputs are made on the CPU), a second broadcast only for what does not fit.
    Measured on a 2-core machine (``python -m trillm.bench.step_broadcast``): 0.9 ms per step
    against 1.1-1.25 ms for ``broadcast_object_list``, which broadcasts the size first."""

    BUFFER = 64 * 1024

    def __init__(self) -> None:
        self.group = _step_group
        self.buffer = torch.zeros(self.BUFFER, dtype=torch.uint8)

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        first = len(data).to_bytes(8, "little") + data[: self.BUFFER - 8]
        self.buffer[: len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(self.buffer, 0, group=self.group)
        if len(data) > self.BUFFER - 8:
            dist.broadcast(torch.frombuffer(bytearray(data[self.BUFFER - 8 :]), dtype=torch.uint8), 0, group=self.group)

    def receive(self) -> Any:
        dist.broadcast(self.buffer, 0, group=self.group)
        size = int.from_bytes(self.buffer[:8].numpy().tobytes(), "little")
        data = self.buffer[8 : 8 + min(size, self.BUFFER - 8)].numpy().tobytes()
        if size > self.BUFFER - 8:
            rest = torch.empty(size - (self.BUFFER - 8), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)


@attrs.frozen
class RunnerSetup:
    """What the workers' runners must agree on with rank 0's: the KV pool and the graphs."""

    num_pages: int
    page_size: int
    graph_batch: int
    max_model_len: int


def worker_main(config: EngineConfig, topology: Topology, rank: int) -> None:
    """A rank that only computes (the body of each spawned process, and of node k's first rank).

    It ignores SIGINT and SIGTERM (a Ctrl-C or a service manager signals the whole process
    group): rank 0 drains, then tells it to stop; without rank 0 it stops at ``dist_timeout``."""
    ignore_stop_signals()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    from trillm.engine.execution.loading import load_model
    from trillm.engine.execution.model_runner import ModelRunner

    model, _, _ = load_model(config, topology, rank)
    channel = StepChannel()
    setup: RunnerSetup = channel.receive()
    runner = ModelRunner(
        model, setup.num_pages, setup.page_size, config.forward_threads, setup.graph_batch, setup.max_model_len
    )
    log.info("rank %d ready: %d KV pages of %d heads", rank, setup.num_pages, model.shape.num_kv_heads)
    while (inputs := channel.receive()) is not None:
        if inputs != HEARTBEAT:
            runner.execute_logits(inputs)
    dist.destroy_process_group()


@contextlib.contextmanager
def children_allowed() -> Iterator[None]:
    """Let this process start children even when it is itself a daemonic ``multiprocessing`` child,
    as Hypercorn's workers are (``hypercorn -k trio 'trillm.api.app:create_app()'``). Python forbids
    it so that children are not orphaned when a daemon is killed; ours stop on their own then (a
    rank at ``--dist-timeout`` without heartbeats, a replica when its pipe ends)."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was


class Workers:
    """This machine's spawned ranks, as rank 0 (or a node's first rank) sees them."""

    def __init__(self, config: EngineConfig, topology: Topology) -> None:
        self.topology = topology
        context = multiprocessing.get_context("spawn")
        first = topology.first_rank
        self.processes = [
            context.Process(target=worker_main, args=(config, topology, rank), name=f"trillm-rank-{rank}", daemon=True)
            for rank in range(first + 1, first + topology.per_node)
        ]
        with children_allowed():
            for process in self.processes:
                process.start()

    def dead(self) -> list[tuple[str, int | None]]:
        """The spawned ranks that have exited, with their exit codes."""
        return [(p.name, p.exitcode) for p in self.processes if not p.is_alive()]

    def join(self, timeout: float) -> None:
        join_or_kill(self.processes, timeout)


def join_or_kill(processes: list[Any], timeout: float) -> None:
    """Wait for ``processes`` to exit, all within one ``timeout``; kill those still running then
    (ranks and replicas ignore SIGTERM, so there is no gentler signal to try)."""
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def serve_node(config: EngineConfig) -> None:
    """``trillm serve --node-rank K`` (K > 0): this machine's ranks compute for node 0's server
    until it stops them; no HTTP here. Returns when they are done."""
    from trillm.engine.execution.loading import choose_device, choose_model_dtype

    topology = Topology.of(config)
    # The model is downloaded and converted once, here, before this node's ranks read it.
    config = attrs.evolve(config, dtype=choose_model_dtype(config, choose_device(config)).name)
    workers = Workers(config, topology)
    try:
        worker_main(config, topology, topology.first_rank)
    finally:
        workers.join(10.0)
