"""Megatron-LM's Table 1 (measured throughput of GPT models from 1.7B to 1T parameters on up to 3072 A100s) against
nabla's estimate read from a GPT program written with nabla ops, run abstractly (no data, no kernel).

    python benchmarks/megatron_table1.py [--rows 1.7,39.1] [--json PATH] [--no-results]

Source: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
SC'21 (arXiv:2104.04473), Table 1 "Weak-scaling throughput for GPT models ranging from 1 billion to 1 trillion
parameters". All rows: vocabulary 51,200, sequence 2048, fp16 mixed precision on Selene (DGX A100 80GB, 8 GPUs
and 8 HDR InfiniBand HCAs per node); percentages are of 312 TFLOP/s, and the FLOPs are eq. (3)'s (activation
recomputation included).

What the table does not list comes from the scripts Megatron-LM published for it, ``examples/sc21/
run_table_1.sh`` and ``CONFIG.sh`` (NVIDIA/Megatron-LM, commit de7dc40 "scripts for sc21", Aug 2021): the
microbatch size of each row (``MBS``), the interleaved schedule only where ``--num-layers-per-virtual-pipeline-
stage`` is given (76B, 145B, 310B, 530B; 39B and 1T run plain 1F1B), ``--checkpoint-activations`` (every layer
recomputed, ``--checkpoint-num-layers`` 1), ``--fp16``, and the data-parallel implementation (``--DDP-impl
torch`` for the rows without pipelining: PyTorch DDP, gradient all_reduces overlapped with the backward pass;
``local`` for the pipelined rows: one all_reduce of every gradient after the pipeline flushes). Megatron's
defaults of that version (``megatron/arguments.py``): attention and hidden dropout 0.1, scatter/gather of the
stage-to-stage activations (sec. 4.1), fused scale-mask-softmax, bias-GeLU and bias-dropout-add kernels.

Each row is predicted from the program, not from a formula: ``stage_program`` writes one pipeline stage of the
GPT (``l/p`` pre-LayerNorm blocks, each under ``nb.checkpoint``; the first stage also has the vocabulary-parallel
embedding, the last the final LayerNorm, the output layer and the vocabulary-parallel cross-entropy), laid out
with Megatron's tensor parallelism over ``tp`` and the batch over ``dp`` on ``cluster.mesh``; its forward and
backward for one microbatch are recorded and priced (``stage_estimate``), the slowest stage type is taken, and
``nb.pipeline_estimate`` turns it into the step (``p`` stages, ``m = B / (dp * microbatch)`` microbatches).
TFLOP/s per GPU are counted as the paper counts them: eq. (3) over the predicted step time. Two things the runs'
PyTorch did are written into the program: dropout writes a one-byte mask that its backward pass reads
(``torch_dropout``), and each microbatch after the first adds its weight gradients into ``param.grad``
(``accumulating``).
The analytic per-layer model an earlier version of this file used (``megatron_layer``, ``predict``) is kept
below it (``analytic_row``) for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import nabla as nb  # noqa: E402
from nabla.collectives import CommEvent  # noqa: E402
from nabla.pytree import flatten, unflatten  # noqa: E402
from _env import write_results  # noqa: E402
from nabla.plan import (MATMUL_OPS, Cluster, Hardware, PipelineReport, Report, PricedStep, estimate_steps,  # noqa: E402
                        gpt_flops, pipeline_estimate, priced_step)

SOURCE = "Narayanan et al., SC'21, arXiv:2104.04473, Table 1"
SCRIPTS = "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh and CONFIG.sh (commit de7dc40, Aug 2021)"
VOCAB, SEQ = 51200, 2048
DROPOUT = 0.1  # Megatron-LM's --attention-dropout and --hidden-dropout defaults (megatron/arguments.py, 2021)
DTYPE = "bfloat16"  # the paper trains in fp16; A100's fp16 and bf16 tensor-core peaks are the same 312 TFLOP/s
NODE = 8  # GPUs per DGX A100 node
DDP_BUCKET = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb default
ONE_BUCKET = 2**62  # Megatron's local DDP (megatron/model/distributed.py): one coalesced all_reduce per dtype
TARGET_NO_PIPELINE, TARGET_PIPELINE = 0.15, 0.25  # relative error allowed: rows with p = 1, rows with p > 1


class Row(NamedTuple):
    """One row of Table 1."""

    params_billion: float
    heads: int
    hidden: int
    layers: int
    tensor_parallel: int
    pipeline_parallel: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved teraFLOP/s per GPU
    peak_percent: int  # of 312 TFLOP/s


ROWS = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)


class Run(NamedTuple):
    """How Megatron-LM ran a row (``SCRIPTS``): microbatch size, layers per model chunk of the interleaved
    schedule (None: plain 1F1B) and the data-parallel implementation ("torch": DDP, overlapped; "local": after
    the flush)."""

    microbatch: int
    layers_per_chunk: int | None
    ddp: str


RUNS = {
    1.7: Run(16, None, "torch"), 3.6: Run(16, None, "torch"), 7.5: Run(16, None, "torch"),
    18.4: Run(8, None, "torch"), 39.1: Run(4, None, "local"), 76.1: Run(2, 5, "local"),
    145.6: Run(2, 5, "local"), 310.1: Run(1, 3, "local"), 529.6: Run(1, 1, "local"), 1008.0: Run(1, None, "local"),
}


class Layout(NamedTuple):
    """A row's parallel layout as this benchmark runs it."""

    tp: int
    pp: int
    dp: int
    microbatch: int
    microbatches: int
    virtual_stages: int
    schedule: str
    overlap: str  # "grads": DDP's all_reduces run behind the backward pass; "none": after it
    bucket_bytes: int  # gradients summed in buckets of at most this many bytes


