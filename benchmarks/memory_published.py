"""Memory per device against published training runs: does nabla say that a run that ran fits, and that a run
its authors say did not fit does not?

    python benchmarks/memory_published.py [--runs K-22B,X-K-22B] [--json PATH]

Every configuration, its numbers and its quotes come from ``benchmarks/published_runs.md`` (a
literature file: each fact quoted from a paper, a config file in the authors' repository at a stated commit, or
plain arithmetic on them); the quotes are repeated in ``RUNS`` below. A run is *validated* when nabla's
``fits`` equals the source's verdict (ran / out of memory). Where the source states a memory figure it is shown
beside nabla's peak with the ratio; figures read off a bar chart carry the file's "±2 GB" caveat, and nvidia-smi
figures include the CUDA context and the caching allocator's reserve (about 1 GiB and up, never counted here).

How each run is written (nothing here is a formula: every number is read from a recorded program)
----------------------------------------------------------------------------------------------------
- **The program** is one pipeline stage of the run's model written with nabla ops at full size, on
  ``nb.abstract`` tensors laid out on ``cluster.mesh("stage", (dp, tp), ("dp", "tp"))`` of the stage's
  ``dp x tp`` devices (pipeline stages sit outside SPMD): ``megatron_table1.stage_program`` (pre-LayerNorm GPT
  blocks, Megatron-LM's tensor parallelism, vocabulary-parallel embedding and cross-entropy on float32 logits)
  with a ``megatron_table1.Variant`` for what the run did differently; MaxText's Llama is ``maxtext_step``.
- **The training step** is that stage's forward and backward for one microbatch followed by the optimizer's
  update, measured together by ``nb.estimate(step, cluster)(params, state, *batch)``. The optimizer is
  ``nabla.optim.Adam(master_dtype="float32")`` (16-bit parameters and gradients, float32 master copy and
  moments: ZeRO's 16 bytes per parameter) with its state made by ``opt.init(params, specs=...)`` outside the
  measured function: replicated (plain data parallelism), or split over ``dp`` (ZeRO-1, DeepSpeed's BF16
  optimizer, Megatron's distributed optimizer); ZeRO-2 also sums the gradients into that layout
  (``grad_specs``). MaxText keeps float32 weights and moments (no master copy): ``Adam()`` on float32 params,
  state laid out as the parameters (FSDP).
- **Pipelines.** Stage 0 (embedding and its layers) goes through ``nb.pipeline_estimate(report, p, m, schedule,
  v).memory`` (its peak plus the microbatches the schedule keeps in flight). The other stages priced (the
  last: its layers, the final norm, output layer and loss; BLOOM's second stage: the most layers) are not what
  ``pipeline_estimate(...).memory`` models (stage 0 only), so their in-flight count is Megatron-LM's warm-up for
  their rank (``in_flight_at``, ``megatron/schedules.py`` ``get_forward_backward_func``'s warm-up count plus
  one; it equals nabla's ``in_flight`` at rank 0, which is checked), added as ``pipeline.py`` adds it:
  ``peak + (in flight - 1) * kept``. The configuration's peak is the worst stage's.
- **Recomputation** as the run did it: ``full`` = each layer under ``nb.checkpoint`` (Megatron's
  ``--checkpoint-activations``, DeepSpeed's activation checkpointing, ``checkpoint-num-layers 1``); Korthikanti's
  "present work" = sequence parallelism (each layer under ``nb.checkpoint(policy="regather")``, the activations
  between layers split over tp) plus selective recompute (the attention core under ``nb.checkpoint``), as
  ``tests/integration/test_memory_megatron.py`` writes Table 2; ``none`` = nothing recomputed. ZeRO's ``P_a``
  keeps each layer's checkpointed input split over tp. MaxText's ``minimal_flash`` (keep every weight matmul's
  output and the attention output "context", recompute the rest) is approximated by the whole layer under
  ``nb.checkpoint(policy="save_matmuls")`` with ``nb.dot_product_attention``: every weight matmul's output is
  kept as there, but the attention output is recomputed (its forward runs again in the backward pass) instead
  of kept: ``b s h`` bytes less per layer than MaxText keeps (4.0 GiB over 32 layers, 4 sequences of 4096 per
  device), stated in the run's note.
- **Megatron-LM's kernels**: row-parallel outputs summed right after their matmul (Megatron's all_reduce; a
  reduce_scatter under sequence parallelism), dropout with a kept 1-byte mask (its fused kernels), the causal
  mask made inside the softmax kernel, tied embeddings (the last stage keeps its own copy as the output layer).
  GPT-NeoX-20B: parallel residual, no position parameters (rotary), no dropout, untied output layer; its rotary
  embedding itself is not written (elementwise on q and k inside one layer's recompute). BLOOM: no position
  parameters (ALiBi; the bias is not written), its embedding LayerNorm (2h parameters) is not written.
- **What is not modelled** (said per run where it matters): the CUDA context and allocator reserve of
  nvidia-smi figures; DeepSpeed's gradient buckets (``reduce_bucket_size``); fragmentation; gradients of
  earlier microbatches during a later microbatch's forward pass (the one-microbatch program makes its gradients
  in its own backward pass; a job accumulating over ``m`` microbatches holds the running sum from the first on).

Source figures are compared as GiB: Korthikanti et al.'s Fig. 1 bars equal their Table 2 equations in GiB (the
22B baseline's 48 layers of ``s b h (10 + 24/t + 5 a s/(h t))`` bytes are 59.2 GiB, 63.6 GB; the bar reads ≈59);
nvidia-smi, PyTorch and DeepSpeed's memory reports count MiB and GiB. Were a figure 10^9 bytes, its ratio would be
7% lower.

The modelling issues this check first found in nabla's pipeline and optimizer memory (``kept`` read after a
recompute, the microbatches in flight added to the update's peak, no update in place, a cotangent handed in
counted as kept) are fixed in nabla itself; docs/planning.md tells what they were.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import nabla as nb  # noqa: E402
from nabla.plan import Cluster, Hardware, gpt_params, pipeline_estimate  # noqa: E402
from nabla.pytree import flatten, unflatten  # noqa: E402

import megatron_table1 as mt  # noqa: E402
from _env import environment, write_results  # noqa: E402

GiB, MiB, GB = 2**30, 2**20, 10**9
RESEARCH = "benchmarks/published_runs.md"

# ---- hardware ------------------------------------------------------------------------------------------------

A100_80GB = Hardware.preset("a100-sxm-80gb")
H100_80GB = Hardware.preset("h100-sxm-80gb")
#: A100 SXM4 40GB (GPT-NeoX-20B's servers): nvidia-smi reports "40960MiB" for "NVIDIA A100-SXM4-40GB" (many
#: public nvidia-smi transcripts, e.g. "19478MiB / 40960MiB"); HBM2 1,555 GB/s (NVIDIA A100 datasheet, the 40GB
#: column; techpowerup "A100 SXM4 40 GB"). Compute and links are the 80GB part's (same GA100 chip and NVLink).
A100_40GB = A100_80GB.replace(name="a100-sxm-40gb", hbm_bytes=40960 * MiB, hbm_bandwidth=1555 * GB)
#: V100 SXM3 32GB (DGX-2; the DeepSpeed tutorial's and the ZeRO paper's GPUs): nvidia-smi "32480MiB" (the
#: tutorial's own screenshot: "32466MiB / 32480MiB"; PyTorch's "31.72 GiB total capacity" in its OOM message);
#: 125 fp16 tensor TFLOP/s ("up to 125 Tensor TFLOPS", developer.nvidia.com/programming-tensor-cores-cuda-9-0),
#: 15.7 fp32 TFLOP/s, no bfloat16. Only the memory is read here: bandwidths, links and efficiencies are the A100
#: preset's, so a step time on this part is not a V100's.
V100_32GB = A100_80GB.replace(name="v100-sxm3-32gb (memory only)", hbm_bytes=32480 * MiB,
                              peak_flops={"float16": 125e12, "float32": 15.7e12}, vector_flops=15.7e12)

# ---- the runs ------------------------------------------------------------------------------------------------

SOURCES = {
    "Narayanan'21": "Narayanan et al., SC'21 (arXiv:2104.04473) Table 1; NVIDIA/Megatron-LM examples/sc21/"
                    "run_table_1.sh and CONFIG.sh @ 6985e58",
    "Korthikanti'22": "Korthikanti et al., \"Reducing Activation Recomputation in Large Transformer Models\" "
                      "(arXiv:2205.05198v1), Table 3, Fig. 1, sec. 6",
    "BLOOM": "bigscience-workshop/bigscience train/tr11-176B-ml (slurm @ ed196cd, README, chronicles-prequel.md)",
    "GPT-NeoX": "EleutherAI/gpt-neox configs/20B.yml @ c560814 (\"as it was trained on 96x 40GB A100\")",
    "MaxText": "AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b (1vm.sh, 16vm.sh) @ efb6d9e",
    "DeepSpeed": "DeepSpeed ZeRO tutorial (docs/_tutorials/zero.md @ fd40516, deepspeed.ai/tutorials/zero)",
    "ZeRO": "Rajbhandari et al., \"ZeRO\" (SC'20, arXiv:1910.02054v3), Tables 3, 5, 8, sec. 6.1, 10, Fig. 7",
}


class Model(NamedTuple):
    """A GPT's shape (what ``megatron_table1.stage_program`` reads: ``hidden``, ``heads``)."""

    name: str
    layers: int
    hidden: int
    heads: int


