"""nabla's memory estimate against published training runs (``benchmarks/memory_published.py``, whose docstring
says how each run is written): a few cheap configurations, each priced from its own program as the benchmark
prices it, must come out fitting when their authors ran them and not fitting when their authors report them out of
memory; the model state a training step holds must be ZeRO's count.

Sources (quoted in the benchmark's ``RUNS``): Korthikanti et al. 2022 (arXiv:2205.05198) Table 3 and Fig. 1, whose
"present work" (sequence parallelism + selective recompute) ran and whose baseline (neither) is "above the 80GB
memory provided by an NVIDIA A100 GPU"; the DeepSpeed ZeRO tutorial's 1.5B GPT-2 on eight 32 GB V100s ("Training
this model without ZeRO fails with an out-of-memory (OOM) error"; with ZeRO stage 1 it trains); GPT-NeoX-20B's
config ("as it was trained on 96x 40GB A100"); Rajbhandari et al. 2020 (ZeRO) sec. 3.1 and Figure 1: mixed-precision
Adam holds ``2 + 2 + K`` bytes per parameter with ``K = 12``, stage 1 divides ``K`` by ``N_d``."""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from nabla.plan import Cluster, zero_model_state_bytes

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def _load():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("memory_published", ROOT / "benchmarks" / "memory_published.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


mp = _load()
RUNS = {r.id: r for r in mp.RUNS}


@lru_cache(maxsize=None)
def priced(rid: str) -> dict:
    return mp.price(RUNS[rid])


# cheap (whole models or two-layer stages): present work and baseline of the smallest and the largest
# Korthikanti configurations, ZeRO-1 and plain data parallelism of the DeepSpeed tutorial, GPT-NeoX on 40 GB A100s
CHEAP = ("K-22B", "X-K-22B", "K-1T", "X-K-1T", "DS-1.5B-ZeRO1", "NeoX-20B",
         pytest.param("X-DS-1.5B", marks=pytest.mark.xfail(strict=True, reason=(
             "a known miss: nabla counts 26.7 GiB of allocations for the program as written (ZeRO's 16 bytes per "
             "parameter and the update's float32 gradients); DeepSpeed's FP16_Optimizer (adapted from Apex) also "
             "flattens every fp16 gradient into one buffer for the step, and the CUDA context and the allocator's "
             "reserve (30.46 GiB reserved against 29.09 allocated in the screenshot) are not modelled"))))


@pytest.mark.parametrize("rid", CHEAP)
def test_fits_as_the_source_says(rid):
    run, r = RUNS[rid], priced(rid)
    said = "fits" if r["fits"] else "does not fit"
    assert r["fits"] == (run.verdict == "ran"), (
        f"{rid}: nabla says {r['peak_gib']:.1f} GiB of {r['hbm_gib']:.1f} per device ({said}); {run.source} says "
        f"{run.verdict}: {run.quote}")


def test_the_largest_narayanan_run_fits():
    """Table 1's 1T row ran (TP 8, PP 64, micro-batch 1, 512 microbatches, full recompute): stage 0 holds its 64
    microbatches' layer inputs (what full recompute keeps) in its forward and backward passes, not at its update
    (run once, after every microbatch), and what a recompute makes is not kept."""
    r = priced("N-1T")
    assert r["fits"], f"N-1T: {r['peak_gib']:.1f} GiB of {r['hbm_gib']:.0f}"


def test_korthikanti_activations_match_figure_1():
    """Fig. 1's activation bars for the 22B model (read off the chart, ±2 GB, which is in GiB: its bars equal Table
    2's equations in GiB): ≈10 with sequence parallelism and selective recompute, ≈59 for the baseline. Without
    pipelining, what the backward pass starts with is all the activations the step holds."""
    for rid, bar in (("K-22B", 10), ("X-K-22B", 59)):
        kept = priced(rid)["stages"][0]["kept"] / GiB
        assert abs(kept - bar) <= 2 + 0.05 * bar, f"{rid}: {kept:.1f} GiB kept, Fig. 1 ≈{bar}"


@pytest.mark.parametrize("rid,stage", [("DS-1.5B-ZeRO1", 1), ("X-DS-1.5B", 0)])
def test_model_state_is_zeros_count(rid, stage):
    """When the backward pass ends, the step holds ZeRO's model states per device: 2 bytes of fp16 parameters and
    2 of gradients per parameter, and 12 of optimizer state divided by N_d = 8 under stage 1 (sec. 3.1, Fig. 1).
    A count per parameter: the run's model with 4 of its 48 layers shows it as well as the whole (and in a
    twelfth of the time)."""
    run = RUNS[rid]
    mesh = Cluster(run.hardware, 1, 8).mesh("stage", (run.dp, run.tp), ("dp", "tp"))
    prog = mp.gpt_step(run, "whole", 4, mesh)
    psi = mp.per_device_params(prog.params)
    mem = mp.record(prog)
    _, end, _ = mp.phases(mem)
    live = {k: sum(b.bytes for b in mem.buffers(at=end) if b.kind == k) for k in ("params", "grads", "optimizer")}
    assert live == {"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi // (run.dp if stage else 1)}
    assert sum(live.values()) == zero_model_state_bytes(psi, stage, run.dp)


def test_by_kind_model_state_over_the_step_is_zeros_count():
    """Over the whole step (update included), the most optimizer state held at once is the state ZeRO counts: the
    update writes the new state over the old, in place as PyTorch's optimizers and FusedAdam do."""
    run = RUNS["DS-1.5B-ZeRO1"]
    r = priced("DS-1.5B-ZeRO1")
    psi = r["stages"][0]["params_per_device"]
    assert r["stages"][0]["by_kind"]["optimizer"] == 12 * psi // run.dp


def test_in_flight_at_rank_zero_is_nablas():
    """The in-flight count used for the other stages (Megatron-LM's warm-up per rank) agrees with nabla's for
    stage 0, where nabla's applies."""
    from nabla.plan.pipeline import in_flight
    for p, m, v in ((8, 64, 3), (35, 280, 3), (12, 128, 1), (64, 512, 1), (8, 48, 2)):
        want = in_flight(p, m, "interleaved" if v > 1 else "1f1b", v)
        assert mp.in_flight_at(0, p, m, v) == want, (p, m, v)
        assert mp.in_flight_at(p - 1, p, m, v) < want  # the last stage holds fewer
