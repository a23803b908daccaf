"""The architecture zoo: every causal-LM, masked-LM, sequence-to-sequence and
image-classification model class the installed transformers ships, built from a
shrunk config (random weights, float32, eager attention, no dropout, nothing
downloaded), with a batch whose loss is the model's own (issue 34).

``entries()`` enumerates the classes from transformers' auto mappings, one entry per
model class (a class several mappings name is taken once, as the first task below
that names it: sequence-to-sequence, image classification, masked LM, causal LM).
``skip_reason(entry)`` says why a class leaves the denominator (None: it is in it);
``build(entry)`` returns ``(model, inputs)``; ``run(entry)`` trains it plainly and
under plans (``benchmarks/zoo.py``, ``tests/memory/test_zoo.py``).

Shrinking is one rule over config attributes (``shrink``), applied to every nested
sub-config too; ``OVERRIDES`` holds the few per-class changes where the rule cannot
work, each with the reason.
"""

from __future__ import annotations

import copy
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TASKS = ("seq2seq", "image", "masked", "causal")
_MAPPINGS = {
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
}

# the batch: B items of T tokens (seq2seq: T source, T // 2 target), or B images
B, T = 8, 64
IMAGE = 32
LABELS = 3

# the rule's sizes
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
FFN, LAYERS, VOCAB, POSITIONS = 128, 2, 256, 128
EXPERTS, TOP_K = 4, 2

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-7  # max abs where ||g_plain|| < SMALL_NORM
SMALL_NORM = 1e-6
STEPS = 2


@dataclass(frozen=True)
class Entry:
    """One model class: its name, the task it is trained on, its model type."""

    name: str
    task: str
    model_type: str


def _mapping(task: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, _MAPPINGS[task]))


def entries() -> list[Entry]:
    """Every model class of the four mappings, once, sorted by task then name."""
    seen: dict[str, Entry] = {}
    for task in TASKS:
        for model_type, names in _mapping(task).items():
            for name in (names,) if isinstance(names, str) else names:
                if name not in seen:
                    seen[name] = Entry(name, task, model_type)
    return sorted(seen.values(), key=lambda e: (TASKS.index(e.task), e.name))


def by_name(name: str) -> Entry:
    for e in entries():
        if e.name == name:
            return e
    raise ValueError(f"{name!r} is no model class of the zoo's four mappings")


# --- what leaves the denominator --------------------------------------------------

# A class is skipped only with a reason of these kinds: it needs a download, a
# package that is not installed (timm, torchvision, a tokenizer or kernel backend),
# or it is a multimodal/audio class (its inputs are not a plain batch of the task).
SKIPS: dict[str, str] = {
    "TimmWrapperForImageClassification": "needs timm (not installed)",
    "ShieldGemma2ForImageClassification": (
        "multimodal: a Gemma 3 vision-language model scoring images, not a plain "
        "image classifier"
    ),
    "MusicgenForCausalLM": "audio: a decoder over audio codebooks (inputs are codes "
    "per codebook, not a token batch)",
    "MusicgenMelodyForCausalLM": "audio: a decoder over audio codebooks",
    "MoshiForCausalLM": "audio: a speech-text model over audio codebooks",
    "SeamlessM4TForTextToText": "multimodal: a speech/text translation family "
    "(text-to-text head of a speech model)",
    "SeamlessM4Tv2ForTextToText": "multimodal: a speech/text translation family "
    "(text-to-text head of a speech model)",
}

# config attributes that make a class multimodal (unless it is the task's input)
_MODAL = ("vision_config", "audio_config", "speech_config", "vq_config")
# sub-config classes that make it multimodal, whatever the attribute's name
_MODAL_CLASS = re.compile(r"Vision|Audio|Speech|Acoustic|Whisper|VQ")


def skip_reason(entry: Entry) -> str | None:
    """Why ``entry`` leaves the denominator (one line), or None."""
    if entry.name in SKIPS:
        return SKIPS[entry.name]
    if entry.task != "image":
        try:
            cfg = _config_class(entry)()
        except Exception:
            return None  # a build failure, counted
        modal = [
            a
            for a, v in vars(cfg).items()
            if a in _MODAL or (_is_config(v) and _MODAL_CLASS.search(type(v).__name__))
        ]
        if modal:
            return (
                f"multimodal: its config has {', '.join(sorted(modal))}; not a plain "
                f"{_TASK_WORDS[entry.task]} batch"
            )
    return None


