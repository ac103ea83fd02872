"""Several models behind one endpoint: each request is served by the model its ``model`` names.

The first ``--model`` is the primary: loaded before the server starts and never unloaded
(``AppState``'s own engine). The others (``--model`` again, as ``NAME=PATH``, and every
model in ``--models-dir``) load on their first request, or at start with ``--preload``: in
a worker thread, while the loaded ones keep serving; a request for a model that is loading
waits for it, within its deadline. They stay while they fit: loading one more than
``--max-loaded-models``, or one whose weights and KV pool would pass ``--models-memory``
(by default 90% of the device's memory), first unloads the least recently used idle ones;
``--model-ttl`` unloads one idle that long, and ``--pin`` keeps one loaded. A model's
footprint is measured once it has loaded (``Engine.footprint_bytes``); before its first load
it is guessed from its files' size, and checked again once measured. With ``--park-models``
(by default on a GPU) an unloaded model is parked: its weights kept in host memory, its KV
pool freed (``ParkedModel``), and woken without reading its files again. An unloaded model's engine
is stopped (its streams end, its pages and, unless parked, its weights are freed); a GGUF
file reopens through its memory map when the model is asked for again.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import trio

from trillm.api.embeddings import Embedder
from trillm.api.engine_host import EngineHost
from trillm.api.errors import ApiError, shown
from trillm.api.metrics import PrometheusObserver, RequestMetrics
from trillm.api.model_memory import GiB, files_bytes, memory_budget, park_limit
from trillm.api.rerank import Scorer
from trillm.api.settings import ServerConfig
from trillm.engine import Engine, EngineConfig, ParkedModel, ReplicaSet

log = logging.getLogger("trillm.api")


@attrs.define(eq=False)
class Served:
    """A loaded model: what the routes read of it."""

    name: str
    engine: Engine | ReplicaSet
    host: EngineHost
    observer: PrometheusObserver
    embedder: Embedder
    rerank_prompt: str  # --rerank-prompt
    last_used: float = attrs.Factory(time.monotonic)
    _scorer: Scorer | None = None

    @classmethod
    def around(cls, name: str, engine: Engine | ReplicaSet, server: ServerConfig, metrics: RequestMetrics) -> Served:
        observer = metrics.observer(name)
        return cls(
            name,
            engine,
            EngineHost(engine, observer),
            observer,
            Embedder(engine.config, engine.model.shape.hidden_size),
            server.rerank_prompt,
        )

    @property
    def scorer(self) -> Scorer:
        """How ``/v1/rerank`` scores with this model: made on first use, once the engine runs (``--dp``
        replicas send their classifier head, if any, when they are ready)."""
        if self._scorer is None:
            classifier = getattr(self.engine.model, "classifier", None)
            engine = self.engine
            self._scorer = Scorer.for_model(self.rerank_prompt, engine.config.model, engine.tokenizer, classifier)
        return self._scorer

    @property
    def idle(self) -> bool:
        return self.engine.stats().num_open_requests == 0


@attrs.define(eq=False)
class Entry:
    """One model the server names, loaded or not."""

    name: str
    config: EngineConfig | None  # None: the primary, loaded before the server starts
    pinned: bool = False
    served: Served | None = None
    loading: trio.Event | None = None  # set when a load in progress ends, loaded or not
    failure: str | None = None  # why its last load failed
    footprint: int | None = None  # bytes of weights and KV pool, measured at its last load
    parked: ParkedModel | None = None  # unloaded with its weights kept on the host (--park-models)

    def expected_bytes(self) -> int:
        """What it takes loaded: measured, or (never loaded) its weight files' size; 0 where unknown."""
        if self.served is not None:
            return self.served.engine.footprint_bytes
        if self.footprint is not None or self.config is None:
            return self.footprint or 0
        return files_bytes(self.config.model)


def model_specs(server: ServerConfig) -> dict[str, str]:
    """The models beside ``--model``, by name: ``NAME=PATH`` flags and ``--models-dir``'s contents."""
    specs: dict[str, str] = {}
    for spec in server.extra_model:
        name, sep, path = spec.partition("=")
        specs[name if sep else spec] = path if sep else spec
    if server.models_dir is not None:
        folder = Path(server.models_dir).expanduser()
        if not folder.is_dir():
            raise ValueError(f"--models-dir {folder} is not a folder")
        for item in sorted(folder.iterdir()):
            if item.is_dir() and (item / "config.json").exists():
                specs.setdefault(item.name, str(item))
            elif item.is_file() and item.suffix == ".gguf":
                specs.setdefault(item.stem, str(item))
    return specs


