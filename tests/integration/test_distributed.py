"""nb.distributed for real: two processes of 4 CPU devices each (collectives through gloo) run one
DP x TP training step under nb.jit, each loading only its half of the batch, and both get the values the
same step gives in a single process."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")
PROGRAM = Path(__file__).resolve().parent / "programs" / "dp_tp_two_processes.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_train_one_step_like_one_process():
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, str(PROGRAM), str(i), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    if any("gloo" in err.lower() and "not" in err.lower() and "support" in err.lower() for _, _, err in outs):
        pytest.skip("this platform's jaxlib has no gloo CPU collectives")
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"process {i} failed:\n{err[-3000:]}"
        assert f"{i} ok" in out
    devices = [out.strip().splitlines()[-1] for _, out, _ in outs]
    assert devices == ["0 ok [0, 1, 2, 3]", "1 ok [4, 5, 6, 7]"]
    # both processes report the loss of the whole batch, the single-process numpy loss
    losses = [float(next(ln for ln in out.splitlines() if " loss " in ln).split()[-1]) for _, out, _ in outs]
    r = np.random.default_rng(0)
    w1, w2 = r.standard_normal((16, 32)).astype(np.float32), r.standard_normal((32, 4)).astype(np.float32)
    x, y = r.standard_normal((8, 16)).astype(np.float32), r.standard_normal((8, 4)).astype(np.float32)
    want = float(((np.maximum(x @ w1, 0) @ w2 - y) ** 2).mean())
    np.testing.assert_allclose(losses, [want, want], rtol=1e-5)
