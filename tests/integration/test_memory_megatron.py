"""The activations a Megatron GPT layer keeps for its backward pass, read by nb.memory_log from the recorded
program, against Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023,
arXiv:2205.05198), Table 2: bytes per layer of a 16-bit model with 1-byte dropout masks, for sequence s, micro-batch
b, hidden h, heads a and tensor-parallel degree t:

    no parallelism                      s b h (34 + 5 a s / h)
    tensor parallel                     s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel          s b h / t (34 + 5 a s / h)
    tensor parallel + selective recompute          s b h (10 + 24 / t)
    tensor + sequence parallel + selective recompute  s b h 34 / t

The layer is written as Megatron-LM computes it (section 4.1's breakdown): pre-LayerNorm, Q, K and V projections,
QKᵀ, softmax, attention dropout, attention over V, the output projection, dropout, residual; pre-LayerNorm, the 4h
MLP with GeLU, dropout, residual. Megatron's dropout keeps a 1-byte mask per element (its fused kernels generate
it in the forward pass and read it in the backward), so the layer's dropout multiplies by a bool mask; nabla's own
``nb.dropout`` keeps no mask at all (it is made again from the key), and the last test counts that difference.
Sequence parallelism keeps each norm's output as its shard and gathers it again in the backward pass (Megatron's
choice, ``nb.checkpoint(policy="regather")``); selective recompute is ``nb.checkpoint`` of the attention core
(QKᵀ, softmax, dropout, attention over V), as Megatron-LM's ``--recompute-activations`` does it."""

from __future__ import annotations

import numpy as np
import pytest

import nabla as nb

S, B, H, A, T = 2048, 1, 2048, 16, 8  # the layer: s = h = 2048, 16 heads, micro-batch 1, t = 8
DT = "bfloat16"
P = 0.1


def korthikanti(tp: int, sp: bool, selective: bool) -> float:
    """Table 2's bytes of activations per layer."""
    sbh, attn = S * B * H, 5 * A * S / H
    if tp == 1:
        return sbh * (34 + attn)
    if selective:
        return sbh * 34 / tp if sp else sbh * (10 + 24 / tp)
    return sbh / tp * (34 + attn) if sp else sbh * (10 + 24 / tp + attn / tp)


def layer_program(mesh, tp: bool, sp: bool, selective: bool, megatron_dropout: bool = True):
    """``loss(params, x0)`` of one GPT layer on ``mesh`` (axis ``tp``), its parameters and input (abstract)."""
    t = "tp" if tp else None
    seq = [None, "tp", None] if sp else [None, None, None]
    whole = [None, None, None]
    d = H // A

    def w(shape, spec, dtype=DT):
        return nb.abstract(shape, dtype).shard(mesh, spec)

    params = {"pos": w((S, H), [None, None]), "g1": w((H,), [None]), "b1": w((H,), [None]),
              "wq": w((H, H), [None, t]), "wk": w((H, H), [None, t]), "wv": w((H, H), [None, t]),
              "wo": w((H, H), [t, None]), "g2": w((H,), [None]), "b2": w((H,), [None]),
              "w1": w((H, 4 * H), [None, t]), "w2": w((4 * H, H), [t, None])}
    x0 = w((B, S, H), seq)

    def drop(v, spec, key):
        if not megatron_dropout:
            return nb.dropout(v, P, key)
        keep = nb.abstract(v.shape, "bool").shard(mesh, spec)  # Megatron's mask: one byte per element, kept
        return v * keep * np.array(1 / (1 - P), DT)

    def core(q, k, v):  # QK^T, softmax, dropout, attention over V: what selective recompute recomputes
        bias = nb.abstract((S, S), DT).shard(mesh, [None, None])  # the causal mask as an additive bias
        scores = nb.einsum("bqnd,bknd->bnqk", q * np.array(1 / np.sqrt(d), DT), k) + bias
        probs = drop(nb.softmax(scores, -1), [None, t, None, None], 7)
        return nb.einsum("bnqk,bknd->bqnd", probs, v).reshape(B, S, H)

    def gathered(v):
        return v.with_sharding(mesh, whole) if sp else v

    def scattered(v):
        return v.with_sharding(mesh, seq) if sp else v

    def layer(x, p):
        y = gathered(nb.layer_norm(x, p["g1"], p["b1"]))
        q, k, v = ((y @ p[n]).reshape(B, S, A, d) for n in ("wq", "wk", "wv"))
        ctx = nb.checkpoint(core)(q, k, v) if selective else core(q, k, v)
        x = x + drop(scattered(ctx @ p["wo"]), seq, 8)
        y = gathered(nb.layer_norm(x, p["g2"], p["b2"]))
        return x + drop(scattered(nb.gelu(y @ p["w1"]) @ p["w2"]), seq, 9)

    run = nb.checkpoint(layer, policy="regather") if sp else layer

    def loss(p, x0):
        x = x0 + p["pos"]  # the layer's input comes from the model before it: an activation, not an argument
        return run(x, p).astype("float32").sum()

    return loss, params, x0


CASES = {"no parallelism": (1, False, False), "tensor parallel": (T, False, False),
         "tensor + sequence parallel": (T, True, False), "tensor parallel + selective": (T, False, True),
         "tensor + sequence parallel + selective": (T, True, True)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_activations_per_layer_match_korthikanti_table_2(case):
    tp, sp, selective = CASES[case]
    mesh = nb.DeviceMesh("m", (tp,), ("tp",))
    loss, params, x0 = layer_program(mesh, tp > 1, sp, selective)
    with nb.memory_log() as mem:
        grads = nb.grad(loss)(params, x0)
    want = korthikanti(tp, sp, selective)
    got = max(mem.kept.values())  # kept for the backward pass as it starts: what Table 2 counts
    assert abs(got / want - 1) <= 0.10, f"{case}: {got / 2**20:.1f} MiB kept, Korthikanti {want / 2**20:.1f} MiB"
    assert set(grads) == set(params)
    peak = max(mem.by_kind["activations"].values())
    if not selective:  # nothing is recomputed: the most kept at once is what the backward pass starts with
        assert peak == got
    else:  # the recomputed attention core is kept too while its backward runs: one layer's (a s^2 b) terms
        assert got < peak <= got + 5 * A * S * S * B // tp


def test_nabla_dropout_keeps_no_mask():
    """nb.dropout makes its mask again from the key in the backward pass: the layer keeps Table 2's bytes less
    the masks Megatron keeps (the attention dropout's a s^2 b and the two hidden dropouts' 2 s b h), exactly."""
    mesh = nb.DeviceMesh("m", (T,), ("tp",))
    kept = {}
    for megatron in (True, False):
        loss, params, x0 = layer_program(mesh, True, False, False, megatron_dropout=megatron)
        with nb.memory_log() as mem:
            nb.grad(loss)(params, x0)
        kept[megatron] = max(mem.kept.values())
    masks = A * S * S * B // T + 2 * S * B * H  # one byte each: heads over tp; hidden masks replicated
    # (and the 1 / (1 - p) constant each of Megatron's three dropouts multiplies by: a bf16 host scalar, on the
    # devices as its product reads it)
    assert kept[True] - kept[False] == masks + 3 * 2