class Run(NamedTuple):
    """One published configuration. ``stages``: the pipeline stages priced, ``(kind, layers, rank)``; ``zero``:
    "none" (optimizer state replicated), "zero1" (split over dp), "zero2" (and gradients), "fsdp" (MaxText);
    ``fp32_accumulation``: gradients summed into a float32 buffer laid out as the parameters (BLOOM's BF16
    optimizer: "doesn't shard the static fp32 buffer"). ``stated_gib``: the source's memory figure per device
    (None: not stated), ``stated``: how the source gives it; ``verdict``: "ran" or "OOM"; ``quote``: the
    source's words for the verdict."""

    id: str
    source: str
    model: Model
    hardware: Hardware
    per_node: int
    tp: int
    pp: int
    dp: int
    microbatch: int
    microbatches: int
    virtual_stages: int
    stages: tuple
    variant: Any  # megatron_table1.Variant, or None for MaxText's Llama
    zero: str
    verdict: str
    quote: str
    stated_gib: float | None = None
    stated: str = "not stated"
    recompute: str = "full"
    fp32_accumulation: bool = False
    note: str = ""

    @property
    def schedule(self) -> str:
        return "interleaved" if self.virtual_stages > 1 else "1f1b"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


# Megatron-LM as Narayanan'21 and Korthikanti'22 ran it: row-parallel sums where Megatron makes them, 1-byte
# dropout masks, the causal mask inside the fused softmax, tied embeddings (vocabulary 51,200, sequence 2048)
MEGATRON = mt.Variant(dropout="mask", summed=True, tied=True, fused_mask=True)
PRESENT = MEGATRON._replace(recompute="selective", sequence_parallel=True)  # Korthikanti's "present work"
BASELINE = MEGATRON._replace(recompute="none")  # Fig. 1/8's "no recomputation and no sequence parallelism"