def layout(row: Row) -> Layout:
    t, p, n = row.tensor_parallel, row.pipeline_parallel, row.gpus
    run = RUNS[row.params_billion]
    dp = n // (t * p)
    m = row.batch // (dp * run.microbatch)
    v = row.layers // p // run.layers_per_chunk if run.layers_per_chunk else 1
    if run.ddp == "torch":  # PyTorch DDP: 25 MiB buckets (bucket_cap_mb), reduced as the backward pass fills them
        overlap, bucket = "grads", DDP_BUCKET
    else:  # Megatron's local DDP: every fp16 gradient flattened into one all_reduce after the flush
        overlap, bucket = "none", ONE_BUCKET
    return Layout(t, p, dp, run.microbatch, m, v, "interleaved" if v > 1 else "1f1b", overlap, bucket)


# ---- the GPT program -----------------------------------------------------------------------------------------


class Variant(NamedTuple):
    """How a run writes its GPT, for the memory checks against other published runs
    (``benchmarks/memory_published.py``). The defaults are Table 1's program as this file prices it; each option
    is a choice a published run made, written as that run computes it."""

    vocab: int = VOCAB
    seq: int = SEQ
    dtype: str = DTYPE
    recompute: str = "full"  # "full": each layer under nb.checkpoint; "selective": the attention core only; "none"
    sequence_parallel: bool = False  # Megatron-LM's SP: norms and dropouts on sequence shards over tp, regathered
    dropout: str = "torch"  # "torch": PyTorch's (torch_dropout: Table 1's); "key": nb.dropout (its mask made again
    # from the key); "mask": a kept 1-byte mask laid out as the value; "none"
    summed: bool = False  # row-parallel outputs summed over tp where Megatron-LM sums them (before bias and dropout)
    tied: bool = False  # a whole model's output layer is its embedding's transpose (False: a weight of its own)
    positions: bool = True  # learned position embeddings (False: rotary or ALiBi, no parameters)
    parallel_residual: bool = False  # GPT-J / GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    partition_activations: bool = False  # ZeRO-R's P_a: each layer's checkpointed input kept split over tp
    fused_mask: bool = False  # the causal mask made inside the softmax kernel (Megatron-LM's fused
    # scale-upper-triangular-mask-softmax), not an (s, s) bias argument read again by the backward pass


TABLE1 = Variant()
RECOMPUTE = ("full", "selective", "none")
DROPOUTS = ("torch", "key", "mask", "none")


def _dropout(v, key: int, variant: Variant, mesh, spec, like=None):
    """Dropout as the run's framework does it: PyTorch's (``torch_dropout``, ``like`` shaping its mask);
    ``nb.dropout`` keeps nothing (the mask is made again from the key); Megatron-LM's fused kernels keep a 1-byte
    mask per element (a bool laid out as ``spec``), as tests/integration/test_memory_megatron.py writes it."""
    if variant.dropout == "none":
        return v
    if variant.dropout == "torch":
        return torch_dropout(v, DROPOUT, key, like)
    if variant.dropout == "key":
        return nb.dropout(v, DROPOUT, key)
    keep = nb.abstract(v.shape, "bool").shard(mesh, spec)
    return v * keep * np.array(1 / (1 - DROPOUT), v.dtype)


def torch_dropout(x, rate: float, key: int, like=None):
    """Dropout as Megatron-LM of 2021 ran it: PyTorch's ``torch.nn.Dropout`` (and ``F.dropout`` in its
    bias-dropout-add) is one kernel that writes the output and a one-byte mask, which the backward pass reads.
    Written here as that mask (``nb.dropout`` of ones, compared: made from the key in the same pass as the output)
    and ``nb.where``, whose gradient reads the mask; ``nb.dropout`` alone keeps no mask (it makes it again from the
    key, as JAX and FlashAttention do). ``like``: a tensor of ``x``'s shape and layout the mask is shaped after
    (where ``x`` is a pending sum over tp, a comparison of it would sum it first)."""
    like = x if like is None else like
    keep = nb.dropout(like * np.array(0, x.dtype) + np.array(1, x.dtype), rate, key) > np.array(0, x.dtype)
    return nb.where(keep, x * np.array(1 / (1 - rate), x.dtype), np.array(0, x.dtype))


def gpt_block(x, p: dict, heads: int, mask, key: int, variant: Variant = TABLE1, mesh=None):
    """One GPT layer as Megatron-LM computes it: pre-LayerNorm, self-attention (one QKV projection, causal
    softmax, attention dropout, output projection), residual with dropout, pre-LayerNorm, the 4h MLP with GeLU,
    residual with dropout. Scalars are 0-d arrays of ``x``'s dtype so nothing is promoted to float32.
    ``variant`` (its defaults: this file's Table 1 program) adds Megatron-LM's sequence parallelism (``x``
    arrives split over tp on the sequence; gathered before each column-parallel matmul, reduce-scattered after
    each row-parallel one), the sum of each row-parallel output where Megatron makes it, selective recompute
    (the attention core under ``nb.checkpoint``), kept dropout masks, and GPT-NeoX's parallel residual; ``mesh``
    (axes ``dp`` and ``tp``) is needed by every option that lays a value out."""
    b, s, h = x.shape
    d = h // heads
    eps = np.array(1e-5, x.dtype)
    sp, dt = variant.sequence_parallel, x.dtype
    hidden_spec = ["dp", "tp", None] if sp else ["dp", None, None]

    def gathered(v):  # SP: the norm's output gathered over tp for the column-parallel matmul
        return v.with_sharding(mesh, ["dp", None, None]) if sp else v

    def summed(v):  # a row-parallel output's sum: all_reduce, or reduce_scatter onto sequence shards under SP
        return v.with_sharding(mesh, hidden_spec) if (sp or variant.summed) else v

    def core(q, k, v):  # QK^T, softmax, dropout, attention over V: what selective recompute recomputes
        bias = nb.abstract(mask.shape, dt).shard(mesh, [None, None]) if variant.fused_mask else mask
        scores = nb.einsum("bqnd,bknd->bnqk", q, k) + bias  # mask: 0 on and below the diagonal, -10000 above
        probs = _dropout(nb.softmax(scores, -1), key, variant, mesh, ["dp", "tp", None, None])
        return nb.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, h)

    def attention(x):
        y = gathered(nb.layer_norm(x, p["ln1_g"], p["ln1_b"], eps=eps))
        qkv = (y @ p["w_qkv"] + p["b_qkv"]).reshape(b, y.shape[1], heads, 3 * d)  # per head [q | k | v], over tp
        q = qkv[..., :d] * np.array(1 / np.sqrt(d), dt)
        k, v = qkv[..., d:2 * d], qkv[..., 2 * d:]
        ctx = nb.checkpoint(core)(q, k, v) if variant.recompute == "selective" else core(q, k, v)
        return _dropout(summed(ctx @ p["w_o"]) + p["b_o"], key + 1, variant, mesh, hidden_spec, x)

    def mlp(x):
        y = gathered(nb.layer_norm(x, p["ln2_g"], p["ln2_b"], eps=eps))
        u = nb.gelu(y @ p["w_1"] + p["b_1"])
        return _dropout(summed(u @ p["w_2"]) + p["b_2"], key + 2, variant, mesh, hidden_spec, x)

    if variant.parallel_residual:
        return x + attention(x) + mlp(x)
    x = x + attention(x)  # row-parallel: summed over tp here (or where ``summed`` says)
    return x + mlp(x)


