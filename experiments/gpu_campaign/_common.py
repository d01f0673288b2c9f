"""What every part of the GPU campaign shares: run metadata, a results
file written after every row, the time budget, the GPT it measures, and
paired timing.
"""

import datetime
import json
import math
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpipe.models import gpt

# Dense peak FLOP/s per device kind (vendor data sheets, SXM parts), by
# compute dtype. float32 matmuls run as TF32 on these GPUs under XLA's
# default precision, so TF32's peak is float32's.
PEAK_FLOPS = {
  "NVIDIA H100 80GB HBM3": {"bfloat16": 989.4e12, "float32": 494.7e12},
  "NVIDIA H200": {"bfloat16": 989.4e12, "float32": 494.7e12},
  "NVIDIA A100-SXM4-80GB": {"bfloat16": 312e12, "float32": 156e12},
}


def commit() -> str:
  """The commit measured: ``JPIPE_COMMIT`` (a copied tree has no .git),
  else git's HEAD, else "unknown"."""
  if os.environ.get("JPIPE_COMMIT"):
    return os.environ["JPIPE_COMMIT"]
  try:
    return subprocess.run(
      ["git", "rev-parse", "HEAD"],
      capture_output=True,
      text=True,
      check=True,
      cwd=os.path.dirname(__file__),
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def metadata() -> dict:
  """Date (UTC), device, JAX version and commit of this run."""
  device = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "device": device.device_kind,
    "platform": device.platform,
    "device_count": jax.device_count(),
    "jax": jax.__version__,
    "commit": commit(),
  }


class Results:
  """A part's rows, rewritten to ``<out>/<part>.json`` after each one, so
  a part stopped by its budget or a crash keeps what it finished."""

  def __init__(self, out_dir: str, part: str, settings: dict):
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, f"{part}.json")
    self.record = {
      "part": part,
      **metadata(),
      "settings": settings,
      "rows": [],
      "finished": False,
    }
    self._write()

  def add(self, row: dict) -> None:
    self.record["rows"].append(row)
    print(json.dumps(row), flush=True)
    self._write()

  def note(self, key: str, value) -> None:
    self.record[key] = value
    self._write()

  def finish(self) -> None:
    self.record["finished"] = True
    self._write()

  def _write(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.record, f, separators=(",", ":"))
    os.replace(tmp, self.path)


class Budget:
  """Seconds a part may spend; work is ordered most important first and
  stops starting new rows once the budget is spent."""

  def __init__(self, seconds: float):
    self.seconds = seconds
    self.start = time.monotonic()

  @property
  def left(self) -> float:
    return self.seconds - (time.monotonic() - self.start)

  @property
  def spent(self) -> bool:
    return self.left <= 0

  def timeout(self, minimum: float) -> float | None:
    """Seconds a child process may run: what is left, at least
    ``minimum``; None (no limit) without a budget."""
    return None if math.isinf(self.left) else max(minimum, self.left)


DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}


def write_table(out_dir: str, name: str, table: str, record: dict) -> None:
  """An experiment's ``table`` (Markdown) to ``out_dir``/NAME.md and its
  ``record`` to NAME.json; prints the table."""
  os.makedirs(out_dir, exist_ok=True)
  base = os.path.join(out_dir, name)
  with open(base + ".json", "w") as f:
    json.dump(record, f, indent=1)
  with open(base + ".md", "w") as f:
    f.write(table)
  print(table)


def language_model(
  *, layers, width, heads, length, batch, vocab=256, dtype="float32"
):
  """``(loss_fn, params, batch, model)``: a GPT (``jpipe.models.gpt``) with
  float32 params computing in ``dtype``; params and tokens live on the
  host (numpy), so a device's memory holds only what a run places."""
  model = gpt.Model(
    vocab_size=vocab,
    width=width,
    num_layers=layers,
    num_heads=heads,
    max_length=length,
    dtype=DTYPES[dtype],
  )
  try:
    host = jax.devices("cpu")[0]
  except RuntimeError:  # JAX_PLATFORMS names no cpu: make them on device 0
    host = jax.devices()[0]
  with jax.default_device(host):
    tokens = jax.random.randint(
      jax.random.key(0), (batch, length + 1), 0, vocab
    )
    params = model.init(jax.random.key(1), tokens[:1, :-1], train=False)
  params = jax.device_get(params["params"])

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["tokens"][:, 1:]
    ).mean()

  return loss_fn, params, {"tokens": np.asarray(tokens)}, model