def _stages(layers: int, pp: int, embed_counts: bool = False) -> tuple:
    """The stages priced: the whole model (p = 1), or stage 0 and stage p-1 (``layers / p`` each; with
    ``embed_counts``, DeepSpeed's ``type:transformer|embedding`` partition: each embedding counts as a layer,
    so stage 0 and p-1 hold one layer fewer and rank 1 the most)."""
    if pp == 1:
        return (("whole", layers, 0),)
    if not embed_counts:
        n = layers // pp
        assert n * pp == layers, (layers, pp)
        return (("first", n, 0), ("last", n, pp - 1))
    n = (layers + 2) // pp
    assert n * pp == layers + 2, (layers, pp)
    return (("first", n - 1, 0), ("middle", n, 1), ("last", n - 1, pp - 1))


N_QUOTE = ("Table 1 ran it (measured TFLOP/s per GPU); sc21 scripts: --activations-checkpoint-method uniform, "
           "--fp16, no distributed optimizer")


def _narayanan(b: float, layers: int, hidden: int, heads: int, tp: int, pp: int, dp: int, mbs: int, gbs: int,
               v: int) -> Run:
    m = gbs // (dp * mbs)
    return Run(f"N-{b:g}B" if b < 1000 else "N-1T", "Narayanan'21", Model(f"GPT {b:g}B", layers, hidden, heads),
               A100_80GB, 8, tp, pp, dp, mbs, m, v, _stages(layers, pp), MEGATRON, "none", "ran", N_QUOTE)


K_QUOTE = ("sec. 6: both the full-recompute and the present-work (SP + selective) variants ran (Table 5's "
           "iteration times)")
K_OOM = ("sec. 1: \"for all these cases, the required memory for the baseline cases is above the 80GB memory "
         "provided by an NVIDIA A100 GPU\"")


def _korthikanti(b: str, layers: int, hidden: int, heads: int, pp: int, v: int, gbs: int, mbs: int,
                 present: float, baseline: float) -> tuple[Run, Run]:
    model = Model(f"GPT {b}", layers, hidden, heads)
    m = gbs // mbs  # "no data parallelism is used in our evaluations"
    ran = Run(f"K-{b}", "Korthikanti'22", model, A100_80GB, 8, 8, pp, 1, mbs, m, v, _stages(layers, pp), PRESENT,
              "none", "ran", K_QUOTE, present, f"≈{present:g} GB, read off Fig. 1 (±2 GB)", "SP + selective")
    oom = ran._replace(id=f"X-K-{b}", variant=BASELINE, verdict="OOM", quote=K_OOM, stated_gib=baseline,
                       stated=f"≈{baseline:g} GB baseline, read off Fig. 1 (±2 GB)", recompute="none (no SP)")
    return ran, oom


BLOOM_VOCAB = 250880  # --pad-vocab-size-to 250880
BLOOM = mt.Variant(vocab=BLOOM_VOCAB, dropout="mask", summed=True, fused_mask=True, positions=False)


