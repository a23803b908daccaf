"""Pipeline stages of a transformers causal LM, cut at its units (``memory.units``).

A transformers model does not run as a chain of children (its forward builds position
ids, a causal mask and rotary tables between them), so its stages are written by hand
(manual ``PipelineStage`` modules, DESIGN.md) from the forward's steps, one step per
unit, for the two families whose forward is known here:

- GPT-2 (``transformer.wte``, ``transformer.wpe``, ``transformer.h.*``,
  ``transformer.ln_f``, ``lm_head``; the head tied to ``wte``);
- Llama and its kin (``model.embed_tokens``, ``model.layers.*``, ``model.norm``,
  ``lm_head``; rotary position embeddings from ``model.rotary_emb``).

A stage owns a contiguous run of units; the first takes ``input_ids``, every other the
previous stage's hidden states, and the last returns the logits, which the schedule's
loss turns into the model's own causal-LM loss (``model.loss_function``). Every stage
rebuilds what its layers need besides the hidden states (position ids, causal mask,
rotary tables): none of it carries a gradient. The stage module has the model's own
top-level children, the units it does not own replaced by ``nn.Identity``, so its
parameter names are those of the unsplit model. ``check_stages`` runs the stages in
turn and insists that their logits equal the model's, bit for bit.

Tied weights (GPT-2's ``wte`` and ``lm_head``): a stage holding either keeps the
weight, so the first and the last stage each hold a copy; ``TiedWeights.sum_grads``
sums the copies' gradients after backward (an all-reduce between the ranks holding
them), so every copy steps identically and its gradient is the unsplit model's.

Inside a stage the device's memory plan applies per unit (``memory.apply``):
recompute and activation offload. Streaming is refused: it updates a unit inside its
backward, before the pipeline has summed tied gradients or averaged replicas.

Example:
    >>> stage = build_stage(model, ["transformer.h.2", "transformer.ln_f", "lm_head"])  # +SKIP
    >>> logits = stage.module(hidden)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memory.spec import MemoryPlan
from partition.plans import PartitionPlan

Step = Callable[[nn.Module, torch.Tensor, dict[str, Any]], torch.Tensor]


class StageError(ValueError):
    """A model, batch or plan the transformers stages cannot run; says which and why."""


# --------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """Where a causal LM keeps its parts (module paths) and how its forward runs."""

    name: str
    embed: tuple[str, ...]  # units before the layers, in forward order
    layers: str  # the ModuleList of layers
    norm: str
    head: str

    def units(self, model: nn.Module) -> list[str]:
        """The unit names in forward order (those ``memory.units`` finds)."""
        n = _num_layers(model, self)
        return [
            *self.embed,
            *(f"{self.layers}.{i}" for i in range(n)),
            self.norm,
            self.head,
        ]


GPT2 = Family(
    "gpt2",
    ("transformer.wte", "transformer.wpe"),
    "transformer.h",
    "transformer.ln_f",
    "lm_head",
)
LLAMA = Family(
    "llama", ("model.embed_tokens",), "model.layers", "model.norm", "lm_head"
)
FAMILIES = (GPT2, LLAMA)


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def family_of(model: nn.Module) -> Family:
    """The family whose parts ``model`` has.

    Raises:
        StageError: neither GPT-2's nor Llama's layout.
    """
    for fam in FAMILIES:
        parts = [*fam.embed, fam.layers, fam.norm, fam.head]
        if fam is LLAMA:
            parts.append("model.rotary_emb")
        if all(_has(model, p) for p in parts) and hasattr(model, "config"):
            return fam
    raise StageError(
        f"{type(model).__name__} is not a transformers causal LM laid out as GPT-2 "
        "(transformer.wte/wpe/h/ln_f, lm_head) or Llama (model.embed_tokens/layers/"
        "norm/rotary_emb, lm_head); the pipeline runtime cuts only those into "
        "stages (other models train with `fleetfit memory` and in federations)"
    )


def require_causal_lm(workload: Any) -> None:
    """Refuse, before planning, a ``module:function`` workload whose model or batch
    the stages cannot run (``family_of``, ``split_batch``).

    Raises:
        StageError: one line naming the workload and why.
    """
    assert workload.example is not None, f"{workload.name} has no example batch"
    inputs, targets, loss_fn = workload.example
    try:
        family_of(workload.make_model(0))
        split_batch(inputs, targets)
        if loss_fn is not None:
            raise StageError(
                "it brings its own loss_fn; pipelined transformers models train on "
                "their own causal-LM loss: put labels in the inputs and return None"
            )
    except StageError as e:
        raise StageError(f"workload {workload.name}: {e}") from None


def _context(model: nn.Module, fam: Family, h: torch.Tensor) -> dict[str, Any]:
    """What every layer takes besides the hidden states, rebuilt from their shape as
    the model's own forward builds it (no cache, no padding mask)."""
    from transformers.masking_utils import create_causal_mask

    pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=h,
        attention_mask=None,
        cache=None,
        position_ids=pos,
    )
    ctx: dict[str, Any] = {"position_ids": pos, "attention_mask": mask}
    if fam is LLAMA:
        ctx["position_embeddings"] = model.get_submodule("model.rotary_emb")(
            h, position_ids=pos
        )
    return ctx


