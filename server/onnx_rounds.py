"""ONNX in the round loop (run-config keys in brackets):

- central evaluation in ONNX Runtime [eval-runtime = "onnxruntime"]: the aggregated
  model is exported and evaluated by ``onnxrun`` on the held-out data, in process;
- evaluation-only nodes [eval-only = "onnxruntime"]: a node whose budget fits no
  training (``none``) receives the round's model as ONNX bytes and evaluates it on its
  own data in a torch-free process (``client.ort_eval``); its metrics and measured
  peak go into the round's ``assignments`` and ``federated_eval``;
- export [export-onnx = "end" | "every-round"]: ``model.onnx`` (and with
  [export-quantize] ``model.int8.onnx``) plus ``export.json`` in the run folder.

An export that fails is logged and recorded in ``export.json``; it never stops the
run, except under ``eval-runtime = "onnxruntime"``, which cannot evaluate without it.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from torch import nn

from onnxrun.evaluate import evaluate_arrays, make_session
from server.config import ServerConfig
from server.export import (
    ONNX_FILE,
    REPORT_FILE,
    ExportError,
    export_model,
    export_onnx,
)
from server.persist import atomic_write_bytes, json_bytes
from wire import keys
from wire.reply import EvalResult
from workloads import Workload

log = logging.getLogger(__name__)

EVAL_FIELDS = {  # EvalResult field -> assignment record key
    "accuracy": "eval_accuracy",
    "loss": "eval_loss",
    "num_examples": "eval_num_examples",
    "eval_s": "eval_s",
}


class OnnxRounds:
    """What the round loop does with ONNX, under one run's settings."""

    def __init__(self, cfg: ServerConfig, workload: Workload, out: Path) -> None:
        self.cfg = cfg
        self.workload = workload
        self.out = out
        self._round_model: tuple[int, ArrayRecord | None] | None = None
        self._eval_data: tuple[np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------ central
    def central_metrics(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics of ``model`` in the configured runtime."""
        if self.cfg.export.eval_runtime == "torch":
            return self.workload.evaluate(model)
        if self.workload.kind not in ("image", "lm"):
            raise ValueError(
                f"eval-runtime=onnxruntime evaluates classifiers and language models; "
                f"{self.workload.name} is neither: use eval-runtime=torch"
            )
        if self._eval_data is None:
            self._eval_data = self.workload.eval_arrays()
        x, y = self._eval_data
        with tempfile.TemporaryDirectory(prefix="fleetfit-central-") as tmp:
            path = export_onnx(model, self.workload, Path(tmp) / ONNX_FILE)
            m = evaluate_arrays(make_session(str(path)), x, y, self.workload.kind)
        return {k: float(v) for k, v in m.items() if k != "num_examples"}

    # ------------------------------------------------------------ eval-only nodes
    def eval_only_arrays(self, model: nn.Module, server_round: int) -> ArrayRecord:
        """The arrays of a ``none`` node's instruction: the round's model as ONNX
        bytes when evaluation-only work is on, else none (empty)."""
        if (
            self.cfg.export.eval_only == "off"
            or self.cfg.strategy == "exclude"  # the status quo: excluded nodes idle
            or self.workload.kind not in ("image", "lm")
        ):
            return ArrayRecord()
        if self._round_model is None or self._round_model[0] != server_round:
            self._round_model = (server_round, self._onnx_record(model))
        record = self._round_model[1]
        if record is None:
            return ArrayRecord()
        return record

    def _onnx_record(self, model: nn.Module) -> ArrayRecord | None:
        with tempfile.TemporaryDirectory(prefix="fleetfit-eval-only-") as tmp:
            try:
                path = export_onnx(
                    model, self.workload, Path(tmp) / ONNX_FILE, external_data=False
                )
            except (ExportError, ValueError) as e:
                log.warning("evaluation-only nodes get no model: %s", e)
                return None
            data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        return ArrayRecord({keys.ONNX_MODEL: Array(data)})

    @staticmethod
    def eval_report(result: EvalResult | None) -> dict[str, Any]:
        """The evaluation entries of a ``none`` node's assignment record."""
        if result is None:
            return {}
        out: dict[str, Any] = {
            key: getattr(result, name)
            for name, key in EVAL_FIELDS.items()
            if getattr(result, name) is not None
        }
        if out:
            out["eval_runtime"] = result.runtime or "onnxruntime"
        if result.error:
            out["eval_error"] = result.error
        return out

    @staticmethod
    def add_federated_eval(
        record: dict[str, Any], reports: dict[int, dict[str, Any]]
    ) -> None:
        """Put the evaluation-only nodes' results into a round record: per node in
        ``assignments`` and, weighted by examples, in ``federated_eval``."""
        total = loss = correct = 0.0
        nodes = 0
        for a in record["assignments"]:
            rep = reports.get(a["node_id"]) or {}
            extra = {
                k: rep[k]
                for k in (*EVAL_FIELDS.values(), "eval_runtime", "eval_error")
                if k in rep
            }
            a.update(extra)
            n = extra.get("eval_num_examples")
            if n and "eval_loss" in extra and "eval_accuracy" in extra:
                nodes += 1
                total += n
                loss += extra["eval_loss"] * n
                correct += extra["eval_accuracy"] * n
        record["num_evaluated"] = nodes
        record["federated_eval"] = (
            {
                "accuracy": correct / total,
                "loss": loss / total,
                "num_examples": int(total),
                "num_nodes": nodes,
            }
            if total
            else None
        )

    # ------------------------------------------------------------ export
    def after_round(self, model: nn.Module, server_round: int) -> dict[str, Any] | None:
        """Export to the run folder when this round calls for it."""
        last = server_round == self.cfg.num_server_rounds
        if self.cfg.export.onnx == "off" or (
            self.cfg.export.onnx == "end" and not last
        ):
            return None
        try:
            return export_model(
                model,
                self.workload,
                self.out / ONNX_FILE,
                quantize=self.cfg.export.quantize,
                extra={"round": server_round},
            )
        except (ExportError, ValueError, RuntimeError) as e:
            log.warning("round %d: ONNX export failed: %s", server_round, e)
            failed = {
                "schema": 1,
                "workload": self.workload.name,
                "round": server_round,
                "error": str(e),
            }
            report = self.out / REPORT_FILE
            if not report.exists() or "error" in json.loads(report.read_text()):
                atomic_write_bytes(report, json_bytes(failed))
            return None
