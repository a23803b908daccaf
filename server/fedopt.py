"""Server-side optimisers over the round's aggregate, one key at a time.

The round's aggregate (``server.aggregate``: a weighted mean, a median or a trimmed
mean per key) is where the clients would move the global model. FedAvg takes it as
the new model. The others (Hsu et al. 2019, FedAvgM; Reddi et al. 2021, "Adaptive
Federated Optimization": FedAdagrad, FedAdam, FedYogi) treat the difference as a
pseudo-gradient and step a server optimiser with it, as Flower's strategies of the
same names do. With ``delta = aggregate - global`` for a key (Reddi's Delta_t, the
negative pseudo-gradient) and ``t`` that key's own step count:

- ``fedavgm``: ``v = delta`` the first time, then ``v = momentum * v + delta``;
  ``x += lr * v`` (Flower's FedAvgM with its pseudo-gradient's sign turned).
- ``fedadagrad``: ``v += delta**2``; ``x += lr * delta / (sqrt(v) + tau)`` (no first
  moment, as Flower's FedAdagrad: beta1 = 0).
- ``fedadam``: ``m = b1 m + (1-b1) delta``, ``v = b2 v + (1-b2) delta**2``;
  ``x += lr * sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + tau)``. Flower corrects
  by ``server_round + 1``; here ``t`` counts the rounds in which this key was trained
  (1 the first time), Adam's own bias correction.
- ``fedyogi``: ``m`` as Adam, ``v = v - (1-b2) delta**2 sign(v - delta**2)``;
  ``x += lr * m / (sqrt(v) + tau)`` (no bias correction, as Flower and Reddi).

Per key: fleetfit's rounds train different parts of the model (``part`` windows), so a
key nobody trained this round has no pseudo-gradient. Its value, moments and step count
stay exactly as they were: an untrained round is no step at all, not a step with a zero
gradient (which would decay Adam's moments and advance its bias correction). Only
floating parameters are optimised; buffers (BatchNorm's running statistics, counters)
take the aggregate. The state is per key and plain tensors: ``state_dict`` /
``load_state_dict`` round-trip it bit for bit (``server.persist`` keeps it in
``state/`` for ``--resume``).

    >>> opt = ServerOptimizer(ServerOptConfig(name="fedadam"), ["w"])
    >>> new = opt.step({"w": w0}, {"w": w_avg}, trained={"w"})  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

log = logging.getLogger(__name__)

SERVER_OPTS = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
AGGREGATIONS = ("mean", "median", "trimmed-mean")
DEFAULT_LR = {
    "fedavg": 1.0,
    "fedavgm": 1.0,
    "fedadagrad": 0.1,
    "fedadam": 0.1,
    "fedyogi": 0.01,
}
"""The server learning rate of ``server-lr = 0``: Flower 1.42's defaults (FedAvgM's
``server_learning_rate``, FedAdagrad's, FedAdam's and FedYogi's ``eta``)."""

_USES = {  # the settings each optimiser reads (the others are ignored, with a warning)
    "fedavg": (),
    "fedavgm": ("server-lr", "server-momentum"),
    "fedadagrad": ("server-lr", "server-tau"),
    "fedadam": ("server-lr", "server-beta1", "server-beta2", "server-tau"),
    "fedyogi": ("server-lr", "server-beta1", "server-beta2", "server-tau"),
}


@dataclass(frozen=True)
class ServerOptConfig:
    """How the server turns the round's replies into the next model (run-config key
    in brackets)."""

    name: str = field(default="fedavg", metadata={"key": "server-opt"})
    #   [server-opt] fedavg | fedavgm | fedadam | fedyogi | fedadagrad: fedavg takes
    #   the aggregate as the model (the default, unchanged); the others step a server
    #   optimiser with it, per key (module doc)
    lr: float = field(default=0.0, metadata={"key": "server-lr"})
    #   [server-lr] server learning rate (dimensionless, on the pseudo-gradient);
    #   0: Flower's default for the optimiser (DEFAULT_LR)
    momentum: float = field(default=0.9, metadata={"key": "server-momentum"})
    #   [server-momentum] fedavgm's momentum, in [0, 1)
    beta1: float = field(default=0.9, metadata={"key": "server-beta1"})
    #   [server-beta1] fedadam / fedyogi: first-moment decay, in [0, 1)
    beta2: float = field(default=0.99, metadata={"key": "server-beta2"})
    #   [server-beta2] fedadam / fedyogi: second-moment decay, in [0, 1)
    tau: float = field(default=1e-3, metadata={"key": "server-tau"})
    #   [server-tau] adaptivity (Reddi's tau, added to sqrt(v)): > 0, in the
    #   parameters' units
    aggregation: str = "mean"  # [aggregation] mean | median | trimmed-mean: mean is
    #   weighted by example counts (weight-clip applies); median and trimmed-mean are
    #   unweighted and per key over the replies that trained it (Flower's FedMedian,
    #   FedTrimmedAvg)
    trim_fraction: float = 0.2  # [trim-fraction] trimmed-mean: share of the replies
    #   cut at each end, per key, in [0, 0.5) (Flower's FedTrimmedAvg beta)

    @property
    def resolved_lr(self) -> float:
        """``server-lr``, or the optimiser's default where it is 0."""
        return self.lr or DEFAULT_LR.get(self.name, 1.0)

    def validate(self, what: str = "run-config") -> None:
        """``ValueError`` naming the key, the value and the fix."""

        def bad(key: str, value: Any, rule: str) -> ValueError:
            return ValueError(f"{what} {key}={value!r} is invalid: {rule}")

        if self.name not in SERVER_OPTS:
            raise bad(
                "server-opt", self.name, f"choose one of {', '.join(SERVER_OPTS)}"
            )
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise bad("server-lr", self.lr, "must be > 0, or 0 for the default")
        for key, value in (
            ("server-momentum", self.momentum),
            ("server-beta1", self.beta1),
            ("server-beta2", self.beta2),
        ):
            if not 0 <= value < 1:
                raise bad(key, value, "must be in [0, 1)")
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise bad("server-tau", self.tau, "must be a positive number (1e-3)")
        if self.aggregation not in AGGREGATIONS:
            raise bad(
                "aggregation",
                self.aggregation,
                f"choose one of {', '.join(AGGREGATIONS)}",
            )
        if not 0 <= self.trim_fraction < 0.5:
            raise bad("trim-fraction", self.trim_fraction, "must be in [0, 0.5)")

    def ignored(self) -> list[str]:
        """The keys set away from their defaults that this configuration does not
        read (the caller warns about them)."""
        from wire.flat import flat_key

        uses = set(_USES[self.name])
        if self.aggregation == "trimmed-mean":
            uses.add("trim-fraction")
        default = ServerOptConfig()
        return [
            flat_key(f)
            for f in fields(self)
            if flat_key(f) not in uses
            and flat_key(f) not in ("server-opt", "aggregation")
            and getattr(self, f.name) != getattr(default, f.name)
        ]


