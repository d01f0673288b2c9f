"""One process of a several-pipelines-in-data-parallel test (or the
one-process reference): runs a few configurations, writes what they did.

  python tests/distributed/data_parallel_worker.py OUT.npz CONFIGS_JSON

Each configuration (a dict): "sync", "pipelines", "stages", "schedule",
"calls" (lockstep ``step`` calls, each pipeline on its own rows) or
"epochs" (free-running ``run_epoch`` calls of "batches_per_epoch"),
optional "hetero" (seconds), "by_stage" (the devices of a stage
together: one process per stage) and "case" (a ``flax_models`` case:
"mlp", or "nnx_dropout", NNX RNG streams -- typed keys -- as model
state); with "transport", only whether that
transport is refused. Under ``jpipe.launch`` the pipelines are
split between the processes; without it, all run in this one on
JPIPE_CPU_DEVICES devices. Process 0 writes every pipeline's gathered
params and losses (lockstep) or the epoch reports and consensus params
(epochs).
"""

import json
import os
import sys

from jpipe import distributed

distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "partition"))
import flax_models  # noqa: E402

import jpipe  # noqa: E402
from jpipe import parallel  # noqa: E402
from jpipe.runtime.build.key_arrays import host_key_data  # noqa: E402


def _rows(batch, rank, i, size):
  """Pipeline ``rank``'s i-th batch: rows of the example, drawn from a
  seed of (rank, i), so every process draws the same for a rank."""
  n = jax.tree.leaves(batch)[0].shape[0]
  rows = np.random.default_rng([rank, i]).integers(0, n, size)
  return jax.tree.map(lambda x: x[rows] if jnp.ndim(x) else x, batch)


def run(config, index, out):
  model_state = None
  if config.get("case") == "nnx_dropout":
    loss_fn, params, model_state, batch = flax_models.nnx_dropout_case()
  else:
    loss_fn, params, batch, _ = flax_models.CASES[config.get("case", "mlp")]()
  size = jax.tree.leaves(batch)[0].shape[0]
  if config.get("transport"):  # Only whether it is refused (spanning).
    try:
      parallel.DataParallelPipelines(
        jpipe.PipelineBuilder.of(
          loss_fn,
          params,
          batch,
          num_stages=config["stages"],
          optimizer=optax.sgd(0.1),
          partition="contiguous",
          transport=config["transport"],
        ),
        pipelines=config["pipelines"],
        devices=jax.devices()[: config["pipelines"] * config["stages"]],
      ).close()
      out[f"{index}/refused"] = np.asarray(0)
    except ValueError as e:
      assert "need the 'pull' transport" in str(e), e
      out[f"{index}/refused"] = np.asarray(1)
    return
  build = jpipe.PipelineBuilder.of(
    loss_fn,
    params,
    batch,
    num_stages=config["stages"],
    schedule=config["schedule"],
    num_microbatches=4,
    optimizer=optax.sgd(0.1, momentum=0.9),
    partition="contiguous",
    weight_stashing=config["schedule"] == "async",
    model_state=model_state,
  )
  dp = parallel.DataParallelPipelines(
    build,
    pipelines=config["pipelines"],
    sync=config["sync"],
    devices=jax.devices()[: config["pipelines"] * config["stages"]],
    placement="stage" if config.get("by_stage") else "pipeline",
    batches_per_epoch=config.get("batches_per_epoch", 4),
    hetero=parallel.Heterogeneity(hetero=config.get("hetero", 0.0), seed=1),
    hetpipe_every=config.get("hetpipe_every", 2),
  )
  states = dp.init(params, model_state)
  dp.compile_groups(states)
  record = {}
  for i in range(config.get("calls", 0)):
    batches = [_rows(batch, p, i, size) for p in dp.ranks]
    states, metrics = dp.step(states, batches)
    for p, m in zip(dp.ranks, metrics, strict=True):
      if "loss" in m:
        record.setdefault(f"{index}/loss/{p}", []).append(float(m["loss"]))
  if config.get("calls"):
    states, _ = dp.flush(states)
  for e in range(config.get("epochs", 0)):
    states, report = dp.run_epoch(
      states, lambda p, i, e=e: _rows(batch, p, 1000 * e + i, size)
    )
    record[f"{index}/batches/{e}"] = report.batches
    record[f"{index}/group/{e}"] = report.mean_group_size
    print(
      f"config {index} epoch {e}: process {jax.process_index()} ran "
      f"pipelines {list(dp.ranks)}, batches {report.batches}"
    )
  # Every pipeline's params and model state (gathered across processes
  # by the state dict; typed keys as their key data).
  for p, d in enumerate(dp.state_dict(states)["pipelines"]):
    for j, x in enumerate(jax.tree.leaves(d["params"])):
      record[f"{index}/params/{p}/{j}"] = np.asarray(x)
    for j, x in enumerate(jax.tree.leaves(d.get("model_state"))):
      record[f"{index}/model_state/{p}/{j}"] = host_key_data(x)
  consensus = dp.consensus_params(states)
  for j, x in enumerate(jax.tree.leaves(consensus)):
    record[f"{index}/consensus/{j}"] = np.asarray(x)
  # The same mean averaged on the stages' devices (across processes),
  # evaluated through pipeline 0 (by its processes; every one gets it).
  held_out = _rows(batch, 0, 999, size)
  metrics = dp.evaluate_consensus(
    states, lambda pipe, state: pipe.evaluate(state, held_out)
  )
  record[f"{index}/consensus_loss"] = metrics["loss"]
  if model_state is None:  # (With it, the host's draws differ.)
    record[f"{index}/consensus_loss_ref"] = float(loss_fn(consensus, held_out))
  if jax.process_count() > 1:
    # Each process gathered the losses of its own pipelines only.
    everyone = dp.hub.all_gather(
      "losses", {k: v for k, v in record.items() if "/loss/" in k}
    )
    for losses in everyone:
      record.update(losses)
  dp.close()
  out.update({k: np.asarray(v) for k, v in record.items()})


def main():
  path, configs = sys.argv[1], json.loads(sys.argv[2])
  out = {}
  for i, config in enumerate(configs):
    run(config, i, out)
  if jax.process_index() == 0:
    np.savez(path, **out)


if __name__ == "__main__":
  main()
