"""The pipeline's work kept out of a mesh its caller has set.

Code written for SPMD sets a mesh for everything it runs (``jax.set_mesh
(mesh)``, as a context or globally). Under it every ``jax.jit`` call is
checked against the mesh's devices, so the pipeline's programs, each
placed on its own stage's devices, fail ("Received incompatible devices
for jitted computation"), and a model's ``nn.with_logical_constraint``
traces to constraints over the whole mesh. The pipeline places stages
itself: ``outside_user_mesh`` runs a class's public methods with no mesh
set (the caller's is back on return), which also makes the model's
logical constraints the no-ops they are without a mesh. The model's code
is traced with the caller's axes, each of size 1 (``partition.
calling_from``), so annotations naming them (``P("data")`` constraints,
``out_sharding=``, ``reshard``) trace and hold on one device. Arrays
typed on an ``Explicit`` mesh (their type carries their sharding) come in
as plain arrays, each whole on one of their devices (leaves taken in turn,
so a sharded model's parameters spread over its devices, not all on one),
their specs recorded for the trace (``partition/_caller_axes.py``).
"""

import functools
import inspect

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe.partition import calling_from


def _mesh_set() -> bool:
  return not (
    jax.sharding.get_abstract_mesh().empty and jax.sharding.get_mesh().empty
  )


def without_mesh(fn):
  """``fn`` run with no mesh set (as it is where none is)."""

  @functools.wraps(fn)
  def run(*args, **kwargs):
    if not _mesh_set():  # (The common case: nothing to swap.)
      return fn(*args, **kwargs)
    caller = jax.sharding.get_abstract_mesh()
    (args, kwargs), specs = _plain((args, kwargs))
    collapsed = one_device_mesh(caller, jax.local_devices()[0])
    with jax.set_mesh(None), calling_from(collapsed, specs):
      return fn(*args, **kwargs)

  return run


def _explicit(x) -> bool:
  return isinstance(x, jax.Array) and (
    AxisType.Explicit in jax.typeof(x).sharding.mesh.axis_types
  )


def one_device_mesh(mesh, device) -> jax.sharding.Mesh:
  """``mesh``'s axes (names, types), each of size 1, on ``device``."""
  return jax.sharding.Mesh(
    np.array([device]).reshape((1,) * len(mesh.axis_names)),
    mesh.axis_names,
    axis_types=mesh.axis_types,
  )


def _plain(tree):
  """``tree`` with its arrays typed on an ``Explicit`` mesh made plain
  arrays, each whole on one device (the k-th such leaf on the k-th of its
  addressable devices, in turn), and their specs: ``{id(plain): (plain,
  spec)}``. ``tree`` itself where it has none."""
  leaves, treedef = jax.tree.flatten(tree)
  if not any(_explicit(x) for x in leaves):
    return tree, {}
  specs = {}
  for i, x in enumerate(leaves):
    if _explicit(x):
      devices = sorted(x.sharding.addressable_devices, key=lambda d: d.id)
      one = one_device_mesh(x.sharding.mesh, devices[len(specs) % len(devices)])
      # (On a one-device mesh its one shard is the whole, typed plain.)
      whole = jax.device_put(x, NamedSharding(one, P()))
      leaves[i] = whole.addressable_shards[0].data
      specs[id(leaves[i])] = (leaves[i], jax.typeof(x).sharding.spec)
  return jax.tree.unflatten(treedef, leaves), specs


def outside_user_mesh(cls):
  """Class decorator: ``__init__`` and every public method of ``cls``
  (its bases' too) run ``without_mesh``; properties are left as they
  are (they compute nothing on devices)."""
  for name in ["__init__", *dir(cls)]:
    if name.startswith("_") and name != "__init__":
      continue
    attr = inspect.getattr_static(cls, name)
    if inspect.isfunction(attr):
      setattr(cls, name, without_mesh(attr))
  return cls
