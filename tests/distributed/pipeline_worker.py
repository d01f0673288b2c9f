"""One process of a multi-process pipeline test (or the one-process
reference): trains a few configurations, writes what they produced.

  python tests/distributed/pipeline_worker.py OUT.npz CONFIGS_JSON

Each configuration (a dict): "case" (a tests/partition/flax_models case,
or "resnet_state", "scan_plain", "scan_state", "dropout_key",
"nnx_dropout"),
"stages", "calls" (microbatch counts or "flush"), "forward_only" (after
training, also evaluate the loss and a metrics function and predict,
forward through the stages), "per_process_save" (after training, each process writes its part of
the state dict, ``process_arrays``, to OUT.npz.arrays<config>),
"aux" (the loss returns aux outputs, ``has_aux``; each call's written to
OUT.npz as "<config>/aux/<name>"), "resume_at" (before that call: flush, each process writes its part
of the state dict to OUT.npz.resume<config> and the run goes on from a
state read back from there), "profile_calls" (indices of calls run with
``profile=True``: each process writes their actions on its clock,
``experiments.distributed.device_waits.records``, its clock before and
after each, and its ``TransferTimes`` events of the whole run to
OUT.npz.profile<config>.p<process>), and Pipeline keyword arguments.
With a round-robin group's per-replica model state, each process writes
its ``replica_model_state`` (key "leaf/replica") to
OUT.npz.replicas<config>.p<process>.npz. Started by ``jpipe.launch`` it
runs across processes (stage s on global device s); without the
launcher's environment it is the one-process reference on
JPIPE_CPU_DEVICES devices. Process 0 writes the gathered params, the
state dict's optimizer state and every call's loss.
"groups" places stage s on global devices groups[s] (a replica group
may span processes); with "refused" (across processes only) building
must fail with a one-line ValueError containing that text.
"""

import dataclasses
import faulthandler
import json
import os
import sys
import time

from jpipe import distributed

distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if os.environ.get("JPIPE_TEST_XLA_CACHE"):  # the test run's shared cache
  jax.config.update(
    "jax_compilation_cache_dir", os.environ["JPIPE_TEST_XLA_CACHE"]
  )
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "partition"))
import flax_models  # noqa: E402
import scan_models  # noqa: E402

import jpipe  # noqa: E402
from experiments.distributed import device_waits  # noqa: E402
from jpipe.train import process_arrays  # noqa: E402

# Seconds after which a worker that has not finished dumps its stacks.
HANG_DUMP_SECONDS = float(os.environ.get("JPIPE_TEST_HANG_DUMP", "200"))

OPTIMIZERS = {
  "sgd": optax.sgd(0.2, momentum=0.9),
  "adam": optax.adam(0.01),
}