class ModelSet:
    """Every model the server names; loads, unloads and finds them."""

    def __init__(
        self,
        primary: Served,
        server: ServerConfig,
        metrics: RequestMetrics,
        load: Callable[[EngineConfig], Engine | ReplicaSet] | None = None,
    ) -> None:
        self.server = server
        self.metrics = metrics
        self.primary = primary
        self._load = load or (lambda config: ReplicaSet(config) if config.dp > 1 else Engine.load(config))
        self.entries: dict[str, Entry] = {primary.name: Entry(primary.name, None, True, primary)}
        self.budget = memory_budget(server, primary.engine.config)
        self.park_limit = park_limit(server, primary.engine.config)
        pinned = set(server.pin)
        for name, path in model_specs(server).items():
            if name in self.entries:
                raise ValueError(f"two models are named {name!r}: give one of them another name (NAME=PATH)")
            config = attrs.evolve(primary.engine.config, model=path)
            self.entries[name] = Entry(name, config, name in pinned)
        unknown = pinned - self.entries.keys()
        if unknown:
            raise ValueError(f"--pin names no served model: {', '.join(sorted(unknown))}")
        self.nursery: trio.Nursery | None = None  # where loaded models' engines run (the app's)

    @property
    def loaded(self) -> list[Served]:
        return [entry.served for entry in self.entries.values() if entry.served is not None]

    def loaded_engines(self) -> list[tuple[str, Engine | ReplicaSet]]:
        """For ``/metrics``: every loaded model's engine, by name."""
        return [(served.name, served.engine) for served in self.loaded]

    def entry(self, name: object) -> Entry:
        """The model ``name`` names; a 404 ``model_not_found`` (OpenAI's words) if none (or not a string)."""
        entry = self.entries.get(name) if isinstance(name, str) else None
        if entry is None:
            names = ", ".join(f"`{n}`" for n in self.entries)
            raise ApiError(
                f"The model `{shown(name)}` does not exist or you do not have access to it "
                f"(this server serves {names}).",
                404,
                param="model",
                code="model_not_found",
                type="invalid_request_error",
            )
        return entry

    async def serve(self, name: str, deadline: float = math.inf) -> Served:
        """The loaded model ``name``, loading it first if need be (waiting for a load in progress)."""
        entry = self.entry(name)
        while entry.served is None:
            if entry.loading is not None:
                with trio.move_on_at(deadline):
                    await entry.loading.wait()
                if entry.loading is not None:  # the deadline came first
                    raise ApiError(f"the model `{name}` is still loading; retry shortly", 503, code="model_loading")
                continue
            await self.load(entry)
        entry.served.last_used = time.monotonic()
        return entry.served

    async def load(self, entry: Entry) -> Served:
        """Load ``entry`` (making room first), start its engine in the app's nursery."""
        if entry.served is not None:
            return entry.served
        assert entry.config is not None and self.nursery is not None
        done = entry.loading = trio.Event()
        parked, entry.parked = entry.parked, None  # not the parked one to drop while making room for it
        try:
            try:
                await self._make_room(entry)
            except ApiError:
                entry.parked = parked
                raise
            started = time.perf_counter()
            log.info("%s model %s (%s)", "waking" if parked else "loading", entry.name, entry.config.model)
            try:
                load = parked.wake if parked is not None else partial(self._load, entry.config)
                engine = await trio.to_thread.run_sync(load)
            except Exception as exc:
                entry.failure = f"{type(exc).__name__}: {exc}"
                log.error("model %s failed to load: %s", entry.name, entry.failure)
                raise ApiError(f"the model `{entry.name}` failed to load: {entry.failure}", 503) from None
            served = Served.around(entry.name, engine, self.server, self.metrics)
            await self.nursery.start(served.host.run)
            entry.served, entry.failure = served, None
            entry.footprint = engine.footprint_bytes
            await self._fit(entry)
            took = time.perf_counter() - started
            log.info(
                "model %s %s in %.2f s (%.2f GiB)",
                entry.name,
                "woken" if parked else "loaded",
                took,
                entry.footprint / GiB,
            )
            return served
        finally:
            entry.loading = None
            done.set()

    async def unload(self, entry: Entry, park: bool = True) -> None:
        """Stop its engine (its streams end, its pages go) and park its weights (``--park-models``)
        or let them go; the primary stays. A load in progress is waited for, then undone."""
        if entry.loading is not None:
            await entry.loading.wait()
        await self._stop(entry, park)

    async def _stop(self, entry: Entry, park: bool) -> None:
        """``unload`` of a model not loading (or, from ``_fit``, of the one this load brought)."""
        served = entry.served
        if served is None or entry.config is None:
            return
        entry.served = None
        await served.host.stop()
        engine = served.engine
        del served
        if park and self.park_limit and ParkedModel.can_park(engine):
            parked = entry.parked = await trio.to_thread.run_sync(ParkedModel.of, engine)
            log.info("model %s parked (%.2f GiB of weights on the host)", entry.name, parked.weight_bytes / GiB)
            every = sorted((e for e in self.entries.values() if e.parked), key=lambda e: e.parked.parked_at)  # type: ignore[union-attr]
            for oldest in every[: max(0, len(every) - self.park_limit)]:
                self.drop_parked(oldest)
        else:
            log.info("model %s unloaded", entry.name)
        del engine
        gc.collect()  # the engine's KV pool (and weights, unless parked), now unreferenced

    def drop_parked(self, entry: Entry) -> None:
        """Let a parked model's weights go: its next load reads its files."""
        if entry.parked is not None:
            entry.parked = None
            gc.collect()
            log.info("model %s no longer parked", entry.name)

    def in_use(self, but: Entry | None = None) -> int:
        """Bytes the loaded models take, and the loads in progress are expected to, and the models
        parked in the same memory (a CPU's), less ``but``'s."""
        others = [e for e in self.entries.values() if e is not but]
        loaded = sum(e.expected_bytes() for e in others if e.served is not None or e.loading is not None)
        parked = [e.parked.weight_bytes for e in self._parked_beside(but) if e.parked is not None]
        return loaded + sum(parked)

    def _parked_beside(self, but: Entry | None) -> list[Entry]:
        """The parked models whose weights take the running models' memory, least recently parked first."""
        found = [e for e in self.entries.values() if e is not but and e.parked and e.parked.holds_host_memory]
        return sorted(found, key=lambda e: e.parked.parked_at)  # type: ignore[union-attr]

    def _victims(self, keep: Entry) -> list[Entry]:
        return [e for e in self.entries.values() if e is not keep and self._may_unload(e) and e.served.idle]  # type: ignore[union-attr]

    def _over(self, coming: Entry) -> str | None:
        """Why ``coming`` does not fit now (None: it fits)."""
        limit, budget = self.server.max_loaded_models, self.budget
        # another load in progress holds its place too: two loads at once must not both fit in one
        loading = sum(1 for e in self.entries.values() if e.loading is not None and e is not coming)
        if limit and len(self.loaded) + loading + (coming.served is None) > limit:
            return f"{len(self.loaded)} models are loaded (--max-loaded-models {limit})"
        if budget and self.in_use(but=coming) + coming.expected_bytes() > budget:
            return (
                f"`{coming.name}` takes {coming.expected_bytes() / GiB:.2f} GiB and the loaded models "
                f"{self.in_use(but=coming) / GiB:.2f} GiB, more than --models-memory {budget / GiB:.2f} GiB"
            )
        return None

    async def _make_room(self, coming: Entry) -> None:
        """Unload the least recently used idle, unpinned models until ``coming`` fits."""
        while (why := self._over(coming)) is not None:
            parked = self._parked_beside(coming)
            if parked and "--models-memory" in why:
                self.drop_parked(parked[0])  # before any running model: its weights are cheaper to lose
                continue
            victims = self._victims(coming)
            if not victims:
                kept = sum(
                    e.expected_bytes()
                    for e in self.entries.values()
                    if e is not coming and (e.served or e.loading) and (e.config is None or e.pinned)
                )
                never = bool(self.budget) and coming.expected_bytes() + kept > (self.budget or 0)
                raise ApiError(
                    f"{why}; `{coming.name}` cannot load "
                    + ("beside the pinned ones: give it more memory" if never else "now: none is idle; retry shortly"),
                    503,
                    code="model_does_not_fit" if never else "models_busy",
                    headers={"Retry-After": "1"},
                )
            await self._stop(min(victims, key=lambda e: e.served.last_used), park=True)  # type: ignore[union-attr]

    async def _fit(self, loaded: Entry) -> None:
        """Once measured, ``loaded`` may take more than guessed: make room again, or unload it."""
        try:
            await self._make_room(loaded)
        except ApiError:
            await self._stop(loaded, park=False)
            raise

    def _may_unload(self, entry: Entry) -> bool:
        return entry.served is not None and entry.config is not None and not entry.pinned

    async def expire_idle(self) -> None:
        """Forever: unload models idle for ``--model-ttl`` (a busy one counts as used now)."""
        ttl = self.server.model_ttl
        while True:
            await trio.sleep(min(1.0, ttl / 4))
            now = time.monotonic()
            for entry in list(self.entries.values()):
                if not self._may_unload(entry):
                    continue
                assert entry.served is not None
                if not entry.served.idle:
                    entry.served.last_used = now
                elif now - entry.served.last_used >= ttl:
                    await self.unload(entry)

    async def run(self, nursery: trio.Nursery) -> None:
        """In the app's nursery: preload (``--preload``) and expire (``--model-ttl``)."""
        self.nursery = nursery
        if self.server.preload:
            for entry in list(self.entries.values()):
                try:
                    await self.load(entry)
                except ApiError as exc:
                    if exc.code not in ("models_busy", "model_does_not_fit"):
                        raise
                    log.warning("--preload: %s", exc.message)  # it loads when asked for, making room then
        if self.server.model_ttl:
            nursery.start_soon(self.expire_idle)

    async def stop(self) -> None:
        """Stop every loaded model's engine but the primary's (the app stops that one)."""
        for entry in self.entries.values():
            await self.unload(entry, park=False)
            self.drop_parked(entry)

    def card(self, entry: Entry, created: int) -> dict[str, object]:
        served = entry.served
        card: dict[str, object] = {
            "id": entry.name,
            "object": "model",
            "created": created,
            "owned_by": "trillm",
            "loaded": served is not None,
            "parked": entry.parked is not None,
        }
        if served is not None:
            card["max_model_len"] = served.engine.max_model_len
            card["memory_bytes"] = served.engine.footprint_bytes
        if entry.failure is not None:
            card["load_error"] = entry.failure
        return card
