"""The architecture zoo (issue 34; ``tests/hf/zoo.py``, ``benchmarks/zoo.py``).

Each class is built from a shrunk config, trained 2 steps under the smallest plan and
a plan at half of plain training's predicted peak, through the public API
(``memory.plan_training`` then ``TrainingPlan.trainer``), and compared before every
optimizer step with plain torch from the same weights: losses within 1e-5 relative,
every parameter's gradient within ``||g_plan - g_plain|| / ||g_plain|| <= 1e-5``.

- ``pytest -m zoo``: every class of the zoo (minutes to hours; in no CI tier).
- The default tier runs ``SUBSET``, chosen by this rule: one class for each mechanism
  and defect class the issue names for the zoo (a post-head transform, an auxiliary
  loss and mixture of experts, layers in nested containers, encoder-decoder, tied
  embeddings, BatchNorm, vision), the cheapest in the census where several have it
  (one class may stand for two), and one per defect the zoo found and fixed, within
  60 s in all.
  Classes that fail today are strict xfails naming the defect: when it is fixed the
  xfail turns into an error, and the mark goes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.hf import zoo  # noqa: E402

SUBSET = {
    # post-head transform: a final-logit soft-cap (the chunked head must step aside)
    "Gemma2ForCausalLM": None,
    # auxiliary loss and mixture of experts: Mixtral's router loss, grouped experts
    "MixtralForCausalLM": None,
    # layers in nested containers: PoolFormer's stages are a ModuleList of
    # ModuleLists of blocks, unpacked in its forward
    "PoolFormerForImageClassification": None,
    # encoder-decoder and tied embeddings: Bart ties its shared embedding, the
    # encoder's and decoder's inputs and the LM head (cheaper than GPT-2 for ties)
    "BartForConditionalGeneration": None,
    # tied embeddings under streaming, the head named before its embedding (a defect
    # the zoo found: PlannedTrainer.gradients() lost the head's gradient)
    "XLMRobertaForMaskedLM": None,
    # BatchNorm in training mode: no micro-batches (a one-item micro-batch has no
    # statistics); MobileNetV2 is the cheapest BatchNorm class that passes (ResNet
    # passes too, in 31 s; EfficientNet and MobileNetV1 fail: docs/memory.md)
    "MobileNetV2ForImageClassification": None,
    # vision
    "ViTForImageClassification": None,
}


def _check(name: str) -> None:
    res = zoo.run(zoo.by_name(name))
    if res.status == "skipped":
        pytest.skip(res.reason)
    assert res.status in ("passed", "refused"), f"{name} {res.status}: {res.reason}"
    if res.status == "refused":
        assert res.reason and "\n" not in res.reason


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=why)) if why else n
        for n, why in SUBSET.items()
    ],
)
def test_zoo_subset(name: str) -> None:
    _check(name)


@pytest.mark.zoo
@pytest.mark.parametrize("name", [e.name for e in zoo.entries()])
def test_zoo(name: str) -> None:
    _check(name)


def test_the_enumeration_covers_the_four_tasks_once_each() -> None:
    """Every class of the four auto mappings is in the zoo, once, and the subset is
    drawn from it; every skip names its reason in one line."""
    from transformers.models.auto import modeling_auto

    entries = zoo.entries()
    names = [e.name for e in entries]
    assert len(names) == len(set(names))
    for attr in zoo._MAPPINGS.values():
        for v in getattr(modeling_auto, attr).values():
            for n in (v,) if isinstance(v, str) else v:
                assert n in names
    assert set(SUBSET) <= set(names)
    assert {e.task for e in entries} == set(zoo.TASKS)
    for name, why in zoo.SKIPS.items():
        assert name in names and why and "\n" not in why


def test_shrinking_keeps_every_kind_of_layer() -> None:
    """The rule cuts layers to the first ones plus the first of every other kind,
    with the per-layer lists cut alike (a hybrid model keeps its attention layers)."""
    attrs = {
        "num_hidden_layers": 6,
        "layer_types": ["conv", "conv", "conv", "attention", "conv", "attention"],
        "widths": [8, 8, 8, 16, 8, 16],
        "vocab_size": 6,
    }
    keys, keep = zoo._layer_indices(attrs, 6)
    assert set(keys) == {"layer_types", "widths"}
    assert keep == [0, 1, 3]
