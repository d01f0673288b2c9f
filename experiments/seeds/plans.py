r"""The seeds' workloads planned at their real sizes, beside the seeds' own
figures.

For every config in ``configs/seeds/``: ``python -m jpipe.train.plan``'s
plan (traced on shapes; nothing of the model's size is allocated): the
partition method, stages and devices, each device's predicted bytes
against the config's limit, and the predicted speed-up (sequential time
/ bottleneck, analytic FLOPs at 1 TFLOP/s per device, transfers at the
config's bandwidth), beside what the seed reports (spec/, sections
cited in each config's docstring). A seed's figure comes from its own
profiles on its own GPUs and, for PipeDream, its speed-up over data
parallelism, so the columns agree in kind, not in value: the table
shows where jpipe's plan differs (stage shapes, replication).

Writes results/plans.{md,json}.

Usage: python -m experiments.seeds.plans [--configs a.py,b.py] [--out DIR]
"""

import contextlib
import io
import json
import os
import time

from absl import app, flags

from jpipe.train import plan as plan_cli

FLAGS = flags.FLAGS
flags.DEFINE_string("configs", "", "comma-separated config files (default all)")
flags.DEFINE_string(
  "out", "", "output folder (default experiments/seeds/results)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
SEEDS = os.path.join(ROOT, "configs", "seeds")
OUT = os.path.join(os.path.dirname(__file__), "results")

# What each seed reports for the workload (spec/ sections in the configs).
SEED_FIGURES = {
  "ftpipe_t5_3b.py": "FTPipe partitioner, 8 GPUs, 512/4: mixed 7.33x, "
  "PipeDream's method 5.90x, acyclic 3.85x",
  "ftpipe_gpt2_xl.py": "FTPipe: 8 x 2080 Ti; no speed-up figure in its repo",
  "ftpipe_bert_large.py": "FTPipe partitioner, 8 GPUs: 6.69x async, 7.37x "
  "sync (4 GPUs: 3.51x async)",
  "ftpipe_wrn28x10.py": "FTPipe partitioner, 4 GPUs (PipeDream method): 2.51x",
  "pipedream_vgg16.py": "PipeDream 4x4 V100 (10 Gbps): 15-1, 5.28x over DP",
  "pipedream_resnet50.py": "PipeDream: data parallel chosen (1x over DP)",
  "pipedream_gnmt16.py": "PipeDream 4x4 V100: straight (14 stages), 2.34x "
  "over DP (2.92x to accuracy); 2x8 V100: 3.14x",
  "sdpipe_bert.py": "SD-Pipe: BERT-base, hand split [2,4,4,2] layers, "
  "4 x 4 pipelines on 2 x 8 GPUs",
  "dynpipe_bert.py": "DynPipe 8 GPUs: 180.9 seq/s (PipeDream 150.7, GPipe 76.1)",
  "sdpipe_resnet50.py": "SD-Pipe: hand split [4,4,4,4] blocks, 4 x 4 pipelines",
  "dynpipe_vgg16.py": "DynPipe 8 GPUs: 179.3 img/s (PipeDream 147.1, GPipe "
  "32.9); GPU utilisation 39.3 % (PipeDream 13.7 %)",
}


def plan_one(name: str) -> dict:
  """The --json plan of ``configs/seeds/<name>`` and its wall time."""
  out = io.StringIO()
  start = time.perf_counter()
  with contextlib.redirect_stdout(out):
    code = plan_cli.main(["--config", os.path.join(SEEDS, name), "--json"])
  seconds = time.perf_counter() - start
  if code != 0:
    return {"config": name, "error": f"exit {code}", "seconds": seconds}
  result = json.loads(out.getvalue())
  held = result["device_memory_bytes"]
  shape = [len(d) for d in result["stage_devices"]]
  return {
    "config": name,
    "method": result["method"],
    "stages": len(shape),
    "devices": len(held),
    "replicas": shape if max(shape) > 1 else None,
    "max_device_gib": max(held.values()) / 2**30,
    "limit_gib": (result["memory_limit"] or 0) / 2**30 or None,
    "speedup": result["sequential"] / result["bottleneck"],
    "plan_seconds": seconds,
    "seed": SEED_FIGURES.get(name, ""),
  }


def main(argv):
  del argv
  names = [n for n in FLAGS.configs.split(",") if n] or sorted(
    n for n in os.listdir(SEEDS) if n.endswith(".py") and n != "__init__.py"
  )
  rows = [plan_one(n) for n in names]
  lines = [
    "| config | method | stages / devices | max device GiB (limit) | "
    "predicted speed-up | plan s | the seed's figure |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['config']} | {r['error']} | | | | | |")
      continue
    limit = f" ({r['limit_gib']:.0f})" if r["limit_gib"] else ""
    replicas = (
      f" [{'-'.join(map(str, r['replicas']))}]" if r["replicas"] else ""
    )
    lines.append(
      f"| {r['config']} | {r['method']} | {r['stages']} / "
      f"{r['devices']}{replicas} | {r['max_device_gib']:.2f}{limit} | "
      f"{r['speedup']:.2f}x | {r['plan_seconds']:.1f} | {r['seed']} |"
    )
  table = "\n".join(lines)
  print(table)
  out = FLAGS.out or OUT
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "plans.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(out, "plans.json"), "w") as f:
    json.dump({"date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
