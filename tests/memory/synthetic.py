"""Synthetic profiles for planner tests: random block costs, no model."""

from __future__ import annotations

import random

from memory.profile import BlockCosts, BlockProfile, DiskBandwidth, Profile

MiB = 2**20


def _costs(rng: random.Random, scale: float, last: bool) -> BlockCosts:
    io = int(rng.randint(1, 8) * MiB * scale)
    saved = int(rng.randint(0, 40) * MiB * scale)
    fwd_s = rng.uniform(0.01, 0.1) * scale
    return BlockCosts(
        input_bytes=io,
        output_bytes=4 if last else io,
        saved_bytes=saved,
        saves_input=rng.random() < 0.7,
        saves_output=rng.random() < 0.3,
        forward_peak_bytes=saved + io + int(rng.randint(0, 10) * MiB * scale),
        forward_no_grad_peak_bytes=io + int(rng.randint(0, 10) * MiB * scale),
        backward_peak_bytes=int(rng.randint(1, 30) * MiB * scale),
        forward_flops=int(1e9 * scale),
        backward_flops=int(2e9 * scale),
        forward_s=fwd_s,
        backward_s=2 * fwd_s,
        time_source="flops",
    )


def random_profile(
    n: int,
    seed: int,
    *,
    batch: int = 4,
    chunks: tuple[int, ...] = (),
    tied: bool = False,
) -> Profile:
    """``n`` random blocks; microbatch counts dividing ``batch``; optional loss chunks."""
    rng = random.Random(seed)
    ms = [m for m in range(1, batch + 1) if batch % m == 0]
    blocks = []
    for k in range(n):
        p = rng.randint(0, 30) * MiB
        last = k == n - 1
        costs = {
            m: _costs(random.Random(seed * 1000 + k * 10 + m), 1 / m, last) for m in ms
        }
        chunk = {}
        if last:
            for m in ms:
                for c in chunks:
                    chunk[(m, c)] = _costs(
                        random.Random(seed + m + c), 1 / (m * c), True
                    )
        shared = 2 * MiB if tied and last and n > 1 else 0
        blocks.append(
            BlockProfile(
                name=f"b{k}",
                num_params=p // 4,
                param_bytes=p,
                grad_bytes=p,
                optimizer_state_bytes=2 * p,
                buffer_bytes=rng.choice([0, 0, 4096]),
                max_param_tensor_bytes=p // 2,
                shared_param_bytes=shared,
                shared_with=("b0",) if shared else (),
                costs=costs,
                chunk_costs=chunk,
            )
        )
    return Profile(
        blocks=tuple(blocks),
        batch_size=batch,
        batch_dependent=False,
        batch_bytes=64 * 1024,
        construction_peak_bytes=sum(b.param_bytes for b in blocks),
        flops_per_s=1e10,
        loss_chunk_options=(1, *chunks),
        disk=DiskBandwidth("/tmp", 500e6, 300e6),
    )


def gpt_like_profile(num_layers: int, *, batch: int = 4) -> Profile:
    """An embedding, ``num_layers`` identical transformer layers and a big-vocab head."""
    ms = [m for m in range(1, batch + 1) if batch % m == 0]
    act = 6 * MiB  # one (batch x seq x d) tensor

    def layer(m: int) -> BlockCosts:
        return BlockCosts(
            act // m,
            act // m,
            16 * act // m,
            True,
            False,
            18 * act // m,
            3 * act // m,
            6 * act // m,
            10**10 // m,
            2 * 10**10 // m,
            0.2 / m,
            0.4 / m,
        )

    def head(m: int, c: int = 1) -> BlockCosts:
        logits = 64 * act // (m * c)
        return BlockCosts(
            act // (m * c),
            4,
            2 * logits,
            True,
            False,
            3 * logits,
            2 * logits,
            3 * logits,
            10**11 // (m * c),
            2 * 10**11 // (m * c),
            1.0 / (m * c),
            2.0 / (m * c),
        )

    def embed(m: int) -> BlockCosts:
        return BlockCosts(
            8192 // m,
            act // m,
            0,
            False,
            False,
            act // m,
            act // m,
            150 * MiB,
            10**6,
            10**6,
            0.01 / m,
            0.02 / m,
        )

    def bp(name, p, costs, chunk=None, shared=0):
        return BlockProfile(
            name,
            p // 4,
            p,
            p,
            2 * p,
            0,
            p,
            shared,
            ("embed",) if shared else (),
            costs,
            chunk or {},
        )

    blocks = [bp("embed", 150 * MiB, {m: embed(m) for m in ms})]
    blocks += [
        bp(f"layers.{i}", 27 * MiB, {m: layer(m) for m in ms})
        for i in range(num_layers)
    ]
    chunk = {(m, c): head(m, c) for m in ms for c in (2, 4, 8)}
    blocks.append(bp("head", 6144, {m: head(m) for m in ms}, chunk, shared=150 * MiB))
    return Profile(
        tuple(blocks),
        batch,
        False,
        65536,
        1100 * MiB,
        flops_per_s=5e10,
        loss_chunk_options=(1, 2, 4, 8),
        disk=DiskBandwidth("/tmp", 1e9, 5e8),
    )
