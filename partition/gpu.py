"""A model for GPU clusters: data x pipeline x tensor parallel layouts of a dense
decoder-only transformer, with sharded data parallel (FSDP / ZeRO) and recompute.

``plan_layout(model, system, global_batch_tokens)`` tries every layout (tensor
parallel within a host, pipeline degrees dividing the layers, 1-8 virtual stages,
data parallel for the rest, micro-batches of 1-64 sequences, recompute, sharding),
keeps those that fit memory and returns the one with the most predicted tokens per
second; ``evaluate(...)`` predicts one given layout. ``system`` is a ``GpuSystem``
(a GPU type of ``partition.gpu_hw`` and a count) or a ``Cluster`` file's GPUs.

Assumptions (docs/partition.md states them with the error against published runs):

- Mixed precision bf16 with fp32 master weights and AdamW: 16 bytes of state per
  parameter. ``zero1`` shards the 12 fp32 bytes over data parallel (Megatron's
  distributed optimizer), ``fsdp`` all 16 (FSDP / ZeRO-3; a layer's bf16 weights
  gathered, the next prefetched), ``ddp`` none.
- Activations per token and layer, bf16, fused (flash) attention: no ``s x s``
  scores are kept. Llama-style ``h(12 + 4 kv/a) + 8 f`` bytes kept (GPT-style
  ``18h + 4f``: Korthikanti et al. 2022's ``34h`` without its ``5as`` score term);
  ``selective`` keeps the inputs of every matmul and of the attention kernel
  (``h(12 + 4 kv/a) + 2f``), recomputing norms and activation functions; ``full``
  keeps each layer's input only (``2h``). With tensor parallel, sequence parallel
  divides all of them by ``t``, the full-recompute input included. The head's
  logits: ``2 sV/t`` bf16 plus their fp32 copy in forward, and the fp32 gradient
  besides in backward. These bytes are units (``analytic_profile``) priced by the
  one cost model, ``memory.cost.price_stage``.
- Time: each GEMM runs at its GPU's sustained rate for its width
  (``GpuType.rate``: ``h/t`` for layers, ``min(h, V/t)`` for the head); flash
  attention does ``7sh`` FLOPs per token and layer (causal, backward recomputing
  the scores); ``full`` recompute adds a forward, ``selective`` the attention.
  Tensor parallel (sequence parallel: all-gather + reduce-scatter, 4 per layer and
  pass) is exposed in forward and hidden behind the weight-gradient GEMMs in
  backward. Pipeline: 1F1B or interleaved, the last stage carries the head, so the
  slowest stage sets the pace: ``(m-1) t_max + t_max + (sum t_k - t_max)/v``,
  boundary activations sent each way per micro-batch. Data parallel: gradients
  reduced behind the last micro-batch's backward (``ddp``, ``zero1``); FSDP gathers
  each micro-batch's weights behind its forward and backward and reduce-scatters
  fp32 gradients. Then the optimizer step, HBM-bound: 32 bytes per local
  parameter.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace

from memory.cost import CostModel, price_stage
from memory.profile import BlockCosts, BlockProfile, Profile
from memory.sizes import format_bytes
from partition import gpu_hw
from partition.cluster import Cluster
from partition.gpu_hw import GpuType, gpu_type
from partition.gpu_spec import MODELS, TransformerSpec

__all__ = [
    "MODELS",
    "GpuSystem",
    "Layout",
    "TransformerSpec",
    "evaluate",
    "memory_bytes",
    "plan_layout",
]

MEMORY_RESERVE = 0.9
"""Share of a GPU's memory a plan may use (allocator fragmentation, CUDA context,
communication buffers)."""

OPTIMIZER_BYTES_PER_PARAM = 32
"""HBM traffic of a fused AdamW step per local parameter: fp32 master, moments and
gradient read, master and moments written, the bf16 copy written."""

RECOMPUTE = ("none", "selective", "full")
SHARDING = ("zero1", "fsdp", "ddp")

UNCERTAINTY = 0.15
"""The worst relative step-time error on the held-out half of the published runs
(docs/partition.md; ``tests/partition/test_gpu_refs.py`` recomputes it)."""


@dataclass(frozen=True)
class GpuSystem:
    """``num_gpus`` GPUs of one type, ``gpu.gpus_per_host`` to a host."""

    gpu: GpuType
    num_gpus: int
    name: str = ""

    @classmethod
    def of(cls, gpu: str, num_gpus: int) -> GpuSystem:
        if num_gpus < 1:
            raise ValueError(f"--num-gpus {num_gpus} must be at least 1")
        return cls(gpu_type(gpu), num_gpus, f"{num_gpus} x {gpu.lower()}")

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> GpuSystem:
        """A cluster file's GPUs: its memory, peak, sustained rate (as the top of the
        rate curve), links and devices per host; the H100 curve's shape when its peak
        is above 600 TFLOP/s, else the A100's."""
        d = cluster.devices[0]
        per_host = sum(1 for x in cluster.devices if x.host == d.host)
        base = gpu_type("h100-80" if d.peak_flops_per_s > 600e12 else "a100-80")
        gpu = replace(
            base,
            name=cluster.name,
            memory_bytes=d.memory_bytes,
            peak_flops_per_s=max(d.peak_flops_per_s, d.flops_per_s),
            nvlink_bytes_per_s=cluster.intra.bandwidth_bytes_per_s,
            network_bytes_per_s=cluster.network.bandwidth_bytes_per_s,
            gpus_per_host=per_host,
            rate_max=d.flops_per_s,
        )
        return cls(gpu, cluster.num_devices, cluster.name)