def _num_layers(model: nn.Module, fam: Family) -> int:
    return len(list(model.get_submodule(fam.layers).children()))


def _unit(name: str, *, layer: bool = False) -> Step:
    """The step that calls unit ``name`` on the hidden states (a layer also takes
    the context: mask, position ids, rotary tables)."""

    def step(m: nn.Module, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        if layer:
            return m.get_submodule(name)(h, use_cache=False, **ctx)
        return m.get_submodule(name)(h)

    return step


def _gpt2_positions(m: nn.Module, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    wpe = m.get_submodule("transformer.wpe")
    return m.get_submodule("transformer.drop")(h + wpe(ctx["position_ids"]))


def _steps(model: nn.Module, fam: Family) -> list[tuple[str, Step]]:
    """The forward as one step per unit; glue between units belongs to the unit before
    it (GPT-2's dropout after the position embedding)."""
    steps: list[tuple[str, Step]] = [(fam.embed[0], _unit(fam.embed[0]))]
    if fam is GPT2:
        steps.append(("transformer.wpe", _gpt2_positions))
    for i in range(_num_layers(model, fam)):
        name = f"{fam.layers}.{i}"
        steps.append((name, _unit(name, layer=True)))
    steps += [(fam.norm, _unit(fam.norm)), (fam.head, _unit(fam.head))]
    return steps


# --------------------------------------------------------------------------- stages
class CausalLMStage(nn.Module):
    """One stage: the model's top-level children, units outside ``owned`` replaced by
    ``nn.Identity``; ``forward`` runs the owned units' steps."""

    def __init__(self, model: nn.Module, owned: Sequence[str]) -> None:
        super().__init__()
        fam = family_of(model)
        steps = _steps(model, fam)
        names = [n for n, _ in steps]
        unknown = [n for n in owned if n not in names]
        if unknown:
            raise StageError(
                f"the plan names units {unknown[:3]} that {type(model).__name__} does "
                f"not have; its units are {names[:3]}...{names[-2:]}"
            )
        idx = [names.index(n) for n in owned]
        if not idx or idx != list(range(idx[0], idx[0] + len(idx))):
            raise StageError(
                f"a stage must own a contiguous run of units in forward order, got "
                f"{list(owned)}"
            )
        self.family = fam
        self.config: Any = model.config
        self.first = idx[0] == 0
        self.last = idx[-1] == len(names) - 1
        self._steps = steps[idx[0] : idx[-1] + 1]
        loss_function: Any = model.loss_function  # transformers' causal-LM loss
        self._loss_function: Callable[..., torch.Tensor] = loss_function
        for child_name, child in model.named_children():
            self.add_module(child_name, child)
        for n in names:
            if n not in owned:
                parent, _, leaf = n.rpartition(".")
                setattr(
                    self.get_submodule(parent) if parent else self, leaf, nn.Identity()
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx: dict[str, Any] = {}
        h = x
        for name, step in self._steps:
            if "attention_mask" not in ctx and name.startswith(
                self.family.layers + "."
            ):
                ctx = _context(self, self.family, h)
            elif "position_ids" not in ctx and name == "transformer.wpe":
                pos = torch.arange(h.shape[1], device=h.device)
                ctx = {"position_ids": pos.unsqueeze(0)}
            h = step(self, h, ctx)
        return h

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's own causal-LM loss (labels shifted inside, -100 ignored)."""
        return self._loss_function(
            logits=logits, labels=labels, vocab_size=self.config.vocab_size
        )


@dataclass
class BuiltStage:
    """A stage module and the memory plan applied to its units (``end_step()`` after
    each backward; None when every unit is kept)."""

    module: CausalLMStage
    applied: Any = None

    def end_step(self) -> None:
        if self.applied is not None:
            self.applied.end_step()


def build_stage(
    model: nn.Module,
    owned: Sequence[str],
    memory: MemoryPlan | None = None,
    *,
    offload_dir: str | None = None,
) -> BuiltStage:
    """The stage of ``model`` owning ``owned``, its units under ``memory``'s plan.

    Raises:
        StageError: units the model does not have or that are not contiguous, or a
            plan that streams a unit (not composable with the pipeline's gradient
            all-reduces).
    """
    from memory.apply import AppliedPlan
    from memory.blocks import Block
    from memory.units import no_kv_cache

    no_kv_cache(model)
    stage = CausalLMStage(model, owned)
    if memory is None or all(
        b.activations == "keep" and b.state == "resident" and not b.offload_inputs
        for b in memory.blocks
    ):
        return BuiltStage(stage)
    streamed = [b.name for b in memory.blocks if b.state == "stream"]
    if streamed:
        raise StageError(
            f"units {streamed[:3]} are planned to stream their parameters from disk; "
            "streaming updates a unit inside its backward, before the pipeline sums "
            "tied gradients and averages replicas, so a pipelined stage takes keep, "
            "recompute and offload plans only: give this stage more memory, or run the "
            "model on one device (`fleetfit memory run`)"
        )
    units = [Block(n, stage.get_submodule(n)) for n in owned]
    return BuiltStage(stage, AppliedPlan(units, memory, offload_dir=offload_dir))


@torch.no_grad()
def check_stages(
    model: nn.Module, cuts: Sequence[Sequence[str]], input_ids: torch.Tensor
) -> None:
    """Run stages of copies of ``model`` in turn; insist their logits equal the
    model's own, bit for bit.

    Raises:
        StageError: they differ (the family's forward is not the one written here).
    """
    import copy

    was = model.training
    model.eval()
    try:
        want = model(input_ids=input_ids).logits
        h = input_ids
        for owned in cuts:
            h = CausalLMStage(copy.deepcopy(model), owned).eval()(h)
    finally:
        model.train(was)
    if h.shape != want.shape or not torch.equal(h, want):
        raise StageError(
            f"{type(model).__name__}'s stages do not reproduce its forward (largest "
            f"difference {float((h - want).abs().max()):.3g}); this transformers "
            "version's forward differs from the one the stages are written for"
        )


# --------------------------------------------------------------------------- batches
def split_batch(inputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of a causal-LM workload's batch.

    Takes ``inputs`` a dict with ``input_ids``, and ``labels`` (the model's own loss)
    or ``targets`` given, and optionally an ``attention_mask`` of ones.

    Raises:
        StageError: another form, or a padding mask (not carried between stages).
    """
    if not isinstance(inputs, dict) or "input_ids" not in inputs:
        raise StageError(
            "a pipelined transformers workload's inputs must be a dict with "
            "input_ids (and labels, for the model's own loss)"
        )
    extra = sorted(set(inputs) - {"input_ids", "labels", "attention_mask"})
    if extra:
        raise StageError(
            f"inputs {extra} are not carried between pipeline stages; give input_ids, "
            "labels and at most an attention_mask of ones"
        )
    mask = inputs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise StageError(
            "the attention_mask pads some tokens; pipeline stages rebuild a plain "
            "causal mask, so pack the batch without padding (or mask the labels with "
            "-100 instead)"
        )
    labels = inputs.get("labels", targets)
    if labels is None:
        raise StageError("the batch has no labels: give inputs['labels']")
    return inputs["input_ids"], labels


# --------------------------------------------------------------------------- tied
@dataclass(frozen=True)
class TiedGroup:
    """Parameter names of the unsplit model that are one tensor, and the pipeline
    ranks whose stages hold any of them."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]


def tied_groups(model: nn.Module, plan: PartitionPlan) -> list[TiedGroup]:
    """The tied parameters of ``model`` that ``plan``'s stages hold, in a fixed order
    (every process computes the same list)."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    groups = []
    for names in by_id.values():
        if len(names) < 2:
            continue
        ranks = sorted(
            {s.rank for s in plan.stages if any(_under(n, s.blocks) for n in names)}
        )
        groups.append(TiedGroup(tuple(names), tuple(ranks)))
    return sorted(groups, key=lambda g: g.names)


def _under(param: str, blocks: Sequence[str]) -> bool:
    return any(param.startswith(b + ".") for b in blocks)


class TiedWeights:
    """Sums the gradients of tied copies across the stages and ranks holding them.

    Build it in every process in the same order (it creates process groups)."""

    def __init__(
        self, groups: list[TiedGroup], num_ranks: int, num_replicas: int, rank: int
    ) -> None:
        import torch.distributed as dist

        self.groups = groups
        self._pg: list[Any] = []
        for g in groups:
            mine = None
            if len(g.ranks) > 1:
                for rep in range(num_replicas):
                    pg = dist.new_group([rep * num_ranks + r for r in g.ranks])
                    if rank // num_ranks == rep:
                        mine = pg
            self._pg.append(mine)

    def sum_grads(self, modules: Sequence[nn.Module]) -> None:
        """After backward: every local copy's gradient becomes the sum over all
        copies (this rank's stages, then an all-reduce over the holding ranks)."""
        import torch.distributed as dist

        for g, pg in zip(self.groups, self._pg):
            copies: dict[int, nn.Parameter] = {}
            for mod in modules:
                params = dict(mod.named_parameters(remove_duplicate=False))
                for n in g.names:
                    if n in params:
                        copies[id(params[n])] = params[n]
            if not copies:
                continue
            ps = list(copies.values())
            if len(ps) == 1 and pg is None:
                continue  # one copy: autograd already summed its uses
            total = torch.zeros_like(ps[0])
            for p in ps:
                if p.grad is not None:
                    total += p.grad
            if pg is not None:
                dist.all_reduce(total, group=pg)
            for p in ps:
                p.grad = total.clone()