def _bloom(rid: str, layers: int, hidden: int, heads: int, dp: int, tp: int, pp: int, mbs: int, verdict: str,
           quote: str, stated_gib: float | None = None, stated: str = "not stated") -> Run:
    b = round(gpt_params(layers, hidden, BLOOM_VOCAB, 0) / 1e9)
    return Run(rid, "BLOOM", Model(f"BLOOM-shaped {b}B", layers, hidden, heads), A100_80GB, 8, tp, pp, dp, mbs,
               2048 // (dp * mbs), 1, _stages(layers, pp, embed_counts=True), BLOOM, "zero1", verdict, quote,
               stated_gib, stated, fp32_accumulation=True)


NEOX = mt.Variant(vocab=50432, dtype="float16", dropout="none", summed=True, fused_mask=True, positions=False,
                  parallel_residual=True)
GPT2_DS = mt.Variant(vocab=50304, seq=1024, dtype="float16", dropout="mask", summed=True, tied=True,
                     fused_mask=True)  # Megatron-LM of 2019-20 as DeepSpeedExamples ran it: vocabulary padded to 128
ZERO100B = GPT2_DS._replace(vocab=51200, partition_activations=True)  # padded to 128 x MP 16

#: what minimal_flash keeps and save_matmuls recomputes: the attention output, b s h bf16 per layer
MX_NOTE = (f"minimal_flash also keeps each layer's attention output: {4 * 4096 * 4096 * 2 * 32 / 2**30:.1f} GiB more "
           "than save_matmuls keeps (4 sequences of 4096 x 4096, bf16, 32 layers)")

DS_QUOTE_OOM = ("\"Training this model without ZeRO fails with an out-of-memory (OOM) error\"; screenshot: \"CUDA "
                "out of memory. Tried to allocate 14.00 MiB (GPU 1; 31.72 GiB total capacity; 29.09 GiB already "
                "allocated; 14.25 MiB free; 30.46 GiB reserved in total by PyTorch)\"")
DS_QUOTE_FITS = ("\"By using ZeRO stage 1 to partition the optimizer state among eight data parallel ranks, the "
                 "per-device memory consumption can be reduced to 2.25GB, thus making the model trainable\"")


