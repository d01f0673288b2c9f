"""Where a stage lives: one device, or several as a data-parallel replica
group (PipeDream's replicated stages, hybrid parallelism).

A replicated stage runs each of its programs once, SPMD over its devices
(a 1-D ``jax.sharding.Mesh``): its params and optimizer state are
replicated on every device, and the values that carry the microbatch
(batch leaves, activations and their cotangents: leading axis = the
microbatch size) are split along that axis, a slice per device. XLA then
sums the param gradients over the group (an all-reduce inside the
backward), so every replica takes the same step. The math is the
unreplicated stage's -- same microbatches, same delays, same weight
versions -- at 1/k of the compute per device.

With ``round_robin`` (PipeDream's 1F1B-RR) the group deals whole
microbatches instead: microbatch b runs, forward and backward, on replica
``b mod k`` alone, at that device's copy of the replicated params
(``on_replica``); each replica accumulates its own gradient and a step
sums the replicas' (``sum_replicas``: an all-reduce over the group) and
updates the replicated params. The stream's delays then follow
PipeDream's per-replica warm-ups (``jpipe.schedule.Stream``'s
``replicas``).

With ``rows`` (DynPipe's DP-stage load balancing) the group splits each
microbatch unevenly: replica j takes ``rows[j]`` of its examples (a slow
device fewer), each replica runs its slice as its own program at its own
copy of the params (``on_device``), and a step sums the replicas'
gradients like round robin. The values between stages live whole on the
group's first device (``device``), which slices them out to the replicas
and gathers their results (``jpipe.runtime.build.weighted``).

A split or round-robin group may span processes (``jpipe.runtime.build.
transport``): its shardings are then global, each process placing only
its own devices' shards (``put_global``) and reading a replicated value
through its own copy (``local_copy``).
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import (
  Mesh,
  NamedSharding,
  PartitionSpec,
  SingleDeviceSharding,
)

from jpipe.runtime.build.user_mesh import own_mesh


def spans_processes(sharding) -> bool:
  """Whether ``sharding`` names devices of other processes than this one
  (a replica group across processes: its arrays are global, each process
  holds its devices' shards)."""
  return not sharding.is_fully_addressable


def put_global(x, sharding):
  """``x`` (whole in this process: a host or local array) as a global
  array over ``sharding``, which spans processes: each of this process's
  devices takes its slice of ``x``. Every process of the sharding passes
  the same value; no process waits for another."""
  shape = np.shape(x)
  shards = [
    jax.device_put(x[index], device)
    for device, index in sharding.addressable_devices_indices_map(shape).items()
  ]
  return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def local_copy(x):
  """A replicated array's copy on one of this process's devices (``x``
  itself where every device is this process's): what a process can read
  of a global array whole."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x.addressable_shards[0].data
  return x


def _in_place(x, sharding) -> bool:
  """Whether ``x`` is an array committed where ``sharding`` puts it."""
  return isinstance(x, jax.Array) and x.committed and x.sharding == sharding


def put(x, where):
  """``x`` placed on ``where`` (a sharding or a device): ``x`` itself
  where it is there already, else ``jax.device_put``'s copy.
  ``device_put`` of an array already in place returns it too, but only
  after ~80 µs of the host's time (JAX 0.10, a CPU); the check costs
  ~1.5 µs."""
  if isinstance(where, jax.Device):
    where = SingleDeviceSharding(where)
  if _in_place(x, where):
    return x
  if spans_processes(where):
    return put_global(x, where)
  return jax.device_put(x, where)


def put_tree(tree, sharding):
  """``put`` of every leaf of ``tree``; the leaves not in place go in one
  ``device_put`` (batched, as placing a whole state at once was)."""
  leaves, treedef = jax.tree.flatten(tree)
  away = [i for i, x in enumerate(leaves) if not _in_place(x, sharding)]
  if away and spans_processes(sharding):
    for i in away:
      leaves[i] = put_global(leaves[i], sharding)
  elif away:
    placed = jax.device_put([leaves[i] for i in away], sharding)
    for i, x in zip(away, placed, strict=True):
      leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


class StagePlacement:
  """The devices of one stage and how its arrays are laid out on them.

  Args:
    devices: the stage's devices (several: a replica group).
    microbatch_size: examples per microbatch; values whose leading axis
      has this size are split over a group's devices.
    round_robin: a group deals whole microbatches to its replicas
      (1F1B-RR) instead of splitting each.
    rows: a group splits each microbatch unevenly, ``rows[j]`` examples
      to replica j (non-negative, summing to ``microbatch_size``; a
      weighted split, ``set_rows`` changes it); None: evenly, SPMD.

  Two placements are equal when they name the same devices.
  """

  def __init__(
    self,
    devices: Sequence[Any],
    microbatch_size: int,
    round_robin: bool = False,
    rows: Sequence[int] | None = None,
  ):
    self.devices = tuple(devices)
    self.microbatch_size = microbatch_size
    self.round_robin = round_robin and len(self.devices) > 1
    self.weighted = rows is not None and len(self.devices) > 1
    if round_robin and self.weighted:
      raise ValueError("a replica group is round robin or weighted, not both")
    self.rows = None
    if len(self.devices) == 1:
      self.replicated = self.split = SingleDeviceSharding(self.devices[0])
    elif self.round_robin or self.weighted:
      mesh = own_mesh(Mesh(np.array(self.devices), ("replica",)))
      self.replicated = NamedSharding(mesh, PartitionSpec())
      # Round robin: nothing is split, a replica takes it whole. Weighted:
      # a microbatch's values wait whole on the first device.
      self.split = (
        SingleDeviceSharding(self.devices[0]) if self.weighted else None
      )
      if self.weighted:
        self.set_rows(rows)
      self._rows = NamedSharding(mesh, PartitionSpec("replica"))
      self.replicas = tuple(
        StagePlacement([d], microbatch_size) for d in self.devices
      )
      self._sum_rows = jax.jit(
        _sum_rows, static_argnums=1, out_shardings=self.replicated
      )
    else:
      if microbatch_size % len(self.devices):
        raise ValueError(
          f"a stage replicated on {len(self.devices)} devices splits every "
          f"microbatch among them, but a microbatch has {microbatch_size} "
          f"examples: use a microbatch size divisible by "
          f"{len(self.devices)} (batch size / num_microbatches)"
        )
      mesh = own_mesh(Mesh(np.array(self.devices), ("replica",)))
      self.replicated = NamedSharding(mesh, PartitionSpec())
      self.split = NamedSharding(mesh, PartitionSpec("replica"))
      # [microbatch, example, ...]: every replica its examples of each.
      self._stacked = NamedSharding(mesh, PartitionSpec(None, "replica"))
      self._unstack = jax.jit(
        _unstack, static_argnums=1, out_shardings=self.split
      )

  @property
  def device(self):
    """The first (or only) device."""
    return self.devices[0]

  def set_rows(self, rows: Sequence[int]) -> None:
    """A weighted group's examples per replica from now on (a microbatch
    in flight keeps the split its forward ran with)."""
    rows = tuple(int(r) for r in rows)
    n, k = self.microbatch_size, len(self.devices)
    if len(rows) != k or min(rows) < 0 or sum(rows) != n:
      raise ValueError(
        f"replica rows {rows} do not split a microbatch of {n} examples "
        f"over {k} replicas: give {k} non-negative counts summing to {n}"
      )
    self.rows = rows

  def on_device(self, tree, j: int):
    """``tree`` (replicated over the group) as replica j's own copy: no
    copy, each leaf's shard on that device."""
    device = self.devices[j]
    return jax.tree.map(lambda x: _shard_on(x, device), tree)

  def __eq__(self, other):
    return isinstance(other, StagePlacement) and self.devices == other.devices

  def __hash__(self):
    return hash(self.devices)

  def value_sharding(self, x) -> jax.sharding.Sharding:
    """A microbatch-carrying value's sharding: split along axis 0 when
    that axis is the microbatch, else replicated."""
    if self.weighted:  # Whole on the first device, sliced at each run.
      return self.split
    if self.round_robin:  # A lowering bug, not a user error.
      raise RuntimeError(
        "a round-robin group places a microbatch's values on its replica "
        "(StagePlacement.replica(b)), not over the group"
      )
    shape = np.shape(x)
    if shape and shape[0] == self.microbatch_size:
      return self.split
    return self.replicated

  def put_values(self, values):
    """Places a pytree of microbatch-carrying values (activations,
    cotangents, batch leaves)."""
    return jax.tree.map(lambda x: put(x, self.value_sharding(x)), values)

  def put_replicated(self, tree):
    """Places a pytree whole on every device (params, optimizer state)."""
    return put_tree(tree, self.replicated)

  def replica_index(self, b: int) -> int:
    """Which replica runs microbatch b: ``b mod k`` in a round-robin
    group, else 0 (the group runs it together)."""
    return b % len(self.devices) if self.round_robin else 0

  def replica(self, b: int) -> "StagePlacement":
    """The one-device placement of the replica that runs microbatch b
    (round robin)."""
    return self.replicas[self.replica_index(b)]

  def on_replica(self, tree, b: int):
    """The arrays of ``tree`` (replicated over the group, or already on
    the replica's device) as replica ``b mod k``'s own copies: no copy,
    each leaf's shard on that device."""
    return self.on_device(tree, self.replica_index(b))

  def sum_replicas(self, trees, like=None):
    """The sum of the replicas' pytrees (``trees[j]`` on replica j's
    device, or None where replica j holds nothing: zeros), replicated
    over the group: one all-reduce program. Across processes each
    process passes its replicas' (``like``: their shapes and dtypes,
    for a process none of whose replicas holds anything)."""
    # (Across processes each process adds its own replicas' trees: the
    # others are not here, and the program sums over all.)
    here = jax.process_index()
    mine = [
      (device, t)
      for device, t in zip(self.devices, trees, strict=True)
      if device.process_index == here
    ]
    present = next((t for _, t in mine if t is not None), like)
    if present is None:
      raise ValueError(
        "a round-robin group's step found no gradient on this process's "
        "replicas (none of them ran a microbatch since its last step): "
        "use at least as many microbatches per step as replicas"
      )
    leaves, treedef = jax.tree.flatten(present)
    per_replica = []
    for device, t in mine:
      if t is None:
        t = [jnp.zeros(x.shape, x.dtype, device=device) for x in leaves]
      per_replica.append(jax.tree.leaves(t))
    rows, shapes = [], []
    for i, x in enumerate(leaves):
      shape = tuple(x.shape)
      shards = [
        parts[i] if parts[i].ndim else parts[i].reshape(1)
        for parts in per_replica
      ]
      rows.append(
        jax.make_array_from_single_device_arrays(
          (len(self.devices) * shards[0].shape[0], *shards[0].shape[1:]),
          self._rows,
          shards,
        )
      )
      shapes.append(shape)
    return jax.tree.unflatten(treedef, self._sum_rows(rows, tuple(shapes)))

  def split_microbatches(self, leaves, m: int) -> tuple:
    """A replica group's m microbatches of the batch ``leaves`` (leading
    axis: the batch), each split over the group: one transfer per leaf,
    in which every device receives only its own examples.

    Returns m tuples of arrays, one per leaf.
    """
    stacked = [x.reshape(m, -1, *x.shape[1:]) for x in leaves]
    return self._unstack(tuple(put_tree(stacked, self._stacked)), m)


