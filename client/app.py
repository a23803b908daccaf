"""fleetfit's ClientApp (Flower Message API).

- ``query``: replies with the node's facts: partition id and count, memory and disk
  budgets (``client.config``), device memory and disk, measured compute rate, and
  whether it can train adapters (peft installed).
- ``train``: runs the server's assignment (``full``: the whole model under its plan;
  ``part``: a window of blocks and the head; ``adapter``: LoRA adapters on a frozen
  base, replying with their factors only (``memory.lora``; a node without peft, which
  only the ``hf`` extra installs, refuses in one line, error code ``MISSING_EXTRA``);
  ``none``: replies that nothing fits, with the smallest budget that would) on its
  share of the data, and replies with the trained ``arrays`` and ``metrics``
  (``num-examples``, ``train-loss``, the measured peak of its training work, the bytes
  of the message it received, ...). A stock strategy's instruction (Flower's FedAvg:
  no ``kind`` or ``plan``) trains the whole model under the node's own plan for its
  budget (``client.selfplan``), the run's shape read from the run config where the
  strategy sent none; a budget that holds no whole-model plan is an error reply naming
  it and the smallest that fits.
- ``evaluate``: evaluates the received arrays on the held-out data.

Errors raised here become error replies: the round goes on without this node.

Differential privacy: a train instruction that carries Flower's ``clipping_norm``
(``DifferentialPrivacyClientSideFixedClipping`` puts it there) has its update clipped
before it leaves the node (``clipping_mod``, Flower's ``fixedclipping_mod`` for
fleetfit's assignments). Replies keep the received arrays' key order, since Flower's DP
wrappers pair arrays by position.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import TypeVar

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.supercore.differential_privacy import (
    KEY_CLIPPING_NORM,
    compute_clip_model_update,
)

from client import round_log
from client.config import (
    NodeConfig,
    available_memory_bytes,
    check_workload_allowed,
    free_disk_bytes,
    total_memory_bytes,
)
from client.ort_eval import evaluate_only
from client.selfplan import is_stock_instruction, own_plan, reserve_bytes, stock_config
from client.train import draw_batches, train_assigned
from memory.errors import MissingExtraError
from memory.lora import LoraSpec, adapters_available, require_peft
from memory.probes import measure_flops_per_s
from memory.spec import MemoryPlan
from wire import keys
from wire.facts import MISSING_EXTRA, NodeFacts
from wire.instruction import TrainInstruction, resolve_measure
from wire.reply import EvalReply, TrainReply
from wire.shape import RunShape
from workloads import get_workload
from workloads.node_data import evaluate_batches

log = logging.getLogger(__name__)
app = ClientApp()

CLIENT_ERROR = 1  # Error.code of a reply whose handler failed; the reason says why

Handler = Callable[[Message, Context], Message]
T = TypeVar("T")


def _error_reply(handler: Handler) -> Handler:
    """Turn a failure into an error reply naming the cause; the round goes on."""

    @functools.wraps(handler)
    def wrapped(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except MissingExtraError as e:  # work this install cannot do: one line
            log.warning("%s refused: %s", handler.__name__, e)
            return Message(Error(MISSING_EXTRA, str(e)), reply_to=msg)
        except Exception as e:  # a failing client is data, not a crash
            log.warning("%s failed: %s: %s", handler.__name__, type(e).__name__, e)
            return Message(
                Error(CLIENT_ERROR, f"{type(e).__name__}: {e}"), reply_to=msg
            )

    return wrapped


def _node(context: Context, extra: dict | None = None) -> NodeConfig:
    fleet = {
        k: v
        for k, v in {**dict(context.run_config), **(extra or {})}.items()
        if k in keys.FLEET_KEYS
    }
    return NodeConfig.from_node_config(dict(context.node_config), fleet)


@app.query()
@_error_reply
def query(msg: Message, context: Context) -> Message:
    asked = dict(msg.content.config_records.get(keys.CONFIG, {}))
    node = _node(context, asked)
    facts = NodeFacts(
        partition_id=node.partition_id,
        num_partitions=node.num_partitions,
        budget_bytes=node.budget_bytes,
        disk_budget_bytes=node.disk_budget_bytes,
        budget_source=node.budget_source,
        total_memory_bytes=total_memory_bytes(),
        available_memory_bytes=available_memory_bytes(),
        free_disk_bytes=free_disk_bytes(node.offload_dir),
        flops_per_s=measure_flops_per_s() * node.speed_factor,
        num_cpus=os.cpu_count() or 1,
        adapters=adapters_available(),
    )
    return Message(
        RecordDict({keys.NODE: ConfigRecord(facts.to_record())}), reply_to=msg
    )


def message_bytes(content: RecordDict) -> int:
    """Bytes of a received message's payload: its arrays and its config values."""
    total = 0
    for rec in content.array_records.values():
        total += sum(len(a.data) for a in rec.values())
    for cfg in content.config_records.values():
        total += sum(len(str(k)) + len(str(v)) for k, v in cfg.items())
    return total


