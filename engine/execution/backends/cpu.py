"""The CPU fast path as a backend: small C kernels where they apply, torch elsewhere.

In float32 on the CPU, with a C compiler, three layers of C stand in for torch:
RMSNorm, rotary and SiLU-mul (``kernels/cpu_ops.c``: at decode sizes each torch op
is mostly dispatch overhead), decode attention that reads the pages in place
(``kernels/cpu_decode.c``), and for decode-only steps of a model whose projections
are all in blocks (repacked, or a GGUF file's own), the whole layer loop in one call
(``kernels/cpu_forward.c``: the same kernels, Qwen3's head norms included, without ~10
Python wrappers per layer). Without a compiler, or in
bfloat16, the same layers run in torch: gather + SDPA for attention. Wide steps (prefill
chunks) run the Python layer loop with their GEMMs and prefill attention on AMX tiles where
the CPU has them (``bf16_panels``, ``flash_prefill``), writing into buffers of the step.

One idea, one file: how a CPU step's rows meet the kernels (its inputs, the layer loop in C
or Python, the head), which is why it runs a little past 400 lines.
"""

from __future__ import annotations

from typing import Any, cast

import attrs
import torch

from trillm.engine.execution.backends.base import (
    Backend,
    KVCache,
    ModelWeights,
    StepRows,
    padded_tables,
    slots,
)
from trillm.engine.execution.backends.cpu_attention import (
    CpuMetadata,
    DecodeGroup,
    DecodeRows,
    PrefillSpan,
    paged_attention,
)
from trillm.engine.execution.experts import moe_mlp
from trillm.engine.execution.layers import (
    MoEWeights,
    Weight,
    gated_activation,
    project,
    project_add,
    qk_norm_,
    rms_norm,
)
from trillm.engine.execution.rope import apply_rotary
from trillm.engine.step import Batch, ScheduledSequence, StepInputs
from trillm.kernels import amx_tiles, bf16_panels, cpu_decode, cpu_forward, cpu_matmul, cpu_ops
from trillm.kernels.block_weights import BlockWeight
from trillm.kernels.gguf_blocks import GGUFWeight
from trillm.kernels.stacked import Stacked, out_features