def layer_params(mesh, h: int, dtype: str = DTYPE) -> dict:
    """One layer's parameters, Megatron's tensor parallelism: QKV and the MLP's first matmul column-parallel,
    the attention output and the MLP's second matmul row-parallel, norms and row-parallel biases replicated."""
    def w(shape, spec):
        return nb.abstract(shape, dtype).shard(mesh, spec)

    return {"ln1_g": w((h,), [None]), "ln1_b": w((h,), [None]),
            "w_qkv": w((h, 3 * h), [None, "tp"]), "b_qkv": w((3 * h,), ["tp"]),
            "w_o": w((h, h), ["tp", None]), "b_o": w((h,), [None]),
            "ln2_g": w((h,), [None]), "ln2_b": w((h,), [None]),
            "w_1": w((h, 4 * h), [None, "tp"]), "b_1": w((4 * h,), ["tp"]),
            "w_2": w((4 * h, h), ["tp", None]), "b_2": w((h,), [None])}


KINDS = ("whole", "first", "middle", "last")


class Stage(NamedTuple):
    """One stage's program for one microbatch (forward and backward) and its arguments, all abstract."""

    kind: str
    fn: Any
    args: tuple
    mesh: Any
    layers: int


def stage_program(row: Row, kind: str, mesh, microbatch: int, layers: int, variant: Variant = TABLE1,
                  grad_specs: Any = None) -> Stage:
    """The ``kind`` stage of ``row``'s GPT (anything with ``hidden`` and ``heads``) on ``mesh`` (axes ``dp``,
    ``tp``) for one microbatch: ``layers`` blocks; ``first`` and ``whole`` start from token ids with the
    vocabulary-parallel embedding (plus learned positions, embedding dropout), ``last`` and ``whole`` end in the
    final LayerNorm, the vocabulary-parallel output layer and cross-entropy (on float32 logits, as Megatron-LM's
    default does); ``first`` and ``middle`` end in the activation the next stage gets, and take its gradient
    back. ``variant`` (default: Table 1's program, each block under ``nb.checkpoint``) sets the vocabulary,
    sequence, dtype, recomputation, sequence parallelism (each block under ``nb.checkpoint(policy="regather")``,
    the activations between blocks split over tp on the sequence), dropout masks and the rest (``Variant``);
    ``grad_specs`` (a stage that ends in the loss: the parameters' gradients, as ``nb.value_and_grad`` takes it)
    the layouts gradients are summed into (ZeRO stage 2)."""
    if kind not in KINDS:
        raise ValueError(f"stage kind must be one of {KINDS}, got {kind!r}")
    if variant.recompute not in RECOMPUTE or variant.dropout not in DROPOUTS:
        raise ValueError(f"recompute must be one of {RECOMPUTE} and dropout one of {DROPOUTS}, got {variant}")
    h, heads = row.hidden, row.heads
    V, S, dt = variant.vocab, variant.seq, variant.dtype
    dp = mesh.shape[mesh.axis_names.index("dp")]
    B = microbatch * dp
    sp = variant.sequence_parallel
    split = ["dp", "tp", None]  # the activations between blocks under SP (and a checkpointed input under P_a)
    between = split if sp else ["dp", None, None]

    def w(shape, spec, dtype=dt):
        return nb.abstract(shape, dtype).shard(mesh, spec)

    params: dict = {"layers": [layer_params(mesh, h, dt) for _ in range(layers)]}
    starts = kind in ("first", "whole")
    ends = kind in ("last", "whole")
    tied = variant.tied and kind == "whole"  # (a last stage holds its own copy of a tied embedding: ``head``)
    if starts:
        params["embed"] = {"wte": w((V, h), ["tp", None])}
        if variant.positions:
            params["embed"]["wpe"] = w((S, h), [None, None])
        inp = w((B, S), ["dp", None], "int32")
    else:
        inp = w((B, S, h), between)
    if ends:
        params["head"] = {"ln_g": w((h,), [None]), "ln_b": w((h,), [None])}
        if not tied:
            params["head"]["w"] = w((h, V), [None, "tp"])
    mask = w((S, S), [None, None])  # the causal mask as an additive bias (a constant, not differentiated)

    def block(i: int):  # (lambdas: the recorded steps are named "checkpoint(<lambda>)", as Table 1's always were)
        run = lambda x, p: gpt_block(x, p, heads, mask, 10 + 3 * i, variant, mesh)  # noqa: E731
        # P_a: the checkpointed input is a 1/tp shard, gathered to run the block
        partitioned = lambda x, p: run(x.with_sharding(mesh, ["dp", None, None]), p).with_sharding(mesh, split)  # noqa: E731
        if variant.recompute == "full":
            return nb.checkpoint(partitioned if variant.partition_activations else run)
        return nb.checkpoint(run, policy="regather") if sp else run

    def body(params, x):
        if starts:
            e = params["embed"]
            with nb.named_scope("embedding"):
                x = nb.take(e["wte"], x, axis=0)
                if sp or variant.summed:  # the vocabulary-parallel lookup summed over tp (scattered under SP)
                    x = x.with_sharding(mesh, between)
                if variant.positions:
                    x = x + e["wpe"]
                x = _dropout(x, 1, variant, mesh, between)
                if variant.partition_activations:
                    x = x.with_sharding(mesh, split)
        for i, p in enumerate(params["layers"]):
            with nb.named_scope(f"layer {i}"):
                x = block(i)(x, p)
        if not ends:  # what is sent is the summed activation (nabla would leave the last row-parallel sum pending)
            return x.with_sharding(mesh, between)
        hd = params["head"]
        with nb.named_scope("output"):
            y = nb.layer_norm(x, hd["ln_g"], hd["ln_b"], eps=np.array(1e-5, x.dtype))
            if sp or variant.partition_activations:
                y = y.with_sharding(mesh, ["dp", None, None])
            return y @ (params["embed"]["wte"].T if tied else hd["w"])  # (B, s, V), the vocabulary over tp

    if ends:
        targets = w((B, S), ["dp", None], "int32")

        def loss(params, x, targets):
            logits = body(params, x)
            with nb.named_scope("loss"):
                return nb.cross_entropy(logits.astype("float32"), targets)

        # a stage that gets an activation sends its gradient back to the stage before
        specs = grad_specs if starts or grad_specs is None else (grad_specs, None)
        fn = nb.value_and_grad(loss, argnums=0 if starts else (0, 1), grad_specs=specs)
        return Stage(kind, fn, (params, inp, targets), mesh, layers)

    cotangent = w((B, S, h), between)  # the gradient the next stage sends back

    return Stage(kind, through(body, starts), (params, inp, cotangent), mesh, layers)