def parameter_count(params) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def training_flops(*, layers, width, length, vocab, tokens) -> float:
  """Model FLOPs of one training step (forward + backward = 3x forward,
  recomputation not counted), the usual MFU convention: per token the
  blocks' matmuls 2 x 12 width^2 per layer (QKV 3, output 1, MLP 8), the
  attention scores and values 2 x 2 x length x width per layer (causal
  masking not discounted), and the tied output projection 2 x width x
  vocab."""
  per_token = layers * (24 * width**2 + 4 * length * width) + 2 * width * vocab
  return 3.0 * per_token * tokens


def peak_flops(dtype: str) -> float | None:
  return PEAK_FLOPS.get(jax.devices()[0].device_kind, {}).get(dtype)


def reference_step(
  loss_fn, params, batch, m, tx, update_every_microbatch, recompute=False
):
  """One jitted step over ``m`` microbatches (``lax.scan``) with the same
  optax update as the pipeline: once over the mean gradient (synchronous
  schedules) or after every microbatch (the asynchronous stream updates
  each stage once per microbatch). With ``recompute`` the loss is
  ``jax.checkpoint``-ed: its backward runs the forward again, as a
  pipeline stage that recomputes does (one extra forward per microbatch
  on both sides, so the ratio shows the pipeline's own cost). Returns
  ``run()``, which does one step and waits for it."""
  if recompute:
    loss_fn = jax.checkpoint(loss_fn)

  def split(batch):
    return jax.tree.map(
      lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch
    )

  @jax.jit
  def accumulate(params, opt_state, batch):
    def body(acc, mb):
      loss, g = jax.value_and_grad(loss_fn)(params, mb)
      return jax.tree.map(jnp.add, acc, g), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, losses = jax.lax.scan(body, zeros, split(batch))
    grads = jax.tree.map(lambda g: g / m, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses.mean()

  @jax.jit
  def per_microbatch(params, opt_state, batch):
    def body(carry, mb):
      params, opt_state = carry
      loss, g = jax.value_and_grad(loss_fn)(params, mb)
      updates, opt_state = tx.update(g, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    (params, opt_state), losses = jax.lax.scan(
      body, (params, opt_state), split(batch)
    )
    return params, opt_state, losses.mean()

  step = per_microbatch if update_every_microbatch else accumulate
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  state = {"p": params, "o": tx.init(params), "b": jax.device_put(batch)}

  def run():
    state["p"], state["o"], _ = step(state["p"], state["o"], state["b"])
    jax.block_until_ready(state["p"])

  run.step, run.state = step, state  # The jitted step; {"p", "o", "b"}.
  return run


def paired_times(fn, reference, repeats):
  """``(fn seconds, reference seconds)`` as arrays, timed alternately
  (ABAB...): a busy or throttled machine slows both members of a pair
  alike, so per-pair ratios are steadier than a ratio of medians."""
  for f in (fn, reference, fn, reference):  # compile, warm up
    f()
  times = {fn: [], reference: []}
  for _ in range(repeats):
    for f in (fn, reference):
      start = time.perf_counter()
      f()
      times[f].append(time.perf_counter() - start)
  return np.asarray(times[fn]), np.asarray(times[reference])


def ratio_summary(pipe_times, ref_times) -> dict:
  """Medians and the per-pair ratio's median and interquartile range."""
  ratios = pipe_times / ref_times
  q25, q75 = np.percentile(ratios, [25, 75])
  return {
    "pipeline_ms": 1e3 * float(np.median(pipe_times)),
    "reference_ms": 1e3 * float(np.median(ref_times)),
    "ratio": float(np.median(ratios)),
    "ratio_iqr": [float(q25), float(q75)],
  }