_TASK_WORDS = {
    "seq2seq": "sequence-to-sequence",
    "image": "image-classification",
    "masked": "masked-LM",
    "causal": "causal-LM",
}


# --- shrinking ----------------------------------------------------------------------

_HIDDEN = {
    "hidden_size",
    "d_model",
    "n_embd",
    "n_embed",
    "d_embed",
    "embed_dim",
    "embedding_size",
    "word_embed_proj_dim",
    "dim",
    "hidden_dim",
    "model_dim",
    "d_latents",
}
_LAYERS = {
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "num_self_attends_per_block",
}
_HEADS = {
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_decoder_attention_heads",
}
_KV_HEADS = {
    "num_key_value_heads",
    "n_kv_heads",
    "num_kv_heads",
    "multi_query_group_num",
}
_FFN = {
    "intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "d_ff",
    "n_inner",
    "ffn_hidden_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "expert_intermediate_size",
    "mlp_dim",
}
_EXPERTS = {
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
}
_TOP_K = {
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_topk",
    "top_k",
    "moe_k",
    "num_selected_experts",
}
_POSITIONS = {
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_seq_len",
    "max_sequence_length",
}
_HEAD_DIM = {"head_dim", "d_kv", "attention_head_size", "kv_channels", "v_head_dim"}
# multi-head latent attention (DeepSeek and its descendants): its ranks and head parts
_MLA = {
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
}
_GROUPS = {"n_group", "topk_group", "num_expert_group"}  # grouped routing: one group

# per-class changes the rule cannot make, each with why
_SWIN = dict(  # two stages of windows of 4 patches on a 32-pixel image
    embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4
)
OVERRIDES: dict[str, dict[str, Any]] = {
    "SwinForImageClassification": _SWIN,
    "Swinv2ForImageClassification": _SWIN,
    "DonutSwinForImageClassification": _SWIN,
    # hidden_dim is the last conv's width, derived from the width coefficient
    "EfficientNetForImageClassification": dict(hidden_dim=2560),
    # its stem downsamples by 16 whatever patch_size says
    "LevitForImageClassification": dict(image_size=64, patch_size=16),
    "LevitForImageClassificationWithTeacher": dict(image_size=64, patch_size=16),
    "MobileViTV2ForImageClassification": dict(image_size=64),  # 5 halvings, 2x2 patches
    # query/key channels are the preprocessed inputs' (261, 322): one head divides them
    "PerceiverForImageClassificationFourier": dict(num_cross_attention_heads=1),
    "PerceiverForImageClassificationConvProcessing": dict(num_cross_attention_heads=1),
    # its decoder has one query per position: the sequence is that long
    "PerceiverForMaskedLM": dict(max_position_embeddings=T),
    # axial position embeddings factor the sequence and the width; chunks divide T
    "ReformerForMaskedLM": dict(
        axial_pos_shape=[8, 8],  # 8 x 8 = T
        axial_pos_embds_dim=[32, 32],
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=4,
    ),
    "ReformerModelWithLMHead": dict(
        axial_pos_shape=[8, 8],  # 8 x 8 = T
        axial_pos_embds_dim=[32, 32],
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=4,
        is_decoder=True,  # its LM head requires it
    ),
    "Mamba2ForCausalLM": dict(num_heads=8),  # num_heads * head_dim = expand * hidden
    "Lfm2MoeForCausalLM": dict(  # layer_types is None by default
        num_hidden_layers=2, layer_types=["conv", "full_attention"]
    ),
    # its shared transformer is tied across hybrid layers: two of them at least
    "ZambaForCausalLM": dict(
        num_hidden_layers=6, attn_layer_period=3, attn_layer_offset=2, _keep_layers=True
    ),
    # its to_dict() doubles the layers (attention and MLP entries) that its __init__
    # takes as pairs: the rule's layer cut cannot be read from it
    "DoryForCausalLM": dict(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        _keep_layers=True,
    ),
    # ESM's default leaves the vocabulary and its special tokens to the checkpoint
    "EsmForMaskedLM": dict(vocab_size=33, pad_token_id=1, mask_token_id=32),
}


