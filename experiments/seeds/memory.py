r"""The partitioner's memory model at full size against XLA's own figures.

For a seed config planned at its real size (``python -m
jpipe.train.plan``'s plan, traced on shapes), each stage's backward
program -- recomputing its forward, as the configs run -- is compiled
abstractly for one microbatch (``jax.jit(...).lower(shapes).compile()``:
nothing of the model's size is allocated, the CPU compiler plans the
buffers) and ``compiled.memory_analysis()`` gives its arguments (params,
the microbatch's inputs, the cotangents), outputs (gradients) and
temporaries. Beside them, the model's prediction for the same program:
params + gradients + the stage's inputs and output cotangents + its
working bytes (``partition.stage_memory_bytes``: every value its nodes
compute, an upper bound on XLA's temporaries).

Writes results/memory.{md,json}.

Usage: python -m experiments.seeds.memory [--configs ftpipe_bert_large.py]
    [--stages 4] [--out DIR]
"""

import json
import os
import time

# One fake CPU device per planned device (the plan only needs their count).
from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(16)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from jpipe import partition  # noqa: E402
from jpipe.train import config_check, config_options, config_plan, tasks  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "configs",
  "ftpipe_bert_large.py,ftpipe_gpt2_xl.py,ftpipe_t5_3b.py",
  "configs/seeds/ files",
)
flags.DEFINE_integer(
  "stages", 4, "stages compiled per config: those predicted largest"
)
flags.DEFINE_string(
  "out", "", "output folder (default experiments/seeds/results)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
OUT = os.path.join(os.path.dirname(__file__), "results")


def _nbytes(tree) -> float:
  return float(
    sum(
      np.prod(x.shape) * getattr(x.dtype, "itemsize", 8)
      for x in jax.tree.leaves(tree)
    )
  )


def measure(name: str, max_stages: int) -> list[dict]:
  """Rows of ``configs/seeds/<name>``'s largest ``max_stages`` stages."""
  config = config_plan.load_config_file(
    os.path.join(ROOT, "configs", "seeds", name)
  )
  config_check.check(config)
  devices = config.pipeline.num_stages
  traced, costs, params = config_plan.trace_config(
    config, None, devices, None, abstract=True
  )
  memory = config_options.memory_limit(config.pipeline.memory_limit)
  budget = config_plan.memory_budget(config, params, devices, memory)
  plan = partition.plan_traced(
    traced,
    costs,
    devices,
    method=config.pipeline.partition,
    memory=budget if memory else None,
  )
  predicted = partition.stage_memory_bytes(traced, plan, budget)
  task = tasks.build_task(config, abstract=True)
  m = config.pipeline.num_microbatches
  micro = {k: v[: len(v) // m] for k, v in task.batch_at(0).items()}
  stages = partition.Stages(traced, list(plan.stage_of_node))
  stage_params = stages.split_params(params)
  stage_batch = stages.split_batch(micro)
  params_bytes = traced.node_param_bytes()
  of = np.asarray(plan.stage_of_node)
  chosen = set(np.argsort(-predicted.total)[:max_stages].tolist())
  values: dict = {}
  rows = []
  for s, spec in enumerate(stages.specs):
    acts = tuple(values[v] for v in spec.inputs)
    args = (stage_params[s], stage_batch[s], acts)
    outputs, _ = jax.eval_shape(lambda *a, s=s: stages.forward(s, *a), *args)
    values.update(zip(spec.outputs, outputs, strict=True))
    if s not in chosen:
      continue
    out_cots = tuple(
      jax.ShapeDtypeStruct(o.shape, o.dtype)
      if jax.numpy.issubdtype(o.dtype, jax.numpy.inexact)
      else None
      for o in outputs
    )
    res_cots = tuple(1.0 if r == 0 else None for r in spec.results)
    start = time.perf_counter()
    compiled = (
      jax.jit(lambda *a, s=s: stages.backward(s, *a))
      .lower(*args, out_cots, res_cots)
      .compile()
    )
    seconds = time.perf_counter() - start
    xla = compiled.memory_analysis()
    p = float(params_bytes[of == s].sum())
    inputs = _nbytes((stage_batch[s], acts, [c for c in out_cots if c]))
    program = 2 * p + inputs + float(predicted.working[s]) - p
    xla_total = (
      xla.argument_size_in_bytes
      + xla.output_size_in_bytes
      + xla.temp_size_in_bytes
    )
    rows.append(
      {
        "config": name,
        "stage": s,
        "nodes": int((of == s).sum()),
        "params_bytes": p,
        "predicted_program_bytes": program,
        "predicted_working_bytes": float(predicted.working[s]) - p,
        "xla_argument_bytes": float(xla.argument_size_in_bytes),
        "xla_output_bytes": float(xla.output_size_in_bytes),
        "xla_temp_bytes": float(xla.temp_size_in_bytes),
        "xla_program_bytes": float(xla_total),
        "ratio": program / xla_total,
        "compile_seconds": seconds,
      }
    )
  return rows


def main(argv):
  del argv
  rows = []
  for name in [n for n in FLAGS.configs.split(",") if n]:
    rows.extend(measure(name, FLAGS.stages))
  gib = 2**30
  lines = [
    "| config | stage | nodes | params GiB | predicted program GiB | XLA "
    "args + out + temp GiB | predicted working / XLA temp GiB | ratio |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['config']} | {r['stage']} | {r['nodes']} | "
      f"{r['params_bytes'] / gib:.2f} | {r['predicted_program_bytes'] / gib:.2f} | "
      f"{r['xla_argument_bytes'] / gib:.2f} + {r['xla_output_bytes'] / gib:.2f}"
      f" + {r['xla_temp_bytes'] / gib:.2f} | "
      f"{r['predicted_working_bytes'] / gib:.2f} / "
      f"{r['xla_temp_bytes'] / gib:.2f} | {r['ratio']:.2f} |"
    )
  table = "\n".join(lines)
  print(table)
  out = FLAGS.out or OUT
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "memory.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(out, "memory.json"), "w") as f:
    json.dump(
      {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "rows": rows},
      f,
      indent=1,
    )


if __name__ == "__main__":
  app.run(main)