def through(body: Any, starts: bool) -> Any:
    """The program of a stage that does not end in the loss: ``body`` forward, then backward from the gradient the
    next stage sends back, to the parameters' gradients (and the incoming activation's, unless it ``starts``)."""
    def forward_backward(params, x, cotangent):
        if starts:
            _, back = nb.vjp(lambda params: body(params, x), params)
        else:
            _, back = nb.vjp(body, params, x)
        return back(cotangent)

    return forward_backward


def accumulating(stage: Any, fp32: bool = False) -> Any:
    """``stage`` (a NamedTuple with ``fn`` and ``args``, the parameters first) with its parameters' gradients added
    into a running sum, as each microbatch after the first does: PyTorch's ``AccumulateGrad`` adds a new gradient
    into ``param.grad`` in place (one elementwise kernel per parameter, reading both, writing the sum), and
    Megatron-LM's local DDP of the runs (``megatron/model/distributed.py`` at 6985e58, without
    ``--use-contiguous-buffers-in-ddp``, which CONFIG.sh does not set) keeps the fp16 gradients in ``param.grad``
    until the all_reduce after the flush; ``fp32``: the sum kept in float32 (DeepSpeed's BF16_Optimizer). The sum's
    arguments are abstract tensors laid out as the parameters."""
    leaves, tree = flatten(stage.args[0])
    acc = unflatten(tree, [nb.abstract(x.shape, "float32" if fp32 else x.dtype).shard(x.sharding) for x in leaves])

    def fn(acc, *args):
        out = stage.fn(*args)
        grads = out[1] if len(out) == 2 and not isinstance(out[0], dict) else out  # value_and_grad: (loss, grads)
        if isinstance(grads, tuple):  # the gradients of (params, activation)
            grads = grads[0]
        a, t = flatten(acc)
        return unflatten(t, [x + g for x, g in zip(a, flatten(grads)[0])])

    return stage._replace(fn=fn, args=(acc,) + tuple(stage.args))


# ---- pricing ------------------------------------------------------------------------------------------------


def _is_dp_sum(e: CommEvent) -> bool:
    return e.kind == "all_reduce" and tuple(e.axes) == ("dp",)


def bucketed(steps: list[PricedStep], dp: int, bucket_bytes: int) -> list[PricedStep]:
    """The gradient sums over ``dp`` fused into buckets of at most ``bucket_bytes`` per device, in the order the
    backward pass makes them, as DDP packs them: each bucket one all_reduce, placed where it fills. The bytes
    are the recorded ones; only the number of collectives (their latency) changes. (``nb.value_and_grad``'s
    ``bucket_bytes`` does the same in the program; the benchmark buckets the recorded sums itself so that one
    recording prices every bucket size.)"""
    if dp == 1:
        return steps
    ring = 2 * (dp - 1) / dp  # an all_reduce sends 2(k-1)/k of the block in a ring
    out: list[PricedStep] = []
    pending, layer = 0, None

    def flush():
        out.append(PricedStep("bucket", "grad of bucket", "backward", DTYPE, 0, 0, 0,
                        (CommEvent("all_reduce", ("dp",), int(pending), dp),), layer))

    for s in steps:
        sums = [e for e in s.events if _is_dp_sum(e)]
        if not (sums and s.user.startswith("grad of")):
            out.append(s)
            continue
        out.append(s._replace(events=tuple(e for e in s.events if not _is_dp_sum(e))))
        pending += sum(e.bytes for e in sums)
        layer = s.layer
        if pending >= bucket_bytes * ring:
            flush()
            pending = 0
    if pending:
        flush()
    return out