class ServerOptimizer:
    """A server optimiser with state per key (see the module doc).

    Args:
        cfg: the optimiser and its settings.
        keys: the state-dict keys it optimises (floating parameters); other keys take
            the aggregate.
    """

    def __init__(self, cfg: ServerOptConfig, keys: Iterable[str]) -> None:
        self.cfg = cfg
        self.keys = tuple(sorted(set(keys)))
        self.steps: dict[str, int] = {}  # rounds in which each key was trained
        self.moments: dict[str, dict[str, torch.Tensor]] = {}  # key -> "m"/"v" state

    @property
    def active(self) -> bool:
        """False for fedavg: the aggregate is the model, bit for bit."""
        return self.cfg.name != "fedavg"

    @torch.no_grad()
    def step(
        self,
        reference: dict[str, torch.Tensor],
        aggregate: dict[str, torch.Tensor],
        trained: set[str] | frozenset[str],
    ) -> dict[str, torch.Tensor]:
        """The next model from the global ``reference`` and the round's ``aggregate``.

        ``trained``: the keys some accepted reply carried this round. Any other key
        keeps its reference value and its state.
        """
        if not self.active:
            return aggregate
        out = dict(aggregate)
        for key in self.keys:
            if key not in trained:
                out[key] = reference[key].clone()
                continue
            x = reference[key]
            out[key] = x + self._direction(key, aggregate[key] - x)
        return out

    def _direction(self, key: str, delta: torch.Tensor) -> torch.Tensor:
        """Advance ``key``'s state by one step with ``delta``; return its change."""
        cfg, lr = self.cfg, self.cfg.resolved_lr
        t = self.steps.get(key, 0) + 1
        self.steps[key] = t
        state = self.moments.setdefault(key, {})
        if cfg.name == "fedavgm":
            v = state.get("v")
            v = delta.clone() if v is None else v.mul_(cfg.momentum).add_(delta)
            state["v"] = v
            return v * lr
        b1, b2 = cfg.beta1, cfg.beta2
        if cfg.name == "fedadagrad":
            v = state.get("v", torch.zeros_like(delta))
            state["v"] = v.add_(delta * delta)
            return lr * delta / (v.sqrt() + cfg.tau)
        m = state.get("m", torch.zeros_like(delta))
        state["m"] = m.mul_(b1).add_(delta, alpha=1 - b1)
        v = state.get("v", torch.zeros_like(delta))
        sq = delta * delta
        if cfg.name == "fedadam":
            v.mul_(b2).add_(sq, alpha=1 - b2)
            scale = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        else:  # fedyogi
            v.sub_((1 - b2) * sq * torch.sign(v - sq))
            scale = lr
        state["v"] = v
        return scale * m / (v.sqrt() + cfg.tau)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors: ``step/<key>`` (int64 scalar), ``m/<key>``, ``v/<key>``."""
        out: dict[str, torch.Tensor] = {}
        for key, t in sorted(self.steps.items()):
            out[f"step/{key}"] = torch.tensor(t, dtype=torch.int64)
            for name, value in sorted(self.moments.get(key, {}).items()):
                out[f"{name}/{key}"] = value.clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict``'s tensors exactly; ``ValueError`` for a key this
        optimiser does not hold."""
        steps: dict[str, int] = {}
        moments: dict[str, dict[str, torch.Tensor]] = {}
        known = set(self.keys)
        for name, value in state.items():
            kind, _, key = name.partition("/")
            if key not in known or kind not in ("step", "m", "v"):
                raise ValueError(
                    f"server optimiser state {name!r} names no parameter of this "
                    "model (or no state of it); resume with the model it was saved with"
                )
            if kind == "step":
                steps[key] = int(value)
            else:
                moments.setdefault(key, {})[kind] = value.clone()
        self.steps, self.moments = steps, moments


__all__ = [
    "AGGREGATIONS",
    "DEFAULT_LR",
    "SERVER_OPTS",
    "ServerOptConfig",
    "ServerOptimizer",
]