def _runs() -> tuple[Run, ...]:
    runs = [
        _narayanan(1.7, 24, 2304, 24, 1, 1, 32, 16, 512, 1),
        _narayanan(3.6, 30, 3072, 32, 2, 1, 32, 16, 512, 1),
        _narayanan(7.5, 36, 4096, 32, 4, 1, 32, 16, 512, 1),
        _narayanan(18.4, 40, 6144, 48, 8, 1, 32, 8, 1024, 1),
        _narayanan(39.1, 48, 8192, 64, 8, 2, 32, 4, 1536, 1),
        _narayanan(76.1, 60, 10240, 80, 8, 4, 32, 2, 1792, 3),
        _narayanan(145.6, 80, 12288, 96, 8, 8, 24, 2, 2304, 2),
        _narayanan(310.1, 96, 16384, 128, 8, 16, 15, 1, 2160, 2),
        _narayanan(529.6, 105, 20480, 128, 8, 35, 9, 1, 2520, 3),
        _narayanan(1008.0, 128, 25600, 160, 8, 64, 6, 1, 3072, 1),
    ]
    for args in (("22B", 48, 6144, 64, 1, 1, 4, 4, 56, 105), ("175B", 96, 12288, 96, 8, 3, 64, 1, 58, 112),
                 ("530B", 105, 20480, 128, 35, 3, 280, 1, 55, 145), ("1T", 128, 25600, 160, 64, 1, 512, 1, 59, 164)):
        runs += _korthikanti(*args)
    runs += [
        _bloom("B-176B", 70, 14336, 112, 8, 4, 12, 2, "ran",
               "the production layout (slurm: TP_SIZE=4 PP_SIZE=12 MICRO_BATCH_SIZE=2, 48 nodes); prequel 02-28: "
               "`| 48 | 176B | 8 | 4 | 12 | 2 | 112 | 2048 | 59GB |`", 59,
               "59 GB (nvidia-smi, 02-28 trial of this layout: context and allocator reserve included)"),
        _bloom("B-176B-TP8", 70, 14336, 64, 4, 8, 12, 2, "ran",
               "prequel 02-28: `| 48 | 176B | 4 | 8 | 12 | 2 | 64 | 2048 | 40GB |`", 40, "40 GB (nvidia-smi)"),
        _bloom("B-184B-TP8", 100, 12288, 64, 8, 8, 6, 2, "ran",
               "prequel 02-28: `| 48 | 184B | 8 | 8 | 6 | 2 | 64 | 2048 | 61GB |`", 61, "61 GB (nvidia-smi)"),
        _bloom("X-B-184B", 100, 12288, 64, 16, 4, 6, 1, "OOM",
               "prequel 02-28: `| 48 | 184B | 16 | 4 | 6 | 1 | 64 | 2048 | OOM  |` (and MBS 2: OOM)"),
        _bloom("X-B-206B", 82, 14336, 128, 8, 4, 12, 2, "OOM",
               "prequel 02-28: `| 48 | 206B | 8 | 4 | 12 | 2 | 128 | 2048 | OOM |` (the 70-layer 176B in this "
               "layout: 59 GB)"),
        Run("X-B-181B-DP48", "BLOOM", Model("BLOOM-shaped 181B", 72, 14336, 64), A100_80GB, 8, 8, 1, 48, 1, 42, 1,
            _stages(72, 1), BLOOM._replace(dtype="float16"), "zero1", "OOM",
            "prequel 02-25 \"GBS Variations\": `| 48 | 181B | 48 | 8 | 1 | 1 | 2016 | OOM  |` (fp16 and ZeRO-1 "
            "per the contemporaneous tr11-200B-ml.slurm: unconfirmed per row)"),
        Run("NeoX-20B", "GPT-NeoX", Model("GPT-NeoX-20B", 44, 6144, 64), A100_40GB, 8, 2, 4, 12, 4, 32, 1,
            _stages(44, 4), NEOX, "zero1", "ran",
            "configs/20B.yml: \"as it was trained on 96x 40GB A100\"; pipe-parallel-size 4, model-parallel-size 2, "
            "micro-batch 4, zero_optimization stage 1, checkpoint-activations",
            note="DeepSpeed's ZeRO buckets (reduce_bucket_size 1.26e9 elements, overlap_comm) are not modelled"),
        Run("MX-7B-1n", "MaxText", Model("Llama 2 7B", 32, 4096, 32), H100_80GB, 8, 1, 1, 1, 4, 1, 1,
            (("fsdp", 32, 0),), None, "fsdp", "ran",
            "README: \"1x A3 (h100-80gb-8) | 492\" TFLOP/s/chip; 1vm.sh: ici_fsdp_parallelism=8 "
            "per_device_batch_size=4 max_target_length=4096 attention=cudnn_flash_te remat_policy=minimal_flash",
            None, "not stated (XLA_PYTHON_CLIENT_MEM_FRACTION=0.85: a 68 GB cap, not a measurement)",
            "minimal_flash ≈ save_matmuls", note=MX_NOTE),
        Run("MX-7B-16n", "MaxText", Model("Llama 2 7B", 32, 4096, 32), H100_80GB, 8, 1, 1, 16, 4, 1, 1,
            (("fsdp", 32, 0),), None, "fsdp", "ran",
            "README: \"16x A3 (h100-80gb-8) | 375\"; 16vm.sh: dcn_data_parallelism=16 ici_fsdp_parallelism=8",
            None, "not stated", "minimal_flash ≈ save_matmuls", note=MX_NOTE),
        Run("DS-1.5B-ZeRO1", "DeepSpeed", Model("GPT-2 1.5B", 48, 1600, 16), V100_32GB, 8, 1, 1, 8, 1, 1, 1,
            _stages(48, 1), GPT2_DS, "zero1", "ran", DS_QUOTE_FITS, None,
            "32466MiB / 32480MiB (nvidia-smi screenshot: the allocator's reserve, not a peak)",
            note="sequence 1024, --checkpoint-activations and --fp16 from the base script (unconfirmed)"),
        Run("X-DS-1.5B", "DeepSpeed", Model("GPT-2 1.5B", 48, 1600, 16), V100_32GB, 8, 1, 1, 8, 1, 1, 1,
            _stages(48, 1), GPT2_DS, "none", "OOM", DS_QUOTE_OOM, 29.09,
            "29.09 GiB allocated when it failed (30.46 GiB reserved)",
            note="sequence 1024, --checkpoint-activations and --fp16 from the base script (unconfirmed)"),
        Run("Z-100B", "ZeRO", Model("GPT-2-like 100B", 125, 8192, 64), V100_32GB, 16, 16, 1, 25, 32, 1, 1,
            _stages(125, 1), ZERO100B, "zero2", "ran",
            "Tables 5 and 8: `100B ZeRO 400 16 125 8192 64 32 800`; sec. 6.1 (P_a); Table 3: C4 = P_os+g + P_a",
            29.7, "≈29.7 GB max cached (C4), read off Fig. 7 (±2 GB)", "full + P_a",
            note="vocabulary and 4h MLP unconfirmed (GPT-2-like); sequence 1024"),
    ]
    return tuple(runs)


RUNS = _runs()

# ---- the programs --------------------------------------------------------------------------------------------


