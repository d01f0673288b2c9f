"""Averaging a stage's replicas over their devices with a JAX collective.

The members of a group hold the same pytree of arrays, each on its own
device. ``GroupMean`` views them as one array sharded over a mesh of the
group's devices (no copy) and runs ``pmean`` over it in one jitted
program: on GPUs an NCCL all-reduce, on CPU devices XLA's own; the values
never pass through the host. Meshes and programs are cached per group.

``Roster`` and ``Rendezvous`` let a group's pipelines meet: the roster
(one for all processes) says who comes, a member that has left (its
pipeline drains) is not waited for; each process's members deposit their
arrays and the last to arrive runs the mean for them (across processes,
the members in other processes run the same program at the same time).
"""

import hashlib
import threading

import jax
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jpipe.runtime.build.user_mesh import own_mesh

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
      mesh = own_mesh(
        jax.make_mesh(
          (len(devices),),
          (_AXIS,),
          devices=list(devices),
          axis_types=(jax.sharding.AxisType.Explicit,),
        )
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

  def __call__(self, trees, devices=None):
    """The group's mean.

    Args:
      trees: one pytree per member this process holds, in rank order,
        each on its member's device (distinct devices).
      devices: every member's device, in rank order (default: the trees'
        devices: every member is here). Across processes each process
        passes its own members and the program runs over all of them.

    Returns:
      This process's members' pytrees of the mean, each on its device.
    """
    if not jax.tree.leaves(trees):  # (A stage whose params are all frozen.)
      return list(trees)
    mine = tuple(device_of(t) for t in trees)
    devices = mine if devices is None else tuple(devices)
    if len(devices) == 1:
      return list(trees)
    if len(set(devices)) != len(devices):
      raise ValueError(f"group members share a device: {devices}")
    if not set(mine) <= set(devices):
      raise ValueError(f"members on {mine} are not in the group {devices}")
    leaves = [jax.tree.leaves(t) for t in trees]
    treedef = jax.tree.structure(trees[0])
    sharding, run = self._program(devices, leaves[0])
    stacked = []
    for j, x in enumerate(leaves[0]):
      # Scalars become (1,) so the member axis can shard them.
      parts = [
        ls[j].reshape((1,)) if ls[j].ndim == 0 else ls[j] for ls in leaves
      ]
      shape = _stacked_shape(x.shape, len(devices))
      stacked.append(
        jax.make_array_from_single_device_arrays(shape, sharding, parts)
      )
    out = run(stacked)
    means = []
    for device in mine:
      member = []
      for x, o in zip(leaves[0], out, strict=True):
        shard = next(s.data for s in o.addressable_shards if s.device == device)
        member.append(shard.reshape(()) if x.ndim == 0 else shard)
      means.append(jax.tree.unflatten(treedef, member))
    return means


class PeerMean:
  """A group's mean by point-to-point pulls, for groups across processes
  while transfers between processes are in flight (pipelines spanning
  processes).

  On CPU a cross-process collective holds its process's whole client
  until every peer has joined: measured, work dispatched to another of
  its devices waited 3.06 s behind a collective whose peer came 3 s
  late. A pipeline spanning processes needs its peer's compute to reach
  the collective, so such a collective can wait for itself (and gloo
  gives up after 30 s). Here nothing waits inside a program: each
  process offers its members' trees to the others (``PullLinks``), pulls
  theirs, and computes each member's mean on the member's device,
  summing in rank order, so every member gets the same bits.

  Args:
    links: this run's ``jpipe.runtime.PullLinks`` (one per process).
  """

  def __init__(self, links):
    self.links = links
    self._mean = jax.jit(
      lambda trees: jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)
    )

  def __call__(self, key, trees, ranks, came, devices):
    """This process's members' copies of the group's mean.

    Args:
      key: the meeting's name, the same in every process (hashable by
        ``repr``): with a member and a receiver, each transfer's key.
      trees: this process's members' pytrees, in rank order.
      ranks: their ranks.
      came: every member's rank, sorted.
      devices: ``{rank: device}`` of every member.
    """
    if not jax.tree.leaves(trees):  # (Nothing to average: every process.)
      return list(trees)
    me = jax.process_index()
    others = sorted({devices[r].process_index for r in came} - {me})
    for r, tree in zip(ranks, trees, strict=True):
      for q in others:
        self.links.offer(_uuid(key, r, q), jax.tree.leaves(tree))
    got = dict(zip(ranks, trees, strict=True))
    treedef = jax.tree.structure(trees[0])
    target = SingleDeviceSharding(devices[ranks[0]])
    specs = [
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)
      for x in jax.tree.leaves(trees[0])
    ]
    for r in came:
      if r not in got:
        leaves = self.links.take(
          _uuid(key, r, me), devices[r].process_index, specs
        )
        got[r] = jax.tree.unflatten(treedef, leaves)
    # The host waits for the pulled values: on CPU a program waiting for
    # them would hold up every device of this process -- and with it,
    # maybe, the work the peer's offer waits for.
    jax.block_until_ready([got[r] for r in came if r not in ranks])
    return [
      self._mean(jax.device_put([got[c] for c in came], devices[r]))
      for r in ranks
    ]