def _system(system: GpuSystem | Cluster) -> GpuSystem:
    return system if isinstance(system, GpuSystem) else GpuSystem.from_cluster(system)


@dataclass(frozen=True)
class Layout:
    """One way to lay a model over the GPUs, and what it is predicted to do."""

    model: str
    num_gpus: int
    dp: int
    pp: int
    tp: int
    microbatch_size: int  # sequences
    num_microbatches: int  # per data-parallel replica per step
    schedule: str
    stages_per_rank: int
    recompute: str  # none | selective | full
    sharding: str  # zero1 | fsdp | ddp
    memory_bytes: int  # predicted peak per GPU
    capacity_bytes: int  # what a plan may use per GPU (MEMORY_RESERVE of it)
    step_s: float
    tokens_per_s: float
    mfu: float
    breakdown: dict[str, float]

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes

    def table(self) -> str:
        b = self.breakdown
        v = f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return "\n".join(
            [
                f"{self.model} on {self.num_gpus} GPUs: dp {self.dp} x pp {self.pp} "
                f"x tp {self.tp} ({self.sharding}, recompute {self.recompute}, "
                f"{self.schedule}{v})",
                f"micro-batches {self.num_microbatches} of {self.microbatch_size} "
                f"sequence(s) per replica; memory {format_bytes(self.memory_bytes)} "
                f"per GPU of {format_bytes(self.capacity_bytes)} usable: {verdict}",
                f"step {self.step_s:.2f} s: compute {b['compute_s']:.2f}, bubble "
                f"{b['bubble_s']:.2f}, tp {b['tp_s']:.2f}, pp {b['pp_s']:.2f}, dp "
                f"{b['dp_s']:.2f}, optimizer {b['optimizer_s']:.2f} (exposed)",
                f"predicted {self.tokens_per_s:,.0f} tokens/s "
                f"({self.tokens_per_s / self.num_gpus:,.0f} per GPU), MFU "
                f"{self.mfu:.1%}; uncertainty +/-{UNCERTAINTY:.0%} (the worst "
                "held-out error against published runs, docs/partition.md)",
            ]
        )

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "fits": self.fits}, sort_keys=True)


def activation_bytes_per_token(spec: TransformerSpec, recompute: str) -> float:
    """Bytes one layer keeps per token for its backward, before tensor parallel
    (bf16, fused attention; see the module docstring)."""
    h, f = spec.hidden, spec.ffn
    kv = spec.num_kv_heads / spec.num_heads
    if recompute == "full":
        return 2.0 * h
    if recompute == "selective":
        return h * (12 + 4 * kv) + 2 * f
    return h * (12 + 4 * kv) + 8 * f if spec.gated else 18.0 * h + 4 * f