class CpuBackend(Backend):
    """The CPU fast path. ``c_kernels=False`` runs the torch fallbacks even where C
    could build (what a machine without a compiler runs; tests compare the two)."""

    name = "cpu"

    def __init__(self, device: torch.device, dtype: torch.dtype, c_kernels: bool = True) -> None:
        if device.type != "cpu":
            raise ValueError("the cpu kernels run on the CPU only")
        super().__init__(device, dtype)
        self.c_kernels = c_kernels and dtype == torch.float32  # where the C kernels apply
        # Small C kernels for RMSNorm, rotary and SiLU-mul.
        self.c_ops = self.c_kernels and cpu_ops.available()
        # The C decode kernel; without it, decode rows go through gather + SDPA.
        self.c_decode = self.c_kernels and cpu_decode.available()
        # Decode-only steps take the C layer loop where ``bind`` could make one; read each
        # step, so tests may switch it off to compare.
        self.fuse_decode = self.c_ops and cpu_forward.available()
        # When set (``--gemm-dtype``, resolved at load), a projection multiplies in bfloat16 (AMX
        # tiles) from the rows where that beats its float32 kernel (``bf16_panels.crossover``), and
        # the prefill spans of steps of ``bf16_panels.ROWS`` rows or more attend in bfloat16.
        self.gemm_bf16 = False
        self.scratch = bf16_panels.Scratch()  # their panels, reused by every step (steps run one at a time)

    @property
    def supports_block_weights(self) -> bool:
        return self.c_kernels and cpu_matmul.available()

    def fusable(self, model: ModelWeights) -> bool:
        """Whether every piece of ``model``'s layers has its C kernel: the C loop applies."""
        return (
            self.c_ops
            and cpu_forward.available()
            and model.tp.size == 1  # the C loop has no all-reduce between layers
            and all(
                (layer.moe is None or _mixture_fusable(layer.moe))
                and (model.shape.activation in cpu_ops.GATED or model.shape.activation == "swiglu_oai")
                and all(
                    w is not None and cpu_forward.fusable(w)
                    for w in (layer.qkv, layer.o_proj, *((layer.gate_up, layer.down) if layer.moe is None else ()))
                )
                for layer in model.layers
            )
        )

    def bind(self, model: ModelWeights, kv_cache: KVCache) -> cpu_forward.DecodeLayers | None:
        """The C layer loop over ``model``'s weights and ``kv_cache``, where it applies."""
        if not self.fusable(model):
            return None
        s = model.shape

        def blocks(w: Weight | None) -> cpu_forward.Projection:
            return cast(cpu_forward.Projection, w)  # every projection is: ``fusable`` said so

        def mlp(w: Weight | None) -> cpu_forward.Projection | None:
            return None if w is None else blocks(w)  # None: a mixture's layer

        layers = [
            cpu_forward.LayerSpec(
                la.input_norm,
                blocks(la.qkv),
                blocks(la.o_proj),
                la.post_norm,
                mlp(la.gate_up),
                mlp(la.down),
                la.q_norm,
                la.k_norm,
                la.attn_out_norm,
                la.mlp_out_norm,
                s.window(i),
                s.local_rope(i),
                _mixture_spec(la.moe) if la.moe is not None else None,
                la.qkv_bias,
                la.sinks,
                la.o_bias,
            )
            for i, la in enumerate(model.layers)
        ]
        return cpu_forward.DecodeLayers(
            layers,
            kv_cache,
            s.num_heads,
            s.rms_norm_eps,
            model.scale,
            s.activation,
            s.rope_dim,
            s.attn_logit_softcap or 0.0,
            (s.swiglu_alpha, s.swiglu_limit),
            tiles=self.gemm_bf16,
        )

    def prepare(self, batch: Batch[ScheduledSequence], page_size: int) -> StepInputs:
        # Plain ints, one tensor each at the end: a few torch calls per sequence cost ~60 us on a busy
        # 2-core machine, a fifth of the event loop's time at 32 streams (measured).
        ps = page_size
        step = StepRows()
        positions: list[int] = []
        slot_mapping: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        for index, chunk in enumerate(batch.chunks):
            start, n, end = chunk.start, chunk.length, chunk.end
            row = step.add(index, chunk)
            positions.extend(range(start, end))
            table = chunk.seq.pages[: -(-end // ps)]
            slot_mapping.extend(slots(table, start, end, ps))
            if chunk.decode_rows:
                for j in range(n):
                    decode_rows.append(row + j)
                    decode_tables.append(table)
                    decode_lens.append(start + j + 1)
            else:
                mask = None
                if start > 0:  # causal within the chunk, everything cached before it
                    mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
                prefills.append(PrefillSpan(row, row + n, torch.tensor(table), end, mask))
        if self.c_decode and decode_rows:
            meta = CpuMetadata(
                slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
                decodes=(),
                prefills=tuple(prefills),
                decode_rows=DecodeRows(
                    None if len(decode_rows) == len(step.ids) else torch.tensor(decode_rows, dtype=torch.long),
                    padded_tables(decode_tables, torch.int32),
                    torch.tensor(decode_lens, dtype=torch.int32),
                    len(batch.chunks) if len(decode_rows) == len(step.ids) > len(batch.chunks) else None,
                ),
            )
        else:
            meta = CpuMetadata(
                slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
                decodes=decode_groups(decode_rows, decode_tables, decode_lens, ps),
                prefills=tuple(prefills),
            )
        return step.inputs(torch.tensor(positions, dtype=torch.long), meta)

    def run_layers(
        self,
        model: ModelWeights,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: CpuMetadata,
        logits_rows: torch.Tensor,
        bound: cpu_forward.DecodeLayers | None = None,
    ) -> torch.Tensor:
        """Decode-only steps go through ``bound``, the C loop, when there is one; the rest
        through the Python loop over the same kernels."""
        s = model.shape
        rope = RopeRows.at(model, positions)
        norm = cpu_ops.rms_norm if self.c_ops else rms_norm
        d = meta.decode_rows
        if (
            bound is not None
            and self.fuse_decode
            and d is not None
            and d.rows is None  # a decode-only step
            and h.shape[0] <= bound.max_rows
        ):
            h = bound.run(
                h, rope, meta.slot_mapping, d.block_tables, d.context_lens, torch.get_num_threads(), d.kernel_rows
            )
        else:
            h = self._layers(model, h, rope, kv_cache, meta)
        return norm(h.index_select(0, logits_rows), model.final_norm, s.rms_norm_eps)

    def head(self, h: torch.Tensor, lm_head: Any, kernel_rows: int | None = None) -> torch.Tensor:
        """The LM head on AMX tiles from its crossover on, as the layers' projections (only where the
        tiles take it: a dense head would be converted to bfloat16 every step); by ``kernel_rows``
        where the step gives them (``DecodeRows``)."""
        if amx_tiles.handles(lm_head) and self._in_bf16(lm_head, kernel_rows or h.shape[0]):
            return bf16_panels.matmul(h, lm_head, scratch=self.scratch)
        if kernel_rows and isinstance(lm_head, BlockWeight):
            return cpu_matmul.matmul(h, lm_head, kernel_rows=kernel_rows)
        return project(h, lm_head)

    def kernel_rows(self, meta: CpuMetadata) -> int | None:
        d = meta.decode_rows
        return d.kernel_rows if d is not None else None

    def _in_bf16(self, w: Weight, rows: int) -> bool:
        return self.gemm_bf16 and rows >= bf16_panels.crossover(w)

    def _gated_on_tiles(self, gate_up: Weight, rows: int, activation: str) -> bool:
        """A wide step's gated MLP as one pass on the AMX tiles: no [rows, 2 I] product written and read
        back by the activation (a 2,000-token prefill of SmolLM2: 0.58 -> 0.47 s, BF16 and Q4_1 alike)."""
        return (
            rows >= amx_tiles.WIDE_ROWS
            and activation in amx_tiles.GATED
            and self._in_bf16(gate_up, rows)
            and amx_tiles.available()
            and amx_tiles.gated_parts(gate_up) is not None
        )

    def _layers(
        self,
        model: ModelWeights,
        h: torch.Tensor,
        rope: RopeRows,
        kv_cache: KVCache,
        meta: CpuMetadata,
    ) -> torch.Tensor:
        s = model.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        norm = cpu_ops.rms_norm if self.c_ops else rms_norm
        reduce = model.tp.all_reduce if model.tp.size > 1 else None
        rows = h.shape[0]
        low = torch.bfloat16 if self.gemm_bf16 and rows >= bf16_panels.ROWS else None

        outputs: dict[int, torch.Tensor] = {}  # width -> this step's output of that width, reused by every layer
        # A wide step's norms, gated activations and attention write into buffers of its own, reused by
        # every layer too: fresh, each was multi-MiB of new pages per layer (glibc maps them afresh).
        buffers: dict[str, torch.Tensor] = {}

        def buffer(name: str, *shape: int) -> torch.Tensor | None:
            if rows < bf16_panels.ROWS:
                return None
            found = buffers.get(name)
            if found is None:
                found = buffers[name] = torch.empty(*shape)
            return found

        tile_buffers: dict[str, amx_tiles.TileRows] = {}
        wide_tiles = rows >= amx_tiles.WIDE_ROWS and self.c_ops and amx_tiles.available()

        def on_tiles(w: Weight) -> bool:
            """Whether a wide step's product with w runs whole on the AMX tiles, x in their own order."""
            parts = w.parts if isinstance(w, Stacked) else (w,)
            return wide_tiles and self._in_bf16(w, rows) and all(amx_tiles.handles(p) for p in parts)

        def tile_rows(name: str, cols: int) -> amx_tiles.TileRows:
            found = tile_buffers.get(name)
            if found is None:
                found = tile_buffers[name] = amx_tiles.TileRows.empty(rows, cols)
            return found

        def normed(x: torch.Tensor, weight: torch.Tensor, tiles: bool = False) -> torch.Tensor | amx_tiles.TileRows:
            """A layer's input norms; for a product on the tiles (``tiles``) normed straight into their order."""
            if tiles:
                return amx_tiles.pack(x, weight, s.rms_norm_eps, out=tile_rows("normed", x.shape[1]))
            if self.c_ops:
                return cpu_ops.rms_norm(x, weight, s.rms_norm_eps, out=buffer("normed", *x.shape))
            return rms_norm(x, weight, s.rms_norm_eps)

        def proj(x: torch.Tensor | amx_tiles.TileRows, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
            """x @ W (+ bias). A wide step writes into one buffer per width for all its layers (each
            layer's output is dead when the next one's is made): fresh multi-MiB tensors are new pages
            each time, and faulting them in cost a third of a prefill chunk's GEMMs."""
            if not self._in_bf16(w, rows):
                assert isinstance(x, torch.Tensor)
                return project(x, w, bias)
            width = out_features(w)
            out = outputs.get(width)
            if out is None:
                out = outputs[width] = torch.empty(rows, width)
            bf16_panels.matmul(x, w, out=out, scratch=self.scratch)
            return out if bias is None else out.add_(bias)

        def proj_add(h: torch.Tensor, x: torch.Tensor | amx_tiles.TileRows, w: Weight) -> torch.Tensor:
            if not self._in_bf16(w, rows):
                assert isinstance(x, torch.Tensor)
                return project_add(h, x, w, reduce)
            if reduce is not None:
                return h.add_(reduce(proj(x, w)))
            return bf16_panels.matmul(x, w, out=h, accumulate=True, scratch=self.scratch)

        def act(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # act(gate) * up
            if self.c_ops and s.activation in cpu_ops.GATED:
                return cpu_ops.gated_mul(gate_up, s.activation, out=out)
            return gated_activation(gate_up, s.activation, s.swiglu_alpha, s.swiglu_limit)

        def add_block(
            h: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, out_norm: torch.Tensor | None
        ) -> torch.Tensor:
            """h + a block's output ``out`` (this rank's part): all-reduced, its bias added once (gpt-oss's
            O), normed where the family norms it (Gemma)."""
            out = reduce(out) if reduce else out
            if bias is not None:
                out = out.add_(bias)
            return h + (out if out_norm is None else norm(out, out_norm, s.rms_norm_eps))

        for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_cache)):
            x = normed(h, layer.input_norm, on_tiles(layer.qkv))
            qkv = proj(x, layer.qkv, layer.qkv_bias)
            # Q and K sit side by side in the fused projection: one rotary pass for both.
            qk = qkv[:, : q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            qk_norm_(qk, s.num_heads, layer, s.rms_norm_eps, norm)  # Qwen3, Gemma 3
            cos, sin = rope.local if s.local_rope(i) else rope.whole
            if self.c_ops:
                cpu_ops.rotary_(qk, cos, sin)
            else:
                qk = apply_rotary(qk, cos, sin)
            q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size :].view(-1, s.num_kv_heads, s.head_dim)
            cap = s.attn_logit_softcap or 0.0
            attn = paged_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta,
                model.scale,
                s.window(i),
                layer.sinks,
                cap,
                low,
                buffer("attn", *q.shape),
            )
            if layer.attn_out_norm is None and layer.o_bias is None:  # the residual add rides on the GEMM
                h = proj_add(h, attn.reshape(-1, q_size), layer.o_proj)
            else:
                h = add_block(h, proj(attn.reshape(-1, q_size), layer.o_proj), layer.o_bias, layer.attn_out_norm)
            gated_on_tiles = (
                layer.moe is None
                and layer.gate_up is not None
                and self._gated_on_tiles(layer.gate_up, rows, s.activation)
            )
            x = normed(h, layer.post_norm, gated_on_tiles)
            if layer.moe is not None:  # a mixture all-reduces and adds its experts' biases itself
                assert isinstance(x, torch.Tensor)
                out = moe_mlp(x, layer.moe, act, reduce)
                h = h + (out if layer.mlp_out_norm is None else norm(out, layer.mlp_out_norm, s.rms_norm_eps))
                continue
            assert layer.gate_up is not None and layer.down is not None
            gated: torch.Tensor | amx_tiles.TileRows
            if gated_on_tiles:  # gate, up and act in one pass, handed to the down projection in the tiles' order
                size = out_features(layer.gate_up) // 2
                into = tile_rows("gated", size) if on_tiles(layer.down) else buffer("gated", rows, size)
                gated = amx_tiles.gated(x, layer.gate_up, s.activation, out=into)
            else:
                assert isinstance(x, torch.Tensor)
                gate_up = proj(x, layer.gate_up)
                gated = act(gate_up, buffer("gated", rows, gate_up.shape[1] // 2))
            if layer.mlp_out_norm is None:
                h = proj_add(h, gated, layer.down)
            else:
                h = add_block(h, proj(gated, layer.down), None, layer.mlp_out_norm)
        return h


@attrs.frozen
class RopeRows:
    """The rotary tables at this step's positions: the model's, and its windowed layers' own (Gemma 3)."""

    whole: tuple[torch.Tensor, torch.Tensor]
    local: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def at(cls, model: ModelWeights, positions: torch.Tensor) -> RopeRows:
        whole = model.rope.rows(positions)
        if model.local_rope is model.rope:
            return cls(whole, whole)
        return cls(whole, model.local_rope.rows(positions))


def decode_groups(rows: list[int], tables: list[list[int]], lens: list[int], page_size: int) -> tuple[DecodeGroup, ...]:
    """Rows sorted by context length, cut where padding would more than double a
    group's work: a 4,000-token context decoding beside 16 short ones made every
    row attend 4,000 padded slots (1.36 s per step instead of 0.08 s, measured)."""
    order = sorted(range(len(rows)), key=lambda i: lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lens[i] <= 2 * lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for members in groups:
        pages = padded_tables([tables[i] for i in members], torch.long)
        width = pages.shape[1]
        group_lens = torch.tensor([lens[i] for i in members], dtype=torch.long)
        mask = (torch.arange(width * page_size).unsqueeze(0) < group_lens.unsqueeze(1)).view(len(members), 1, 1, -1)
        out.append(DecodeGroup(torch.tensor([rows[i] for i in members], dtype=torch.long), pages, mask, group_lens))
    return tuple(out)


def _mixture_fusable(moe: MoEWeights) -> bool:
    """Whether the C loop runs this mixture: its experts a GGUF file's blocks of one type
    (``grouped_blocks``), a shared expert (Qwen2-MoE's) in blocks too."""
    shared = moe.shared_gate_up, moe.shared_down
    return (
        moe.grouped_blocks
        and all(w is None or cpu_forward.fusable(w) for w in shared)
        and moe.top_k <= cpu_forward.MAX_TOP_K
        and moe.router.dtype is torch.float32
        and moe.router.is_contiguous()
    )


def _mixture_spec(moe: MoEWeights) -> cpu_forward.MixtureSpec:
    halves = [cast(Stacked, w).parts for w in moe.gate_up]  # gate, up: ``grouped_blocks`` said so
    return cpu_forward.MixtureSpec(
        moe.router,
        moe.top_k,
        moe.normalize,
        [cast(GGUFWeight, h[0]) for h in halves],
        [cast(GGUFWeight, h[1]) for h in halves],
        [cast(GGUFWeight, w) for w in moe.down],
        moe.router_bias,
        moe.gate_up_bias,
        moe.down_bias,
        cast(cpu_forward.Projection | None, moe.shared_gate_up),
        cast(cpu_forward.Projection | None, moe.shared_down),
        moe.shared_gate,
    )
