r"""Driver overhead: a pipeline on ONE device against one jitted step.

(1) A GPT-style model split into p in {2, 4} stages, all on one device, run
with ``gpipe`` over m microbatches, against the same model as one jitted
gradient-accumulation step over the same microbatches (``lax.scan``) plus
the same optax update, timed alternately: the median over pairs of the
ratio of the two step times and its interquartile range (target <= 1.10
on CPU, <= 1.05 on a GPU), with the last stage's forward and backward
fused (the default) and not, and with recomputation against a jitted
step that recomputes too (``jax.checkpoint``; in brackets the ratio to
the one that does not); beside the ratio, the fixed cost per
microbatch in microseconds (median over the pairs of (pipeline -
reference) / m), which compares across machines of different speed.
"host dispatch" is the time until
``pipe.step`` returns, before waiting for the device. It includes waits
when the runtime's queue of in-flight programs is full (the CPU client
holds ~32), so it bounds the host's work from above; when it nears the
step time on a GPU, the host sets the pace.
(2) Driver cost per action: a tiny model (compute ~ 0) on p stages and m
microbatches; step time / number of actions, in microseconds, and the
host's share of it, split (``experiments.runtime.host_cost``) into the
driver's own Python (programs replayed), the programs' dispatch (the
same arguments into an empty program) and their run (on a CPU the tiny
programs execute inline and fill the queue: mostly execution).

Writes results/overhead_<platform>.{md,json}.

Usage: python -m experiments.runtime.overhead [--size small|gpu]
"""

import dataclasses
import json
import os
import time

import jax
import numpy as np
import optax
from absl import app, flags

import jpipe
from experiments.gpu_campaign._common import paired_times, reference_step
from experiments.runtime.host_cost import host_breakdown
from jpipe import partition
from jpipe.models import gpt

FLAGS = flags.FLAGS
flags.DEFINE_enum(
  "size", "small", ["tiny", "small", "gpu"], "Model size preset."
)
flags.DEFINE_integer("repeats", 10, "Timed steps per configuration.")
flags.DEFINE_string(
  "out_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Output folder.",
)

SIZES = {  # layers, width, heads, sequence, batch, microbatches
  "tiny": (2, 32, 2, 16, 8, 2),  # (tests: the code path in seconds)
  "small": (8, 128, 4, 64, 16, 8),
  "gpu": (16, 1024, 16, 256, 32, 8),
}


def _lm(layers, width, heads, length, batch):
  model = gpt.Model(
    vocab_size=256,
    width=width,
    num_layers=layers,
    num_heads=heads,
    max_length=length,
  )
  tokens = jax.random.randint(jax.random.key(0), (batch, length + 1), 0, 256)
  params = model.init(jax.random.key(1), tokens[:2, :-1], train=False)["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["tokens"][:, 1:]
    ).mean()

  return loss_fn, params, {"tokens": tokens}


