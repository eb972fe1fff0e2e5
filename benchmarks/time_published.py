"""nabla's step time against published measured training throughput that nabla was not built against (Megatron-LM's
Table 1 is ``megatron_table1.py``'s): each run written as a program with nabla ops, laid out as the run was, run
abstractly and priced with the overlap options the run used.

    python benchmarks/time_published.py [--runs id,id] [--json PATH]

Every measured figure is quoted below with its source (``RUNS``); so is every setting a run's own scripts or
configs give. Throughput is compared in the unit the source gives, converted by the source's own FLOP formula
where it gives TFLOP/s (``Run.flops_per_step``), so the comparison is of step times: predicted throughput over
measured. What a source leaves out is said where it is assumed (``Run.assumed``).

How a run is predicted: ``stage_program`` writes one pipeline stage (or the whole model) of the run's
architecture for one microbatch (forward and backward, with the run's recomputation), laid out on a mesh of the
stage's devices with the run's tensor, sequence, context and data parallelism; ``nb.estimate``'s pricing of its
recorded steps (``estimate_steps``, with the run's ``overlap``) gives one microbatch, ``nb.pipeline_estimate``
the pipelined step over the run's microbatches, plus an Adam update of the stage's parameters (``optimizer``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import nabla as nb  # noqa: E402
from nabla.plan import (Cluster, Hardware, Report, estimate_steps, gpt_flops, pipeline_estimate,  # noqa: E402
                        priced_step)
from _env import write_results  # noqa: E402
from megatron_table1 import accumulating, through  # noqa: E402

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = "bfloat16"
TARGET = 0.15  # each run within 15% of its measured throughput


class Model(NamedTuple):
    """A decoder-only transformer. ``arch``: ``"gpt"`` (LayerNorm with biases, learned positions, a 4h GeLU MLP,
    Megatron-LM's attention with its scores materialised: scale, additive mask, softmax, dropout; ReLU in place of GeLU
    with ``act="relu"``) or ``"llama"``
    (RMSNorm, rotary positions, grouped-query attention through ``nb.dot_product_attention``, causal, and a
    SwiGLU MLP, no biases)."""

    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    dropout: float = 0.0
    act: str = "gelu"  # the GPT MLP's activation: "gelu", or "relu" (OPT)


class Layout(NamedTuple):
    """How a run laid the model out. ``dp`` replicas; ``fsdp``: data parallelism with the parameters sharded over
    it (ZeRO-3: gathered per layer, gradients reduce-scattered); ``sp``: Megatron-LM's sequence parallelism;
    ``cp``: context parallelism (the sequence cut, keys and values gathered); ``vp`` model chunks per pipeline
    stage (interleaved schedule); ``recompute``: ``"full"`` (every layer, ``nb.checkpoint``), ``"selective"``
    (the attention core only, Korthikanti et al.), ``"save_matmuls"`` or ``"none"``; ``fp8``: the GEMMs'
    operands cast to float8 (Transformer Engine's FP8 recipes; attention stays bf16); ``stages``: per pipeline
    stage type, (layers, embeds, ends in the loss), the slowest of which sets the pace."""

    tp: int
    pp: int
    dp: int
    mbs: int
    gbs: int
    fsdp: int = 1
    cp: int = 1
    vp: int = 1
    sp: bool = False
    recompute: str = "none"
    fp8: bool = False
    stages: tuple = ()
    p2p_bytes: int | None = None  # per device and send; default: the microbatch's activation as the stage hands it
    master_weights: bool = True  # bf16 parameters with a float32 master copy in the optimizer
    weight_dtype: str = BF16  # the parameters' dtype in the step (MaxText: float32, cast to bf16 for compute)
    xla_norm: bool = False  # RMSNorm as MaxText writes it in jax.numpy (XLA fuses it), not one fused kernel
    iota_embed: bool = False  # the embedding as a one-hot matmul (MaxText's use_iota_embed)
    logits_fp32: bool = False  # the output layer's matmul in float32 (MaxText's logits_dot_in_fp32)
    accumulate_fp32: bool = False  # gradients accumulated over microbatches in float32 (DeepSpeed's BF16_Optimizer)
    reshard: bool = True  # FSDP gathers a layer's parameters again for its backward (False: metaseq's
    # --no-reshard-after-forward, the gathered copy kept from the forward, not gathered again when recomputing)


class Run(NamedTuple):
    """One published measurement: what ran, how, and what was measured (``measured`` in ``unit``, quoted in
    ``quote`` from ``source``, ``SHORT[source]`` for tables)."""

    id: str
    source: str
    quote: str
    hardware: str  # a Hardware preset
    nodes: int
    per_node: int
    model: Model
    layout: Layout
    overlap: Any  # the overlap options the run used (``nb.estimate``'s)
    unit: str  # "tokens/s/GPU", "s/step" or "TFLOP/s/GPU"
    measured: float
    flops_per_step: float = 0.0  # the source's FLOP count of one step (for "TFLOP/s/GPU"), all GPUs together
    assumed: str = ""  # what the source leaves out and is assumed here
    network_bandwidth: float | None = None  # per GPU and direction when the cluster's differs from the preset's
    allow_tf32: bool = False  # float32 matmuls at the TF32 peak (JAX's default precision on GPUs)

    @property
    def gpus(self) -> int:
        return self.nodes * self.per_node

    @property
    def tokens(self) -> int:
        return self.layout.gbs * self.model.seq

    def throughput(self, step_s: float) -> float:
        """``step_s`` in the run's unit."""
        if self.unit == "tokens/s/GPU":
            return self.tokens / step_s / self.gpus
        if self.unit == "s/step":
            return step_s
        return self.flops_per_step / step_s / self.gpus / 1e12

    def measured_step(self) -> float:
        if self.unit == "tokens/s/GPU":
            return self.tokens / self.measured / self.gpus
        if self.unit == "s/step":
            return self.measured
        return self.flops_per_step / (self.measured * 1e12 * self.gpus)


# ---- the programs ----------------------------------------------------------------------------------------------


class Ctx(NamedTuple):
    """What a block needs besides its input and parameters: the mesh and the run's layout."""

    mesh: Any
    model: Model
    layout: Layout
    key: int

    @property
    def batch(self) -> tuple:
        return ("dp", "fsdp")

    def seq(self, sp: bool | None = None) -> tuple:
        """The sequence's axes between blocks (cut over cp, and over tp too with sequence parallelism)."""
        return ("cp", "tp") if (self.layout.sp if sp is None else sp) else ("cp",)

    def act(self, x: Any, sp: bool | None = None) -> Any:
        """``x`` (b, s, h) laid out as between blocks: a pending sum over tp reduce-scattered (sp) or all_reduced."""
        return x.with_sharding(self.mesh, [self.batch, self.seq(sp), None])

    def gathered(self, x: Any) -> Any:
        """``x`` with its sequence whole over tp (sequence parallelism's all_gather before a column-parallel GEMM);
        in float8 first when the GEMM takes float8 (Transformer Engine gathers the cast activation)."""
        if self.layout.fp8:
            x = _f8(x)
        return x.with_sharding(self.mesh, [self.batch, ("cp",), None])

    def linear(self, x: Any, w: Any) -> Any:
        """``x @ w`` of a column-parallel weight: in float8 when the run trains in FP8 (the product returned as
        bf16, as TE's GEMMs give it)."""
        if self.layout.fp8:
            return (_f8(x) @ w.astype(F8)).astype(BF16)
        return x @ w

    def out_proj(self, x: Any, w: Any) -> Any:
        """``x @ w`` of a row-parallel weight, its partial sums over tp reduce-scattered (sp) or all_reduced. In
        FP8 the sum is made in float8 before the product goes back to bf16 (nabla sums a pending sum before a
        cast: the reduce_scatter moves 1 byte per value where TE's moves the bf16 product's 2)."""
        if self.layout.fp8:
            return self.act(_f8(x) @ w.astype(F8)).astype(BF16)
        return self.act(x @ w)

    def weight(self, w: Any) -> Any:
        """A parameter as the step computes with it (MaxText keeps float32 weights and computes in bf16)."""
        return w.astype(BF16) if w.dtype != np.dtype(ml_dtypes.bfloat16) else w


def _f8(x):
    """``x`` in float8 with FP8 current scaling (Transformer Engine's tensorwise recipe of the runs: the tensor's
    absolute maximum read first, the scaled tensor then cast); a value already in float8 as it is (a second cast
    would sum a pending gradient first). The maximum is taken per sequence (over the tokens and features a GEMM
    reads: reduced over the tensor- and context-parallel groups, as TE reduces amax, never across replicas)."""
    if x.dtype == F8:
        return x
    amax = nb.max(nb.abs(x), axis=(-2, -1), keepdims=True)
    return (x * (np.array(448.0, np.float32) / amax).astype(x.dtype)).astype(F8)


def _norm(x, g, b=None, xla: bool = False):
    """LayerNorm, or RMSNorm where ``b`` is None: one fused kernel either way (``nb.layer_norm``: reads ``x``,
    writes the result, keeps ``x`` and two float32 numbers per row), as Apex's and Transformer Engine's norms run.
    ``xla``: RMSNorm as MaxText's ``normalizations.py`` writes it (float32, the mean of squares, rsqrt, scale),
    op by op, which XLA fuses as its rules allow (the estimate's fusion)."""
    if xla:
        dt = x.dtype
        x = x.astype("float32")
        y = x / nb.sqrt((x * x).mean(-1, keepdims=True) + np.float32(1e-6))
        return y.astype(dt) * g
    return nb.layer_norm(x, g, b, eps=np.array(1e-5, x.dtype))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + nb.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def llama_block(x, p: dict, c: Ctx, rope):
    """A Llama block as Megatron-Core runs it: RMSNorm, one fused QKV projection (per query group: its query
    heads, its key, its value), rotary, grouped-query attention (``nb.dot_product_attention``, causal), the
    output projection, RMSNorm, one fused gate-and-up projection, SwiGLU, the down projection; residuals.
    Column-parallel QKV and gate/up (whole query groups per device), row-parallel outputs, over ``tp``."""
    m = c.model
    b, s, h = x.shape
    d, g = h // m.heads, m.heads // m.kv_heads
    cos, sin = rope
    y = c.gathered(_norm(x, c.weight(p["attn_norm"]), xla=c.layout.xla_norm))
    qkv = c.linear(y, c.weight(p["wqkv"])).reshape(b, s, m.kv_heads, g + 2, d)
    q = _rotate(qkv[..., :g, :].reshape(b, s, m.heads, d), cos, sin)
    k = _rotate(qkv[..., g, :], cos, sin)
    v = qkv[..., g + 1, :]
    o = nb.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, h)
    x = x + c.out_proj(o, c.weight(p["wo"]))
    y = c.gathered(_norm(x, c.weight(p["mlp_norm"]), xla=c.layout.xla_norm))
    u = c.linear(y, c.weight(p["w13"])).reshape(b, s, m.ffn, 2)
    u = nb.silu(u[..., 0]) * u[..., 1]
    return x + c.out_proj(u, c.weight(p["w2"]))