def analytic_profile(
    spec: TransformerSpec,
    *,
    dp: int,
    tp: int,
    microbatch_size: int,
    recompute: str,
    sharding: str,
    pp: int = 1,
) -> Profile:
    """The model as units for ``memory.cost``: the embedding, each layer and the
    head, with one GPU's share of their state and one micro-batch's activations.

    A layer keeps ``s*b*activation_bytes_per_token/t`` bytes, its ``2*s*b*h/t``-byte
    input among them (sequence parallel), or only that input (``full``: recomputed,
    its whole activations alive again in its backward). FSDP gathers one layer's
    bf16 weights and prefetches the next (``4*P/t`` bytes in each forward and
    backward). The head's bf16 logits and their fp32 copy (``6*s*b*V/t``) exist in
    its forward, with the fp32 gradient (``10*s*b*V/t``) in its backward. A tied
    head shares the embedding's matrix when both are on one pipeline rank.
    """
    L, h, s = spec.num_layers, spec.hidden, spec.seq_len
    b, V = microbatch_size, spec.vocab
    weights = 2 / (dp if sharding == "fsdp" else 1)  # bf16 weights; bf16 grads alike
    moments = 12 / (1 if sharding == "ddp" else dp)  # fp32 master and AdamW moments
    tokens = s * b
    full = tokens * activation_bytes_per_token(spec, "none") / tp
    kept = tokens * activation_bytes_per_token(spec, recompute) / tp
    x = 2 * tokens * h / tp  # a layer's bf16 input, sequence parallel
    gather = 4 * spec.layer_params / tp if sharding == "fsdp" else 0

    def unit(
        name: str, params: float, costs: BlockCosts, options: tuple[str, ...]
    ) -> BlockProfile:
        return BlockProfile(
            name=name,
            num_params=int(params),
            param_bytes=int(params * weights),
            grad_bytes=int(params * weights),
            optimizer_state_bytes=int(params * moments),
            buffer_bytes=0,
            max_param_tensor_bytes=0,  # fused optimizers: no per-tensor temporary
            shared_param_bytes=0,
            shared_with=(),
            costs={1: costs},
            options=options,
        )

    def costs(
        inp: float, out: float, saved: float, fwd: float, bwd: float, saves_input: bool
    ) -> BlockCosts:
        return BlockCosts(
            input_bytes=int(inp),
            output_bytes=int(out),
            saved_bytes=int(saved),
            saves_input=saves_input,
            saves_output=False,
            forward_peak_bytes=int(fwd),
            forward_no_grad_peak_bytes=int(gather),
            backward_peak_bytes=int(bwd),
            forward_flops=0,
            backward_flops=0,
        )

    rec = recompute == "full"
    saved = full if rec else max(kept - x, 0.0)
    layer = costs(x, x, saved, saved + gather, gather, saves_input=not rec)
    head_params = 0 if spec.tied and pp == 1 else V * h / tp
    logits = tokens * V / tp
    return Profile(
        blocks=(
            unit("embed", V * h / tp, costs(8 * tokens, x, 0, x, 0, False), ("K",)),
            *(
                unit(
                    f"layers.{i}",
                    spec.layer_params / tp,
                    layer,
                    ("R",) if rec else ("K",),
                )
                for i in range(L)
            ),
            unit(
                "head",
                head_params,
                costs(x, 4, 0, 6 * logits, 10 * logits, True),
                ("K",),
            ),
        ),
        batch_size=microbatch_size,
        batch_dependent=False,
        batch_bytes=0,
        construction_peak_bytes=0,
    )


