"""Loads a safetensors checkpoint the test wrote into a 4-stage pipeline
through ``hf:PATH`` (lazy leaves, placed one by one) and prints, as JSON,
the peak resident memory the loading added and the checkpoint's size.

Run by tests/train/test_hf_streaming.py in its own process, so the peak
(``ru_maxrss``) is this load's alone.

  python hf_streaming_worker.py CHECKPOINT LAYERS WIDTH
"""

import json
import os
import resource
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jpipe  # noqa: E402
from jpipe.train import pretrained  # noqa: E402


def _peak_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(path, layers, width):
  template = {
    f"layer_{i}": {"kernel": jax.ShapeDtypeStruct((width, width), np.float32)}
    for i in range(layers)
  }
  # The checkpoint holds PyTorch-layout [out, in] weights named "layers.i".
  names = {
    f"layer_{i}/kernel": (f"layers.{i}.weight", True) for i in range(layers)
  }

  def loss_fn(params, batch):
    x = batch["x"]
    for i in range(layers):
      with jax.named_scope(f"layer_{i}"):
        x = jnp.tanh(x @ params[f"layer_{i}"]["kernel"])
    return jnp.mean(x**2)

  batch = {"x": np.ones((8, width), np.float32)}
  before = _peak_bytes()
  params = pretrained.load_params(
    f"hf:{path}", template, hf_names=names, lazy=True
  )
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=4,
    schedule="gpipe",
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
  )
  state = pipe.init(params)
  jax.block_until_ready(state.stage_params)
  reads = [leaf.reads for leaf in jax.tree.leaves(params)]
  # One value, checked against the file: layer 0's [0, 1] is the
  # checkpoint's [1, 0] (transposed).
  first = np.asarray(state.stage_params[0][0])[0, 1]
  print(
    json.dumps(
      {
        "added_peak_bytes": _peak_bytes() - before,
        "checkpoint_bytes": os.path.getsize(path),
        "leaf_bytes": width * width * 4,
        "reads": reads,
        "first": float(first),
      }
    )
  )


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