def gpt_core(q, k, v, mask, rate: float, key: int):
    """Megatron-LM's attention core with its scores materialised: ``QKᵀ`` (scaled), the causal mask added,
    softmax, dropout, the product with ``V`` (what selective recomputation recomputes)."""
    scores = nb.einsum("bqnd,bknd->bnqk", q, k) + mask
    probs = nb.softmax(scores, -1)
    if rate:
        probs = nb.dropout(probs, rate, key)
    return nb.einsum("bnqk,bknd->bqnd", probs, v)


def gpt_block(x, p: dict, c: Ctx, mask):
    """A GPT block as Megatron-LM computes it: pre-LayerNorm, one QKV projection (bias), the attention core,
    the output projection, bias-dropout-add, pre-LayerNorm, the 4h GeLU MLP, bias-dropout-add."""
    m = c.model
    b, s, h = x.shape
    d = h // m.heads
    rate = m.dropout
    y = c.gathered(_norm(x, p["ln1_g"], p["ln1_b"]))
    qkv = (c.linear(y, p["w_qkv"]) + p["b_qkv"]).reshape(b, s, m.heads, 3 * d)
    q = qkv[..., :d] * np.array(1 / np.sqrt(d), x.dtype)
    k, v = qkv[..., d:2 * d], qkv[..., 2 * d:]
    core = nb.checkpoint(gpt_core) if c.layout.recompute == "selective" else gpt_core
    ctx = core(q, k, v, mask, rate, c.key).reshape(b, s, h)

    def drop(t, key):
        return nb.dropout(t, rate, key) if rate else t

    x = x + drop(c.out_proj(ctx, p["w_o"]) + p["b_o"], c.key + 1)
    y = c.gathered(_norm(x, p["ln2_g"], p["ln2_b"]))
    u = (nb.relu if m.act == "relu" else nb.gelu)(c.linear(y, p["w_1"]) + p["b_1"])
    return x + drop(c.out_proj(u, p["w_2"]) + p["b_2"], c.key + 2)


