"""Greedy decoding with the vocabulary sharded over 8 devices: logits never gather.

The output projection is split by vocabulary columns, so each device scores its slice of the
vocabulary; argmax over the sharded dim reduces the row max and then the first index holding it,
a few bytes per row instead of the whole logits row.
"""

import numpy as np

import nabla as nb
from nabla import DeviceMesh

mesh = DeviceMesh("line", (8,), ("tp",))
rng = np.random.default_rng(1)
batch, d_model, vocab = 4, 64, 50_000
hidden = rng.standard_normal((batch, d_model)).astype(np.float32)
w_out = rng.standard_normal((d_model, vocab)).astype(np.float32)

W = nb.tensor(w_out).shard(mesh, [None, "tp"])  # 6,250 vocabulary columns per device
with nb.comm_log() as log:
    logits = nb.tensor(hidden) @ W  # [-|tp], no communication
    tokens = nb.argmax(logits, axis=1)
    probs = nb.softmax(logits, axis=1)  # also without gathering the vocabulary

print("logits:", logits.sharding, "tokens:", tokens.numpy())
print(log.summary())
ref = hidden @ w_out
assert (tokens.numpy() == ref.argmax(1)).all()
np.testing.assert_allclose(probs.numpy().sum(1), np.ones(batch), rtol=1e-5)
gather_bytes = 7 * batch * (vocab // 8) * 4
print(f"argmax + softmax sent {log.total_bytes} bytes per device; gathering the logits once would send {gather_bytes}")
