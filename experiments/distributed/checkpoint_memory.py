"""Host memory of a checkpoint across processes: written where the state
lives (each process its own stages' leaves, ``jpipe.train.process_arrays``)
against the gathered save (``Pipeline.state_dict`` on every process, one
orbax ``StandardSave``).

  python -m experiments.distributed.checkpoint_memory [--nprocs 4]
      [--width 3344] [--layers 8] [--out_dir DIR]

starts the processes itself (``jpipe.launch``, one CPU device each): an
MLP of ``--layers`` square Dense layers in ``--nprocs`` stages (one per
process) under Adam: its training state (params and two moments) is
3 x 4 bytes x params (1.0 GiB at the defaults, 89.5 M params). Each
process builds its stage from zero-stride params (no memory until placed),
takes one step, then, for each way of saving: saves, then restores into
a fresh state. Around each it resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``) and reads the peak (``VmHWM``): the table
gives, per process, the peak above the RSS before the operation, in MiB
and as a multiple of the process's own share of the training state. On
a CPU the state itself already lives in host memory (the devices are
the host): the figure is what a save or restore adds to it. Writes
``experiments/distributed/results/checkpoint_memory.json`` (or under
``--out_dir``).
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
RESULTS = os.path.join(os.path.dirname(__file__), "results")
MIB = 2**20


def _rss_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_above(fn):
  """(fn's result, its peak RSS above the RSS before it, bytes)."""
  import gc

  gc.collect()
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # Resets VmHWM to the current RSS.
  before = _rss_kib("VmRSS")
  out = fn()
  return out, (_rss_kib("VmHWM") - before) * 1024


def _model(width: int, layers: int):
  import flax.linen as nn
  import jax
  import numpy as np

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(layers):
        x = nn.tanh(nn.Dense(width, name=f"layer_{i}")(x))
      return x

  model = Mlp()
  batch = {
    "x": np.ones((4, width), np.float32),
    "y": np.zeros((4, width), np.float32),
  }
  shapes = jax.eval_shape(model.init, jax.random.key(0), batch["x"])["params"]
  # Zero-stride arrays: a process holds only the stage it places.
  params = jax.tree.map(
    lambda s: np.broadcast_to(np.float32(1e-3), s.shape), shapes
  )

  def loss_fn(params, batch):
    out = model.apply({"params": params}, batch["x"])
    return ((out - batch["y"]) ** 2).mean()

  return loss_fn, params, batch


def _worker(width: int, layers: int, directory: str) -> None:
  from jpipe import distributed

  distributed.initialize()
  import jax
  import numpy as np
  import optax

  import jpipe
  from jpipe.train import checkpoint

  loss_fn, params, batch = _model(width, layers)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=jax.process_count(),
    optimizer=optax.adam(1e-3),
    schedule="1f1b",
    num_microbatches=jax.process_count(),
  )
  state, _ = pipe.step(pipe.init(params), batch)
  own = pipe.local_state_dict(state)
  share = sum(
    np.prod(x.shape) * x.dtype.itemsize
    for x in jax.tree.leaves(own)
    if not isinstance(x, jax.ShapeDtypeStruct)
  )
  fingerprint = {"model": "mlp"}
  rows = []
  for way in ("per process", "gathered"):
    saves = checkpoint.Checkpoints(os.path.join(directory, way), keep=1)
    per_process = way == "per process"

    def save(saves=saves, per_process=per_process):
      tree = (
        pipe.local_state_dict(state)
        if per_process
        else (jax.tree.map(np.asarray, pipe.state_dict(state)))
      )
      saves.save(
        1,
        tree,
        {"step": 1, "fingerprint": fingerprint},
        per_process=per_process,
      )

    _, saved = _peak_above(save)

    def restore(saves=saves, per_process=per_process):
      if per_process:
        template, needed = pipe.state_dict_layout()
      else:  # Today's template: the state dict, gathered.
        template = jax.tree.map(np.asarray, pipe.state_dict(state))
        needed = None
      tree, _ = saves.restore(template, fingerprint, needed=needed)
      return pipe.load_state_dict(tree)

    back, restored = _peak_above(restore)
    jax.block_until_ready(back.stage_params)
    del back
    saves.close()
    rows.append(
      {
        "way": way,
        "process": jax.process_index(),
        "share_mib": share / MIB,
        "save_peak_mib": saved / MIB,
        "restore_peak_mib": restored / MIB,
        "save_x_share": saved / share,
        "restore_x_share": restored / share,
      }
    )
  everyone = distributed.exchange("rows", json.dumps(rows).encode())
  if jax.process_index() == 0:
    print("ROWS " + json.dumps([r for b in everyone for r in json.loads(b)]))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--nprocs", type=int, default=4)
  parser.add_argument("--width", type=int, default=3344)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--out_dir", default=RESULTS)
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    _worker(args.width, args.layers, args.worker)
    return
  directory = tempfile.mkdtemp(prefix="jpipe-ckpt-memory-")
  try:
    done = subprocess.run(
      [
        sys.executable,
        "-m",
        "jpipe.launch",
        f"--nprocs={args.nprocs}",
        "--",
        sys.executable,
        "-m",
        "experiments.distributed.checkpoint_memory",
        f"--width={args.width}",
        f"--layers={args.layers}",
        f"--worker={directory}",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=False,
    )
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  lines = [x for x in done.stdout.splitlines() if "ROWS " in x]
  if done.returncode != 0 or not lines:
    sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
  rows = json.loads(lines[0].split("ROWS ", 1)[1])
  state_gib = 3 * 4 * args.width * (args.width + 1) * args.layers / 2**30
  print(
    f"{args.nprocs} processes, training state {state_gib:.2f} GiB "
    f"(MLP {args.layers} x {args.width}, Adam)"
  )
  print(
    f"{'way':<12} {'proc':>4} {'share MiB':>10} {'save +MiB':>10} "
    f"{'x share':>8} {'restore +MiB':>13} {'x share':>8}"
  )
  for r in sorted(rows, key=lambda r: (r["way"], r["process"])):
    print(
      f"{r['way']:<12} {r['process']:>4} {r['share_mib']:>10.0f} "
      f"{r['save_peak_mib']:>10.0f} {r['save_x_share']:>8.2f} "
      f"{r['restore_peak_mib']:>13.0f} {r['restore_x_share']:>8.2f}"
    )
  os.makedirs(args.out_dir, exist_ok=True)
  out = {
    "date": datetime.date.today().isoformat(),
    "machine": platform.processor() or platform.machine(),
    "cpus": os.cpu_count(),
    "nprocs": args.nprocs,
    "state_gib": state_gib,
    "rows": rows,
  }
  with open(os.path.join(args.out_dir, "checkpoint_memory.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