def layer_params(c: Ctx, fsdp: bool = True, specs: bool = False) -> dict:
    """One layer's parameters: column-parallel (columns over tp) and row-parallel (rows over tp) matrices, the
    rest replicated over tp; with FSDP every one's first dim also cut over ``fsdp`` (with tp, a row-parallel
    matrix's second: FSDP shards each tensor-parallel rank's parameters, and gathered they are that rank's shard;
    with tp the vectors, biases and norms, stay whole over fsdp: FSDP gathers a layer's parameters as one flat
    buffer, and gathered one by one over a hundred nodes each would pay the ring's latency for a few KB).
    ``fsdp=False``: as gathered over fsdp; ``specs``: the specs, not the arrays."""
    m, lay = c.model, c.layout
    h, d = m.hidden, m.hidden // m.heads
    dt = lay.weight_dtype

    def w(shape, tp_dim):
        spec = [[] for _ in shape]
        if tp_dim is not None:
            spec[tp_dim].append("tp")
        if fsdp and lay.fsdp > 1 and (len(shape) > 1 or lay.tp == 1):  # with tp: vectors whole, and fsdp on a dim
            spec[1 if lay.tp > 1 and tp_dim == 0 else 0].append("fsdp")  # tp does not cut (gathered: the tp shard)
        if specs:
            return [tuple(a) for a in spec]
        return nb.abstract(shape, dt).shard(c.mesh, [tuple(a) for a in spec])

    if m.arch == "llama":
        qkv = (m.heads + 2 * m.kv_heads) * d
        return {"attn_norm": w((h,), None), "wqkv": w((h, qkv), 1), "wo": w((h, h), 0), "mlp_norm": w((h,), None),
                "w13": w((h, 2 * m.ffn), 1), "w2": w((m.ffn, h), 0)}
    return {"ln1_g": w((h,), None), "ln1_b": w((h,), None), "w_qkv": w((h, 3 * h), 1), "b_qkv": w((3 * h,), 0),
            "w_o": w((h, h), 0), "b_o": w((h,), None), "ln2_g": w((h,), None), "ln2_b": w((h,), None),
            "w_1": w((h, m.ffn), 1), "b_1": w((m.ffn,), 0), "w_2": w((m.ffn, h), 0), "b_2": w((h,), None)}


class Stage(NamedTuple):
    fn: Any
    args: tuple
    mesh: Any
    layers: int


def stage_program(run: Run, mesh, layers: int, embeds: bool, loss: bool) -> Stage:
    """One pipeline stage of ``run`` for one microbatch on ``mesh`` (axes dp, fsdp, cp, tp): ``layers`` blocks
    (each under ``nb.checkpoint`` with full recomputation), the vocabulary-parallel embedding first if
    ``embeds``, the final norm, the vocabulary-parallel output layer and cross-entropy (float32 logits) if
    ``loss``. A stage that does not start from tokens takes the previous stage's activation and returns its
    gradient; one that does not end in the loss takes its output's gradient from the next stage."""
    m, lay = run.model, run.layout
    h, S = m.hidden, m.seq
    B = lay.mbs * lay.dp * lay.fsdp
    c0 = Ctx(mesh, m, lay, 10)

    def w(shape, spec, dtype=BF16):
        return nb.abstract(shape, dtype).shard(mesh, spec)

    params: dict = {"layers": [layer_params(c0) for _ in range(layers)]}
    kept = layer_params(c0, fsdp=False, specs=True) if lay.fsdp > 1 and not lay.reshard else None
    seq = c0.seq()
    if embeds:
        params["embed"] = {"wte": w((m.vocab, h), [("fsdp", "tp"), None])}
        if m.arch == "gpt":
            params["embed"]["wpe"] = w((S, h), [None, None])
        inp = w((B, S), [c0.batch, ("cp",)], "int32")
    else:
        inp = w((B, S, h), [c0.batch, seq, None])
    if loss:
        params["head"] = {"g": w((h,), [None]), "w": w((h, m.vocab), ["fsdp", "tp"])}
        if m.arch == "gpt":
            params["head"]["b"] = w((h,), [None])
    d = h // m.heads
    extra = {}
    if m.arch == "gpt":
        extra["mask"] = w((S, S), [("cp",), None])  # causal, as an additive bias (a constant)
    else:
        extra["rope"] = (w((S, 1, d), [("cp",), None, None]), w((S, 1, d), [("cp",), None, None]))

    def body(params, x):
        if embeds:
            e = params["embed"]
            with nb.named_scope("embedding"):
                if lay.iota_embed:  # MaxText's use_iota_embed: a one-hot matmul
                    x = nb.one_hot(x, m.vocab, BF16) @ e["wte"]
                else:
                    x = nb.take(e["wte"], x, axis=0)
                if m.arch == "gpt":
                    x = x + e["wpe"]
                x = c0.act(x)
                if m.dropout:
                    x = nb.dropout(x, m.dropout, 1)
        for i, p in enumerate(params["layers"]):
            c = c0._replace(key=10 + 3 * i)
            with nb.named_scope(f"layer {i}"):
                if kept is not None:  # gathered here, outside the recomputed block: the backward reuses it
                    p = {k: v.with_sharding(mesh, kept[k]) for k, v in p.items()}
                if m.arch == "gpt":
                    blk = lambda x, p, c=c: gpt_block(x, p, c, extra["mask"])  # noqa: E731
                else:
                    blk = lambda x, p, c=c: llama_block(x, p, c, extra["rope"])  # noqa: E731
                if lay.recompute in ("full", "save_matmuls"):
                    blk = nb.checkpoint(blk, policy=lay.recompute)
                x = blk(x, p)
        if not loss:
            return x
        hd = params["head"]
        with nb.named_scope("output"):
            y = c0.gathered(_norm(x, hd["g"], hd.get("b"), xla=lay.xla_norm))
            if lay.logits_fp32:
                return y.astype("float32") @ hd["w"].astype("float32")
            return c0.linear(y, hd["w"])  # (B, s, V), the vocabulary over tp

    if loss:
        targets = w((B, S), [c0.batch, ("cp",)], "int32")

        def step(params, x, targets):
            logits = body(params, x)
            with nb.named_scope("loss"):
                return nb.cross_entropy(logits.astype("float32"), targets)

        return Stage(nb.value_and_grad(step, argnums=0 if embeds else (0, 1)), (params, inp, targets), mesh, layers)

    cotangent = w((B, S, h), [c0.batch, seq, None])

    return Stage(through(body, embeds), (params, inp, cotangent), mesh, layers)


