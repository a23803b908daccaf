"""A model for GPU clusters: data x pipeline x tensor parallel layouts of a dense
decoder-only transformer, with sharded data parallel (FSDP / ZeRO) and recompute.

``plan_layout(model, cluster, global_batch_tokens)`` tries every layout (tensor
parallel degree within a host, pipeline degree dividing the layers, data parallel for
the rest, micro-batch size, schedule, recompute, sharding), keeps those that fit
memory and returns the one with the most predicted tokens per second, with its MFU.

Assumptions (all stated in docs/partition.md, each a field or constant here):

- Mixed precision bf16 with fp32 master weights and AdamW: 16 bytes of state per
  parameter (2 bf16 weights, 2 bf16 gradients, 4 fp32 master, 8 fp32 moments).
  ``zero1`` shards the 12 bytes of fp32 state over the data-parallel group (Megatron's
  distributed optimizer); ``fsdp`` shards all 16 (FSDP full shard / ZeRO-3) and
  gathers weights for forward and again for backward.
- Activations per layer and micro-batch (Korthikanti et al. 2022, bf16, sequence
  parallel with tensor parallel): ``s*b*h*(34 + 5*a*s/h) / t`` bytes without recompute,
  ``34*s*b*h / t`` with selective recompute (attention scores rerun; flash attention
  makes it the default), ``2*s*b*h`` with full recompute (only each layer's input).
  The first stage of 1F1B holds ``pp`` micro-batches of its ``L/pp`` layers. These
  bytes are units (``analytic_profile``) priced by the one cost model,
  ``memory.cost.price_stage``, as a device's plan and a pipeline stage are.
- Compute: model FLOPs ``6*N*tokens + 12*L*h*s*tokens`` (PaLM's MFU convention,
  attention not halved for causality), run at each GPU's sustained rate
  (``compute`` in the cluster file), +1/3 of the layer FLOPs for full recompute.
- Tensor parallel: per layer per micro-batch 4 all-reduce-equivalents of ``s*b*h*2``
  bytes over NVLink, not overlapped. Pipeline: each micro-batch's activations and
  gradients cross stage boundaries (``s*b*h*2`` bytes each way), bubble
  ``(pp-1)/(v*m)``. Data parallel: ring reduce-scatter + all-gather of bf16 gradients
  (FSDP: 1.5x that volume) over the inter-host network, ``DP_OVERLAP`` hidden behind
  backward compute.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from memory.cost import CostModel, price_stage
from memory.profile import BlockCosts, BlockProfile, Profile
from memory.sizes import format_bytes
from partition.cluster import Cluster

BYTES_PER_PARAM = {"zero1": (4, 12), "fsdp": (0, 16), "ddp": (16, 0)}
"""(unsharded bytes, bytes sharded over data parallel) per parameter."""

DP_OVERLAP = 0.7
"""Share of data-parallel communication hidden behind backward compute."""

MEMORY_RESERVE = 0.9
"""Share of a GPU's memory a plan may use (allocator fragmentation, CUDA context)."""


