"""A chunked loss head trains the model's own loss, or is not offered (issue 34, item 1).

Each class of model here does something after its output layer or beside its loss that
the chunked cross entropy of the raw head would drop: a final-logit soft-cap (Gemma 2),
a logit scale (Cohere), a logits-bias buffer (Marian, as converted translation
checkpoints carry; zero in a fresh model, so only the check of what the forward does
catches it), a router's load-balancing loss (Mixtral), a label-smoothed loss (a
model of the test's own). Plans for them get no loss chunks, with the reason in the
plan's notes; a plan given loss chunks anyway stops at its first forward in one line.
Plain causal LMs keep their chunked head.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

tf = pytest.importorskip("transformers")

from memory.errors import MemoryPlanError  # noqa: E402
from memory.head import own_loss_refusal  # noqa: E402
from memory.spec import MemoryPlan  # noqa: E402
from memory.step import PlannedTrainer  # noqa: E402
from memory.unit_profile import plan_units, unit_profiles  # noqa: E402
from memory.units import find_units  # noqa: E402
from tests.hf.models import tiny_lm  # noqa: E402

V, T = 128, 16


def _lm(config_class, model_class, **extra):
    return tiny_lm(config_class, model_class, V, **extra)


def _marian():
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.MarianConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        pad_token_id=0,
        decoder_start_token_id=0,
        max_position_embeddings=64,
    )
    return tf.MarianMTModel(cfg)


class SmoothedLM(nn.Module):
    """A user's LM whose own loss is label-smoothed cross entropy on its head's
    logits: the head is a Linear, the logits leave it unchanged, and still the loss
    is not the head's plain cross entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, V)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.body(self.embed(input_ids))))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, V), labels.reshape(-1), label_smoothing=0.1
            )
        return {"logits": logits, "loss": loss}


REFUSED = {
    "gemma2 soft-cap": (
        lambda: _lm(
            tf.Gemma2Config,
            tf.Gemma2ForCausalLM,
            final_logit_softcapping=30.0,
            head_dim=8,
        ),
        "changes its logits after its head",
    ),
    "cohere logit scale": (
        lambda: _lm(tf.CohereConfig, tf.CohereForCausalLM, logit_scale=0.5),
        "changes its logits after its head",
    ),
    "marian logits bias (zero)": (_marian, "changes its logits after its head"),
    "mixtral router loss": (
        lambda: _lm(
            tf.MixtralConfig,
            tf.MixtralForCausalLM,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
        ),
        "auxiliary loss",
    ),
    "label smoothing": (SmoothedLM, "not the head's plain cross entropy"),
}


def _batch(seed: int = 0, n: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (n, T), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_head_whose_loss_is_not_the_models_is_refused(case: str) -> None:
    make, why = REFUSED[case]
    model = make()
    reason = own_loss_refusal(model, _batch())
    assert reason is not None and why in reason, reason
    assert "\n" not in reason


def test_the_check_changes_no_state_and_passes_plain_lms_with_dropout() -> None:
    """Llama with its config's dropout passes (both forwards draw alike); a model's
    buffers and parameters are as before, and the random state too."""
    model = _lm(tf.LlamaConfig, tf.LlamaForCausalLM, attention_dropout=0.3)
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    assert own_loss_refusal(model, _batch()) is None
    assert torch.equal(torch.random.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())


def test_plans_of_a_soft_capped_model_have_no_loss_chunks_and_say_why() -> None:
    model = _lm(
        tf.Gemma2Config, tf.Gemma2ForCausalLM, final_logit_softcapping=30.0, head_dim=8
    )
    x = _batch(n=4)
    profiles = unit_profiles(model, x)
    assert list(profiles) == [1]
    assert "changes its logits" in (profiles[1].loss_chunk_refusal or "")
    plan, _ = plan_units(profiles, None, disk_budget_bytes=0)
    assert plan.loss_chunks == 1
    assert any(n.startswith("no loss chunks: ") for n in plan.notes), plan.notes
    # the plain LM keeps its chunk options
    llama = _lm(tf.LlamaConfig, tf.LlamaForCausalLM)
    chunked = unit_profiles(llama, x)
    assert list(chunked) == [1, 4, 16]
    assert chunked[1].loss_chunk_refusal is None


@pytest.mark.parametrize("case", ["gemma2 soft-cap", "mixtral router loss"])
def test_a_plan_given_loss_chunks_anyway_stops_at_its_first_forward(case) -> None:
    make, why = REFUSED[case]
    model = make()
    x = _batch(n=4)
    units = find_units(model, x)
    plain = MemoryPlan.plain([u.name for u in units])
    plan = MemoryPlan(plain.blocks, loss_chunks=4)
    with PlannedTrainer(model, plan, units=units) as tr:
        with pytest.raises(MemoryPlanError, match=why) as e:
            tr.backward(x, None)
    assert "plan with loss_chunks=1" in str(e.value) and "\n" not in str(e.value)


def softcapped() -> tuple[nn.Module, tuple[dict, None]]:
    """A ``module:function`` factory: the soft-capped LM and its batch."""
    make, _ = REFUSED["gemma2 soft-cap"]
    return make(), (_batch(n=4), None)


def test_the_runtime_probe_steps_a_refused_model_without_loss_chunks() -> None:
    """The probe's plan with every mechanism tries two loss chunks first; on a model
    whose loss is not the head's it goes on without them instead of failing."""
    from memory.step import runtime_probe

    out = runtime_probe("tests.memory.test_own_loss:softcapped", {})
    assert out["file_bytes"] >= 0
