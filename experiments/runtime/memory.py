r"""Per-stage memory: jpipe's prediction against XLA's own figures.

For a GPT (``jpipe.models.gpt``) split into p stages under several
schedules, each stage's predicted memory (``jpipe.Pipeline.memory``,
computed from abstract shapes before anything compiles) beside what XLA
reports for the compiled stage programs (``compiled.memory_analysis()``):
the optimizer state (the stage optimizer's init program's output), the
params and a microbatch's inputs (the saving forward's arguments), the
residuals a microbatch keeps without recomputation (its outputs), and
the largest temporary buffer of the forward and backward programs (the
prediction's ``working`` term bounds it from above). "total" is the
prediction's peak: params x versions + grads + optimizer state +
in-flight microbatches x what each keeps + working.

Writes results/memory_<platform>.{md,json}.

Usage: python -m experiments.runtime.memory [--memory_stages 2,4]
"""

import datetime
import json
import os

# On a CPU, one fake device per stage (a GPU machine has its own).
from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(8)

import jax  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

import jpipe  # noqa: E402
from jpipe.models import gpt  # noqa: E402
from jpipe.runtime import format_bytes  # noqa: E402
from jpipe.runtime.build.memory import nbytes  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("memory_stages", ["2", "4"], "Stage counts.")
flags.DEFINE_string(
  "memory_results_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Where to write the tables.",
)

SETTINGS = (
  ("gpipe", {"recompute": False}),
  ("1f1b", {"recompute": False}),
  ("1f1b", {"recompute": True}),
  ("async", {"weight_stashing": True, "recompute": False}),
)


def _pipeline(num_stages, schedule, options, width=128, layers=4):
  model = gpt.Model(vocab_size=256, width=width, num_layers=layers)
  tokens = jax.random.randint(jax.random.key(0), (16, 65), 0, 256)
  params = model.init(jax.random.key(1), tokens[:1, :-1])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["tokens"][:, 1:]
    ).mean()

  return jpipe.Pipeline(
    loss_fn,
    params,
    {"tokens": tokens},
    num_stages=num_stages,
    devices=jax.devices()[:num_stages],
    schedule=schedule,
    num_microbatches=4,
    optimizer=optax.adam(1e-3),
    **options,
  )


def _xla_figures(pipe, s):
  """XLA's bytes for stage s's programs."""
  avals = pipe.traced.closed_jaxpr.in_avals
  spec = pipe.stages.specs[s]
  params = tuple(avals[i] for i in spec.param_leaves)
  first = pipe.traced.num_param_leaves
  batch = tuple(avals[first + i] for i in spec.batch_leaves)
  acts = tuple(v.aval for v in spec.inputs)
  init = jax.jit(pipe.stage_optimizers[s].init).lower(params).compile()
  saving = pipe.stages.jitted("forward_saving", s)
  forward = saving.lower(params, batch, acts).compile().memory_analysis()
  outputs, results, residuals = jax.eval_shape(saving, params, batch, acts)
  cots = tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results)
  if spec.outputs:
    program = pipe.programs.backward(s, first=True)
    head = (batch, acts) if pipe.programs.recompute else (residuals,)
    args = (None, params, *head, outputs, cots)
  else:
    program = pipe.programs.forward_backward(s, first=True)
    args = (None, params, batch, acts, cots)
  backward = program.lower(*args).compile().memory_analysis()
  return {
    "opt_state": init.memory_analysis().output_size_in_bytes,
    "params_and_inputs": forward.argument_size_in_bytes,
    "inputs": nbytes((batch, acts)),
    "residuals_and_outputs": forward.output_size_in_bytes,
    "outputs": nbytes((outputs, results)),
    "temp": max(forward.temp_size_in_bytes, backward.temp_size_in_bytes),
  }


def run(stage_counts=(2, 4), **model) -> list[dict]:
  rows = []
  for p in stage_counts:
    for schedule, options in SETTINGS:
      pipe = _pipeline(p, schedule, options, **model)
      for s, m in enumerate(pipe.memory):
        xla = _xla_figures(pipe, s)
        rows.append(
          {
            "stages": p,
            "schedule": schedule,
            "recompute": options["recompute"],
            "stage": s,
            "predicted": {
              "params": m.params,
              "versions": m.versions,
              "opt_state": m.opt_state,
              "kept_per_microbatch": m.kept_per_microbatch,
              "in_flight": m.in_flight,
              "working": m.working,
              "total": m.total,
            },
            "xla": xla,
          }
        )
  return rows


def write(rows, results_dir) -> str:
  platform = jax.devices()[0].platform
  device = jax.devices()[0].device_kind
  lines = [
    f"# Predicted stage memory vs XLA ({device}, "
    f"{datetime.date.today().isoformat()})",
    "",
    "| p | schedule | recompute | stage | opt state pred / XLA | params "
    "pred / XLA | kept per microbatch pred / XLA | in flight | working "
    "pred / XLA temp | total |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    pred, xla = r["predicted"], r["xla"]
    kept_xla = (
      xla["inputs"]
      if r["recompute"]
      else xla["residuals_and_outputs"] - xla["outputs"]
    )
    lines.append(
      f"| {r['stages']} | {r['schedule']} | {r['recompute']} | "
      f"{r['stage']} | {format_bytes(pred['opt_state'])} / "
      f"{format_bytes(xla['opt_state'])} | {format_bytes(pred['params'])} "
      f"/ {format_bytes(xla['params_and_inputs'] - xla['inputs'])} | "
      f"{format_bytes(pred['kept_per_microbatch'])} / "
      f"{format_bytes(kept_xla)} | {pred['in_flight']} | "
      f"{format_bytes(pred['working'])} / {format_bytes(xla['temp'])} | "
      f"{format_bytes(pred['total'])} |"
    )
  table = "\n".join(lines)
  os.makedirs(results_dir, exist_ok=True)
  stem = os.path.join(results_dir, f"memory_{platform}")
  with open(stem + ".md", "w") as f:
    f.write(table + "\n")
  with open(stem + ".json", "w") as f:
    json.dump(
      {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "rows": rows,
      },
      f,
      separators=(",", ":"),
    )
  return table


def main(argv):
  del argv
  rows = run(tuple(int(p) for p in FLAGS.memory_stages))
  print(write(rows, FLAGS.memory_results_dir))


if __name__ == "__main__":
  app.run(main)
