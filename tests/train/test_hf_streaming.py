"""A HuggingFace-layout checkpoint of 1 GiB, loaded through ``hf:PATH``
into 4 stages, never whole in host memory: each tensor is read once,
as it is placed, and the load's peak adds about the model (on the CPU
devices, which are host memory) plus one leaf in flight -- not a second
host copy of the whole model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
LAYERS, WIDTH = 4, 8192  # 4 x 256 MiB float32.


def _value(i, rows, cols):
  """Tensor ``i``'s entries at (rows, cols): a cheap known pattern."""
  return ((i + 1) * 1e-3 * ((rows * 7 + cols * 3) % 101)).astype(np.float32)


def _write_checkpoint(path):
  """A safetensors file of LAYERS [WIDTH, WIDTH] float32 tensors
  "layers.i.weight", written in row blocks (the test never holds it)."""
  size = WIDTH * WIDTH * 4
  header = {
    f"layers.{i}.weight": {
      "dtype": "F32",
      "shape": [WIDTH, WIDTH],
      "data_offsets": [i * size, (i + 1) * size],
    }
    for i in range(LAYERS)
  }
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)  # Aligned data, as the library writes.
  cols = np.arange(WIDTH)[None, :]
  with open(path, "wb") as f:
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for i in range(LAYERS):
      for start in range(0, WIDTH, 512):
        rows = np.arange(start, start + 512)[:, None]
        f.write(_value(i, rows, cols).tobytes())


@pytest.mark.slow
def test_a_1_gib_checkpoint_is_placed_leaf_by_leaf(tmp_path):
  path = str(tmp_path / "model.safetensors")
  _write_checkpoint(path)
  out = subprocess.run(
    [
      sys.executable,
      os.path.join(HERE, "hf_streaming_worker.py"),
      path,
      str(LAYERS),
      str(WIDTH),
    ],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["checkpoint_bytes"] >= 2**30
  assert result["reads"] == [1] * LAYERS  # Each tensor read once.
  # Transposed on the way: ours [0, 1] is the checkpoint's [1, 0].
  expected = _value(0, np.array([1]), np.array([0]))[0]
  assert result["first"] == pytest.approx(float(expected))
  model = LAYERS * result["leaf_bytes"]
  # Placed (the CPU devices are host memory) plus at most two leaves in
  # flight (a read and its transposed copy); a host copy of the whole
  # model first would add another 1 GiB.
  assert result["added_peak_bytes"] < model + 2.5 * result["leaf_bytes"], result