@functools.lru_cache(maxsize=4096)
def memory_bytes(
    spec: TransformerSpec,
    *,
    dp: int,
    pp: int,
    tp: int,
    microbatch_size: int,
    recompute: str,
    sharding: str,
    stages_per_rank: int = 1,
    num_microbatches: int = 1,
) -> int:
    """Predicted peak bytes per GPU (``memory.cost``'s events of the analytic units,
    no allocator slack: ``MEMORY_RESERVE`` stands for it): the larger of the first
    pipeline rank's (the embedding and its layers, the most micro-batches in flight:
    ``pp`` for 1F1B, ``pp + (pp-1)/v`` interleaved) and the last's (its layers and
    the head, one in flight for 1F1B)."""
    profile = analytic_profile(
        spec,
        dp=dp,
        tp=tp,
        microbatch_size=microbatch_size,
        recompute=recompute,
        sharding=sharding,
        pp=pp,
    )
    model = CostModel(profile, num_microbatches, 1, slices=1)
    L, v, m = spec.num_layers, stages_per_rank, num_microbatches
    per_rank = -(-L // pp)  # the fullest rank when the layers do not divide evenly
    n = len(profile.blocks)
    spans = {(0, 1 + per_rank): pp + (pp - 1) / v if v > 1 else pp}
    spans[(n - 1 - per_rank, n) if pp > 1 else (0, n)] = (
        1 + (pp - 1) / v if v > 1 else 1
    )
    peak = 0
    for (a, b), flight in spans.items():
        choices = [profile.blocks[k].options[0] for k in range(a, b)]
        price = price_stage(
            model, (a, b), choices, in_flight=min(flight, m), base_bytes=0
        )
        peak = max(peak, price.raw_bytes)
    return peak


def _ring_s(nbytes: float, n: int, bandwidth: float) -> float:
    """An all-gather or a reduce-scatter of ``nbytes`` (the whole) over ``n``."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bandwidth


def invalid_reason(
    spec: TransformerSpec,
    system: GpuSystem,
    global_batch_tokens: int,
    *,
    dp: int,
    pp: int,
    tp: int,
    microbatch_size: int,
    recompute: str,
    sharding: str,
    stages_per_rank: int = 1,
) -> str | None:
    """Why a layout cannot run, as one line with the numbers and the fix; None when
    it can (memory aside)."""
    n, per_host = system.num_gpus, system.gpu.gpus_per_host
    L, v, s = spec.num_layers, stages_per_rank, spec.seq_len
    if recompute not in RECOMPUTE:
        return f"recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}"
    if sharding not in SHARDING:
        return f"sharding {sharding!r} is not one of {', '.join(SHARDING)}"
    if min(dp, pp, tp, microbatch_size, v) < 1:
        return "dp, pp, tp, micro-batch and virtual stages must be at least 1"
    if dp * pp * tp != n:
        return (
            f"dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp} is not the {n} GPUs; "
            "give degrees whose product is the GPU count"
        )
    if tp > per_host or per_host % tp:
        return (
            f"tp {tp} does not divide the {per_host} GPUs of a host; give a tensor "
            "parallel degree that does (tensor parallel stays within NVLink)"
        )
    if spec.num_heads % tp or spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        return (
            f"tp {tp} does not divide the {spec.num_heads} heads "
            f"({spec.num_kv_heads} kv-heads); give a tensor parallel degree that does"
        )
    if pp * v > L:
        return (
            f"pp {pp} x virtual stages {v} = {pp * v} stages exceed the {L} "
            "layers; give at most one stage per layer"
        )
    if global_batch_tokens % s:
        return (
            f"a step's {global_batch_tokens} tokens are not whole sequences of {s}; "
            "give a multiple of the sequence length"
        )
    seqs = global_batch_tokens // s
    if seqs % (dp * microbatch_size):
        return (
            f"{seqs} sequences per step do not split into dp {dp} replicas of "
            f"micro-batches of {microbatch_size}; give a batch that is a multiple "
            f"of {dp * microbatch_size} sequences"
        )
    m = seqs // (dp * microbatch_size)
    if m < pp:
        return (
            f"{m} micro-batch(es) per replica cannot fill {pp} pipeline stages; give "
            f"at least {pp * dp * microbatch_size * s} tokens per step or a smaller pp"
        )
    if v > 1 and m % pp:
        return (
            f"the interleaved schedule needs micro-batches ({m}) in multiples of pp "
            f"({pp}); change the batch or the micro-batch size"
        )
    return None


def evaluate(
    spec: TransformerSpec,
    system: GpuSystem | Cluster,
    global_batch_tokens: int,
    *,
    dp: int,
    pp: int,
    tp: int,
    microbatch_size: int,
    recompute: str,
    sharding: str,
    stages_per_rank: int = 1,
    require_fit: bool = True,
    flash_attention: bool = True,
) -> Layout | None:
    """The predicted step of one layout; None when it is not a valid layout, or
    (``require_fit``) when it does not fit memory. ``flash_attention=False``: the
    attention scores are materialised (time only; memory assumes a fused kernel)."""
    sys_ = _system(system)
    kw = dict(
        dp=dp,
        pp=pp,
        tp=tp,
        microbatch_size=microbatch_size,
        recompute=recompute,
        sharding=sharding,
        stages_per_rank=stages_per_rank,
    )
    if invalid_reason(spec, sys_, global_batch_tokens, **kw) is not None:  # type: ignore[arg-type]
        return None
    gpu, n = sys_.gpu, sys_.num_gpus
    L, h, s, V = spec.num_layers, spec.hidden, spec.seq_len, spec.vocab
    b, v = microbatch_size, stages_per_rank
    seqs = global_batch_tokens // s
    m = seqs // (dp * b)
    mem = memory_bytes(spec, num_microbatches=m, **kw)  # type: ignore[arg-type]
    capacity = int(MEMORY_RESERVE * gpu.memory_bytes)
    if require_fit and mem > capacity:
        return None
    tokens_mb = b * s
    # ---- compute per micro-batch (forward + backward), one GPU's share
    P = spec.layer_params
    attn = 7 * s * h / 2 * 2  # flash attention, causal: 2sh forward, 5sh backward
    layer_flops = 6 * P + attn
    if recompute == "full":
        layer_flops += 2 * P + 2 * s * h
    elif recompute == "selective":
        layer_flops += 2 * s * h
    r_layer = gpu.rate(h / tp)
    # memory-bound work (norms, activations, residuals; softmax over the scores
    # without a fused kernel): HBM passes over the bytes a layer would keep
    touched = activation_bytes_per_token(spec, "none") + (
        0 if flash_attention else 5 * spec.num_heads * s
    )
    passes = gpu_hw.MEMORY_PASSES * (4 / 3 if recompute == "full" else 1)
    t_layer = (
        tokens_mb
        * (layer_flops / r_layer + passes * touched / gpu.hbm_bytes_per_s)
        / tp
    )
    t_wgrad = tokens_mb * 2 * P / tp / r_layer  # weight-gradient GEMMs
    t_head = tokens_mb * 6 * h * V / tp / gpu.rate(min(h, V / tp))
    # ---- tensor parallel: sequence-parallel all-gather + reduce-scatter of the
    # layer's bf16 activations, 4 per pass (a forward more with full recompute)
    nv = gpu.nvlink_bytes_per_s
    tp_pass = 4 * _ring_s(2 * tokens_mb * h, tp, nv)
    tp_fwd = tp_pass * (2 if recompute == "full" else 1)
    tp_layer = tp_fwd + max(0.0, tp_pass - t_wgrad)
    # ---- pipeline: stages of L/pp layers, the last with the head
    per_host = gpu.gpus_per_host
    hop = gpu.network_bytes_per_s if tp * pp > per_host else nv
    pp_mb = 2 * v * (2 * tokens_mb * h / tp) / hop if pp > 1 else 0.0
    layers_per_rank = -(-L // pp)  # uneven splits: the fullest rank sets the pace
    body = layers_per_rank * (t_layer + tp_layer) + pp_mb
    stages = [body] * (pp - 1) + [body + t_head]
    t_max = max(stages)
    pipe_s = (m - 1) * t_max + t_max + (sum(stages) - t_max) / v
    compute_s = m * (sum(stages) / pp)
    # ---- data parallel over the slowest stage's parameters
    params_rank = (layers_per_rank * P + V * h) / tp
    # a ring collective across hosts runs one ring per member a host holds, each
    # through its own NIC: the group's bandwidth is the per-GPU network times the
    # members per host (NVLink at most)
    members = max(1, per_host // (tp * pp))
    dp_bw = min(nv, gpu.network_bytes_per_s * members) if n > per_host else nv
    t_bwd = t_max * 2 / 3
    if sharding == "fsdp":
        gather = _ring_s(2 * params_rank, dp, dp_bw)
        scatter = _ring_s(4 * params_rank, dp, dp_bw)  # fp32 gradient reduction
        t_fwd = t_max / 3
        dp_s = m * (max(0.0, gather - t_fwd) + max(0.0, gather + scatter - t_bwd))
    else:
        dp_s = max(0.0, 2 * _ring_s(2 * params_rank, dp, dp_bw) - t_bwd)
    local = params_rank / (1 if sharding == "ddp" else dp)
    opt_s = OPTIMIZER_BYTES_PER_PARAM * local / gpu.hbm_bytes_per_s
    step = pipe_s + dp_s + opt_s
    tokens = seqs * s
    tps = tokens / step
    mfu = tps * spec.flops_per_token() / (n * gpu.peak_flops_per_s)
    return Layout(
        model=spec.name,
        num_gpus=n,
        dp=dp,
        pp=pp,
        tp=tp,
        microbatch_size=b,
        num_microbatches=m,
        schedule="1F1B" if v == 1 else "Interleaved1F1B",
        stages_per_rank=v,
        recompute=recompute,
        sharding=sharding,
        memory_bytes=int(mem),
        capacity_bytes=capacity,
        step_s=step,
        tokens_per_s=tps,
        mfu=mfu,
        breakdown={
            "compute_s": compute_s - m * layers_per_rank * tp_layer - m * pp_mb,
            "bubble_s": pipe_s - compute_s,
            "tp_s": m * layers_per_rank * tp_layer,
            "pp_s": m * pp_mb,
            "dp_s": dp_s,
            "optimizer_s": opt_s,
        },
    )


def evaluate_given(
    spec: TransformerSpec,
    system: GpuSystem | Cluster,
    global_batch_tokens: int,
    **layout: int | str,
) -> Layout:
    """``evaluate`` for a layout a user gives: a reason instead of None.

    Raises:
        ValueError: the layout cannot run (the message gives the numbers and the fix).
    """
    sys_ = _system(system)
    why = invalid_reason(spec, sys_, global_batch_tokens, **layout)  # type: ignore[arg-type]
    if why is not None:
        raise ValueError(why)
    lay = evaluate(spec, sys_, global_batch_tokens, require_fit=False, **layout)  # type: ignore[arg-type]
    assert lay is not None
    return lay


def _layouts(spec: TransformerSpec, system: GpuSystem):
    n, per_host = system.num_gpus, system.gpu.gpus_per_host
    for tp in (1, 2, 4, 8, 16):
        if tp > per_host or n % tp:
            continue
        for pp in range(1, n // tp + 1):
            if n % (tp * pp) or spec.num_layers % pp:
                continue  # the search keeps to even splits; a given layout may not
            for v in (1, 2, 3, 4, 6, 8):
                if v > 1 and (pp == 1 or spec.num_layers % (pp * v)):
                    continue
                yield n // (tp * pp), pp, tp, v


def plan_layout(
    model: str | TransformerSpec,
    system: GpuSystem | Cluster,
    global_batch_tokens: int = 4 * 2**20,
) -> Layout:
    """The layout with the most predicted tokens per second that fits memory.

    Example::

        plan_layout("llama3-8b", GpuSystem.of("h100-80", 64), 4 * 2**20)

    Raises:
        ValueError: an unknown model, or no layout fits (the message gives the least
            memory per GPU any layout needs).
    """
    spec = MODELS.get(model) if isinstance(model, str) else model
    if spec is None:
        raise ValueError(f"unknown model {model!r}; one of {', '.join(MODELS)}")
    sys_ = _system(system)
    best: Layout | None = None
    least: int | None = None
    seqs = global_batch_tokens // spec.seq_len
    for dp, pp, tp, v in _layouts(spec, sys_):
        for b in (1, 2, 4, 8, 16, 32, 64):
            if b * dp > seqs:
                break
            for rec in RECOMPUTE:
                for sh in SHARDING:
                    lay = evaluate(
                        spec,
                        sys_,
                        global_batch_tokens,
                        dp=dp,
                        pp=pp,
                        tp=tp,
                        microbatch_size=b,
                        recompute=rec,
                        sharding=sh,
                        stages_per_rank=v,
                        require_fit=False,
                    )
                    if lay is None:
                        continue
                    if least is None or lay.memory_bytes < least:
                        least = lay.memory_bytes
                    if lay.fits and (
                        best is None or lay.tokens_per_s > best.tokens_per_s
                    ):
                        best = lay
    if best is None:
        need = (
            f"; the least any layout needs is "
            f"{format_bytes(least / MEMORY_RESERVE)} per GPU"
            if least
            else "; no layout divides this model, batch and GPU count"
        )
        raise ValueError(
            f"no layout of {spec.name} fits {sys_.num_gpus} GPUs of "
            f"{format_bytes(sys_.gpu.memory_bytes)}{need}"
        )
    return best


def is_gpu_cluster(cluster: Cluster) -> bool:
    """A cluster whose devices declare a hardware peak above their sustained rate,
    or have more than 16 GB: the analytic GPU model applies."""
    d = cluster.devices[0]
    return d.peak_flops_per_s > d.flops_per_s or d.memory_bytes > 16 * 10**9