def even_rows(n: int, k: int) -> tuple[int, ...]:
  """n examples over k replicas as evenly as they go (the first replicas
  one more)."""
  return tuple(n // k + (j < n % k) for j in range(k))


def rows_for_speeds(n: int, speeds) -> tuple[int, ...]:
  """DynPipe's split of a microbatch of n examples over replicas of
  relative ``speeds`` (examples per second, or any proportional
  measure): replica j gets ``round(speeds[j] / sum * n)``, the remainder
  (or excess) spread one by one over the first replicas (DynPipe's
  ``communication_tyf_1.py``). DynPipe takes its profiles' slow-down
  ratios there, which would give a slow replica more examples (the spec
  calls it probably inverted); jpipe takes speeds, so a slow one gets
  fewer."""
  speeds = [float(v) for v in speeds]
  if not speeds or min(speeds) < 0 or sum(speeds) <= 0:
    raise ValueError(f"replica speeds must be >= 0, not all 0: {speeds}")
  total = sum(speeds)
  rows = [round(v / total * n) for v in speeds]
  j, step = 0, 1 if sum(rows) < n else -1
  while sum(rows) != n:
    if step > 0 or rows[j % len(rows)] > 0:
      rows[j % len(rows)] += step
    j += 1
  return tuple(rows)


def _shard_on(x, device):
  """``x``'s shard on ``device`` (``x`` itself if it lives there)."""
  for shard in x.addressable_shards:
    if shard.device == device:
      return shard.data
  raise ValueError(f"an array on {x.devices()} has no copy on {device}")


def _sum_rows(rows, shapes):
  """Each [k * n, ...] row block summed over its k replicas, as
  ``shapes``."""
  return [
    x.reshape(-1, *(shape or (1,))).sum(0).reshape(shape)
    for x, shape in zip(rows, shapes, strict=True)
  ]


def _unstack(stacked, m):
  """[m, ...] leaves -> m tuples of their rows."""
  return tuple(tuple(x[k] for x in stacked) for k in range(m))


def device_name(group) -> str:
  """'device 2', 'devices 0-3' (consecutive) or 'devices 0,2'."""
  if len(group) == 1:
    return f"device {group[0]}"
  if list(group) == list(range(group[0], group[0] + len(group))):
    return f"devices {group[0]}-{group[-1]}"
  return "devices " + ",".join(map(str, group))


def check_device_groups(stage_devices) -> None:
  """Stages share all their devices (mixed pipe) or none: replica groups
  of different stages cannot overlap."""
  for a in stage_devices:
    if len(set(a)) != len(a):
      raise ValueError(f"a stage lists a device twice: {tuple(a)}")
    for b in stage_devices:
      if tuple(a) != tuple(b) and set(a) & set(b):
        raise ValueError(
          f"stages on devices {tuple(a)} and {tuple(b)} overlap: stages "
          "must share all their devices, listed in the same order (several "
          "stages on one device or group), or none"
        )