def _is_config(v: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(v, PretrainedConfig)


def _attr(cfg: Any, key: str) -> Any:
    try:
        return getattr(cfg, key, None)
    except Exception:  # per-layer attributes that refuse a global read (Gemma 4)
        return None


def _layer_indices(attrs: dict[str, Any], layers: int) -> tuple[list[str], list[int]]:
    """The per-layer lists of a config (as long as its layer count) and the layers
    to keep: the first ``LAYERS``, plus the first of every other kind of layer those
    lists name (so that every kind of layer stays: attention and recurrent, sliding
    and full, dense and MoE)."""
    keys = [
        k
        for k, v in attrs.items()
        if isinstance(v, list) and len(v) == layers and not _is_config(v)
    ]
    kinds: dict[str, int] = {}
    for i in range(layers):
        kinds.setdefault(repr([attrs[k][i] for k in keys]), i)
    keep = sorted(set(range(min(LAYERS, layers))) | set(kinds.values()))
    return keys, keep


def _scalar(key: str, value: Any, heads_before: Any) -> Any:
    """The rule for one attribute's value; ``value`` itself where it keeps it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and (
        "dropout" in key or "pdrop" in key or "drop_path" in key or key == "layerdrop"
    ):
        return 0.0
    if value is None:  # defaults some configs leave to be derived, or broken
        if key == "head_dim":
            return HEAD_DIM
        if key in _KV_HEADS and key != "multi_query_group_num":
            return HEADS
        if key in _TOP_K:
            return TOP_K
        if key in _EXPERTS:
            return EXPERTS
        if key in ("n_shared_experts", "num_shared_experts"):
            return 1
        if key == "vocab_size":
            return VOCAB
        return None
    if key == "image_size" and isinstance(value, list | tuple) and value:
        return [min(v, IMAGE) for v in value]  # (height, width)
    if not isinstance(value, int):
        return value
    if key in _HIDDEN and value > HIDDEN:
        return HIDDEN
    if key in _LAYERS and value > LAYERS:
        return LAYERS
    if key in _HEADS and value > HEADS:
        return HEADS
    if key in _KV_HEADS:
        return HEADS if value == heads_before else min(value, KV_HEADS)
    if key in _FFN and value > FFN:
        return FFN
    if key in _EXPERTS and value > EXPERTS:
        return EXPERTS
    if key in _TOP_K and value > TOP_K:
        return TOP_K
    if key in _GROUPS:
        return 1
    if key in _POSITIONS and value > POSITIONS:
        return POSITIONS
    if key in _MLA:
        return _MLA[key]
    if key in _HEAD_DIM and value > HEAD_DIM:
        return HEAD_DIM
    if key in ("rotary_dim", "rotary_emb_base_dim") and value > HEAD_DIM // 2:
        return HEAD_DIM // 2
    if "vocab_size" in key and value > VOCAB:
        return VOCAB
    if key == "image_size" and value > IMAGE:
        return IMAGE
    if key == "patch_size" and value > 4:
        return 4
    if key.endswith("_token_id") and value >= VOCAB:
        return VOCAB - 1 - sum(map(ord, key)) % 8
    if key in ("n_shared_experts", "num_shared_experts") and value > 1:
        return 1
    if key in ("hidden_size_per_layer_input", "laurel_rank") and value > HEAD_DIM:
        return HEAD_DIM
    return value


def shrink(
    cfg: Any, task: str, top: bool = True, keep_layers: bool = False
) -> dict[str, Any]:
    """The attributes of ``cfg`` the rule changes (sub-configs as whole configs)."""
    out: dict[str, Any] = {}
    attrs = cfg.to_dict()
    heads_before = next(
        (attrs[k] for k in _HEADS if isinstance(attrs.get(k), int)), None
    )
    layers_key = next(
        (k for k in _LAYERS if isinstance(attrs.get(k), int) and attrs[k] > LAYERS),
        None,
    )
    per_layer: list[str] = []
    if layers_key is not None and not keep_layers:
        per_layer, keep = _layer_indices(attrs, attrs[layers_key])
        for k in per_layer:
            out[k] = [_scalar(k, attrs[k][i], heads_before) for i in keep]
        for k in _LAYERS:
            if isinstance(attrs.get(k), int) and attrs[k] == attrs[layers_key]:
                out[k] = len(keep)
        if isinstance(attrs.get("num_kv_shared_layers"), int):
            # the last layers reuse earlier layers' caches: as many as keep every
            # kind of layer among the earlier ones
            out["num_kv_shared_layers"] = min(attrs["num_kv_shared_layers"], 2)
    for key, value in attrs.items():
        sub = _attr(cfg, key)
        if _is_config(sub):
            out[key] = _shrunk_sub(sub, task)
            continue
        if key in per_layer or key in out:
            continue
        if (keep_layers or "depths" in attrs) and key in _LAYERS:
            continue  # stages' depths (vision): the layer count is theirs
        new = _scalar(key, value, heads_before)
        if new is not value and new != value:
            out[key] = new
        elif value is None and new is not None:
            out[key] = new
    if "qk_rope_head_dim" in attrs and isinstance(attrs.get("head_dim"), int):
        out["head_dim"] = _MLA["qk_rope_head_dim"]  # MLA: head_dim is the rope part
    if "use_cache" in attrs:
        out["use_cache"] = False
    if top and task == "image":
        out["num_labels"] = LABELS
    return out


def _shrunk_sub(sub: Any, task: str) -> Any:
    """A sub-config with the rule applied: rebuilt from its dict where that keeps
    every attribute (derived ones recomputed), else changed in place on a copy."""
    changes = shrink(sub, task, top=False)
    try:
        rebuilt = type(sub)(**{**sub.to_dict(), **changes})
        if set(vars(sub)) <= set(vars(rebuilt)):
            return rebuilt
    except Exception:
        pass
    out = copy.deepcopy(sub)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


def _config_class(entry: Entry) -> type:
    """The class's own config class (a text-only class under a multimodal model
    type takes the text config: ``Llama4ForCausalLM``, ``MllamaForCausalLM``), else
    the model type's."""
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    own = getattr(getattr(tf, entry.name, None), "config_class", None)
    return own if isinstance(own, type) else CONFIG_MAPPING[entry.model_type]