# ---- pricing -------------------------------------------------------------------------------------------------


class Prediction(NamedTuple):
    run: Run
    step_s: float
    microbatch_s: float
    bubble_s: float
    p2p_s: float
    grad_s: float
    optimizer_s: float
    stage: Report
    slowest: tuple
    seconds: float

    @property
    def predicted(self) -> float:
        return self.run.throughput(self.step_s)

    @property
    def ratio(self) -> float:
        return self.predicted / self.run.measured if self.run.unit != "s/step" else self.run.measured / self.step_s

    @property
    def met(self) -> bool:
        return abs(self.ratio - 1) <= TARGET


def stage_mesh(run: Run) -> tuple[Cluster, Any]:
    """The cluster of one pipeline stage's devices and its mesh ``(dp, fsdp, cp, tp)`` (tp fastest, as Megatron-LM
    and MaxText order ranks: tensor parallelism inside a node first)."""
    lay = run.layout
    hw = Hardware.preset(run.hardware)
    if run.network_bandwidth:
        hw = hw.replace(network_bandwidth=run.network_bandwidth)
    if run.allow_tf32:
        hw = hw.replace(allow_tf32=True)
    n = lay.dp * lay.fsdp * lay.cp * lay.tp
    cluster = Cluster(hw, max(1, n // run.per_node), min(run.per_node, n))
    return cluster, cluster.mesh("stage", (lay.dp, lay.fsdp, lay.cp, lay.tp), ("dp", "fsdp", "cp", "tp"))


def price(stage: Stage, cluster: Cluster, overlap: Any) -> Report:
    with nb.comm_log() as log, nb.memory_log() as mem:
        stage.fn(*stage.args)
    steps = [priced_step(s) for s in log.steps]
    model = sum(s.flops for s in steps if s.phase != "recompute")
    return estimate_steps(steps, cluster, stage.mesh, overlap, model, mem)


def optimizer_time(params: Any, cluster: Cluster, mesh, master: bool) -> float:
    """One Adam update of a stage's parameters on one device (its float32 master copy and moments sharded over
    the data-parallel axes when the run's optimizer is distributed: the parameters' own layout here)."""
    opt = nb.optim.Adam(1e-4, master_dtype="float32" if master else None)
    state = opt.init(params)
    with nb.comm_log() as log:
        opt.update(params, state, params)
    return estimate_steps([priced_step(s) for s in log.steps], cluster, mesh, "none").step_time


def predict(run: Run) -> Prediction:
    t0 = time.perf_counter()
    lay, m = run.layout, run.model
    cluster, mesh = stage_mesh(run)
    microbatches = lay.gbs // (lay.mbs * lay.dp * lay.fsdp)
    reports = {}
    programs = {}
    for st in lay.stages:
        prog = stage_program(run, mesh, *st)
        programs[st] = prog
        reports[st] = price(accumulating(prog, lay.accumulate_fp32) if microbatches > 1 else prog, cluster,
                            run.overlap)
    slowest = max(reports, key=lambda k: reports[k].step_time - reports[k].exposed_grad_comm)
    rep = reports[slowest]
    job = Cluster(cluster.hardware, run.nodes, run.per_node)
    p2p = lay.p2p_bytes
    if p2p is None and lay.pp > 1:  # the activation a stage hands on, per device (scattered over tp)
        p2p = lay.mbs * m.seq * m.hidden * 2 // (lay.cp * lay.tp)
    pipe = pipeline_estimate(rep, lay.pp, microbatches, "interleaved" if lay.vp > 1 else "1f1b", lay.vp,
                             p2p if lay.pp > 1 else None, job)
    opt = optimizer_time(programs[slowest].args[0], cluster, mesh, lay.master_weights)
    step = pipe.step_time + opt
    return Prediction(run, step, pipe.microbatch_time, pipe.bubble_time, pipe.p2p_time, pipe.grad_time, opt, rep,
                      slowest, time.perf_counter() - t0)


# ---- the runs --------------------------------------------------------------------------------------------------

BLOOM_176B = Model("BLOOM 176B", "gpt", 14336, 70, 112, 112, 4 * 14336, 250880, 2048, dropout=0.1)
GPT_22B = Model("GPT 22B", "gpt", 6144, 48, 64, 64, 4 * 6144, 51200, 2048, dropout=0.1)
GPT_175B = Model("GPT-3 175B", "gpt", 12288, 96, 96, 96, 4 * 12288, 51200, 2048, dropout=0.1)
GPT_530B = Model("MT-NLG 530B", "gpt", 20480, 105, 128, 128, 4 * 20480, 51200, 2048, dropout=0.1)
GPT_1T = Model("GPT 1T", "gpt", 25600, 128, 160, 160, 4 * 25600, 51200, 2048, dropout=0.1)
LLAMA3_70B = Model("Llama 3 70B", "llama", 8192, 80, 64, 8, 28672, 128256, 8192)
LLAMA2_70B = Model("Llama 2 70B", "llama", 8192, 80, 64, 8, 28672, 32000, 4096)
LLAMA3_8B = Model("Llama 3 8B", "llama", 4096, 32, 32, 8, 14336, 128256, 8192)
LLAMA2_7B_4K = Model("Llama 2 7B", "llama", 4096, 32, 32, 32, 11008, 32000, 4096)
LLAMA2_7B_128K = LLAMA2_7B_4K._replace(seq=131072)
LLAMA2_7B_16K = LLAMA2_7B_4K._replace(seq=16384)
LLAMA31_405B = Model("Llama 3.1 405B", "llama", 16384, 126, 128, 8, 53248, 128256, 8192)
OPT_175B = Model("OPT-175B", "gpt", 12288, 96, 96, 96, 4 * 12288, 50272, 2048, dropout=0.1, act="relu")


def nemo_llama_flops(m: Model, gbs: int) -> float:
    """NeMo's FLOP count of a Llama training step, as its performance tables of 2024 computed it, all GPUs:
    ``gbs s l h^2 (12 + 12 kv/heads + 18 ffn/h + 12 s/h + 6 V/(l h))`` (``nemo/utils/flops_formulas.py``,
    ``llama2``/``llama3``, before causal attention was halved in it). The attention term counts every (query,
    key) pair: checked on NeMo 24.07's own table (docs/source/performance/performance_summary.md), whose
    Llama 3 70B row gives 1533 tokens/s/GPU and 738 TFLOP/s/GPU: 4.81e11 FLOPs per token, which this formula
    gives for seq 8192 (4.814e11; halving the attention term would give 4.49e11)."""
    l, h, s = m.layers, m.hidden, m.seq
    return gbs * s * l * h * h * (12 + 12 * m.kv_heads / m.heads + 18 * m.ffn / h + 12 * s / h + 6 * m.vocab / (l * h))

def stages(middle: int, first: int | None = None, last: int | None = None) -> tuple:
    """A pipeline's stage types: ``middle`` layers, the first stage's with the embedding, the last one's with the
    loss (as many layers as the middle's unless given)."""
    return ((middle, False, False), (middle if first is None else first, True, False),
            (middle if last is None else last, False, True))


def maxtext_flops(m: Model, gbs: int) -> float:
    """MaxText's count of a training step's FLOPs (``MaxText/maxtext_utils.py``, ``calculate_tflops_training_per_
    device`` at efb6d9e), all devices together: ``6 N`` per token for the ``N`` parameters (embedding and output
    layer included) plus causal attention, ``12 heads layers head_dim seq^2 / 2`` per sequence."""
    d = m.hidden // m.heads
    n = 2 * m.vocab * m.hidden + m.hidden + m.layers * (
        m.hidden * (m.heads + 2 * m.kv_heads) * d + m.hidden * m.hidden + 3 * m.hidden * m.ffn + 2 * m.hidden)
    return gbs * (6 * n * m.seq + 12 * m.heads * m.layers * d * m.seq ** 2 / 2)


MAXTEXT = ("AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md and 1vm.sh, 16vm.sh (commit efb6d9e, "
           "April 2024)")
MAXTEXT_ASSUMED = (
    "1vm.sh/16vm.sh: ici_fsdp_parallelism=8 (dcn_data_parallelism 1 or 16), per_device_batch_size=4, "
    "max_target_length=4096, attention=cudnn_flash_te, use_iota_embed=true (the embedding a one-hot matmul), "
    "remat_policy=minimal_flash (weight matmuls' outputs and the "
    "attention output saved: nb.checkpoint 'save_matmuls' here, so the attention forward is recomputed with its "
    "softmax statistics), scan_layers=false; base.yml: dtype bfloat16, weight_dtype float32 (written here as bf16 "
    "parameters with a float32 master copy in Adam: the gathers move the bf16 copies either way, the gradients' "
    "reduce_scatters move bf16 here), logits_dot_in_fp32 (the output layer in float32: at the TF32 peak, JAX's "
    "default precision for float32 dots on GPUs), RMSNorm in jax.numpy (normalizations.py), AdamW; XLA flags "
    "async all_gather, reduce_scatter and all_reduce with the latency-hiding scheduler: overlap ('grads', "
    "'params'); no gradient accumulation (GBS = 4 x GPUs); q, k, v and the MLP's two input projections written "
    "fused (MaxText's are separate: the same FLOPs and bytes)")

KORTHIKANTI = ("Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', MLSys'23, "
               "arXiv:2205.05198, Table 3 (configurations) and Table 5 (iteration time, A100 80GB, Selene)")
KORTHIKANTI_ASSUMED = (
    "Table 3: TP 8, the given PP, no data parallelism, sequence 2048, vocabulary 51200; sec. 6: 'the interleaving "
    "schedule with three interleaving stages' for 175B and 530B (1T plain 1F1B), mixed precision (bf16 here: "
    "A100's fp16 and bf16 peaks are equal); 'present work' = sequence parallelism and selective recomputation "
    "(the attention core: QK^T, softmax, dropout, its product with V), the baseline = full recomputation without "
    "sequence parallelism; Megatron-LM's defaults of 2022: dropout 0.1, fused kernels. Overlap 'none': the paper "
    "states none, and Megatron-LM of 2022 overlapped only the backward pass's tensor-parallel all_reduce/all_gather "
    "with the weight-gradient GEMM, which overlap 'tp' (TE userbuffers' forward pipelining too) overstates")


def korthikanti(name: str, model: Model, pp: int, vp: int, gbs: int, mbs: int, present: float,
                full: float) -> tuple[Run, Run]:
    """The two rows of Table 5 for one Table 3 model: 'present work' and 'full recompute'."""
    per = model.layers // pp
    lay = Layout(tp=8, pp=pp, dp=1, mbs=mbs, gbs=gbs, vp=vp,
                 stages=stages(per) if pp > 2 else stages(per)[1:] if pp == 2 else ((per, True, True),))
    quote = (f"Table 5: {name}: full recompute {full} s, present work {present} s (iteration time); Table 3: "
             f"{model.heads} heads, hidden {model.hidden}, {model.layers} layers, TP 8, PP {pp}, {8 * pp} GPUs, "
             f"global batch {gbs}, micro batch {mbs}")
    common = dict(source=KORTHIKANTI, hardware="a100-sxm-80gb", nodes=pp, per_node=8, model=model, overlap="none",
                  unit="s/step", assumed=KORTHIKANTI_ASSUMED)
    return (Run(f"korthikanti-{name}-present", quote=quote, layout=lay._replace(sp=True, recompute="selective"),
                measured=present, **common),
            Run(f"korthikanti-{name}-full", quote=quote, layout=lay._replace(recompute="full"), measured=full,
                **common))


BLOOM = ("bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md, 'Rebalancing layers' (2022-02-28),"
         " with tr11-176B-ml.slurm (commit ed196cd) and README.md")
BLOOM_ASSUMED = (
    "the slurm script: TP 4, PP 12 (DP 8 on 48 nodes), micro-batch 2, global batch 2048, 70 layers, hidden 14336, "
    "112 heads, sequence 2048, vocabulary padded to 250880, bf16, --checkpoint-activations (every layer), ALiBi "
    "(a bias added to the scores, as the causal mask here), --pp-partition-method 'type:transformer|embedding' "
    "(stages of 6 blocks, or 5 and an embedding: the last one's tied output layer and loss), no dropout flag "
    "(Megatron-DeepSpeed's default 0.1); README: DeepSpeed's BF16_Optimizer accumulates gradients in fp32, "
    "'8 GPUs per node Using NVLink 4 inter-gpu connects, 4 OmniPath links': 4 x 100 Gb/s Omni-Path (OPA100) per "
    "node, 6.25 GB/s per GPU; DeepSpeed's 1F1B pipeline and its gradient all_reduce after the last microbatch: "
    "overlap 'none'")


OPT = ("Zhang et al., 'OPT: Open Pre-trained Transformer Language Models', arXiv:2205.01068v4, sec. 2.2, 2.4 and "
       "Table 1; facebookresearch/metaseq metaseq/launcher/opt_baselines.py, opt_job_constants.py and "
       "projects/OPT/chronicles/10_percent_update.md, final_update.md (commit f7ffa5f)")
OPT_ASSUMED = (
    "the FLOP count behind 'TFLOP/s' is not stated in the paper: Narayanan et al.'s eq. (3) with recomputation, "
    "96 B s l h^2 (1 + s/6h + V/16lh), is taken because it gives the chronicles' total (final_update.md: 'This "
    "required ~4.30E+23 FLOPs of compute' for 300B tokens): 1.434e12 FLOPs per token x 300e9 = 4.302e23, where the "
    "count without recomputation gives 3.23e23 and 6N 3.15e23; 'up to' 147: the paper's best figure, not an average. "
    "metaseq (opt_baselines.py, exp 12.00's flags): --ddp-backend fully_sharded with --no-reshard-after-forward "
    "('zero2': parameters gathered once per layer in the forward and kept for the backward), --model-parallel-size "
    "8 (opt_job_constants.py: '\"175b\": Size(96, 12288, 96, 128, int(2.0 * M), 3e-5, 8)'), --checkpoint-activations "
    "(every layer; --distribute-checkpointed-activations splits what is kept over tp, and its gather over tp when "
    "recomputing is not written), --batch-size "
    "(2M // (992 // 8)) // 2048 = 8 sequences per replica with --update-freq 1 (992 sequences, 2,031,616 tokens per "
    "step: Table 1's '2M'), --memory-efficient-fp16 (fp16 parameters, fp32 Adam state: bf16 and a float32 master "
    "copy here, A100's fp16 and bf16 peaks being equal), --activation-fn relu, --decoder-learned-pos, "
    "--share-decoder-input-output-embed (tied: written untied here, the same FLOPs), dropout 0.1 and attention "
    "dropout 0.1, --no-emb-dropout (the embedding's dropout is written here: one elementwise op); vocabulary "
    "50272, not stated in these sources (the GPT-2 BPE's 50257 padded; 51200 would move the FLOP count by 0.005%); "
    "the cluster's network is not stated: the "
    "preset's one 200 Gb/s HDR InfiniBand link per GPU; FSDP (fairscale) prefetches its all_gathers and "
    "reduce_scatters the gradients during the backward: overlap ('grads', 'params'); Megatron-LM's tensor-parallel "
    "all_reduces of 2021 are not overlapped; TP 8 inside a node, FSDP over the 124 nodes")


NEMO_LONG = ("NVIDIA/NeMo docs/source/performance/performance_long_sequence.md, 'LLAMA2-7B (FP8) - H100' "
             "(NeMo 24.03.01 container, DGX-H100)")

NEMO_SUMMARY = ("NVIDIA/NeMo docs/source/performance/performance_summary.md (NeMo 24.07 container, DGX-H100, FP8; "
                "commit 4c73f77)")

MB = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (26.02 and 25.11 containers) and "
      "performance-summary.md, DGX-H100 tables")

def megatron_bridge(id: str, quote: str, model: Model, nodes: int, layout: Layout, measured: float,
                    recipe: str) -> Run:
    """A Megatron-Bridge performance-table row on DGX-H100 nodes, its settings from its recipe
    (``src/megatron/bridge/perf_recipes/llama/`` + ``recipe``) and what every such recipe sets: sequence
    parallelism, no recomputation, FP8 current scaling, tp_comm_overlap with userbuffers, and (training/
    comm_overlap.py) overlap_p2p_comm for VP > 1, overlap_grad_reduce and overlap_param_gather for DP > 1."""
    return Run(id, MB, quote, "h100-sxm-80gb", nodes, 8, model, layout, "all", "tokens/s/GPU", measured,
               assumed=f"{recipe}; every perf recipe: sequence parallelism, no recomputation, tp_comm_overlap, "
                       "overlap_p2p_comm, overlap_grad_reduce, overlap_param_gather: overlap 'all'; the gradients' "
                       "reduce_scatter of the distributed optimizer priced as an all_reduce (twice its bytes)")


RUNS: tuple[Run, ...] = (
    *korthikanti("22B", GPT_22B, 1, 1, 4, 4, 1.10, 1.42),
    *korthikanti("175B", GPT_175B, 8, 3, 64, 1, 13.75, 18.13),
    *korthikanti("530B", GPT_530B, 35, 3, 280, 1, 37.83, 49.05),
    *korthikanti("1T", GPT_1T, 64, 1, 512, 1, 71.49, 94.42),
    megatron_bridge("mb-llama3-70b-fp8", "| DGX-H100 | 64 | FP8 | 256 | 1 | 8192 | 0 | 4 | 8 | 1 | 5 | n/a | 1621 | "
                    "728 | (26.02: GPUs, precision, GBS, MBS, sequence, FSDP, TP, PP, CP, VP, EP, tokens/s/GPU, model "
                    "TFLOP/s/GPU)", LLAMA3_70B, 8,
                    Layout(tp=4, pp=8, dp=2, mbs=1, gbs=256, vp=5, sp=True, fp8=True, stages=stages(11, 10, 9)), 1621,
                    "h100/llama3.py, llama3_70b_pretrain_64gpu_h100_fp8cs_config: pipeline layout "
                    "'Et*2|(t*2|)*34,t*3|(t*2|)*3,tL' (stages of 10, 11 and 9 layers plus the embedding or the loss)"),
    megatron_bridge("mb-llama31-405b-fp8", "| DGX-H100 | 1024 | FP8 | 1536 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | n/a | 311 "
                    "| 784 | (26.02)", LLAMA31_405B, 128,
                    Layout(tp=8, pp=8, dp=8, cp=2, mbs=1, gbs=1536, vp=8, sp=True, fp8=True,
                           stages=stages(16, 15, 15)), 311,
                    "h100/llama31.py, llama31_405b_pretrain_1024gpu_h100_fp8cs_config and its base recipe: "
                    "account_for_embedding/loss_in_pipeline_split (128 slots over 64 chunks: stages of 16 layers, or "
                    "15 and the embedding or the loss); ranks ordered tp, cp, dp (Megatron-Core's default): tp inside "
                    "a node, cp over two nodes"),
    Run("bloom-176b", BLOOM,
        "| 48 | 176B | 8 | 4 | 12 | 2 | 112 | 2048 | 59GB | 104.50 | 150.05 | 02-28 | (Nodes, Size, DP, TP, PP, MBS, "
        "NHEADS, GBS, Mem, Sec/it, TFLOPs)",
        "a100-sxm-80gb", 48, 8, BLOOM_176B,
        Layout(tp=4, pp=12, dp=8, mbs=2, gbs=2048, recompute="full", accumulate_fp32=True,
               stages=stages(6, 5, 5)),
        "none", "s/step", 104.50, assumed=BLOOM_ASSUMED, network_bandwidth=6.25e9),
    Run("opt-175b", OPT,
        "sec. 2.4: 'We trained OPT-175B on 992 80GB A100 GPUs, by utilizing Fully Sharded Data Parallel (Artetxe et "
        "al., 2021) with Megatron-LM Tensor Parallelism (Shoeybi et al., 2019). We achieve utilization of up to 147 "
        "TFLOP/s per GPU. We keep Adam state in FP32, since we shard it across all hosts, while the model weights "
        "remained in FP16.'; Table 1: '175B 96 96 12288 1.2e−4 2M' (#L, #H, d_model, LR, Batch in tokens); sec. 2.2: "
        "'all models are trained with ReLU activation and a sequence length of 2048', 'We use a dropout of 0.1 "
        "throughout, but we do not apply any dropout to embeddings'; 10_percent_update.md: '8x Tensor Parallelism', "
        "'FP32 Adam' (settings the 11.xx lineage began with; 12.xx, the run trained, changed the initialisation, "
        "Normformer and embeddings, not these)",
        "a100-sxm-80gb", 124, 8, OPT_175B,
        Layout(tp=8, pp=1, dp=1, fsdp=124, mbs=8, gbs=992, recompute="full", reshard=False,
               stages=((96, True, True),)),
        ("grads", "params"), "TFLOP/s/GPU", 147,
        gpt_flops(992, OPT_175B.seq, OPT_175B.layers, OPT_175B.hidden, OPT_175B.vocab), OPT_ASSUMED),
    Run("nemo-llama2-7b-128k-cp4", NEMO_LONG,
        "| 128 | 128 | 32 | 424 | 4 | 1 | 8 | 4 | 555 | 1.31 | (SeqLen (K), # of GPUs, Batch Size, without-CP "
        "TFLOPS/GPU, TP, PP, DP, CP, with-CP TFLOPS/GPU, speedup)",
        "h100-sxm-80gb", 16, 8, LLAMA2_7B_128K,
        Layout(tp=4, pp=1, dp=8, cp=4, mbs=1, gbs=32, sp=True, fp8=True, stages=((32, True, True),)),
        "all", "TFLOP/s/GPU", 555, nemo_llama_flops(LLAMA2_7B_128K, 32),
        assumed="micro-batch 1 (4 microbatches per step; not stated), no recomputation, NeMo's performance "
                "configurations' overlaps (TP with userbuffers, gradients and parameters): overlap 'all' (not "
                "stated for this table); ranks ordered tp, cp, dp: tp inside a node, cp over two nodes"),
    Run("nemo-llama2-7b-16k", NEMO_LONG,
        "| 16 | 16 | 256 | 660 | 2 | 1 | 8 | 1 | 660 | 1.00 |",
        "h100-sxm-80gb", 2, 8, LLAMA2_7B_16K,
        Layout(tp=2, pp=1, dp=8, mbs=1, gbs=256, sp=True, fp8=True, stages=((32, True, True),)),
        "all", "TFLOP/s/GPU", 660, nemo_llama_flops(LLAMA2_7B_16K, 256),
        assumed="as the 128K row: micro-batch 1, no recomputation, overlap 'all'"),
    Run("nemo-llama2-7b-4k", NEMO_SUMMARY,
        "| LLAMA2-7B     | 8      | 128  | 1   | 4096           | 1  | 1  | 1  | 1  | 16847              | 776 |",
        "h100-sxm-80gb", 1, 8, LLAMA2_7B_4K,
        Layout(tp=1, pp=1, dp=8, mbs=1, gbs=128, fp8=True, stages=((32, True, True),)),
        "all", "tokens/s/GPU", 16847,
        assumed="no recomputation; data parallelism with NeMo's distributed optimizer and its overlaps: overlap 'all'"),
    Run("nemo-llama2-70b", NEMO_SUMMARY,
        "| LLAMA2-70B    | 64     | 128  | 1   | 4096           | 4  | 4  | 1  | 20 | 1707               | 759 |",
        "h100-sxm-80gb", 8, 8, LLAMA2_70B,
        Layout(tp=4, pp=4, dp=4, mbs=1, gbs=128, vp=20, sp=True, fp8=True,
               stages=stages(20)),
        "all", "tokens/s/GPU", 1707,
        assumed="sequence parallelism, no recomputation, NeMo's performance configurations' overlaps (TP with "
                "userbuffers, p2p, gradients, parameters): overlap 'all' (not stated in the table); 20 layers per "
                "stage, the embedding on the first and the loss on the last"),
    Run("nemo-llama3-70b-cp2", NEMO_SUMMARY,
        "| LLAMA3-70B    | 64     | 128  | 1   | 8192           | 4  | 4  | 2  | 5  | 1533               | 738 |",
        "h100-sxm-80gb", 8, 8, LLAMA3_70B,
        Layout(tp=4, pp=4, dp=2, cp=2, mbs=1, gbs=128, vp=5, sp=True, fp8=True,
               stages=stages(20)),
        "all", "tokens/s/GPU", 1533,
        assumed="as the Llama 2 70B row; ranks ordered tp, cp, dp: tp and cp inside a node"),
    Run("maxtext-llama2-7b-16vm", MAXTEXT, "| 16x A3 (h100-80gb-8)   | 375              | (TFLOP/sec/chip)",
        "h100-sxm-80gb", 16, 8, LLAMA2_7B_4K,
        Layout(tp=1, pp=1, dp=16, fsdp=8, mbs=4, gbs=512, recompute="save_matmuls", xla_norm=True, iota_embed=True,
               logits_fp32=True, stages=((32, True, True),)),
        ("grads", "params"), "TFLOP/s/GPU", 375, maxtext_flops(LLAMA2_7B_4K, 512),
        MAXTEXT_ASSUMED + "; A3 High VMs (Google Cloud, 'Networking and GPU machines': 'A3 High | NVIDIA H100 80GB "
        "| 1,000 Gbps | GPUDirect-TCPX'): 125 Gb/s, 15.6 GB/s per GPU across VMs",
        network_bandwidth=1000e9 / 8 / 8, allow_tf32=True),
    Run("maxtext-llama2-7b-1vm", MAXTEXT, "| 1x A3 (h100-80gb-8)    | 492              | (TFLOP/sec/chip)",
        "h100-sxm-80gb", 1, 8, LLAMA2_7B_4K,
        Layout(tp=1, pp=1, dp=1, fsdp=8, mbs=4, gbs=32, recompute="save_matmuls", xla_norm=True, iota_embed=True,
               logits_fp32=True, stages=((32, True, True),)),
        ("grads", "params"), "TFLOP/s/GPU", 492, maxtext_flops(LLAMA2_7B_4K, 32), MAXTEXT_ASSUMED, allow_tf32=True),
)


#: each source's name in tables
SHORT = {KORTHIKANTI: "Korthikanti et al. 2022", BLOOM: "BigScience BLOOM", MB: "Megatron-Bridge", NEMO_LONG: "NeMo",
         NEMO_SUMMARY: "NeMo", MAXTEXT: "MaxText", OPT: "OPT (Zhang et al. 2022)"}


# ---- output ----------------------------------------------------------------------------------------------------


def result(p: Prediction) -> dict:
    r = p.run
    return {"id": r.id, "source": r.source, "short": SHORT[r.source], "quote": r.quote, "hardware": r.hardware, "gpus": r.gpus,
            "model": r.model.name, "seq": r.model.seq, "layout": {k: v for k, v in r.layout._asdict().items()
                                                                  if k != "stages"},
            "stages": [list(s) for s in r.layout.stages], "slowest_stage": list(p.slowest),
            "overlap": r.overlap if isinstance(r.overlap, str) else list(r.overlap), "unit": r.unit,
            "measured": r.measured, "predicted": p.predicted, "ratio": p.ratio, "met": p.met, "target": TARGET,
            "step_s": p.step_s, "measured_step_s": r.measured_step(), "microbatch_ms": p.microbatch_s * 1e3,
            "bubble_s": p.bubble_s, "p2p_s": p.p2p_s, "grad_s": p.grad_s, "optimizer_s": p.optimizer_s,
            "stage_compute_ms": p.stage.compute_time * 1e3, "stage_exposed_comm_ms": p.stage.exposed_comm * 1e3,
            "assumed": r.assumed, "seconds": p.seconds}


def run_all(ids: list[str] | None = None) -> dict:
    rows = []
    for r in RUNS:
        if ids and r.id not in ids:
            continue
        p = predict(r)
        rows.append(result(p))
        print(f"{r.id:<28} {r.gpus:>5} {r.hardware:<14} measured {r.measured:>9.4g} {r.unit:<13} predicted "
              f"{p.predicted:>9.4g} ratio {p.ratio:.2f} ({'met' if p.met else 'MISSED'}) | microbatch "
              f"{p.microbatch_s * 1e3:.1f} ms, exposed comm {p.stage.exposed_comm * 1e3:.1f} ms | {p.seconds:.1f} s",
              flush=True)
    return {"target": TARGET, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", help="run ids, comma-separated (default: every run)")
    ap.add_argument("--json", help="write the results here (default: update benchmarks/results.json)")
    a = ap.parse_args()
    res = {"time_published": run_all(a.runs.split(",") if a.runs else None)}
    write_results(res, a.json)


if __name__ == "__main__":
    main()
