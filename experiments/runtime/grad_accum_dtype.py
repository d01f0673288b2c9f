r"""What summing microbatch gradients in float32 buys bfloat16 params, and
what it costs (``jpipe.Pipeline(grad_accum_dtype="float32")``).

A GPT with bfloat16 params (``experiments.runtime.overhead``'s, cast)
through a 2-stage 1f1b pipeline on 2 devices, for each microbatch count m
(2 sequences per microbatch): the gradient the optimizer received (SGD
momentum's trace after one step: the step's mean gradient, in the
accumulator's dtype) with the default bfloat16 sum and with
``grad_accum_dtype="float32"``, each against the exact (float64) mean of
the pipeline's own microbatch gradients -- each microbatch run alone
through a one-microbatch pipeline, the same stage programs: the sum's
rounding alone -- and against the float64 mean of one device's
``jax.grad`` in bfloat16 (which adds bfloat16 compute's own spread
between two programs). Also: the accumulator's predicted bytes
(``pipe.memory``) and the step time of float32 over bfloat16 accumulation
(paired steps, alternating). With ``--train_steps``: the loss after that
many AdamW steps each way (one batch repeated: memorisation, where the
gradients shrink and a bfloat16 sum drops them first).

Writes results/grad_accum_dtype_<platform>.{md,json}.

Usage: python -m experiments.runtime.grad_accum_dtype [--size small]
  [--microbatches 4,16,64] [--pairs 5] [--train_steps 0]
"""

# (Two stages on two devices: fake CPU ones without an accelerator.)
from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

import jpipe  # noqa: E402
from experiments.gpu_campaign import _common  # noqa: E402
from experiments.runtime.overhead import SIZES, _lm  # noqa: E402
from jpipe.runtime import format_bytes  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("microbatches", ["4", "16", "64"], "Microbatch counts m.")
flags.DEFINE_integer("pairs", 5, "Paired timed steps per m.")
flags.DEFINE_integer("train_steps", 0, "AdamW steps each way (0: none).")
# --size (the GPT: its layers, width, heads, sequence) and --out_dir are
# experiments.runtime.overhead's flags.

PER_MICROBATCH = 2  # sequences


def _pipelines(loss_fn, params, batch, m, tx):
  """``{dtype name: Pipeline}`` summing in bfloat16 and in float32."""
  return {
    name: jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      schedule="1f1b",
      num_microbatches=m,
      optimizer=tx,
      grad_accum_dtype=dtype,
    )
    for name, dtype in (("bfloat16", None), ("float32", "float32"))
  }


def _received(pipe, params, batch) -> dict:
  """``{path: float64 array}``: the mean gradient one step gave the
  optimizer (SGD momentum's trace)."""
  state, _ = pipe.step(pipe.init(params), batch)
  trace = pipe.state_dict(state)["opt_state"][0].trace
  return _by_name(trace)


def _exact_means(loss_fn, params, batch, m) -> tuple[dict, dict]:
  """The float64 means of the m microbatch gradients: the pipeline's own
  (each microbatch alone through a one-microbatch pipeline: the same
  stage programs, nothing summed) and one device's (``jax.grad``, both in
  bfloat16)."""
  one = _pipelines(
    loss_fn,
    params,
    _microbatch(batch, 0),
    1,
    optax.sgd(1.0, momentum=0.9),
  )["bfloat16"]
  grad = jax.jit(jax.grad(loss_fn))
  own, device = None, None
  for k in range(m):
    mb = _microbatch(batch, k)
    g, d = _received(one, params, mb), _by_name(grad(params, mb))
    own = g if own is None else {n: own[n] + g[n] for n in own}
    device = d if device is None else {n: device[n] + d[n] for n in device}
  return (
    {n: v / m for n, v in own.items()},
    {n: v / m for n, v in device.items()},
  )


def _microbatch(batch, k):
  return jax.tree.map(
    lambda x: x[k * PER_MICROBATCH : (k + 1) * PER_MICROBATCH], batch
  )