def _median_seconds(fn, repeats):
  fn()  # compile
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _pipeline(
  loss_fn, params, batch, m, p, tx, recompute, fuse=True, own_buffer_bytes=None
):
  """``(run, pipe)``: ``run()`` does one step and waits for it; the host
  time until ``pipe.step`` returned (dispatch, before the wait) is
  appended to ``run.host_seconds``. ``own_buffer_bytes``: the pipeline's
  (None: the platform's default)."""
  micro = jax.tree.map(lambda x: x[: x.shape[0] // m], batch)
  traced = partition.trace(loss_fn, params, micro)
  costs = partition.profile_nodes(traced, params, micro, method="analytic")
  plan = partition.plan_traced(traced, costs, p)
  plan = dataclasses.replace(plan, stage_devices=((0,),) * plan.num_stages)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=p,
    devices=jax.devices()[:1],
    schedule="gpipe",
    num_microbatches=m,
    optimizer=tx,
    partition=plan,
    recompute=recompute,
    fuse_last_stage=fuse,
    own_buffer_bytes=own_buffer_bytes,
  )
  state = {"s": pipe.init(params)}

  def run():
    start = time.perf_counter()
    state["s"], metrics = pipe.step(state["s"], batch)
    run.host_seconds.append(time.perf_counter() - start)
    jax.block_until_ready((state["s"].stage_params, metrics["loss"]))

  run.host_seconds = []
  return run, pipe


def _host_median(run, repeats):
  """Median host (dispatch) seconds of the last ``repeats`` timed steps."""
  return float(np.median(run.host_seconds[-repeats:]))


def main(argv):
  del argv
  layers, width, heads, length, batch_size, m = SIZES[FLAGS.size]
  loss_fn, params, batch = _lm(layers, width, heads, length, batch_size)
  tx = optax.adamw(1e-4)
  device = jax.devices()[0]
  rows, records = [], []
  # A recomputing pipeline runs an extra forward per microbatch by the
  # user's choice: its own cost shows against a jitted step that
  # recomputes too (jax.checkpoint), its total against the plain one.
  references = {
    recompute: reference_step(
      loss_fn, params, batch, m, tx, False, recompute=recompute
    )
    for recompute in (False, True)
  }
  # (recompute, last stage fused): the unfused row shows what fusing buys.
  variants = ((False, True), (False, False), (True, True))
  for p in (2, 4):
    for recompute, fuse in variants:
      run, pipe = _pipeline(loss_fn, params, batch, m, p, tx, recompute, fuse)
      pipe_times, ref_times = paired_times(
        run, references[recompute], FLAGS.repeats
      )
      plain = ""
      if recompute:  # Against the step that does not recompute as well.
        _, plain_times = paired_times(run, references[False], FLAGS.repeats)
        plain = (
          f" ({float(np.median(pipe_times) / np.median(plain_times)):.3f})"
        )
      seconds, reference = np.median(pipe_times), np.median(ref_times)
      host = _host_median(run, FLAGS.repeats)
      ratios = pipe_times / ref_times
      ratio = float(np.median(ratios))
      q25, q75 = (float(q) for q in np.percentile(ratios, [25, 75]))
      # What the pipeline adds per microbatch, comparable across machines.
      fixed = float(np.median(pipe_times - ref_times)) * 1e6 / m
      records.append(
        {
          "kind": "overhead",
          "stages": p,
          "microbatches": m,
          "recompute": recompute,
          "fuse_last_stage": fuse,
          "pipeline_seconds": float(seconds),
          "pipeline_host_seconds": host,
          "reference_seconds": float(reference),
          "ratio": ratio,
          "ratio_iqr": [q25, q75],
          "fixed_us_per_microbatch": fixed,
          "reference_recomputes": recompute,
        }
      )
      rows.append(
        f"| {p} | {m} | {'yes' if recompute else 'no'} | "
        f"{'yes' if fuse else 'no'} | {1e3 * seconds:.2f} | "
        f"{1e3 * host:.2f} | {1e3 * reference:.2f} | {ratio:.3f}{plain} | "
        f"{q25:.3f}-{q75:.3f} | {fixed:.0f} |"
      )
  table1 = (
    "| stages | microbatches | recompute | last stage fused | pipeline ms | "
    "host dispatch ms | one jitted step ms (recomputing where the "
    "pipeline does) | ratio (vs a step without recompute) | ratio IQR | "
    "fixed µs / microbatch |\n"
    "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
  )

  tiny_loss, tiny_params, tiny_batch = _lm(8, 8, 1, 4, 64)
  rows = []
  for p in (2, 4, 8):
    for mb in (4, 8, 16, 32):
      run, pipe = _pipeline(
        tiny_loss,
        tiny_params,
        tiny_batch,
        mb,
        p,
        optax.sgd(1e-3),
        recompute=False,
      )
      repeats = max(3, FLAGS.repeats // 2)
      seconds = _median_seconds(run, repeats)
      actions = sum(len(a) for a in pipe.schedule.device_actions)
      per_action = 1e6 * seconds / actions
      host = host_breakdown(pipe, run, actions, repeats)
      records.append(
        {
          "kind": "per_action",
          "stages": p,
          "microbatches": mb,
          "actions": actions,
          "step_seconds": seconds,
          "microseconds_per_action": per_action,
          **host,
        }
      )
      rows.append(
        f"| {p} | {mb} | {actions} | {1e3 * seconds:.2f} | {per_action:.0f} "
        f"| {host['host_us_per_action']:.0f} | "
        f"{host['driver_us_per_action']:.1f} | "
        f"{host['dispatch_us_per_action']:.1f} | "
        f"{host['run_us_per_action']:.0f} |"
      )
  table2 = (
    "| stages | microbatches | actions | step ms | µs / action | "
    "host µs / action | of which driver | dispatch | run |\n"
    "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
  )
  header = (
    f"{device.device_kind} ({device.platform}), jax "
    f"{jax.__version__}, size={FLAGS.size}: GPT {layers} layers x "
    f"{width}, {heads} heads, sequence {length}, batch {batch_size}, "
    f"AdamW; median of {FLAGS.repeats} steps."
  )
  text = (
    f"{header}\n\nOne-device overhead (gpipe, all stages on one "
    f"device):\n\n{table1}\n\nDriver cost per action (GPT 8 x 8, "
    f"batch 64, no recompute):\n\n{table2}\n"
  )
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  name = f"overhead_{device.platform}"
  with open(os.path.join(FLAGS.out_dir, name + ".md"), "w") as f:
    f.write(text)
  with open(os.path.join(FLAGS.out_dir, name + ".json"), "w") as f:
    json.dump(
      {
        "device": device.device_kind,
        "platform": device.platform,
        "size": FLAGS.size,
        "records": records,
      },
      f,
      separators=(",", ":"),
    )
  print(text)


if __name__ == "__main__":
  app.run(main)