def _entries(p: nb.Tensor) -> list:
    """A parameter's layout as a dim-spec list (None, an axis, or a tuple of axes per dim)."""
    out = []
    for d in p.sharding.dim_specs:
        out.append(None if not d.axes else d.axes[0] if len(d.axes) == 1 else tuple(d.axes))
    return out


def split_over(params: Any, axis: str, n: int) -> Any:
    """Each parameter's layout with one more split over ``axis`` of size ``n`` (ZeRO's partition of the optimizer
    state, and of gradients at stage 2): the first whole dim that ``n`` divides, else the first split dim whose
    block ``n`` divides (split over both), else the largest whole dim, unevenly (padded blocks: DeepSpeed splits a
    flat buffer, so its shards are even to the element, ours to a row)."""
    def one(p):
        mesh = p.sharding.mesh
        size = dict(zip(mesh.axis_names, mesh.shape))
        e = _entries(p)
        for i, (a, dim) in enumerate(zip(e, p.shape)):
            if a is None and dim % n == 0:
                return e[:i] + [axis] + e[i + 1:]
        for i, (a, dim) in enumerate(zip(e, p.shape)):
            if a is not None:
                axes = (a,) if isinstance(a, str) else a
                if (dim // math.prod(size[x] for x in axes)) % n == 0:
                    return e[:i] + [axes + (axis,)] + e[i + 1:]
        whole = [i for i, a in enumerate(e) if a is None and p.shape[i] >= n]
        if not whole:
            return None
        i = max(whole, key=lambda i: p.shape[i])
        return e[:i] + [axis] + e[i + 1:]

    leaves, tree = flatten(params)
    return unflatten(tree, [one(p) for p in leaves])


def param_grads(kind: str, out: Any) -> Any:
    """The parameters' gradients out of a stage program's result (``value_and_grad`` for a stage ending in the
    loss, ``vjp``'s pull-back otherwise)."""
    if kind in ("whole", "fsdp"):
        return out[1]
    if kind == "last":
        return out[1][0]
    return out[0]


class Program(NamedTuple):
    """A training step to measure: ``fn(*args)``, its mesh, the optimizer state passed in, the parameters, and the
    activation a middle or last stage receives (None for a stage that starts from token ids)."""

    fn: Any
    args: tuple
    mesh: Any
    params: Any
    state: Any
    received: Any = None


def gpt_step(run: Run, kind: str, layers: int, mesh) -> Program:
    """``run``'s ``kind`` stage (``layers`` blocks) for one microbatch followed by mixed-precision Adam's update
    of its parameters, the state made outside and passed in (laid out as ``run.zero`` says)."""
    zero = run.zero in ("zero1", "zero2")
    probe = mt.stage_program(run.model, kind, mesh, run.microbatch, layers, run.variant)
    specs = split_over(probe.args[0], "dp", run.dp) if zero and run.dp > 1 else None
    stage = mt.stage_program(run.model, kind, mesh, run.microbatch, layers, run.variant,
                             grad_specs=specs) if run.zero == "zero2" else probe
    params, *batch = stage.args
    opt = nb.optim.Adam(1e-4, master_dtype="float32")
    leaves, tree = flatten(params)

    def buffer():  # BLOOM's float32 gradient buffer, laid out as the parameters (never split)
        return unflatten(tree, [nb.abstract(p.shape, "float32").shard(mesh, _entries(p)) for p in leaves])

    def step(params, state, *rest):
        if run.fp32_accumulation:
            acc, rest = rest[0], rest[1:]
        grads = param_grads(kind, stage.fn(params, *rest))
        if run.fp32_accumulation:  # the microbatch's gradients summed into the float32 buffer
            gl, gtree = flatten(grads)
            grads = unflatten(gtree, [a + g.astype("float32") for a, g in zip(flatten(acc)[0], gl)])
        return opt.update(grads, state, params)

    received = batch[0] if kind in ("middle", "last") else None
    state = opt.init(params, specs=specs)
    extra = (buffer(),) if run.fp32_accumulation else ()
    return Program(step, (params, state) + extra + tuple(batch), mesh, params, state, received)


#: Llama 2 7B (MaxText configs/models/llama2-7b.yml): vocabulary 32,000, MLP 11,008, 32 heads of 128, 32 kv heads
LLAMA7B = dict(vocab=32000, mlp=11008, kv_heads=32)


def maxtext_step(run: Run, mesh) -> Program:
    """MaxText's Llama-2-7B training step as ``1vm.sh``/``16vm.sh`` run it: float32 weights
    (``weight_dtype: float32``) split over ``fsdp`` (ZeRO-3: gathered while used), cast to bfloat16 for compute
    (``dtype: bfloat16``); the batch over ``dp`` x ``fsdp``; each layer ``megatron_table1.llama_block``
    (RMSNorm, rotary, ``nb.dot_product_attention`` (cuDNN flash attention), SwiGLU) under
    ``nb.checkpoint(policy="save_matmuls")`` (``minimal_flash`` approximated: see the module docstring);
    logits in float32 (``logits_dot_in_fp32: True``), cross-entropy; AdamW's moments in float32 (optax follows
    the parameters' dtype), laid out as the parameters."""
    c, m = LLAMA7B, run.model
    h, heads, f, V, S = m.hidden, m.heads, c["mlp"], c["vocab"], 4096
    d = h // heads
    batch = run.microbatch * run.dp * 8

    def w(shape, spec, dtype="float32"):
        return nb.abstract(shape, dtype).shard(mesh, spec)

    def rows(shape):  # FSDP: each weight's first dim over fsdp
        return w(shape, ["fsdp"] + [None] * (len(shape) - 1))

    def layer():
        return {"attn_norm": rows((h,)), "wq": rows((h, h)), "wk": rows((h, h)), "wv": rows((h, h)),
                "wo": rows((h, h)), "mlp_norm": rows((h,)), "w1": rows((h, f)), "w3": rows((h, f)),
                "w2": rows((f, h))}

    params = {"embed": rows((V, h)), "layers": [layer() for _ in range(m.layers)], "norm": rows((h,)),
              "head": rows((h, V))}
    ids = w((batch, S), [("dp", "fsdp"), None], "int32")
    targets = w((batch, S), [("dp", "fsdp"), None], "int32")
    cos, sin = w((S, 1, d), [None, None, None], "bfloat16"), w((S, 1, d), [None, None, None], "bfloat16")

    def block(x, p):
        pb = {k: v.astype("bfloat16") for k, v in p.items()}
        return mt.llama_block(x, pb, heads, c["kv_heads"], cos, sin)

    remat = nb.checkpoint(block, policy="save_matmuls")

    def loss(params, ids, targets):
        x = nb.take(params["embed"].astype("bfloat16"), ids, axis=0)
        for i, p in enumerate(params["layers"]):
            with nb.named_scope(f"layer {i}"):
                x = remat(x, p)
        y = mt._rms(x, params["norm"].astype("bfloat16"))
        logits = y.astype("float32") @ params["head"]
        return nb.cross_entropy(logits, targets)

    opt = nb.optim.Adam(1e-4)
    vg = nb.value_and_grad(loss)

    def step(params, state, ids, targets):
        return opt.update(vg(params, ids, targets)[1], state, params)

    state = opt.init(params)
    return Program(step, (params, state, ids, targets), mesh, params, state)


# ---- pricing -------------------------------------------------------------------------------------------------


def in_flight_at(rank: int, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Microbatches (in units of the whole stage) whose activations pipeline rank ``rank`` holds at once:
    Megatron-LM's warm-up forwards for that rank plus the one before its first backward
    (``megatron/schedules.py``: 1F1B ``min(p - rank - 1, m)``; interleaved ``(p - rank - 1) * 2 + (v - 1) * p``
    chunk forwards, at most ``m v``, each ``1/v`` of the stage). DeepSpeed's pipeline engine keeps
    ``min(p - rank, m)`` buffers: the same count under 1F1B."""
    p, m, v = stages, microbatches, virtual_stages
    if v == 1:
        return float(min(p - rank - 1, m) + 1)
    return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v) / v


def per_device_params(params: Any) -> int:
    """Parameters one device holds (its blocks' elements, padded as stored)."""
    total = 0
    for p in flatten(params)[0]:
        s = p.sharding
        total += math.prod(-(-n // s.num_shards(i)) for i, n in enumerate(p.shape))
    return total


def per_device_bytes(tree: Any) -> int:
    total = 0
    for p in flatten(tree)[0]:
        if isinstance(p, nb.Tensor) and p.sharding is not None:
            s = p.sharding
            total += math.prod(-(-n // s.num_shards(i)) for i, n in enumerate(p.shape)) * np.dtype(p.dtype).itemsize
    return total


def record(prog: Program) -> Any:
    """A memory log of the program, every argument held from the start (as ``nb.estimate`` records it)."""
    leaves = [x for x in flatten(prog.args)[0] if isinstance(x, nb.Tensor)]
    with nb.memory_log() as mem:
        mem.hold(leaves)
        prog.fn(*prog.args)
    return mem


def phases(mem: Any) -> tuple[int, int, int]:
    """(first step of the backward pass counting a recompute, last step of it, last step of the record)."""
    back = [i for i, s in enumerate(mem.steps) if s.phase in ("backward", "recompute")]
    return back[0], back[-1], len(mem.steps) - 1


def price_stage(run: Run, kind: str, layers: int, rank: int) -> dict:
    """One stage of ``run``: ``nb.estimate`` of its training step on its ``dp x tp`` devices and the microbatches
    in flight at its rank."""
    t0 = time.perf_counter()
    n = run.dp * run.tp * (8 if kind == "fsdp" else 1)
    cluster = Cluster(run.hardware, max(1, n // run.per_node), min(run.per_node, n))
    if kind == "fsdp":
        mesh = cluster.mesh("stage", (run.dp, 8), ("dp", "fsdp"))
        prog = maxtext_step(run, mesh)
    else:
        mesh = cluster.mesh("stage", (run.dp, run.tp), ("dp", "tp"))
        prog = gpt_step(run, kind, layers, mesh)
    report = nb.estimate(prog.fn, cluster)(*prog.args)
    mem = report.memory
    peak0, kept = max(mem.peak.values()), max(mem.kept.values())
    by_kind = {k: max(v.values()) for k, v in mem.by_kind.items()}
    if run.pp > 1 and rank == 0:
        pm = pipeline_estimate(report, run.pp, run.microbatches, run.schedule, run.virtual_stages).memory
        n_flight, peak, fits = pm.in_flight, max(pm.peak.values()), pm.fits
        by_kind = {k: max(v.values()) for k, v in pm.by_kind.items()}
        assert abs(n_flight - in_flight_at(0, run.pp, run.microbatches, run.virtual_stages)) <= 1  # (1f1b: m+1)
    elif run.pp > 1:
        n_flight = in_flight_at(rank, run.pp, run.microbatches, run.virtual_stages)
        extra = int(round((n_flight - 1) * kept))
        peak = peak0 + extra
        by_kind["activations"] += extra
        fits = peak <= mem.capacity
    else:
        n_flight, peak, fits = 1.0, peak0, mem.fits
    out = {"kind": kind, "layers": layers, "rank": rank, "devices": n, "params_per_device": per_device_params(
        prog.params), "stage_peak": peak0, "kept": kept, "in_flight": n_flight, "peak": peak, "fits": bool(fits),
        "by_kind": by_kind, "capacity": mem.capacity}
    out["seconds"] = time.perf_counter() - t0
    return out


def price(run: Run) -> dict:
    """Every priced stage of ``run``; the configuration's peak is its worst stage's."""
    t0 = time.perf_counter()
    stages = [price_stage(run, k, n, r) for k, n, r in run.stages]
    worst = max(stages, key=lambda s: s["peak"])
    fits = all(s["fits"] for s in stages)
    ratio = worst["peak"] / (run.stated_gib * GiB) if run.stated_gib else None
    res = {"id": run.id, "source": run.source, "model": run.model.name, "hardware": run.hardware.name,
           "hbm_gib": run.hardware.hbm_bytes / GiB, "gpus": run.gpus * (8 if run.zero == "fsdp" else 1),
           "tp": run.tp, "pp": run.pp, "dp": run.dp, "virtual_stages": run.virtual_stages,
           "microbatch": run.microbatch, "microbatches": run.microbatches, "schedule": run.schedule,
           "seq": run.variant.seq if run.variant else 4096, "recompute": run.recompute, "zero": run.zero,
           "verdict": run.verdict, "quote": run.quote, "stated": run.stated, "stated_gib": run.stated_gib,
           "peak_gib": worst["peak"] / GiB, "worst_stage": worst["kind"], "by_kind_gib": {
               k: v / GiB for k, v in worst["by_kind"].items()}, "fits": fits,
           "validated": fits == (run.verdict == "ran"), "ratio_to_stated": ratio, "note": run.note,
           "stages": stages, "seconds": time.perf_counter() - t0}
    return res


def run_all(ids: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    rows = []
    for run in RUNS:
        if ids and run.id not in ids:
            continue
        r = price(run)
        rows.append(r)
        stated = f"{r['stated_gib']:.0f} GiB" if r["stated_gib"] else "-"
        print(f"{r['id']:<14} {r['source']:<15} peak {r['peak_gib']:6.1f} GiB of {r['hbm_gib']:.0f} "
              f"({r['worst_stage']:<6}) fits {str(r['fits']):<5} source {r['verdict']:<4} stated {stated:>6} "
              f"{'validated' if r['validated'] else 'MISMATCH'} | {r['seconds']:.1f} s", flush=True)
    return {"sources": SOURCES, "research": RESEARCH, "rows": rows, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", help="ids, e.g. K-22B,X-K-22B (default: every run)")
    ap.add_argument("--json", help="write the results here (default: update benchmarks/results.json)")
    a = ap.parse_args()
    env = environment(HERE.parent)
    res = {"memory_published": dict(run_all(a.runs.split(",") if a.runs else None),
                                    date=env["date"], commit=env["commit"])}
    write_results(res, a.json)


if __name__ == "__main__":
    main()