def _by_name(tree) -> dict:
  """``{"a/b/c": float64 array}`` of a params-shaped tree, or of the
  state dict's ``{path: leaf}`` (the same names)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {
    "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x, np.float64)
    for path, x in flat
  }


def _relative_error(got: dict, exact: dict) -> float:
  """``||got - exact|| / ||exact||`` over every leaf (float64)."""
  num = sum(float(np.sum((got[k] - exact[k]) ** 2)) for k in exact)
  den = sum(float(np.sum(exact[k] ** 2)) for k in exact)
  return float(np.sqrt(num / den))


def _timed(pipes, params, batch) -> dict:
  """Paired step times: float32 over bfloat16 accumulation."""
  states = {k: p.init(params) for k, p in pipes.items()}

  def stepper(name):
    def run():
      states[name], metrics = pipes[name].step(states[name], batch)
      jax.block_until_ready(metrics["loss"])

    return run

  wide, narrow = _common.paired_times(
    stepper("float32"), stepper("bfloat16"), FLAGS.pairs
  )
  summary = _common.ratio_summary(wide, narrow)
  return {
    "float32_ms": summary["pipeline_ms"],
    "bfloat16_ms": summary["reference_ms"],
    "time_ratio": summary["ratio"],
    "time_ratio_iqr": summary["ratio_iqr"],
  }


def _trained_losses(loss_fn, params, batch, m) -> dict:
  """``{dtype name: loss after train_steps AdamW steps}``."""
  out = {}
  for name, pipe in _pipelines(
    loss_fn, params, batch, m, optax.adamw(3e-3)
  ).items():
    state = pipe.init(params)
    for _ in range(FLAGS.train_steps):
      state, metrics = pipe.step(state, batch)
    out[name] = float(metrics["loss"])
  return out


def main(argv):
  del argv
  layers, width, heads, length, _, _ = SIZES[FLAGS.size]
  rows = []
  for m in (int(x) for x in FLAGS.microbatches):
    loss_fn, params, batch = _lm(
      layers, width, heads, length, m * PER_MICROBATCH
    )
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    pipes = _pipelines(loss_fn, params, batch, m, optax.sgd(1.0, momentum=0.9))
    own, device = _exact_means(loss_fn, params, batch, m)
    row = {"microbatches": m}
    for name, pipe in pipes.items():
      received = _received(pipe, params, batch)
      row[f"{name}_error"] = _relative_error(received, own)
      row[f"{name}_vs_one_device"] = _relative_error(received, device)
      row[f"{name}_grad_bytes"] = sum(s.grads for s in pipe.memory)
    row.update(_timed(pipes, params, batch))
    if FLAGS.train_steps:
      losses = _trained_losses(loss_fn, params, batch, m)
      row.update({f"{k}_loss": v for k, v in losses.items()})
    print(row, flush=True)
    rows.append(row)
  record = {
    **_common.metadata(),
    "size": FLAGS.size,
    "model": {
      "layers": layers,
      "width": width,
      "heads": heads,
      "length": length,
    },
    "train_steps": FLAGS.train_steps,
    "rows": rows,
  }
  _common.write_table(
    FLAGS.out_dir,
    f"grad_accum_dtype_{record['platform']}",
    _table(record),
    record,
  )


def _table(record) -> str:
  model = record["model"]
  lines = [
    f"# Summing bfloat16 params' gradients in float32 ({record['device']}, "
    f"{record['date']}, commit {record['commit'][:10]})",
    "",
    f"GPT {model['layers']} x {model['width']}, {model['heads']} heads, "
    f"sequence {model['length']}, bfloat16 params; 2 stages, 1f1b, "
    f"{PER_MICROBATCH} sequences per microbatch. Sum error: relative L2 "
    "distance of the optimizer's gradient from the float64 mean of the "
    "pipeline's own microbatch gradients (each run alone through a "
    "one-microbatch pipeline: nothing summed; XLA may keep a gradient's "
    "excess precision into a float32 sum, so that row is not 0). Against one "
    "device: from the float64 mean of jax.grad's bfloat16 microbatch "
    "gradients (bfloat16 compute's own spread included). Time: float32 "
    "over bfloat16 accumulation, median of paired steps.",
    "",
  ]
  trained = record["train_steps"] > 0
  head = (
    "| m | sum error, bf16 / f32 | against one device, bf16 / f32 "
    "| accumulator bytes (bf16 -> f32) | time f32/bf16 |"
  )
  rule = "|---|---|---|---|---|"
  if trained:
    head += f" loss after {record['train_steps']} steps (bf16 / f32) |"
    rule += "---|"
  lines += [head, rule]
  for r in record["rows"]:
    line = (
      f"| {r['microbatches']} | {r['bfloat16_error']:.2e} / "
      f"{r['float32_error']:.2e} | {r['bfloat16_vs_one_device']:.2e} / "
      f"{r['float32_vs_one_device']:.2e} | "
      f"{format_bytes(r['bfloat16_grad_bytes'])} -> "
      f"{format_bytes(r['float32_grad_bytes'])} | {r['time_ratio']:.3f} |"
    )
    if trained:
      line += f" {r['bfloat16_loss']:.4f} / {r['float32_loss']:.4f} |"
    lines.append(line)
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
