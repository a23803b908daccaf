"""The run's shape: what every client trains on in a round, written once.

The same ``RunShape`` travels the whole way: a CLI flag or a fleet file sets it in
``SimulationSettings.shape``, the run config holds it in ``ServerConfig.shape`` (its
keys flat beside the others: ``workload``, ``local-steps``, ...), and the server sends
it in every ``TrainInstruction.shape`` (with the node's own ``local_steps``). One name
and one default per setting; ``server.config`` checks the values.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNTIME_RESERVE = "100MiB"
"""Fixed process costs outside the memory model (torch's first backward, convolution
set-up, allocator state: 55-90 MiB measured here): the run config's
``runtime-reserve`` default. Plans are made for a budget minus this, by the server's
assigner and by a node planning for itself (``client.selfplan``)."""
RUNTIME_RESERVE_KEY = "runtime-reserve"


@dataclass(frozen=True)
class RunShape:
    """What a client trains on in a round (run-config and instruction key in
    brackets)."""

    workload: str = "digits-cnn"  # [workload] built-in name or module:function
    local_steps: int = 20  # [local-steps] optimizer steps per client per round
    lr: float = 0.003  # [lr] client AdamW learning rate
    seed: int = 0  # [seed] all randomness derives from it; a client's batch order
    #   from (seed, round, partition)
    split: str = "iid"  # [split] iid | dirichlet | natural (natural: by device class)
    dirichlet_alpha: float = 0.5  # [dirichlet-alpha] label skew for split=dirichlet
    batch_size: int = 0  # [batch-size] examples per step; 0: the workload's default
    seq_len: int = 0  # [seq-len] tokens per example (language models); 0: the
    #   workload's default
    proximal_mu: float = 0.0  # [proximal-mu] FedProx: mu / 2 * ||w - w_global||^2
    #   added to every client's loss (mu in 1 / the loss's units per squared
    #   parameter unit); 0: none
    public_share: float = 0.0  # [public-share] share of every group's training
    #   items held out from every client: data the server may pretrain on
    #   (workloads.splits.public_indices); 0: none, every item is the clients'


__all__ = ["RunShape"]