def config(entry: Entry) -> Any:
    """The shrunk config of ``entry``'s class."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    cls = _config_class(entry)
    overrides = dict(OVERRIDES.get(entry.name, {}))
    keep_layers = bool(overrides.pop("_keep_layers", False))
    flat = {k: v for k, v in overrides.items() if not isinstance(v, dict)}
    try:
        base = cls(**flat)
    except Exception:  # overrides made for the shrunk sizes
        base = cls()
    kwargs = shrink(base, entry.task, keep_layers=keep_layers)
    for k, v in overrides.items():
        if isinstance(v, dict) and _is_config(kwargs.get(k)):
            for a, x in v.items():  # into a sub-config
                setattr(kwargs[k], a, x)
        else:
            kwargs[k] = v
    if "num_labels" in kwargs:
        n = kwargs.pop("num_labels")
        kwargs["id2label"] = {i: str(i) for i in range(n)}
        kwargs["label2id"] = {str(i): i for i in range(n)}
    cfg = cls(**kwargs)
    for c in _configs(cfg):
        c._attn_implementation = "eager"
        if entry.task == "seq2seq" or getattr(c, "is_encoder_decoder", False):
            if getattr(c, "pad_token_id", None) is None:
                c.pad_token_id = 0
            if getattr(c, "decoder_start_token_id", None) is None:
                c.decoder_start_token_id = c.pad_token_id
    return cfg


def _configs(cfg: Any) -> list[Any]:
    out = [cfg]
    for v in vars(cfg).values():
        if _is_config(v):
            out.extend(_configs(v))
    return out


def vocab_of(cfg: Any) -> int:
    for c in _configs(cfg):
        v = getattr(c, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
    return VOCAB


def default_build_error(entry: Entry) -> str | None:
    """The first line of the error building ``entry``'s class from its default
    config raises (on the meta device: no memory), or None where that builds."""
    import transformers as tf

    try:
        with torch.device("meta"):
            getattr(tf, entry.name)(_config_class(entry)())
    except Exception as e:  # noqa: BLE001 - any error: the class is broken here
        return _first_line(e)
    return None


def build(entry: Entry, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model (random weights, float32, train mode) and its batch."""
    import transformers as tf

    cfg = config(entry)
    cls = getattr(tf, entry.name)
    torch.manual_seed(seed)
    model = cls(cfg).float()
    for mod in model.modules():
        if getattr(getattr(mod, "config", None), "use_cache", False):
            mod.config.use_cache = False
    languages = getattr(cfg, "languages", None)
    if hasattr(model, "set_default_language") and languages:
        model.set_default_language(languages[0])  # X-MOD: one adapter per language
    model.train()
    return model, batch(entry, cfg, seed, model)


