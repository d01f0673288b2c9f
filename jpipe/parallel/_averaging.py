"""Averaging a stage's replicas over their devices with a JAX collective.

The members of a group hold the same pytree of arrays, each on its own
device. ``GroupMean`` views them as one array sharded over a mesh of the
group's devices (no copy) and runs ``pmean`` over it in one jitted
program: on GPUs an NCCL all-reduce, on CPU devices XLA's own; the values
never pass through the host. Meshes and programs are cached per group.

``Rendezvous`` lets the threads of a group's pipelines meet: each
deposits its arrays; the last to arrive runs the mean for all; a member
that has left (its pipeline drains) is not waited for.
"""

import threading

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_AXIS = "replicas"


class GroupMean:
  """``mean(trees)``: each member's copy of the mean over the group.

  ``compile(devices, avals)`` compiles a group's program ahead of its
  first use (a new group otherwise compiles when it first forms, as NCCL
  builds a communicator for a new group).
  """

  def __init__(self):
    self._meshes = {}
    self._compiled = {}
    self._lock = threading.Lock()

  def _sharding(self, devices):
    if devices not in self._meshes:
      mesh = jax.make_mesh(
        (len(devices),),
        (_AXIS,),
        devices=list(devices),
        axis_types=(jax.sharding.AxisType.Explicit,),
      )

      def mean(leaves):
        return [jax.lax.pmean(x, _AXIS) for x in leaves]

      program = jax.jit(
        jax.shard_map(mean, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS))
      )
      self._meshes[devices] = (NamedSharding(mesh, P(_AXIS)), program)
    return self._meshes[devices]

  def _program(self, devices, avals):
    """The compiled mean of one member's leaves ``avals`` (shapes and
    dtypes) over ``devices``, and the sharding of its stacked inputs."""
    key = (devices, tuple((tuple(a.shape), str(a.dtype)) for a in avals))
    with self._lock:
      if key not in self._compiled:
        sharding, program = self._sharding(devices)
        stacked = [
          jax.ShapeDtypeStruct(
            _stacked_shape(a.shape, len(devices)), a.dtype, sharding=sharding
          )
          for a in avals
        ]
        self._compiled[key] = (sharding, program.lower(stacked).compile())
      return self._compiled[key]

  def compile(self, devices, tree) -> None:
    """Compiles the mean of pytrees shaped like ``tree`` over ``devices``."""
    self._program(tuple(devices), jax.tree.leaves(tree))

  def __call__(self, trees):
    """``trees``: one pytree per member, each on its member's device
    (distinct devices). Returns the members' pytrees of the mean, each on
    its member's device."""
    if len(trees) == 1:
      return list(trees)
    devices = tuple(device_of(t) for t in trees)
    if len(set(devices)) != len(devices):
      raise ValueError(f"group members share a device: {devices}")
    leaves = [jax.tree.leaves(t) for t in trees]
    treedef = jax.tree.structure(trees[0])
    sharding, run = self._program(devices, leaves[0])
    stacked = []
    for j, x in enumerate(leaves[0]):
      # Scalars become (1,) so the member axis can shard them.
      parts = [
        ls[j].reshape((1,)) if ls[j].ndim == 0 else ls[j] for ls in leaves
      ]
      shape = _stacked_shape(x.shape, len(trees))
      stacked.append(
        jax.make_array_from_single_device_arrays(shape, sharding, parts)
      )
    out = run(stacked)
    means = []
    for device in devices:
      member = []
      for x, o in zip(leaves[0], out, strict=True):
        shard = next(s.data for s in o.addressable_shards if s.device == device)
        member.append(shard.reshape(()) if x.ndim == 0 else shard)
      means.append(jax.tree.unflatten(treedef, member))
    return means


def _stacked_shape(shape, members):
  """The members' arrays of ``shape`` side by side on axis 0."""
  if not shape:
    return (members,)
  return (members * shape[0],) + tuple(shape[1:])


def device_of(tree):
  """The one device a replica's arrays sit on."""
  devices = {d for x in jax.tree.leaves(tree) for d in x.devices()}
  if len(devices) != 1:
    raise ValueError(
      f"a replica's arrays must sit on one device to be averaged, found {devices}"
    )
  return devices.pop()


class Rendezvous:
  """Where the threads of a group meet to average.

  ``meet(key, members, rank, tree, combine)``: ``key`` names the meeting
  (the same for every member), ``members`` the ranks expected. Blocks
  until every member still present has deposited; the last runs
  ``combine(list of trees, in rank order)`` and everyone gets its own
  result. ``leave(rank)`` stops meetings from waiting for ``rank``.
  """

  def __init__(self):
    self._cond = threading.Condition()
    self._meetings = {}
    self._left = set()

  def meet(self, key, members, rank, tree, combine):
    with self._cond:
      meeting = self._meetings.setdefault(key, {"trees": {}, "out": None})
      meeting["trees"][rank] = tree
      self._maybe_close(key, members, combine)
      while meeting["out"] is None:
        self._cond.wait()
        self._maybe_close(key, members, combine)
      out = meeting["out"]
      mine = out.pop(rank)
      if not out:
        del self._meetings[key]
      return mine

  def _maybe_close(self, key, members, combine):
    meeting = self._meetings[key]
    if meeting["out"] is not None:
      return
    present = meeting["trees"]
    if all(r in present or r in self._left for r in members):
      ranks = sorted(present)
      results = combine([present[r] for r in ranks])
      meeting["out"] = dict(zip(ranks, results, strict=True))
      self._cond.notify_all()

  def leave(self, rank):
    with self._cond:
      self._left.add(rank)
      self._cond.notify_all()

  def rejoin_all(self):
    with self._cond:
      self._left = set()
