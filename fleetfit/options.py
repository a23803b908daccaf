"""The options the ``fleetfit`` commands share: one name, one type, one default and one
help text each, so that ``--workload``, ``--memory-budget``, ``--local-steps`` or
``--seed`` mean the same in every command that takes them.

Each is an ``Annotated`` type for a typer command's parameter. Values are checked while
the command line is parsed: a bad one ends the command with one line naming the flag,
the value and the fix (``fleetfit.cli``), before any work starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from fleetfit import args as checks
from server.config import ServerConfig
from simulations.run import SimulationSettings
from wire.shape import RunShape

T = TypeVar("T")

_SHAPE = RunShape()  # the run config's defaults: one source for every command
_SIM = SimulationSettings()
_SERVER = ServerConfig()

# Help panels: options grouped the same way in every command's --help.
TRAINING = "Training"
DATA = "Data"
MEMORY = "Memory"
NETWORK = "Network and security"
OUTPUT = "Output"


def checked(convert: Callable[[str], T]) -> Callable[[str], T]:
    """A typer ``parser`` from a check that raises ``ValueError`` with its reason:
    click then names the flag beside the reason."""

    def parse(text: str) -> T:
        if not isinstance(text, str):  # a default already converted
            return text  # type: ignore[return-value]
        try:
            return convert(text)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def size(text: str) -> str:
    """A byte size as the user wrote it ("512MB", "1.5GiB", bytes if bare), checked."""
    from memory.sizes import parse_bytes

    parse_bytes(text, what="size")
    return text


def disk_size(text: str) -> str:
    """A byte size where 0 means none."""
    from memory.sizes import parse_bytes

    parse_bytes(text, what="size", allow_zero=True)
    return text


def split_name(text: str) -> str:
    from workloads.splits import SPLITS

    if text not in SPLITS:
        raise ValueError(f"{text!r} is not a split; give one of {', '.join(SPLITS)}")
    return text


def fraction(text: str) -> float:
    value = checks.positive_float(text)
    if value > 1:
        raise ValueError(f"{value:g} is not a share in (0, 1]")
    return value


def _opt(*names: str, parser: Callable[[str], Any] | None = None, **kw: Any) -> Any:
    if parser is not None:
        kw["parser"] = checked(parser)
        kw.setdefault("metavar", parser.__name__.upper().replace("_", "-"))
    return typer.Option(*names, **kw)


# ------------------------------------------------------------------- the run
Workload = Annotated[
    str | None,
    _opt(
        "--workload",
        metavar="NAME",
        help="built-in workload (NAME, or NAME@SCALE for a shrunk one) or "
        f"module:function (default: {_SHAPE.workload})",
        rich_help_panel=TRAINING,
    ),
]
Rounds = Annotated[
    int | None,
    _opt(
        "--rounds",
        min=1,
        help=f"federated rounds (default: {_SIM.num_server_rounds})",
        rich_help_panel=TRAINING,
    ),
]
LocalSteps = Annotated[
    int | None,
    _opt(
        "--local-steps",
        min=1,
        help=f"optimizer steps per client per round (default: {_SHAPE.local_steps})",
        rich_help_panel=TRAINING,
    ),
]
Lr = Annotated[
    float | None,
    _opt(
        "--lr",
        parser=checks.positive_float,
        metavar="RATE",
        help=f"client AdamW learning rate (default: {_SHAPE.lr:g})",
        rich_help_panel=TRAINING,
    ),
]
Seed = Annotated[
    int | None,
    _opt(
        "--seed",
        help=f"seed of all randomness (default: {_SHAPE.seed})",
        rich_help_panel=TRAINING,
    ),
]
Fraction = Annotated[
    float | None,
    _opt(
        "--fraction",
        parser=fraction,
        metavar="SHARE",
        help="share of clients sampled each round, in (0, 1] "
        f"(default: {_SIM.fraction_train:g})",
        rich_help_panel=TRAINING,
    ),
]
Split = Annotated[
    str | None,
    _opt(
        "--split",
        parser=split_name,
        metavar="iid|dirichlet|natural",
        help=f"how data is split across clients (default: {_SHAPE.split})",
        rich_help_panel=DATA,
    ),
]
Alpha = Annotated[
    float | None,
    _opt(
        "--alpha",
        parser=checks.positive_float,
        metavar="ALPHA",
        help="Dirichlet concentration for --split dirichlet "
        f"(default: {_SHAPE.dirichlet_alpha:g})",
        rich_help_panel=DATA,
    ),
]
Batch = Annotated[
    int | None,
    _opt(
        "--batch",
        min=1,
        help="examples per batch (default: the workload's)",
        rich_help_panel=DATA,
    ),
]
Seq = Annotated[
    int | None,
    _opt(
        "--seq",
        min=1,
        help="tokens per example, language models (default: the workload's)",
        rich_help_panel=DATA,
    ),
]

# ------------------------------------------------------------------- memory
BUDGET_HELP = (
    "memory training may add above the runtime's import footprint (about 290-350 "
    'MiB), e.g. "512MB", "1.5GiB" (bytes if bare)'
)
MemoryBudget = Annotated[
    str | None,
    _opt(
        "--memory-budget",
        parser=size,
        metavar="SIZE",
        help=f"{BUDGET_HELP} (default: none, the smallest plan)",
        rich_help_panel=MEMORY,
    ),
]
RunMemoryBudget = Annotated[
    str | None,
    _opt(
        "--memory-budget",
        parser=size,
        metavar="SIZE",
        help=f"{BUDGET_HELP}; the run stops if a step crosses it (required unless "
        "--plain)",
        rich_help_panel=MEMORY,
    ),
]
DiskBudget = Annotated[
    str | None,
    _opt(
        "--disk-budget",
        parser=disk_size,
        metavar="SIZE",
        help="disk for offload and streaming files; 0 forbids both "
        "(default: half the free space of --offload-dir)",
        rich_help_panel=MEMORY,
    ),
]
OffloadDir = Annotated[
    str | None,
    _opt(
        "--offload-dir",
        metavar="DIR",
        help="folder for offloaded activations and streamed state "
        "(default: the system temporary folder)",
        rich_help_panel=MEMORY,
    ),
]

# ------------------------------------------------------------------- output
Json = Annotated[
    bool,
    _opt(
        "--json",
        help="print one JSON object as the last line of standard output",
        rich_help_panel=OUTPUT,
    ),
]
Progress = Annotated[
    bool,
    _opt(
        "--progress/--no-progress",
        help="a live progress bar on a terminal (elsewhere one line per round)",
        rich_help_panel=OUTPUT,
    ),
]

# ------------------------------------------------------------------- GPU layouts
GPU_MODEL = "Model (GPU layouts)"
GPU_HARDWARE = "GPUs"
GPU_LAYOUT = "Layout to evaluate (else searched)"


def _int_opt(name: str, help: str, panel: str) -> Any:
    return Annotated[int | None, _opt(name, min=1, help=help, rich_help_panel=panel)]


ModelConfig = Annotated[
    str | None,
    _opt(
        "--config",
        metavar="FILE",
        help="a transformers config.json (Llama, Mistral or GPT-2 keys) describing "
        "the model for the GPU layout model",
        rich_help_panel=GPU_MODEL,
    ),
]
Layers = _int_opt("--layers", "transformer layers (explicit model)", GPU_MODEL)
Hidden = _int_opt("--hidden", "hidden size, elements (explicit model)", GPU_MODEL)
Heads = _int_opt("--heads", "attention heads (explicit model)", GPU_MODEL)
KvHeads = _int_opt(
    "--kv-heads", "key/value heads (default: --heads, or the config's)", GPU_MODEL
)
Ffn = _int_opt(
    "--ffn", "MLP inner width, elements; SwiGLU assumed (explicit model)", GPU_MODEL
)
Vocab = _int_opt("--vocab", "vocabulary size, tokens (explicit model)", GPU_MODEL)
Tied = Annotated[
    bool | None,
    _opt(
        "--tied/--untied",
        help="input embedding and output head share one matrix (default: the "
        "config's, untied for explicit numbers)",
        rich_help_panel=GPU_MODEL,
        show_default=False,
    ),
]
GpuName = Annotated[
    str | None,
    _opt(
        "--gpu",
        metavar="TYPE",
        help="GPU type with its memory: a100-40, a100-80, h100-80, h100-94 "
        "(h100-nvl), h100-96 (gh200); instead of --cluster",
        rich_help_panel=GPU_HARDWARE,
    ),
]
NumGpus = _int_opt("--num-gpus", "number of GPUs of --gpu, 8 to a host", GPU_HARDWARE)
Dp = _int_opt("--dp", "data-parallel degree (default: GPUs / (pp x tp))", GPU_LAYOUT)
Pp = _int_opt("--pp", "pipeline-parallel degree (stages)", GPU_LAYOUT)
Tp = _int_opt("--tp", "tensor-parallel degree, within a host", GPU_LAYOUT)
VirtualStages = _int_opt(
    "--virtual-stages",
    "stages per pipeline rank, interleaved 1F1B above 1, up to the layer count "
    "(default: 1)",
    GPU_LAYOUT,
)
MicroBatch = _int_opt(
    "--micro-batch", "sequences per micro-batch (default: 1)", GPU_LAYOUT
)
Recompute = Annotated[
    str | None,
    _opt(
        "--recompute",
        metavar="none|selective|full",
        help="activation recompute (default: selective)",
        rich_help_panel=GPU_LAYOUT,
    ),
]
Sharding = Annotated[
    str | None,
    _opt(
        "--sharding",
        metavar="ddp|zero1|fsdp",
        help="data-parallel sharding of weights and optimizer state (default: fsdp)",
        rich_help_panel=GPU_LAYOUT,
    ),
]
