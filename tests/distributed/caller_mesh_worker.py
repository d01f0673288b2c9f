"""One process of a run of multi-host SPMD code: a mesh over every
process's devices, the batch and a weight global arrays sharded over
"data" on it (each process holds its rows), the other weights replicated
global arrays; the mesh set (Auto, then Explicit), then not set at all
(the arrays carry it). A pipeline of 2 stages (one per process) steps
once; every process checks the loss, the gathered params and the
evaluated loss after the step against the same loss jitted over the
mesh, and prints "<kind>: equal" ("unset: equal" for the last).

Process 0 receives each value a stage of process 1 shares late (the
step's and the evaluation's loss, the gathered params), so process 1
returns from each call first and goes on to its own collectives over
the mesh: the call must return at a quiet point (a collective entered
while a peer still pulls from this process's device waits forever;
``runtime/build/user_mesh.py``).

  python -m jpipe.launch --nprocs 2 --devices-per-process 2 -- \\
    python tests/distributed/caller_mesh_worker.py
"""

import contextlib
import time

from jpipe import distributed

distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jpipe  # noqa: E402
from jpipe.runtime.build import transport  # noqa: E402

LATE_SHARE_S = 2.0


def _late_shares():
  """This process's receiving ends of ``Transport.share`` wait first."""
  share = transport.Transport.share

  def late(self, x, src, aval):
    if x is None:  # (The receiving end.)
      time.sleep(LATE_SHARE_S)
    return share(self, x, src, aval)

  transport.Transport.share = late


def loss_fn(params, batch):
  h = batch["x"]
  for i in range(4):
    with jax.named_scope(f"l{i}"):
      h = jnp.tanh(h @ params[f"l{i}"])
  return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def _whole(x):
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def run(kind, set_mesh=True):
  mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
  context = jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext()
  rng = np.random.RandomState(0)
  x = rng.randn(16, 8).astype(np.float32)
  y = (np.arange(16) % 8).astype(np.int32)
  weights = [rng.randn(8, 8).astype(np.float32) * 0.3 for _ in range(4)]
  rows = slice(8 * jax.process_index(), 8 * (jax.process_index() + 1))
  with context:

    def spread(value):  # (Rows over "data": each process its half.)
      return jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), value[rows]
      )

    batch = {"x": spread(x), "y": spread(y)}
    params = {
      f"l{i}": jax.device_put(w, NamedSharding(mesh, P()))
      for i, w in enumerate(weights)
    }
    params["l0"] = jax.device_put(weights[0], NamedSharding(mesh, P("data")))
    assert not batch["x"].is_fully_addressable
    grads = jax.jit(jax.grad(loss_fn))(params, batch)
    expected = {k: _whole(params[k] - 0.1 * grads[k]) for k in params}
    before = float(_whole(jax.jit(loss_fn)(params, batch)))
    after = float(_whole(jax.jit(loss_fn)(expected, batch)))
    pipe = jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=[jax.devices()[0], jax.devices()[2]],  # (One per process.)
      num_microbatches=2,
      optimizer=optax.sgd(0.1),
    )
    state = pipe.init(params)
    state, metrics = pipe.step(state, batch)
    got = pipe.gather_params(state)
    evaluated = pipe.evaluate(state, batch)
    if set_mesh:
      assert jax.sharding.get_mesh() is mesh  # (The caller's, back.)
  np.testing.assert_allclose(float(metrics["loss"]), before, rtol=1e-5)
  for k in expected:
    np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(evaluated["loss"]), after, rtol=1e-5)
  print(f"{kind.name if set_mesh else 'unset'}: equal", flush=True)


if __name__ == "__main__":
  if jax.process_index() == 0:
    _late_shares()
  for kind in (AxisType.Auto, AxisType.Explicit):
    run(kind)
  run(AxisType.Auto, set_mesh=False)