def stage_estimate(stage: Stage, cluster: Cluster, overlap: str = "grads", bucket_bytes: int | None = None,
                   fusion: tuple[bool, ...] = (True,)) -> tuple[Report, ...]:
    """``nb.estimate`` of ``stage``: its program run abstractly, its recorded steps (``priced_step``, gradient sums
    ``bucketed`` as DDP buckets them when ``bucket_bytes`` is given) and memory priced on ``cluster``, once per
    entry of ``fusion`` (``estimate_steps``'s option: elementwise chains fused, or every step alone)."""
    with nb.comm_log() as log, nb.memory_log() as mem:
        stage.fn(*stage.args)
    dp = stage.mesh.shape[stage.mesh.axis_names.index("dp")]
    steps = [priced_step(s) for s in log.steps]
    if bucket_bytes:
        steps = bucketed(steps, dp, bucket_bytes)
    model = sum(s.flops for s in steps if s.phase != "recompute")
    return tuple(estimate_steps(steps, cluster, stage.mesh, overlap, model, mem, fusion=f) for f in fusion)


def optimizer_estimate(params: Any, cluster: Cluster, mesh, fusion: tuple[bool, ...] = (True,)) -> tuple[Report, ...]:
    """One mixed-precision Adam update of ``params`` (``nabla.optim.Adam`` with a float32 master copy and float32
    moments, as Megatron-LM's fp16 optimizer keeps them; the gradients laid out as the parameters), priced on
    ``cluster`` once per entry of ``fusion`` (fused: one pass over each tensor's state, as apex's FusedAdam)."""
    opt = nb.optim.Adam(1e-4, master_dtype="float32")
    state = opt.init(params)
    with nb.comm_log() as log:
        opt.update(params, state, params)
    steps = [priced_step(s) for s in log.steps]
    return tuple(estimate_steps(steps, cluster, mesh, "none", fusion=f) for f in fusion)


class Estimate(NamedTuple):
    """One way of pricing a row: the stage reports, the slowest stage, its pipeline and the optimizer update."""

    stages: dict  # kind -> Report of one microbatch through that stage
    slowest: str
    pipeline: PipelineReport
    optimizer_time: float

    @property
    def step_time(self) -> float:
        return self.pipeline.step_time + self.optimizer_time


class Prediction(NamedTuple):
    row: Row
    layout: Layout
    estimate: Estimate  # nabla's pricing of the recorded steps (elementwise chains fused: the default)
    unfused: Estimate | None  # the same steps each priced as its own kernel (``fusion=False``), to compare
    flops_per_gpu: float  # eq. (3) over the GPUs: what the paper divides by the step time
    seconds: float  # wall time of the prediction on this machine

    @property
    def step_time(self) -> float:
        return self.estimate.step_time

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_gpu / self.step_time / 1e12

    @property
    def unfused_tflops_per_gpu(self) -> float | None:
        return None if self.unfused is None else self.flops_per_gpu / self.unfused.step_time / 1e12

    @property
    def ratio(self) -> float:
        return self.tflops_per_gpu / self.row.tflops_per_gpu

    @property
    def target(self) -> float:
        return TARGET_NO_PIPELINE if self.row.pipeline_parallel == 1 else TARGET_PIPELINE

    @property
    def met(self) -> bool:
        return abs(self.ratio - 1) <= self.target


def stage_kinds(pp: int) -> tuple[str, ...]:
    return ("whole",) if pp == 1 else ("first", "last") if pp == 2 else ("first", "middle", "last")