def clipping_mod(
    msg: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """Clip this node's update to the instruction's ``clipping_norm``, if it has one.

    Flower's ``fixedclipping_mod`` for fleetfit's assignments: the update (reply minus
    received arrays) is clipped to L2 norm ``clipping_norm`` over the keys the reply
    carries (all of them for ``full``, the window and head for ``part``; a ``none``
    reply has no arrays and passes unchanged). Integer buffers (BatchNorm's step
    counters) are neither counted nor scaled. Without ``clipping_norm`` the reply
    passes unchanged (the server did not ask for client-side clipping).
    """
    config = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
    if KEY_CLIPPING_NORM not in config:
        return call_next(msg, context)
    norm = config[KEY_CLIPPING_NORM]
    if isinstance(norm, bool) or not isinstance(norm, int | float) or not norm > 0:
        return Message(
            Error(
                ErrorCode.MOD_FAILED_PRECONDITION,
                f"clipping_norm={norm!r} must be a positive number",
            ),
            reply_to=msg,
        )
    received = msg.content.array_records.get(keys.ARRAYS)
    reply = call_next(msg, context)
    if reply.has_error() or keys.ARRAYS not in reply.content.array_records:
        return reply
    sent = reply.content.array_records[keys.ARRAYS]
    if received is None or not set(sent) <= set(received):
        return Message(
            Error(
                ErrorCode.MOD_FAILED_PRECONDITION,
                "clipping_mod: the reply carries arrays the node did not receive",
            ),
            reply_to=msg,
        )
    new = {k: sent[k].numpy() for k in sent}
    floats = [k for k in sent if new[k].dtype.kind == "f"]
    trained = [new[k] for k in floats]
    compute_clip_model_update(
        trained, [received[k].numpy() for k in floats], float(norm)
    )
    new.update(zip(floats, trained, strict=True))
    reply.content.array_records[keys.ARRAYS] = ArrayRecord(
        {k: Array(new[k]) for k in sent}
    )
    log.info("update clipped to L2 norm %g over %d arrays", norm, len(floats))
    return reply


def _lora_spec(ins: TrainInstruction) -> LoraSpec | None:
    """An ``adapter`` instruction's adapters (None for other kinds)."""
    if ins.kind != "adapter":
        return None
    return LoraSpec(
        rank=ins.lora_rank,
        alpha=ins.lora_alpha,
        targets=ins.lora_targets,
        start=ins.window_start,
        base_dtype=ins.base_dtype,
    )


def _logged_round(handler: Handler) -> Handler:
    """A failed round goes to the node's round log too (``client.round_log``)."""

    @functools.wraps(handler)
    def wrapped(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except Exception as e:
            if round_log.round_log_path() is not None:
                round_log.append(
                    {
                        "round": _server_round(msg),
                        "kind": "error",
                        "error": f"{type(e).__name__}: {e}",
                    }
                )
            raise

    return wrapped


def _server_round(msg: Message) -> int | None:
    """The round a train instruction belongs to, as far as it can be read."""
    try:
        config: dict = dict(_record(msg.content.config_records, keys.CONFIG) or {})
        return int(config.get("server-round", msg.metadata.group_id))
    except (TypeError, ValueError, AttributeError):
        return None


@app.train(mods=[clipping_mod])
@_error_reply
@_logged_round
def train(msg: Message, context: Context) -> Message:
    node = _node(context)
    received = message_bytes(msg.content)
    config = dict(_record(msg.content.config_records, keys.CONFIG) or {})
    stock = is_stock_instruction(config)  # an ordinary strategy: no plan sent
    if stock:
        config = stock_config(config, context.run_config)
    ins = TrainInstruction.from_config(config)
    shape = ins.shape
    check_workload_allowed(shape.workload, context.node_config)  # before any import
    if ins.kind == "adapter":
        require_peft()  # else one line naming the extra (MissingExtraError)
    if ins.kind == "none":
        log.warning("no part of the model fits this node: %s", ins.reason)
        evaluated = None
        if ins.eval_runtime == "onnxruntime":  # evaluate the round's model, torch-free
            evaluated = evaluate_only(msg.content, node, ins)
        reply = TrainReply(
            "none",
            num_examples=0,
            partition_id=node.partition_id,
            min_budget_bytes=ins.min_budget_bytes,
            message_bytes=received,
            reason=ins.reason,
            peak_method="ort-child" if evaluated and evaluated.ran else None,
            eval=evaluated,
        )
        round_log.append(
            {
                "round": ins.server_round,
                "kind": "none",
                "budget_bytes": node.budget_bytes,
                "min_budget_bytes": ins.min_budget_bytes,
                "reason": ins.reason,
            }
        )
        return Message(reply.to_content(), reply_to=msg)
    workload = get_workload(
        shape.workload,
        batch_size=shape.batch_size or None,
        seq_len=shape.seq_len or None,
    )
    plan = MemoryPlan.from_dict(json.loads(ins.plan)) if ins.plan else None
    if stock:  # the whole model's keys go back: a whole-model plan or a refusal
        plan = own_plan(
            workload,
            node,
            reserve_bytes=reserve_bytes(context.run_config),
            proximal_mu=shape.proximal_mu,
        )
    arrays_in = _record(msg.content.array_records, keys.ARRAYS)
    if arrays_in is None:
        raise ValueError(
            f"the train instruction has no ArrayRecord {keys.ARRAYS!r} (records: "
            f"{', '.join(msg.content.array_records) or 'none'}); send the model there"
        )
    state = arrays_in.to_torch_state_dict()
    # the reply keeps the received order: Flower's DP wrappers pair arrays by position
    order = {k: i for i, k in enumerate(state)}
    batches, num_examples, torch_seed = draw_batches(
        workload,
        node.partition_id,
        node.num_partitions,
        split=shape.split,
        alpha=shape.dirichlet_alpha,
        classes=ins.classes or None,
        seed=shape.seed,
        server_round=ins.server_round,
        local_steps=shape.local_steps,
        public_share=shape.public_share,
    )
    result = train_assigned(
        state,
        workload,
        batches,
        num_examples=num_examples,
        torch_seed=torch_seed,
        plan=plan,
        window=ins.window,
        lr=shape.lr,
        measure=resolve_measure(ins.measure, node.budget_source),
        offload_dir=node.offload_dir,
        proximal_mu=shape.proximal_mu,
        adapters=_lora_spec(ins),
    )
    del state
    reply = TrainReply(
        ins.kind,
        num_examples=result.num_examples,
        train_loss=result.mean_loss,
        train_s=result.train_s,
        partition_id=node.partition_id,
        peak_bytes=result.peak_bytes,
        baseline_bytes=result.baseline_bytes,
        message_bytes=received,
        steps_done=result.steps,
        peak_method=result.method,
        window=ins.window,
    )
    arrays = ArrayRecord(
        dict(sorted(result.state.items(), key=lambda kv: order.get(kv[0], -1)))
    )
    content = reply.to_content(arrays)
    if stock:
        report = content.config_records[keys.REPORT]
        report[keys.OWN_PLAN] = "" if plan is None else plan.to_json()
        report[keys.BUDGET_BYTES] = node.budget_bytes
        if result.peak_bytes > node.budget_bytes and result.method == "child":
            log.warning(
                "measured peak %d bytes is over this node's budget of %d bytes "
                "under its own plan",
                result.peak_bytes,
                node.budget_bytes,
            )
    round_log.append(
        {
            "round": ins.server_round,
            "kind": ins.kind,
            "window": list(ins.window) if ins.window else None,
            "steps": result.steps,
            "num_examples": result.num_examples,
            "train_loss": result.mean_loss,
            "train_s": result.train_s,
            "peak_bytes": result.peak_bytes,
            "baseline_bytes": result.baseline_bytes,
            "budget_bytes": node.budget_bytes,
            "peak_method": result.method,
        }
    )
    return Message(content, reply_to=msg)


def _record(records: Mapping[str, T], name: str) -> T | None:
    """The record ``name``, else the only record (a strategy may name its records
    otherwise: FedAvg's ``arrayrecord_key``/``configrecord_key``), else None."""
    if name in records:
        return records[name]
    if len(records) == 1:
        return next(iter(records.values()))
    return None


@app.evaluate()
@_error_reply
def evaluate(msg: Message, context: Context) -> Message:
    config = dict(msg.content.config_records.get(keys.CONFIG, {}))
    name = str(config.get(keys.WORKLOAD, RunShape.workload))
    check_workload_allowed(name, context.node_config)
    workload = get_workload(name)
    model = workload.make_model(0)
    model.load_state_dict(msg.content.array_records[keys.ARRAYS].to_torch_state_dict())
    if workload.own_data:  # this node's own held-out batches
        node = _node(context)
        batches = workload.eval_batches(node.partition_id, node.num_partitions)
        m = evaluate_batches(model, batches, workload.loss_fn)
        num_examples = int(m["num_examples"])
    else:
        m = workload.evaluate(model)
        num_examples = len(workload.items(train=False))
    reply = EvalReply(float(m["loss"]), float(m["accuracy"]), num_examples)
    return Message(reply.to_content(), reply_to=msg)