def _host(x):
  """A leaf as a NumPy array (a typed PRNG key: its key data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def run(config, index, out, path_of_out):
  config = dict(config)
  case, model_state = config.pop("case"), None
  if case == "resnet_state":  # BatchNorm statistics as the model state
    loss_fn, params, model_state, batch = flax_models.resnet_state_case(
      num_blocks=3, batch_size=8
    )
  elif case == "scan_plain":  # 8 layers under a lax.scan, stacked params
    loss_fn, params, batch = scan_models.plain_case()
  elif case == "scan_state":  # BatchNorm statistics stacked per layer too
    batch = flax_models.mlp_case()[2]
    batch = {"x": batch["x"][:, :6], "y": batch["y"] % 3}
    loss_fn, params, model_state = scan_models.batch_stats_case(
      batch, noise_key=False
    )
  elif case == "dropout_key":  # a typed key made on stage 0, read later
    loss_fn, params, batch, _ = flax_models.dropout_key_case()
  elif case == "nnx_dropout":  # typed RNG keys as each stage's state
    loss_fn, params, model_state, batch = flax_models.nnx_dropout_case()
  elif case == "nnx_lora":  # frozen weights as state returned unchanged
    loss_fn, params, model_state, batch = flax_models.nnx_lora_case()
  else:
    loss_fn, params, batch, _ = flax_models.CASES[case]()
  if config.pop("aux", False):  # has_aux: (loss, aux) or (loss, (state, aux))
    loss_fn = _with_aux(loss_fn, model_state is not None)
    config["has_aux"] = True
  stages = config.pop("stages")
  calls = config.pop("calls")
  forward_only = config.pop("forward_only", False)
  profile_calls = config.pop("profile_calls", ())
  per_process_save = config.pop("per_process_save", False)
  resume_at = config.pop("resume_at", None)
  micro = config.pop("num_microbatches", 4)
  # Replica groups: stage s on devices s*r .. s*r + r - 1, or on the
  # global devices "groups"[s] (groups that may span processes).
  replicas = config.pop("replicas", 1)
  groups = config.pop("groups", None)
  refused = config.pop("refused", None)
  count = stages * replicas
  if groups is not None:
    groups = tuple(tuple(g) for g in groups)
    count = 1 + max(max(g) for g in groups)
  size = jax.tree.leaves(batch)[0].shape[0] // micro

  def build(partition):
    return jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=stages,
      devices=jax.devices()[:count],
      num_microbatches=micro,
      optimizer=OPTIMIZERS[config.get("optimizer", "sgd")],
      model_state=model_state,
      partition=partition,
      **{k: v for k, v in config.items() if k != "optimizer"},
    )

  if refused is not None:  # Across processes: the one line it must say.
    if jax.process_count() > 1:
      _check_refused(build, groups, refused, index)
    return
  if replicas == 1 and groups is None:
    pipe = build("contiguous")
  else:
    plan = build("contiguous").plan
    groups = groups or tuple(
      tuple(range(s * replicas, (s + 1) * replicas)) for s in range(stages)
    )
    pipe = build(dataclasses.replace(plan, stage_devices=groups))
  state = pipe.init(params, model_state)
  losses, auxes = [], []
  rng = np.random.default_rng(index)
  profiled = []
  times = pipe.transport.time_transfers() if profile_calls else None
  for i, call in enumerate(calls):
    if i == resume_at:
      state = _resumed(pipe, state, f"{path_of_out}.resume{index}")
    if call == "flush":
      state, _ = pipe.flush(state)
      continue
    # Deterministic distinct data: the batch, rows shuffled per call.
    rows = rng.integers(0, jax.tree.leaves(batch)[0].shape[0], call * size)
    data = jax.tree.map(
      lambda x, rows=rows: x[rows] if jnp.ndim(x) else x, batch
    )
    if not pipe.reads_batch:  # a middle stage: the shapes suffice
      data = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), data
      )
    before = time.perf_counter()
    state, metrics = pipe.step(state, data, profile=i in profile_calls)
    losses.append(float(metrics["loss"]))
    if "aux" in metrics:
      auxes.append({k: float(v) for k, v in metrics["aux"].items()})
    if i in profile_calls:  # What each process measured, on its clock.
      profiled.append(
        {
          "before": before,
          "after": time.perf_counter(),
          "actions": device_waits.records(metrics["timeline"]),
        }
      )
  if profiled:
    transfers = times.close() if times else []
    with open(f"{path_of_out}.profile{index}.p{jax.process_index()}", "w") as f:
      json.dump({"calls": profiled, "transfers": transfers}, f)
  state, _ = pipe.flush(state)
  if per_process_save:  # Each process its own leaves (and rows).
    process_arrays.write_arrays(
      f"{path_of_out}.arrays{index}",
      jax.process_index(),
      pipe.local_state_dict(state),
    )
  if state.replica_model_state:  # 1F1B-RR: replicas 1..k-1's own copies.
    np.savez(
      f"{path_of_out}.replicas{index}.p{jax.process_index()}",
      **{
        f"{i}/{j}": np.asarray(x)
        for i, copies in enumerate(state.replica_model_state)
        for j, x in enumerate(copies, 1)
      },
    )
  tree = pipe.state_dict(state)
  leaves = {
    f"{index}/params/{i}": np.asarray(x)
    for i, x in enumerate(jax.tree.leaves(tree["params"]))
  }
  leaves.update(
    {
      f"{index}/opt/{i}": np.asarray(x)
      for i, x in enumerate(jax.tree.leaves(tree["opt_state"]))
    }
  )
  if tree["model_state"] is not None:
    leaves.update(
      {
        f"{index}/state/{i}": _host(x)
        for i, x in enumerate(jax.tree.leaves(tree["model_state"]))
      }
    )
  leaves[f"{index}/losses"] = np.asarray(losses)
  if "loss_scale" in tree:  # A dynamic one: (scale, finite steps).
    leaves[f"{index}/loss_scale"] = np.asarray(
      [tree["loss_scale"]["scale"], tree["loss_scale"]["good_steps"]]
    )
  for name in auxes[0] if auxes else ():
    leaves[f"{index}/aux/{name}"] = np.asarray([a[name] for a in auxes])
  if forward_only:
    leaves.update(_forward_only(pipe, state, case, batch, index))
  owned = [s for s in range(pipe.stages.num_stages) if pipe.transport.owns(s)]
  print(
    f"config {index}: process {jax.process_index()} ran stages {owned}"
    + ("" if pipe.reads_batch else ", read no data")
  )
  if pipe.loss_outputs.aux_treedef is not None:  # Where each was made.
    first = pipe.driver.first_aux_result
    made = [pipe.driver.result_stage[r] for r in range(first, first + 2)]
    print(f"config {index}: aux made on stages {made}")
  out.update(leaves)


def _with_aux(loss_fn, model_state: bool):
  """``loss_fn`` returning aux outputs too: the mean of the first batch
  leaf (taken before the model: made on the first stage) and the loss
  (on the last)."""

  def input_mean(batch):
    return jnp.mean(jax.tree.leaves(batch)[0].astype(jnp.float32))

  if model_state:

    def with_state(params, state, batch):
      mean = input_mean(batch)
      loss, new_state = loss_fn(params, state, batch)
      return loss, (new_state, {"loss": loss, "input_mean": mean})

    return with_state

  def with_aux(params, batch):
    mean = input_mean(batch)
    loss = loss_fn(params, batch)
    return loss, {"loss": loss, "input_mean": mean}

  return with_aux


def _resumed(pipe, state, directory):
  """``state`` flushed, written by each process (its part) to
  ``directory`` and read back as a checkpoint restore reads it."""
  state, _ = pipe.flush(state)
  process_arrays.write_arrays(
    directory, jax.process_index(), pipe.local_state_dict(state)
  )
  distributed.barrier("resume")
  tree = process_arrays.read_arrays(directory, *pipe.state_dict_layout())
  return pipe.load_state_dict(tree)


def _check_refused(build, groups, refused, index):
  """Building on ``groups`` raises a ValueError saying ``refused``."""
  plan = build("contiguous").plan
  try:
    build(dataclasses.replace(plan, stage_devices=groups))
  except ValueError as e:
    assert refused in str(e), str(e)
    assert "\n" not in str(e), str(e)
    print(f"config {index}: refused: {e}")
    return
  raise AssertionError(f"config {index} was not refused")


def _logits_fn(case):
  """``(params, [model state,] batch) -> logits`` in inference mode."""
  if case == "resnet_state":
    model = flax_models.ResNet(num_blocks=3)
    return lambda p, stats, b: model.apply(
      {"params": p, "batch_stats": stats}, b["x"], train=False
    )
  if case == "gpt_tied":
    model = flax_models.Gpt()
    return lambda p, b: model.apply(p, b["tokens"][:, :-1])
  model = flax_models.Mlp()
  return lambda p, b: model.apply(p, b["x"])


def _forward_only(pipe, state, case, batch, index):
  """The loss, a metrics function (logit sums per class) and the
  predicted logits of ``batch`` through the stages (every process
  passes the data)."""
  logits_fn = _logits_fn(case)

  def metrics_fn(*args):
    logits = logits_fn(*args)
    return {"logit_sums": logits.reshape(-1, logits.shape[-1]).sum(0)}

  evaluated = pipe.evaluate(state, batch)
  out = {f"{index}/eval_loss": np.asarray(evaluated["loss"])}
  for name, value in evaluated.get("aux", {}).items():  # (has_aux)
    out[f"{index}/eval_aux/{name}"] = np.asarray(value)
  metrics = pipe.evaluate(state, batch, metrics_fn)
  out[f"{index}/logit_sums"] = np.asarray(metrics["logit_sums"])
  out[f"{index}/logits"] = np.asarray(pipe.predict(state, batch, logits_fn))
  return out


def main():
  path, configs = sys.argv[1], json.loads(sys.argv[2])
  # A run that hangs writes every thread's stack and exits before the
  # test's timeout (240 s) kills it silently: the failure names the
  # config (its "start" line) and where each process waits.
  faulthandler.dump_traceback_later(HANG_DUMP_SECONDS, exit=True)
  out = {}
  for i, config in enumerate(configs):
    print(f"config {i}: start {json.dumps(config)}", flush=True)
    run(config, i, out, path)
  faulthandler.cancel_dump_traceback_later()
  if jax.process_index() == 0:
    np.savez(path, **out)


if __name__ == "__main__":
  main()