def predict_row(row: Row, hw: Hardware | None = None, kinds: tuple[str, ...] | None = None, compare: bool = True,
                optimizer: bool = True) -> Prediction:
    """Row ``row`` predicted from the program: each stage type of ``stage_kinds`` estimated on the ``(dp, tp)``
    mesh of its ``t * dp`` GPUs (A100 SXM 80GB nodes of 8, Selene's) for one microbatch; the slowest one (a
    pipeline runs at its slowest stage) priced as a pipeline of ``p`` stages, ``m`` microbatches, the row's
    schedule, stage-to-stage sends of ``microbatch * s * h * 2 / t`` bytes per GPU on the network (the
    scatter/gather optimization: each of a stage's ``t`` GPUs sends its slice on its own HCA); then the
    optimizer's update of that stage's parameters, once a step. ``compare``: also price every step alone."""
    t0 = time.perf_counter()
    hw = Hardware.preset("a100-sxm-80gb") if hw is None else hw
    lay = layout(row)
    n = lay.tp * lay.dp
    cluster = Cluster(hw, max(1, n // NODE), min(NODE, n))
    mesh = cluster.mesh("stage", (lay.dp, lay.tp), ("dp", "tp"))
    per_stage = row.layers // lay.pp
    fusion = (True, False) if compare else (True,)
    programs = {k: stage_program(row, k, mesh, lay.microbatch, per_stage) for k in (kinds or stage_kinds(lay.pp))}
    runs = {k: accumulating(s) if lay.microbatches > 1 else s for k, s in programs.items()}
    priced = {k: stage_estimate(s, cluster, lay.overlap, lay.bucket_bytes, fusion) for k, s in runs.items()}
    job = Cluster(hw, row.gpus // NODE, NODE)
    p2p = lay.microbatch * SEQ * row.hidden * 2 // lay.tp if lay.pp > 1 else None

    def pipeline(which: int) -> Estimate:
        reports = {k: r[which] for k, r in priced.items()}
        slowest = max(reports, key=lambda k: reports[k].step_time - reports[k].exposed_grad_comm)
        pipe = pipeline_estimate(reports[slowest], lay.pp, lay.microbatches, lay.schedule, lay.virtual_stages,
                                 p2p, job)
        opt = 0.0
        if optimizer:
            opt = optimizer_estimate(programs[slowest].args[0], cluster, mesh, (fusion[which],))[0].step_time
        return Estimate(reports, slowest, pipe, opt)

    flops = gpt_flops(row.batch, SEQ, row.layers, row.hidden, VOCAB) / row.gpus
    return Prediction(row, lay, pipeline(0), pipeline(1) if compare else None, flops, time.perf_counter() - t0)


# ---- the analytic model an earlier version used (kept for comparison) -------------------------------------

MICROBATCH = 1  # assumed by the analytic model: Table 1 does not list it
VIRTUAL_STAGES = 2  # assumed by the analytic model for rows with pipeline parallelism


class LayerCost(NamedTuple):
    """One transformer layer on one device for one microbatch: FLOPs of its matmuls forward and backward
    (recomputation included in the backward), HBM bytes of its memory-bound kernels (norms, softmax, GeLU,
    dropout, residuals) forward and backward, the ring bytes each device sends in the layer's
    tensor-parallel all_reduces forward and backward, and its gradient bytes (reduced over dp once a step)."""

    fwd_flops: int
    bwd_flops: int
    fwd_bytes: int
    bwd_bytes: int
    fwd_comm_bytes: int
    bwd_comm_bytes: int
    grad_bytes: int


def stage_steps(cost: LayerCost, layers: int, extra_flops: int = 0) -> list[PricedStep]:
    """The steps of one pipeline stage for one microbatch: ``layers`` identical layers forward (a matmul step,
    a memory-bound step carrying the tensor-parallel all_reduces over ``tp``), the logit GEMMs' share
    ``extra_flops``, then the layers backward, each followed by its gradient all_reduce over ``dp``."""
    def layer(i: int, phase: str, flops: int, nbytes: int, comm: int) -> list[PricedStep]:
        events = (CommEvent("all_reduce", ("tp",), comm),) if comm else ()
        return [PricedStep("matmul", "layer", phase, "bfloat16", flops, 0, 0, (), f"layer {i}"),
                PricedStep("add", "layer", phase, "bfloat16", 0, nbytes, 0, events, f"layer {i}")]

    out: list[PricedStep] = []
    for i in range(layers):
        out += layer(i, "forward", cost.fwd_flops, cost.fwd_bytes, cost.fwd_comm_bytes)
    if extra_flops:
        out.append(PricedStep("matmul", "logits", "forward", "bfloat16", extra_flops, 0, 0, (), "logits"))
    for i in reversed(range(layers)):
        out += layer(i, "backward", cost.bwd_flops, cost.bwd_bytes, cost.bwd_comm_bytes)
        if cost.grad_bytes:
            out.append(PricedStep("with_sharding", f"grad of p['layer {i}']", "backward", "bfloat16", 0, 0, 0,
                            (CommEvent("all_reduce", ("dp",), cost.grad_bytes),), f"layer {i}"))
    return out


def predict(cost: LayerCost, layers: int, stage_cluster: Cluster, dp: int, tp: int, stages: int,
            microbatches: int, job_cluster: Cluster | None = None, virtual_stages: int = 1, p2p_bytes: int = 0,
            extra_flops: int = 0, overlap: str = "grads") -> PipelineReport:
    """The predicted step of a job whose stages each run ``layers`` layers of ``cost`` on a ``(dp, tp)`` mesh
    of ``stage_cluster``: the stage's schedule (``overlap``) priced per microbatch, then the pipeline.
    ``.tflops_per_device`` is the predicted TFLOP/s per GPU."""
    mesh = stage_cluster.mesh("stage", (dp, tp), ("dp", "tp"))
    report = estimate_steps(stage_steps(cost, layers, extra_flops), stage_cluster, mesh, overlap=overlap)
    schedule = "interleaved" if virtual_stages > 1 else "1f1b"
    return pipeline_estimate(report, stages, microbatches, schedule, virtual_stages, p2p_bytes or None,
                             job_cluster)


def megatron_layer(row: Row, microbatch: int = MICROBATCH, bytes_per_value: int = 2) -> LayerCost:
    """Analytic costs of one layer of ``row`` per device. Matmuls: forward ``24 b s h^2 (1 + s/(6h)) / t``
    (eq. 3's layer term over 4 passes), backward twice that plus the recomputed forward. Memory-bound
    kernels: the activations they write, ``s b h (10 + 24/t + 5 a s/(h t))`` bytes (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", eq. 2 with tensor parallelism), each
    written and read once (x2) forward, and twice that backward (a rough traffic model, not a measurement).
    Comm: Megatron's two all_reduces of the ``b s h`` activation per pass over ``t`` (forward: two;
    backward and the recomputed forward: four). Gradients: the layer's ``12 h^2 / t`` weights in bf16."""
    b, s, h, t, a = microbatch, SEQ, row.hidden, row.tensor_parallel, row.heads
    fwd = int(24 * b * s * h * h * (1 + s / (6 * h)) / t)
    traffic = int(2 * s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    ring = 2 * (t - 1) * (b * s * h * bytes_per_value) // t if t > 1 else 0
    return LayerCost(fwd, 3 * fwd, traffic, 2 * traffic, 2 * ring, 4 * ring, 12 * h * h // t * bytes_per_value)


def analytic_row(row: Row, hw: Hardware | None = None) -> PipelineReport:
    """The analytic prediction for one row of Table 1 on A100 SXM 80GB nodes of 8 (Selene's), with
    ``MICROBATCH`` 1 and ``VIRTUAL_STAGES`` 2 assumed for every row (the earlier model, kept for comparison)."""
    hw = Hardware.preset("a100-sxm-80gb") if hw is None else hw
    t, p, n = row.tensor_parallel, row.pipeline_parallel, row.gpus
    d = n // (t * p)
    microbatches = row.batch // (d * MICROBATCH)
    stage_gpus = d * t
    stage_cluster = Cluster(hw, max(1, stage_gpus // 8), min(8, stage_gpus))
    job = Cluster(hw, n // 8, 8)
    v = VIRTUAL_STAGES if p > 1 else 1
    logits = int(6 * MICROBATCH * SEQ * row.hidden * VOCAB / (t * p))  # eq. (3)'s logit term, spread over stages
    p2p = MICROBATCH * SEQ * row.hidden * 2 // t  # scatter/gather: b s h / t values per boundary (sec. 4.1)
    return predict(megatron_layer(row), row.layers // p, stage_cluster, d, t, p, microbatches, job, v,
                   p2p if p > 1 else 0, logits)




# ---- the estimator at scale: a Llama-2-70B-shaped step on 16,384 devices -----------------------------------------

#: Llama 2 70B (its config.json): hidden, layers, heads, KV heads, MLP size, vocabulary; sequence 4096
LLAMA70B = dict(hidden=8192, layers=80, heads=64, kv_heads=8, mlp=28672, vocab=32000, seq=4096)
LLAMA_TP, LLAMA_DP = 8, 2048
SCALE_TARGET_SECONDS, SCALE_TARGET_BYTES = 2.0, 2**30
LLAMA_RUNS = 5  # fresh processes timed; the median is recorded


def _rms(x, g):
    return x / nb.sqrt((x * x).mean(-1, keepdims=True) + np.array(1e-5, x.dtype)) * g


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + nb.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def llama_block(x, p: dict, heads: int, kv: int, cos, sin):
    """A Llama 2 block: RMSNorm, rotary grouped-query attention (``kv`` key/value heads, each shared by
    ``heads / kv`` query heads) as FlashAttention runs it (``nb.dot_product_attention``, causal: no scores kept),
    RMSNorm, SwiGLU MLP, residuals."""
    b, s, h = x.shape
    d = h // heads
    y = _rms(x, p["attn_norm"])
    q = _rotate((y @ p["wq"]).reshape(b, s, heads, d), cos, sin)
    k = _rotate((y @ p["wk"]).reshape(b, s, kv, d), cos, sin)
    v = (y @ p["wv"]).reshape(b, s, kv, d)
    o = nb.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, h)
    x = x + o @ p["wo"]
    y = _rms(x, p["mlp_norm"])
    return x + (nb.silu(y @ p["w1"]) * (y @ p["w3"])) @ p["w2"]


def llama70b_program(tp: int = LLAMA_TP, dp: int = LLAMA_DP, layers: int | None = None):
    """The training step (``nb.value_and_grad`` of the mean cross-entropy, DDP's 25 MiB gradient buckets) of a
    Llama-2-70B-shaped model, one sequence per data-parallel rank, on a ``(dp, tp)`` mesh of A100 nodes of 8:
    Megatron's tensor parallelism (vocabulary-parallel embedding and loss). Returns ``(fn, cluster, args)``."""
    c = LLAMA70B
    h, heads, kv, f, V, S = c["hidden"], c["heads"], c["kv_heads"], c["mlp"], c["vocab"], c["seq"]
    d = h // heads
    cluster = Cluster(Hardware.preset("a100-sxm-80gb"), tp * dp // NODE, NODE)
    mesh = cluster.mesh("m", (dp, tp), ("dp", "tp"))

    def w(shape, spec, dtype=DTYPE):
        return nb.abstract(shape, dtype).shard(mesh, spec)

    def layer():
        return {"attn_norm": w((h,), [None]), "wq": w((h, h), [None, "tp"]), "wk": w((h, kv * d), [None, "tp"]),
                "wv": w((h, kv * d), [None, "tp"]), "wo": w((h, h), ["tp", None]), "mlp_norm": w((h,), [None]),
                "w1": w((h, f), [None, "tp"]), "w3": w((h, f), [None, "tp"]), "w2": w((f, h), ["tp", None])}

    params = {"embed": w((V, h), ["tp", None]), "layers": [layer() for _ in range(layers or c["layers"])],
              "norm": w((h,), [None]), "head": w((h, V), [None, "tp"])}
    ids, targets = w((dp, S), ["dp", None], "int32"), w((dp, S), ["dp", None], "int32")
    cos, sin = w((S, 1, d), [None, None, None]), w((S, 1, d), [None, None, None])

    def loss(params, ids, targets):
        x = nb.take(params["embed"], ids, axis=0)
        for i, p in enumerate(params["layers"]):
            with nb.named_scope(f"layer {i}"):
                x = llama_block(x, p, heads, kv, cos, sin)
        logits = _rms(x, params["norm"]) @ params["head"]
        return nb.cross_entropy(logits.astype("float32"), targets)

    return nb.value_and_grad(loss, bucket_bytes=DDP_BUCKET), cluster, (params, ids, targets)


def llama70b_timing() -> dict:
    """``nb.estimate`` of ``llama70b_program`` in this process: wall time of the first call (every op's
    sharding program built anew) and of a second (cached), the peak resident memory of the process
    (``resource.getrusage``, the interpreter and imports included) and the peak of Python's allocations during
    a third call (``tracemalloc``). Run it in a fresh process for the first call to mean anything."""
    import resource
    import tracemalloc
    fn, cluster, args = llama70b_program()
    t, cpu = time.perf_counter(), time.process_time()
    report = nb.estimate(fn, cluster)(*args)
    cold, cold_cpu = time.perf_counter() - t, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    t = time.perf_counter()
    nb.estimate(fn, cluster)(*args)
    warm = time.perf_counter() - t
    tracemalloc.start()
    nb.estimate(fn, cluster)(*args)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"model": "Llama-2-70B shape: 80 layers, hidden 8192, 64 heads with 8 KV heads (grouped-query "
                     "attention), SwiGLU MLP 28672, vocabulary 32000, sequence 4096, bf16",
            "mesh": f"({LLAMA_DP}, {LLAMA_TP}) dp x tp, {LLAMA_DP * LLAMA_TP:,} A100s, one sequence per dp rank",
            "steps": len(report.timeline.costs), "first_call_s": cold, "first_call_cpu_s": cold_cpu,
            "second_call_s": warm,
            "peak_rss_bytes": rss, "traced_peak_bytes": traced, "target_s": SCALE_TARGET_SECONDS,
            "target_bytes": SCALE_TARGET_BYTES, "estimated_step_s": report.step_time, "mfu": report.mfu,
            "exposed_grad_comm_s": report.exposed_grad_comm}


def llama70b_profile(top: int = 15) -> str:
    """cProfile of a first ``nb.estimate`` call of ``llama70b_program`` (run in a fresh process), by own time."""
    import cProfile
    import io
    import pstats
    fn, cluster, args = llama70b_program()
    pr = cProfile.Profile()
    pr.enable()
    nb.estimate(fn, cluster)(*args)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# ---- output ------------------------------------------------------------------------------------------------------


def row_result(p: Prediction) -> dict:
    r, lay, e = p.row, p.layout, p.estimate
    st = e.stages[e.slowest]
    out = {"params_billion": r.params_billion, "heads": r.heads, "hidden": r.hidden, "layers": r.layers,
           "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "gpus": r.gpus, "batch": r.batch, "microbatch": lay.microbatch,
           "microbatches": lay.microbatches, "schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
           "ddp": RUNS[r.params_billion].ddp, "measured_tflops": r.tflops_per_gpu,
           "predicted_tflops": p.tflops_per_gpu, "ratio": p.ratio, "target": p.target, "met": p.met,
           "slowest_stage": e.slowest, "step_s": p.step_time, "microbatch_ms": e.pipeline.microbatch_time * 1e3,
           "stage_compute_ms": st.compute_time * 1e3, "stage_exposed_comm_ms": st.exposed_comm * 1e3,
           "grad_ms": e.pipeline.grad_time * 1e3, "bubble_s": e.pipeline.bubble_time,
           "p2p_s": e.pipeline.p2p_time, "optimizer_ms": e.optimizer_time * 1e3,
           "stage_peak_gib": max(st.memory.peak.values()) / 2**30 if st.memory.peak else None,
           "seconds": p.seconds}
    if p.unfused is not None:
        out.update(unfused_tflops=p.unfused_tflops_per_gpu,
                   unfused_ratio=p.unfused_tflops_per_gpu / r.tflops_per_gpu)
    return out


def run_rows(rows=ROWS, compare: bool = True) -> dict:
    t = time.perf_counter()
    out = []
    for row in rows:
        res = row_result(predict_row(row, compare=compare))
        out.append(res)
        print(f"{row.params_billion:>7}B t={res['tp']} p={res['pp']:>2} d={res['dp']:>2} b={res['microbatch']:>2} "
              f"m={res['microbatches']:>3} {res['schedule']:<11} measured {row.tflops_per_gpu:>5} predicted "
              f"{res['predicted_tflops']:6.1f} ratio {res['ratio']:.2f} "
              f"({'met' if res['met'] else 'MISSED'} ±{res['target']:.0%})"
              + (f" | unfused {res['unfused_tflops']:6.1f} ({res['unfused_ratio']:.2f})" if compare else "")
              + f" | {res['seconds']:.1f} s", flush=True)
    return {"source": SOURCE, "scripts": SCRIPTS, "hardware": "a100-sxm-80gb, 8 per node",
            "targets": {"no_pipeline": TARGET_NO_PIPELINE, "pipeline": TARGET_PIPELINE}, "rows": out,
            "seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", help="parameter counts in billions, e.g. 1.7,39.1 (default: every row)")
    ap.add_argument("--json", help="write the results here (default: update benchmarks/results.json)")
    ap.add_argument("--no-compare", action="store_true", help="skip pricing every step alone (fusion=False)")
    ap.add_argument("--no-llama", action="store_true", help="skip the Llama-2-70B timing")
    ap.add_argument("--llama-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="with the Llama timing, a cProfile of one call")
    a = ap.parse_args()
    if a.llama_child:  # a fresh process: the first call builds every op's program, as a user's first call does
        print(llama70b_profile() if a.profile else json.dumps(llama70b_timing()))
        return
    rows = ROWS if not a.rows else [r for r in ROWS if str(r.params_billion) in a.rows.split(",")]
    print(f"Megatron-LM Table 1 ({SOURCE}; runs as in {SCRIPTS}) against nabla's estimate of a GPT program")
    res = {"megatron": run_rows(rows, compare=not a.no_compare)}
    if not a.no_llama:
        import subprocess
        env = dict(__import__("os").environ, PYTHONPATH=str(HERE.parent))
        runs = []
        for _ in range(LLAMA_RUNS):  # fresh processes: a first call is only first once
            proc = subprocess.run([sys.executable, __file__, "--llama-child"], capture_output=True, text=True,
                                  env=env, check=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        s = dict(sorted(runs, key=lambda r: r["first_call_s"])[len(runs) // 2])  # the median run
        s.update(runs=len(runs), first_call_all_s=[r["first_call_s"] for r in runs],
                 first_call_cpu_all_s=[r["first_call_cpu_s"] for r in runs],
                 second_call_all_s=[r["second_call_s"] for r in runs],
                 peak_rss_bytes=max(r["peak_rss_bytes"] for r in runs))
        res["estimate_scale"] = s
        print(f"Llama-2-70B step on {LLAMA_DP * LLAMA_TP:,} devices: nb.estimate {s['first_call_s']:.2f} s first "
              f"call (median of {len(runs)} fresh processes: {', '.join(f'{t:.2f}' for t in s['first_call_all_s'])}),"
              f" {s['second_call_s']:.2f} s cached; CPU {s['first_call_cpu_s']:.2f} s; peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB (Python "
              f"allocations {s['traced_peak_bytes'] / 2**20:.0f} MiB)")
        if a.profile:
            print(subprocess.run([sys.executable, __file__, "--llama-child", "--profile"], capture_output=True,
                                 text=True, env=env, check=True).stdout)
    write_results(res, a.json)


if __name__ == "__main__":
    main()
