"""HeteroFL and FedRolex: every node trains a width-scaled sub-model that fits it.

The baselines a memory-aware federation is compared with (``--compare heterofl,
fedrolex``): Diao et al., "HeteroFL: Computation and Communication Efficient Federated
Learning for Heterogeneous Clients" (ICLR 2021) and Alam et al., "FedRolex:
Model-Heterogeneous Federated Learning with Rolling Sub-Model Extraction" (NeurIPS
2022). The sub-models are ``workloads.width``'s (``NAME@wR``).

- **Sizing.** A node gets the largest level of ``workloads.width.levels`` (1, 1/2, 1/4,
  1/8, 1/16; a GPT's levels keep a whole number of heads) whose sub-model's *plain*
  training step, by the memory model plus the runtime reserve, fits its budget: the
  test ``exclude`` applies to the whole model, applied to each sub-model. Plain,
  because both papers train their sub-models plainly; giving them fleetfit's plans
  (recompute, offload, streaming) would make them a hybrid with fleetfit. A node
  below the smallest level gets ``none``, as in ``exclude``.
- **Which indices.** ``heterofl``: the first ones of every hidden axis, every round.
  ``fedrolex``: a window that starts ``round - 1`` units further on (modulo each
  axis's units) and wraps around, so over rounds every index is trained.
- **Wire.** The server sends the sliced state and names the sub-model's workload
  (``NAME@wR``) in the instruction's shape, with a ``full`` assignment and the
  sub-model's plain plan: the client trains "the whole model" it is given, and needs
  nothing of this module. The reply carries the sliced arrays back; the server
  rebuilds the index maps from the assignment (ratio and round), nothing index-like
  travels.
- **Aggregation.** ``expand`` puts a reply's arrays back into full-size tensors
  (the global values elsewhere) with a coverage mask per key; ``weighted_average``
  then averages every element over the updates that covered it, weighted by example
  count, and keeps the global value where nobody did (HeteroFL's rule, in the same
  per-key averaging every strategy uses).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch

from server.assign import Assigner, Assignment
from wire.facts import NodeFacts
from workloads import Workload, get_workload, width

log = logging.getLogger(__name__)

STRATEGIES = ("heterofl", "fedrolex")

IndexMaps = dict[str, tuple[torch.Tensor | None, ...]]


def sub_name(base: str, ratio: float) -> str:
    """The workload name of ``base``'s sub-model at ``ratio`` (``NAME@wR``)."""
    return base if ratio == 1.0 else f"{base}@w{ratio:g}"