def _uuid(key, member: int, receiver: int) -> int:
  """A transfer's key from its meeting, member and receiving process: the
  same in every process (a hash; 62 bits)."""
  digest = hashlib.blake2b(
    repr((key, member, receiver)).encode(), digest_size=8
  )
  return int.from_bytes(digest.digest(), "big") >> 2


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


class Roster:
  """Who comes to each averaging meeting, for every process.

  ``gather(key, stage, members, rank)``: stage ``stage`` of ``rank`` is
  at meeting ``key`` (the same key for every member) of ``members``;
  blocks until every member is present or has left, and returns the
  ranks present (sorted), the same answer for each. ``leave(rank,
  stages)``: meetings of those stages stop waiting for ``rank`` (its
  pipeline drains there: by stage, since a pipeline spanning processes
  drains each process's stages when that process stops feeding it);
  ``rejoin_all`` undoes every leave (a new epoch). Thread-safe; across
  processes process 0 serves it (``_hub.py``).
  """

  def __init__(self):
    self._cond = threading.Condition()
    self._meetings = {}  # key -> {"present": set, "out": tuple, "told": set}
    self._left = set()  # (rank, stage)

  def gather(self, key, stage, members, rank) -> tuple[int, ...]:
    with self._cond:
      meeting = self._meetings.setdefault(
        key, {"present": set(), "out": None, "told": set()}
      )
      meeting["present"].add(rank)
      self._cond.notify_all()
      while meeting["out"] is None:
        if all(
          r in meeting["present"] or (r, stage) in self._left for r in members
        ):
          meeting["out"] = tuple(sorted(meeting["present"]))
        else:
          self._cond.wait()
      meeting["told"].add(rank)
      if meeting["told"] == set(meeting["out"]):
        del self._meetings[key]
      return meeting["out"]

  def leave(self, rank, stages) -> None:
    with self._cond:
      self._left.update((rank, s) for s in stages)
      self._cond.notify_all()

  def rejoin_all(self) -> None:
    with self._cond:
      self._left = set()


class Rendezvous:
  """Where the threads of a group's pipelines meet to average.

  ``meet(key, stage, members, rank, tree, combine, local)``: ``key``
  names the meeting (the same for every member), ``members`` the ranks
  expected, ``local`` the ranks whose ``stage`` this process runs. The
  ``Roster`` (shared by every process) says who comes: every member
  still present. This process's members among them meet here; the last
  to arrive runs ``combine(their trees in rank order, every rank that
  came)``, which returns their results in the same order, and each gets
  its own.
  """

  def __init__(self, roster: Roster | None = None):
    self.roster = Roster() if roster is None else roster
    self._cond = threading.Condition()
    self._meetings = {}

  def meet(self, key, stage, members, rank, tree, combine, local):
    came = tuple(self.roster.gather(key, stage, tuple(members), rank))
    here = [r for r in came if r in local]
    with self._cond:
      meeting = self._meetings.setdefault(key, {"trees": {}, "out": None})
      meeting["trees"][rank] = tree
      last = len(meeting["trees"]) == len(here)
    if last:
      # Outside the lock: across processes ``combine`` is a collective
      # that other processes' members may reach only later.
      try:
        results = combine([meeting["trees"][r] for r in here], came)
      except BaseException as e:  # The members waiting fail too, not hang.
        with self._cond:
          meeting["failed"] = e
          self._cond.notify_all()
        raise
      with self._cond:
        meeting["out"] = dict(zip(here, results, strict=True))
        self._cond.notify_all()
    with self._cond:
      while meeting["out"] is None and "failed" not in meeting:
        self._cond.wait()
      if "failed" in meeting:
        raise RuntimeError(
          f"the average of stage {stage} with pipelines {list(here)} "
          f"failed in another pipeline's thread: {meeting['failed']!r}"
        ) from meeting["failed"]
      out = meeting["out"]
      mine = out.pop(rank)
      if not out:
        del self._meetings[key]
      return mine

  def leave(self, rank, stages):
    self.roster.leave(rank, stages)

  def rejoin_all(self):
    self.roster.rejoin_all()