def batch(
    entry: Entry, cfg: Any, seed: int = 0, model: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The task's batch: tokens and ``labels`` (masked LM: a quarter of the tokens
    masked; seq2seq: a target sequence), or images and class labels."""
    import inspect

    g = torch.Generator().manual_seed(seed + 1)
    takes = set(inspect.signature(model.forward).parameters) if model else set()
    if entry.task == "image" and "pixel_values" not in takes and "input_ids" in takes:
        # an image classifier over colour-cluster tokens (ImageGPT)
        ids = torch.randint(0, vocab_of(cfg) - 1, (B, T), generator=g)
        return dict(input_ids=ids, labels=torch.randint(0, LABELS, (B,), generator=g))
    if entry.task == "image" and "spatial_shapes" in takes:
        # pre-cut patches with their grid (SigLIP 2's image processor's layout)
        vis = getattr(cfg, "vision_config", cfg)
        p, side = vis.patch_size, 8
        pix = torch.randn(B, side * side, vis.num_channels * p * p, generator=g)
        return dict(
            pixel_values=pix,
            pixel_attention_mask=torch.ones(B, side * side, dtype=torch.long),
            spatial_shapes=torch.tensor([[side, side]] * B),
            labels=torch.randint(0, LABELS, (B,), generator=g),
        )
    if entry.task == "image":
        vis = cfg
        for c in _configs(cfg):
            if getattr(c, "image_size", None) is not None:
                vis = c
                break
        side = getattr(vis, "image_size", IMAGE)
        side = side[0] if isinstance(side, list | tuple) else side
        ch = getattr(vis, "num_channels", 3)
        pix = torch.randn(B, ch, side, side, generator=g)
        return dict(
            pixel_values=pix, labels=torch.randint(0, LABELS, (B,), generator=g)
        )
    v = vocab_of(cfg)
    low = 4 if v > 8 else 0  # past the usual special tokens
    ids = torch.randint(low, v, (B, T), generator=g)
    if entry.task == "causal":
        return dict(input_ids=ids, labels=ids.clone())
    if entry.task == "masked":
        labels = torch.full_like(ids, -100)
        masked = torch.rand(B, T, generator=g) < 0.25
        masked[:, 1] = True  # every row counts
        labels[masked] = ids[masked]
        mask_id = getattr(cfg, "mask_token_id", None)
        ids = ids.masked_fill(masked, mask_id if isinstance(mask_id, int) else low)
        return dict(input_ids=ids, labels=labels)
    labels = torch.randint(low, v, (B, T), generator=g)
    labels[1, -2:] = -100
    return dict(input_ids=ids, labels=labels)


# --- training and comparing ---------------------------------------------------------


@dataclass
class Result:
    """One class's outcome: ``status`` is passed, refused, skipped or failed."""

    name: str
    task: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    detail: dict | None = None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class NoLoss(Exception):
    """The class computes no loss from labels (an inference-only head)."""


def _plain_step(model: nn.Module, inputs: dict) -> tuple[float, dict]:
    """Plain torch: forward, the model's own loss, backward; the loss and gradients."""
    loss = getattr(model(**inputs), "loss", None)
    if loss is None:
        raise NoLoss("inference-only: its forward computes no loss from labels")
    loss.backward()
    grads = {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }
    return float(loss.detach()), grads


def _weights_of(trainer: Any, model0: nn.Module, tmp: str) -> nn.Module:
    """A copy of ``model0`` with the trainer's current weights (``save``: streamed
    units read from their files; a tied parameter once, its aliases follow)."""
    import os

    from safetensors.torch import load_file

    path = os.path.join(tmp, "weights.safetensors")
    trainer.save(path)
    out = copy.deepcopy(model0)
    missing, unexpected = out.load_state_dict(load_file(path), strict=False)
    if unexpected:
        raise RuntimeError(f"saved state has unknown tensors: {unexpected[:3]}")
    state = out.state_dict()
    for k in missing:  # aliases of tied tensors, which load with their owner
        if k not in state:
            raise RuntimeError(f"saved state lacks {k}")
    return out


def _train(
    planned: Any, model0: nn.Module, inputs: dict, first: tuple[float, dict]
) -> str | None:
    """STEPS steps under the plan, each compared before its optimizer step with
    plain torch's step from the same weights: the first from the initial weights
    (``first``), later ones from the weights the plan's previous update left (AdamW
    turns rounding-size differences of near-zero gradients into update-size ones,
    issue 34 item 4, so plain's own second step is not the reference)."""
    import tempfile

    with (
        tempfile.TemporaryDirectory() as tmp,
        planned.trainer(settings=settings()) as tr,
    ):
        for step in range(STEPS):
            ref = (
                first
                if step == 0
                else _plain_step(_weights_of(tr, model0, tmp), inputs)
            )
            loss = tr.backward(inputs)
            grads = {n: g.detach().clone() for n, g in tr.gradients().items()}
            bad = compare(step, ref, (loss, grads))
            if bad is not None:
                return bad
            tr.update()
    return None