@dataclass(frozen=True)
class TransformerSpec:
    """A dense decoder-only transformer (Llama-style: SwiGLU MLP, grouped-query
    attention, untied embeddings)."""

    name: str
    num_layers: int  # L
    hidden: int  # h
    ffn: int  # SwiGLU inner width
    num_heads: int  # a
    num_kv_heads: int
    vocab: int
    seq_len: int  # s, tokens per sequence

    @property
    def num_params(self) -> int:
        h, kv = self.hidden, self.hidden * self.num_kv_heads // self.num_heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.ffn + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab * h

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward and backward)."""
        return 6 * self.num_params + 12 * self.num_layers * self.hidden * self.seq_len


MODELS = {
    "llama2-7b": TransformerSpec("llama2-7b", 32, 4096, 11008, 32, 32, 32000, 4096),
    "llama2-13b": TransformerSpec("llama2-13b", 40, 5120, 13824, 40, 40, 32000, 4096),
    "llama2-70b": TransformerSpec("llama2-70b", 80, 8192, 28672, 64, 8, 32000, 4096),
    "gpt3-175b": TransformerSpec("gpt3-175b", 96, 12288, 32768, 96, 96, 50257, 2048),
}
"""Shapes from the Llama 2 paper (Touvron et al. 2023) and GPT-3 (Brown et al. 2020;
its MLP written as SwiGLU of equal parameter count)."""


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
    step_s: float
    tokens_per_s: float
    mfu: float
    breakdown: dict[str, float]

    def table(self) -> str:
        b = self.breakdown
        return "\n".join(
            [
                f"{self.model} on {self.num_gpus} GPUs: dp {self.dp} x pp {self.pp} "
                f"x tp {self.tp} ({self.sharding}, recompute {self.recompute}, "
                f"{self.schedule}{f' v={self.stages_per_rank}' if self.stages_per_rank > 1 else ''})",
                f"micro-batches {self.num_microbatches} of {self.microbatch_size} "
                f"sequence(s) per replica; memory {format_bytes(self.memory_bytes)} "
                "per GPU",
                f"step {self.step_s:.2f} s: compute {b['compute_s']:.2f}, bubble "
                f"{b['bubble_s']:.2f}, tp {b['tp_s']:.2f}, pp {b['pp_s']:.2f}, dp "
                f"{b['dp_s']:.2f} (exposed)",
                f"predicted {self.tokens_per_s:,.0f} tokens/s "
                f"({self.tokens_per_s / self.num_gpus:,.0f} per GPU), MFU {self.mfu:.1%}",
            ]
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def analytic_profile(
    spec: TransformerSpec,
    *,
    dp: int,
    tp: int,
    microbatch_size: int,
    recompute: str,
    sharding: str,
) -> Profile:
    """The model as units for ``memory.cost``: the embedding, each layer and the
    head, with one GPU's share of their state and one micro-batch's activations
    (bytes from the formulas of the module docstring; times are not used).

    A layer keeps ``s*b*h*(34 + 5*a*s/h) / t`` bytes (``none``) or ``34*s*b*h / t``
    (``selective``), its ``2*s*b*h``-byte input among them, or only that input
    (``full``: recomputed, its full activations alive again in its backward). FSDP
    gathers one layer's bf16 weights and prefetches the next (``4*N/(t*L)`` bytes in
    each forward and backward). The head's fp32 logits (``4*s*b*V/t``) exist in its
    forward and its backward.
    """
    L, h, s, a = spec.num_layers, spec.hidden, spec.seq_len, spec.num_heads
    b, V, N = microbatch_size, spec.vocab, spec.num_params
    weights = 2 / (dp if sharding == "fsdp" else 1)  # bf16 weights; bf16 grads alike
    moments = 12 / (1 if sharding == "ddp" else dp)  # fp32 master and AdamW moments
    full = s * b * h * (34 + 5 * a * s / h) / tp
    per_layer = {"none": full, "selective": 34 * s * b * h / tp, "full": 0.0}
    x = 2 * s * b * h  # a layer's bf16 input
    gather = 4 * N / (tp * L) if sharding == "fsdp" else 0
    logits = 4 * s * b * V / tp

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
    saved = full if rec else max(per_layer[recompute] - x, 0.0)
    layer = costs(x, x, saved, saved + gather, gather, saves_input=not rec)
    layer_params = (N - 2 * V * h) / (L * tp)
    return Profile(
        blocks=(
            unit("embed", V * h / tp, costs(8 * s * b, x, 0, x, 0, False), ("K",)),
            *(
                unit(f"layers.{i}", layer_params, layer, ("R",) if rec else ("K",))
                for i in range(L)
            ),
            unit("head", V * h / tp, costs(x, 4, 0, logits, logits, True), ("K",)),
        ),
        batch_size=microbatch_size,
        batch_dependent=False,
        batch_bytes=0,
        construction_peak_bytes=0,
    )


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
    )
    model = CostModel(profile, num_microbatches, 1, slices=1)
    L, v, m = spec.num_layers, stages_per_rank, num_microbatches
    per_rank = L // pp
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


def _ring_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` members."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def evaluate(
    spec: TransformerSpec,
    cluster: Cluster,
    global_batch_tokens: int,
    *,
    dp: int,
    pp: int,
    tp: int,
    microbatch_size: int,
    recompute: str,
    sharding: str,
    stages_per_rank: int = 1,
) -> Layout | None:
    """The predicted step of one layout, or None when it is not a valid layout."""
    n = cluster.num_devices
    dev = cluster.devices[0]
    per_host = sum(1 for d in cluster.devices if d.host == dev.host)
    L, h, s, a = spec.num_layers, spec.hidden, spec.seq_len, spec.num_heads
    if (
        dp * pp * tp != n
        or tp > per_host
        or per_host % tp
        or L % (pp * stages_per_rank)
    ):
        return None
    if a % tp or h % tp:
        return None
    seqs = global_batch_tokens // s
    if seqs % (dp * microbatch_size):
        return None
    m = seqs // (dp * microbatch_size)
    v = stages_per_rank
    if m < pp or (v > 1 and m % pp):
        return None
    b = microbatch_size
    N = spec.num_params
    # ---- memory: the units' analytic costs priced by the one cost model, on the
    # first pipeline rank (the most micro-batches in flight) and the last (the head)
    mem = memory_bytes(
        spec,
        dp=dp,
        pp=pp,
        tp=tp,
        microbatch_size=b,
        recompute=recompute,
        sharding=sharding,
        stages_per_rank=v,
        num_microbatches=m,
    )
    if mem > MEMORY_RESERVE * dev.memory_bytes:
        return None
    layers_here = L / pp
    params_here = N / (tp * pp)
    # ---- time
    tokens_mb = b * s
    layer_flops = 6 * (N - 2 * spec.vocab * h) / L + 12 * h * s  # per token per layer
    flops_mb = tokens_mb * (layer_flops * L + 6 * 2 * spec.vocab * h) / (pp * tp)
    if recompute == "full":
        flops_mb += tokens_mb * layer_flops * L / 3 / (pp * tp)
    elif recompute == "selective":
        flops_mb += tokens_mb * 4 * h * s * L / 3 / (pp * tp) * 0.5
    t_mb = flops_mb / dev.flops_per_s
    intra, inter = cluster.intra, cluster.network
    tp_mb = (
        4
        * layers_here
        * _ring_s(tokens_mb * h * 2, tp, intra.bandwidth_bytes_per_s, intra.latency_s)
    )
    hop = inter if tp * pp > per_host else intra
    pp_mb = 2 * hop.transfer_s(tokens_mb * h * 2 / tp) if pp > 1 else 0.0
    stage_mb = t_mb + tp_mb + pp_mb
    compute_s = m * t_mb
    bubble_s = (pp - 1) / v * stage_mb
    grad_bytes = 2 * params_here
    dp_link = inter if n > per_host else intra
    dp_s = _ring_s(grad_bytes, dp, dp_link.bandwidth_bytes_per_s, dp_link.latency_s)
    if sharding == "fsdp":
        dp_s *= 1.5
    dp_exposed = dp_s * (1 - DP_OVERLAP)
    step = m * stage_mb + bubble_s + dp_exposed
    tokens = seqs * s
    tps = tokens / step
    mfu = tps * spec.flops_per_token() / (n * dev.peak_flops_per_s)
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
        step_s=step,
        tokens_per_s=tps,
        mfu=mfu,
        breakdown={
            "compute_s": compute_s,
            "bubble_s": bubble_s,
            "tp_s": m * tp_mb,
            "pp_s": m * pp_mb,
            "dp_s": dp_exposed,
        },
    )


def plan_layout(
    model: str | TransformerSpec,
    cluster: Cluster,
    global_batch_tokens: int = 4 * 2**20,
) -> Layout:
    """The layout with the most predicted tokens per second that fits memory.

    Raises:
        ValueError: an unknown model, or no layout fits (the message gives the least
            memory per GPU any layout needs).
    """
    spec = MODELS.get(model) if isinstance(model, str) else model
    if spec is None:
        raise ValueError(f"unknown model {model!r}; one of {', '.join(MODELS)}")
    n = cluster.num_devices
    best: Layout | None = None
    for tp in (1, 2, 4, 8, 16):
        for pp in range(1, n // tp + 1):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            for b in (1, 2, 4, 8):
                for rec in ("none", "selective", "full"):
                    for sh in ("zero1", "fsdp"):
                        for v in (1, 2):
                            lay = evaluate(
                                spec,
                                cluster,
                                global_batch_tokens,
                                dp=dp,
                                pp=pp,
                                tp=tp,
                                microbatch_size=b,
                                recompute=rec,
                                sharding=sh,
                                stages_per_rank=v,
                            )
                            if lay and (
                                best is None or lay.tokens_per_s > best.tokens_per_s
                            ):
                                best = lay
    if best is None:
        bigger = Cluster(
            tuple(
                type(d)(d.name, d.host, 2**50, d.flops_per_s, d.peak_flops_per_s)
                for d in cluster.devices
            ),
            cluster.network,
            cluster.intra,
            cluster.links,
            cluster.name,
        )
        least = min(
            (
                lay.memory_bytes
                for tp in (1, 2, 4, 8)
                for pp in range(1, n // tp + 1)
                if n % (tp * pp) == 0
                for lay in [
                    evaluate(
                        spec,
                        bigger,
                        global_batch_tokens,
                        dp=n // (tp * pp),
                        pp=pp,
                        tp=tp,
                        microbatch_size=1,
                        recompute="full",
                        sharding="fsdp",
                    )
                ]
                if lay is not None
            ),
            default=None,
        )
        need = (
            f"; the least any layout needs is {format_bytes(least / MEMORY_RESERVE)} per GPU"
            if least
            else ""
        )
        raise ValueError(
            f"no layout of {spec.name} fits {n} GPUs of "
            f"{format_bytes(cluster.devices[0].memory_bytes)}{need}"
        )
    return best


def is_gpu_cluster(cluster: Cluster) -> bool:
    """A cluster whose devices declare a hardware peak above their sustained rate,
    or have more than 16 GB: the analytic GPU model applies."""
    d = cluster.devices[0]
    return d.peak_flops_per_s > d.flops_per_s or d.memory_bytes > 16 * 10**9