class SubmodelAssigner:
    """Assignments of ``heterofl`` (static indices) or ``fedrolex`` (rolling)."""

    def __init__(
        self,
        workload: Workload,
        *,
        strategy: str,
        local_steps: int,
        runtime_reserve_bytes: int,
        train_time_s: float,
        proximal_mu: float = 0.0,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r}: choose {' or '.join(STRATEGIES)}")
        base = workload.name
        if workload.kind == "custom" or not width.supported(base):
            raise ValueError(
                f"{strategy} cuts built-in workloads into width-scaled sub-models "
                f"({', '.join(width.CHAIN_MODELS)} and the GPTs); {workload.name} is "
                "not one"
            )
        self.strategy = strategy
        self.rolling = strategy == "fedrolex"
        self.workload = workload
        self.base = base
        self.levels = width.levels(base)
        self.spec = width.width_spec(base)
        self.blocks: list = []  # no windows: every assignment trains its sub-model
        self._kw = dict(
            local_steps=local_steps,
            runtime_reserve_bytes=runtime_reserve_bytes,
            train_time_s=train_time_s,
            strategy="exclude",
            proximal_mu=proximal_mu,  # FedProx's w0 copy counts in the plain step
        )
        self._levels: dict[float, Assigner] = {}
        self._maps: dict[tuple[float, int], IndexMaps] = {}

    def sub_workload(self, ratio: float) -> Workload:
        """The sub-model's workload, in the run's batch shape."""
        wl = self.workload
        return get_workload(sub_name(self.base, ratio)).with_shape(
            wl.batch_size, wl.seq_len if wl.kind == "lm" else None
        )

    def _level(self, ratio: float) -> Assigner:
        if ratio not in self._levels:
            wl = self.sub_workload(ratio)
            self._levels[ratio] = Assigner(wl, wl.make_model(0), **self._kw)  # type: ignore[arg-type]
        return self._levels[ratio]

    def need_bytes(self, ratio: float) -> int:
        """The budget that trains the sub-model at ``ratio`` plainly (memory model
        plus the runtime reserve)."""
        return self._level(ratio).plain_need_bytes()

    def level_for(self, budget_bytes: int) -> float | None:
        """The largest level whose sub-model trains plainly in ``budget_bytes``
        (None: not even the smallest)."""
        for r in self.levels:
            if self.need_bytes(r) <= budget_bytes:
                return r
        return None

    def roll(self, server_round: int) -> int:
        """The window offset of ``server_round``: ``round - 1`` units (FedRolex),
        0 (HeteroFL); taken modulo each axis's units."""
        return server_round - 1 if self.rolling else 0

    def assign(self, facts: NodeFacts, server_round: int) -> Assignment:
        budget = facts.budget_bytes
        ratio: float | None = 1.0
        if budget is not None:
            ratio = self.level_for(budget)
        if ratio is None:
            smallest = self.levels[-1]
            need = self.need_bytes(smallest)
            return Assignment(
                "none",
                budget,
                facts.disk_budget_bytes,
                None,
                None,
                0,
                min_budget_bytes=need,
                reason=(
                    f"excluded: even the smallest sub-model ({self.base} at width "
                    f"{smallest:g}) needs {need} bytes to train plainly, more than the "
                    f"memory budget of {budget} bytes"
                ),
            )
        a = self._level(ratio).assign(facts, server_round)
        assert a.kind == "full", a  # the level was chosen to fit
        return replace(
            a,
            width=ratio,
            roll=self.roll(server_round),
            workload=sub_name(self.base, ratio),
        )

    def maps(self, a: Assignment) -> IndexMaps:
        """The index maps of a sub-model assignment (cached by ratio and offset)."""
        assert a.width is not None
        key = (a.width, a.roll)
        if key not in self._maps:
            self._maps[key] = width.index_maps(self.spec, a.width, a.roll)
        return self._maps[key]

    def sliced(
        self, a: Assignment, state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """What a node assigned ``a`` is sent: ``state`` sliced to its sub-model."""
        return width.slice_state(state, self.maps(a))


def expand(
    sub: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    maps: Mapping[str, tuple[torch.Tensor | None, ...]],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A sub-model's state put back into the full model's shapes.

    Returns ``(state, coverage)``: every key of ``sub`` as a full-size tensor (the
    reference's values where the sub-model has no entry) and, for every key the
    sub-model covers only partly, a boolean mask of the entries it covers (a key it
    covers whole has no mask: it is averaged as any update's).

    Raises:
        ValueError: a key that is not the model's, or a shape that is not the
            sub-model's (the reply was not trained on the sub-model it was sent).
    """
    state: dict[str, torch.Tensor] = {}
    coverage: dict[str, torch.Tensor] = {}
    for key, got in sub.items():
        if key not in reference or key not in maps:
            raise ValueError(f"unexpected key {key!r}")
        ref = reference[key]
        idx = maps[key]
        want = tuple(
            n if i is None else len(i) for n, i in zip(ref.shape, idx, strict=True)
        )
        if tuple(got.shape) != want:
            raise ValueError(
                f"{key}: shape {tuple(got.shape)}, the sub-model's is {want}"
            )
        if got.dtype != ref.dtype:
            raise ValueError(f"{key}: dtype {got.dtype} != {ref.dtype}")
        if all(i is None for i in idx):
            state[key] = got
            continue
        where = width.full_indices(idx, ref.shape)
        full = ref.clone()
        full[where] = got
        state[key] = full
        if any(i is not None and len(i) < n for n, i in zip(ref.shape, idx)):
            mask = torch.zeros(ref.shape, dtype=torch.bool)
            mask[where] = True
            coverage[key] = mask
    return state, coverage