def compare(step: int, ref: tuple[float, dict], got: tuple[float, dict]) -> str | None:
    """None when ``got`` equals ``ref`` within the zoo's tolerances, else the first
    mismatch (one line)."""
    (l0, g0), (l1, g1) = ref, got
    if not math.isfinite(l1) or abs(l1 - l0) > LOSS_RTOL * max(abs(l0), 1e-12):
        return f"step {step}: loss {l1!r} against plain {l0!r}"
    missing = sorted(set(g0) - set(g1))
    if missing:
        return f"step {step}: no gradient for {missing[0]} ({len(missing)} in all)"
    for n, a in g0.items():
        b = g1[n]
        ref_norm = float(a.norm())
        if ref_norm < SMALL_NORM:
            err = float((b - a).abs().max()) if a.numel() else 0.0
            if err > GRAD_ATOL:
                return f"step {step}: {n}: max abs {err:.3g} (||g|| {ref_norm:.2g})"
            continue
        ratio = float((b - a).norm()) / ref_norm
        if not ratio <= GRAD_RTOL:
            return f"step {step}: {n}: grad ratio {ratio:.3g}"
    return None


def settings() -> Any:
    from memory import TrainSettings

    # clipping at a norm no gradient reaches (a factor of exactly 1): the trainer then
    # keeps streamed units' gradients until the update, so that every gradient can be
    # compared before the optimizer step
    return TrainSettings(lr=1e-3, clip_norm=1e30)


def run(entry: Entry) -> Result:
    """Build ``entry``'s class, train it plainly and under two plans (half of
    plain's predicted peak, then the smallest plan), compare."""
    from memory import plan_training
    from memory.errors import BudgetError, MemoryPlanError

    t0 = time.monotonic()
    res = Result(entry.name, entry.task, "failed")
    why = skip_reason(entry)
    if why is not None:
        res.status, res.reason = "skipped", why
        return res
    stage = "build"
    detail: dict[str, Any] = {}
    try:
        try:
            model, inputs = build(entry)
        except ImportError as e:  # a backend the class needs (natten, ...)
            lib = re.search(r"requires the (\S+) library", str(e))
            if lib is None:
                raise
            res.status, res.reason = "skipped", f"needs {lib.group(1)} (not installed)"
            return res
        except Exception as e:
            broken = default_build_error(entry)
            if broken is None:
                raise
            res.status = "skipped"
            res.reason = (
                "does not build in this transformers even from its default config: "
                + broken
            )
            del e
            return res
        stage = "plain"
        first = _plain_step(copy.deepcopy(model), inputs)
        detail["loss"] = first[0]
        # the smallest plan first: its call also predicts plain's peak
        for label in ("smallest", "half"):
            stage = f"plan {label}"
            m = copy.deepcopy(model)
            budget = None if label == "smallest" else detail["plain_peak_bytes"] // 2
            planned = plan_training(m, inputs, budget_bytes=budget)
            detail.setdefault("plain_peak_bytes", planned.plain_peak_bytes)
            detail[label] = dict(
                budget_bytes=budget,
                predicted_peak_bytes=planned.plan.predicted_peak_bytes,
                plan=describe(planned.plan),
            )
            stage = f"train {label}"
            bad = _train(planned, model, inputs, first)
            if bad is not None:
                res.reason = f"{label} plan ({describe(planned.plan)}): {bad}"
                break
        else:
            res.status = "passed"
    except NoLoss as e:
        res.status, res.reason = "skipped", str(e)
    except (BudgetError, MemoryPlanError) as e:
        res.status = "refused"
        res.reason = f"{stage}: {_first_line(e)}"
    except Exception as e:  # noqa: BLE001 - the census records every failure
        res.reason = f"{stage}: {_first_line(e)}"
    res.seconds = round(time.monotonic() - t0, 2)
    res.detail = detail
    return res


def describe(plan: Any) -> str:
    """A short summary of a plan: its mechanisms."""
    states: dict[str, int] = {}
    for b in plan.blocks:
        states[b.state] = states.get(b.state, 0) + 1
    parts = [f"{k}x{v}" for k, v in sorted(states.items())]
    if plan.num_microbatches > 1:
        parts.append(f"mb{plan.num_microbatches}")
    if plan.loss_chunks > 1:
        parts.append(f"chunks{plan.loss_chunks}")
    return " ".join(parts) or "plain"
