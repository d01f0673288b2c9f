"""Moving values between stages, in one process or across processes.

In one process a move is a ``jax.device_put`` onto the destination
stage's devices. Across processes (``jax.distributed``) every process
walks the same global action order (``jpipe.schedule.issue_order``) and
makes the moves of every action in it -- sending what its own stages
produced, receiving what they read -- so the two ends of every transfer
agree on it without negotiation (spec/multiprocess.md). Processes that
own neither end do nothing. Two ways to carry a value:

- "pull" (default): ``jax.experimental.transfer``. The sender registers
  the array (``await_pull``, returns at once); the receiver's ``pull``
  returns at once an array that becomes ready when the bytes have arrived
  (TCP, host memory). Nothing blocks either side's device: a stage keeps
  computing while its values travel. Transfers are keyed by a counter per
  (sender, receiver) process pair, equal on both sides by the global order.
- "collective": a ``ppermute`` inside ``shard_map`` over a two-device mesh
  (gloo on CPU, NCCL on GPU). Both devices must reach it: each transfer
  ties the two stages' streams together, so a busy receiver stalls the
  sender (measured on CPU: 1.2x instead of 1.9x for streaming async over
  2 processes, experiments/distributed/throughput.py). NCCL's bandwidth
  may still win for large activations on GPUs.

A replica group may span processes. Split routing: the group's programs
run SPMD over all its devices, each of its processes dispatching every
one of them (XLA sums the gradient over the replicas across processes);
its values are global arrays. A value leaving such a group is gathered
whole in each of its processes (one all-gather program, all of them at
the same place in the order: so no early sends), and the group's lead
(the process of its first device) sends it to each process of the
destination that lacks it; each process there places its rows (a
replicated value -- a model-state leaf, a tied leaf or its gradient --
is whole in each process already: no gather). Round
robin (1F1B-RR): microbatch b runs on replica b mod k in that replica's
process alone (``jpipe.schedule.lower``'s ``replica_process``), so its
values move as a one-device stage's; the group's steps, an all-reduce
over every process's own replicas, run in all of its processes.
"""

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import (
  NamedSharding,
  PartitionSpec,
  SingleDeviceSharding,
)

from jpipe import distributed
from jpipe.runtime.build.collective_pairs import CollectivePairs
from jpipe.runtime.build.key_arrays import key_data, wrap_key_data
from jpipe.runtime.build.placement import StagePlacement, local_copy

TRANSPORTS = ("pull", "collective")


class Transport:
  """Moves values between the stages of one pipeline.

  Args:
    placement: each stage's ``StagePlacement`` (devices of any process).
    kind: across processes, "pull" or "collective" (module docstring).

  A stage belongs to the processes of its devices. A replica group may
  span processes (split or round-robin routing; module docstring).
  """

  def __init__(self, placement: Sequence[StagePlacement], kind: str = "pull"):
    if kind not in TRANSPORTS:
      raise ValueError(f"unknown transport {kind!r}: one of {TRANSPORTS}")
    self.kind = kind
    self.placement = tuple(placement)
    self.process = jax.process_index()
    # Per stage: its processes, and its lead (its first device's): the
    # one that sends the stage's values to other processes.
    self.stage_processes = tuple(
      tuple(sorted({d.process_index for d in place.devices}))
      for place in self.placement
    )
    self.stage_process = tuple(p.device.process_index for p in self.placement)
    self.spanning = tuple(
      s for s, ps in enumerate(self.stage_processes) if len(ps) > 1
    )
    _check_spanning(self.placement, self.stage_processes)
    # Per stage: for a round-robin group across processes, the process
    # of each replica (microbatch b runs in that of replica b mod k).
    self.replica_processes = tuple(
      tuple(d.process_index for d in p.devices)
      if s in self.spanning and p.round_robin
      else None
      for s, p in enumerate(self.placement)
    )
    # The processes this pipeline runs in (a data-parallel run's other
    # pipelines may run in others: they take no part in its transfers).
    self.processes = tuple(
      sorted({q for ps in self.stage_processes for q in ps})
    )
    self.multiprocess = len(self.processes) > 1
    self._collective = CollectivePairs()
    self._gathers = _Gathers()
    self._pulls = PullLinks() if self.multiprocess and kind == "pull" else None
    # Whether a received value is waited for, on the host, before the
    # program that reads it is dispatched (``wait_for_arrivals``).
    self.waits_for_arrivals = False
    self.calls = 0  # Calls begun: with a move's seq, its key.

  @property
  def sends_early(self) -> bool:
    """Whether a value may be sent as soon as it exists: the ends of a
    transfer then meet by the call and the transfer's ``seq``
    (``jpipe.schedule.lower``) instead of by order -- "pull" does; a
    collective's two ends must run in the same order."""
    # (Not where a group spans processes: its processes must gather a
    # value off the group at the same place in the order.)
    return self._pulls is not None and not self.spanning

  def begin_call(self) -> None:
    """Every process, at the start of each driver call."""
    self.calls += 1

  def connect(self) -> None:
    """Opens every link this pipeline's moves use, all processes together
    (every process calls it): gloo gives up on a link whose first
    transfer waits more than ~30 s for its peer (a slow compile of a
    stage's program), later ones wait as long as needed."""
    if not self.multiprocess:
      return
    distributed.barrier("connect")
    # A stage's first device in each of its processes (where its values
    # arrive and leave); each of the pipeline's processes receives the
    # loss (``share``) on the pipeline's first device there.
    firsts = [
      _first_in(p, q)
      for p, ps in zip(self.placement, self.stage_processes, strict=True)
      for q in ps
    ]
    firsts += [self._device_of(q) for q in self.processes]
    links = sorted(
      {
        (a, b)
        for a in firsts
        for b in firsts
        if a.process_index != b.process_index
      },
      key=lambda ab: (ab[0].id, ab[1].id),
    )
    scalar = jax.ShapeDtypeStruct((), np.float32)
    for a, b in links:
      if self.process == a.process_index:
        self._pair(np.float32(0), a, b, scalar)
      elif self.process == b.process_index:
        jax.block_until_ready(self._pair(None, a, b, scalar))
    # A sender's end does not wait for its peer's pull: without this, a
    # sender could go on and drop the pipeline (``Pipeline(...).plan``),
    # its transfer server and the value offered with it, before a slower
    # peer pulled, which then waited forever (seen in CI: one process in
    # the next pipeline's address exchange, the other here).
    distributed.barrier("connected")

  def time_transfers(self) -> "TransferTimes | None":
    """From now on, stamps when each of this process's transfer ends
    happen (pull transport; None otherwise): see ``TransferTimes``."""
    if self._pulls is None:
      return None
    self._pulls.times = TransferTimes()
    return self._pulls.times

  def wait_for_arrivals(self) -> None:
    """From now on ``move`` and ``share`` return a received value only
    once it has arrived. For processes that run stages of several
    pipelines (data parallel across processes): the CPU backend runs a
    process's programs in order, so one that waits for a value from
    another process holds up every later one, and two pipelines whose
    programs were dispatched in opposite orders in two processes would
    each wait for the other's (measured: work dispatched to another
    device waited 3.08 s behind a program reading a pull that came 3 s
    late). Waiting on the host instead keeps every dispatched program
    runnable; each pipeline's own order still orders its waits."""
    self.waits_for_arrivals = True

  def owns(self, s: int) -> bool:
    """Whether this process runs stage s (or its share of it: a replica
    group across processes)."""
    return self.process in self.stage_processes[s]

  def leads(self, s: int) -> bool:
    """Whether this process is stage s's lead (its first device's): the
    one that sends and writes what the stage holds, where it spans
    processes."""
    return self.stage_process[s] == self.process

  def move(
    self,
    x,
    src: int,
    dst: int,
    aval,
    *,
    replicated: bool = False,
    seq=-1,
    place: StagePlacement | None = None,
    microbatch: int | None = None,
  ):
    """Value ``x`` (held by stage src) onto stage dst's devices.

    Every process calls it for every move, in the same order: the process
    of src passes ``x`` (others pass None), the process of dst gets the
    placed value back; every other process gets None.

    Args:
      x: the value (one array), or None where src is not this process's.
      src, dst: the stages.
      aval: ``x``'s shape and dtype (``jax.ShapeDtypeStruct`` or an
        abstract value): the receiver allocates by it.
      replicated: place whole on every device of dst (params, their
        gradients) instead of split like a microbatch (activations).
      seq: the transfer's ``Move.seq`` (-1: none; the ends then meet by
        order). With ``sends_early`` the ends meet by it.
      place: where on dst it goes, if not dst's placement (the one
        replica of a round-robin group that runs the microbatch).
      microbatch: the microbatch the value belongs to: a round-robin
        end's replica is that microbatch's (given for F and B values).
    """
    # The ends' placements and processes (a round-robin group's: the
    # microbatch's replica); a stage's own processes are known already.
    a_place, pa = self.placement[src], self.stage_processes[src]
    if microbatch is not None and a_place.round_robin:
      a_place = a_place.replica(microbatch)
      pa = (a_place.device.process_index,)
    if place is None:
      place, pb = self.placement[dst], self.stage_processes[dst]
      if microbatch is not None and place.round_robin:
        place = place.replica(microbatch)
        pb = (place.device.process_index,)
    else:
      pb = _processes(place)
    if len(pa) > 1 or len(pb) > 1:
      return self._move_groups(x, a_place, place, aval, replicated)
    put = place.put_replicated if replicated else place.put_values
    here_src, here_dst = pa[0] == self.process, pb[0] == self.process
    if pa == pb:
      return put(x) if here_dst and self.placement[src] != place else x
    if not (here_src or here_dst):
      return None
    a, b = a_place.device, place.device
    key = (self.calls, seq) if self.sends_early and seq >= 0 else None
    y = self._pair(x if here_src else None, a, b, aval, key)
    if here_src:
      return None
    if self.waits_for_arrivals:
      jax.block_until_ready(y)
    return put(y) if len(place.devices) > 1 else y

  def _move_groups(self, x, from_place, place, aval, replicated):
    """``move`` where an end's devices span processes (a split group).
    Every process of the source takes the value whole (a split value
    gathered over its group: one all-gather program, all of them
    together); the source's lead sends it to each process of the
    destination that has none; each process there places it on its
    devices, a global array where they span processes."""
    srcs, dsts = _processes(from_place), _processes(place)
    here_src, here_dst = self.process in srcs, self.process in dsts
    if not (here_src or here_dst):
      return None
    if here_src:
      if not replicated and len(srcs) > 1:
        x = self._gathers.whole(x, from_place.replicated)
      x = local_copy(x)
    lead = from_place.device.process_index
    for q in dsts:
      if q in srcs or self.process not in (lead, q):
        continue
      a, b = _first_in(from_place, lead), _first_in(place, q)
      y = self._pair(x if self.process == lead else None, a, b, aval)
      if self.process == q:
        x = y
    if not here_dst:
      return None
    if self.waits_for_arrivals:
      jax.block_until_ready(x)
    return place.put_replicated(x) if replicated else place.put_values(x)

  def share(self, x, src: int, aval):
    """Value ``x`` of stage src on every process of this pipeline (on a
    device of its own): the process of src passes ``x`` and gets it
    back, the others pass None. Every process calls it, in the same
    order; a process outside the pipeline gets None."""
    owner = self.stage_process[src]
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = local_copy(self._gathers.whole(x))
    for q in sorted(set(self.processes) - {owner}):
      if self.process not in (owner, q):
        continue
      a = self.placement[src].device
      b = self._device_of(q)
      y = self._pair(x if self.process == owner else None, a, b, aval)
      if self.process == q:
        if self.waits_for_arrivals:
          jax.block_until_ready(y)
        return y
    return x

  def all_sum(self, x):
    """The sum over processes of each one's f32 scalar ``x`` (on one of
    its devices; None where it has none to add), on every process, in
    the same order everywhere (equal everywhere). Every process calls
    it, in the same order."""
    if not self.multiprocess:
      return x
    aval = jax.ShapeDtypeStruct((), np.float32)
    first_stage = {}
    for s, q in enumerate(self.stage_process):
      first_stage.setdefault(q, s)
    here = self._device_of(self.process)
    total = None
    for q, s in sorted(first_stage.items()):
      mine = None
      if q == self.process:
        mine = np.float32(0) if x is None else x
      y = jax.device_put(self.share(mine, s, aval), here)
      total = y if total is None else total + y
    return total

  def _device_of(self, process: int):
    """Where values shared with ``process`` arrive: the first device of
    this pipeline's stages there. Not the process's first device, which
    may belong to another pipeline of a data-parallel run: a value
    arriving behind that pipeline's averaging collective would tie the
    two pipelines' progress together (and hung such runs)."""
    return next(
      d for p in self.placement for d in p.devices if d.process_index == process
    )

  def _pair(self, x, a, b, aval, key=None):
    """Sends ``x`` (on device a; None on the receiver) to device b of
    another process; returns the value on the receiver, None on the
    sender. ``key``: (call, seq) the pull transport's ends meet by
    (None: by order)."""
    if self._pulls is not None:
      return self._pulls.transfer(x, a, b, aval, key)
    return self._collective.send(x, a, b, aval)


def _check_spanning(placement, stage_processes) -> None:
  """Refuses, in one line, the replica groups across processes that do
  not run there: weighted ones, and a round-robin last stage."""
  for s, (place, ps) in enumerate(zip(placement, stage_processes, strict=True)):
    if len(ps) == 1:
      continue
    if place.weighted:
      raise ValueError(
        f"stage {s}'s replica group spans processes {list(ps)} with the "
        "'weighted' routing: across processes use 'split' or "
        "'round_robin', or give the group devices of one process"
      )
    if place.round_robin and s == len(placement) - 1:
      raise ValueError(
        f"the last stage's round-robin replica group spans processes "
        f"{list(ps)} (its replicas' losses would meet in no process): give "
        "it devices of one process, or use replica_routing='split'"
      )


class _Gathers:
  """Programs that make a value of a replica group across processes
  whole on every device of the group (an all-gather; every process of
  the group calls it), one per group."""

  def __init__(self):
    self._programs: dict[NamedSharding, Any] = {}

  def whole(self, x, replicated: NamedSharding | None = None):
    """``x`` (a global array) replicated over its group (``replicated``:
    the group's replicated sharding; None: ``x``'s mesh's)."""
    if replicated is None:
      replicated = NamedSharding(x.sharding.mesh, PartitionSpec())
    if replicated not in self._programs:
      self._programs[replicated] = jax.jit(
        lambda v: v, out_shardings=replicated
      )
    return self._programs[replicated](x)


class PullLinks:
  """This process's transfer server and its connections to the others'
  (addresses exchanged once, by all processes together: every process
  makes one at the same point). ``offer`` / ``take`` move arrays by a
  key both ends know; neither blocks, and no program waits for a peer
  (the servers' own threads carry the bytes). Thread-safe."""

  def __init__(self):
    me = jax.process_index()
    device = jax.local_devices()[0]
    host = distributed.host_address()
    self.server = transfer.start_transfer_server(
      device.client, f"{host}:0", [f"{host}:0"]
    )
    everyone = distributed.exchange(
      "transfer servers", self.server.address().encode()
    )
    self.addresses = [a.decode() for a in everyone]
    self.connections = {}
    self.count = {}  # (sender, receiver) process -> transfers so far
    self.me = me
    self._lock = threading.Lock()
    self.times: TransferTimes | None = None  # Stamps, while timing.

  def offer(self, uuid: int, arrays) -> None:
    """Holds ``arrays`` (on this process's devices) until the process
    that ``take``s ``uuid`` pulls them (once). Typed PRNG keys go as
    their key data (the transfer server moves plain arrays only)."""
    wire = [key_data(x) for x in arrays]
    self.server.await_pull(uuid, wire)
    if self.times is not None:
      self.times.offered(uuid, wire)

  def take(self, uuid: int, src: int, specs) -> list:
    """The arrays process ``src`` offers as ``uuid``, placed as ``specs``
    (``jax.ShapeDtypeStruct`` with a sharding) say: returned at once,
    ready when the bytes have arrived."""
    with self._lock:
      if src not in self.connections:
        self.connections[src] = self.server.connect(self.addresses[src])
      connection = self.connections[src]
    specs = list(specs)
    out = connection.pull(uuid, [key_data(spec) for spec in specs])
    for y in out:
      distributed.note_received(y)  # (A device collective waits for it.)
    if self.times is not None:
      self.times.pulled(uuid, out)
    return [wrap_key_data(y, spec) for y, spec in zip(out, specs, strict=True)]

  def transfer(self, x, a, b, aval, key=None):
    src, dst = a.process_index, b.process_index
    if key is None:
      n = self.count.get((src, dst), 0)
      self.count[(src, dst)] = n + 1
      # One key per transfer, the same in both processes: the pair, then
      # the count (2**40 transfers per pair; below 2**62 for < 1024
      # processes).
      uuid = ((src * 4096 + dst) << 40) + n
    else:  # A call's transfer by its seq: the same wherever it is sent.
      call, seq = key
      if max(src, dst) >= 1024 or seq >= 2**20:
        raise ValueError(
          f"transfer {seq} of a call between processes {src} and {dst}: "
          "keyed transfers support < 1024 processes and < 2**20 transfers "
          "per call and pair"
        )
      uuid = (1 << 62) | (src << 52) | (dst << 42) | (call % 2**22) << 20 | seq
    if self.me == src:
      self.offer(uuid, [jax.device_put(x, a)])
      return None
    spec = jax.ShapeDtypeStruct(
      tuple(aval.shape), aval.dtype, sharding=SingleDeviceSharding(b)
    )
    (y,) = self.take(uuid, src, [spec])
    return y


class TransferTimes:
  """When this process's ends of pull transfers happened, on
  ``time.perf_counter``'s clock (system-wide on Linux, so the two ends'
  stamps compare): "offer" (the sender registered the value), "ready"
  (the value existed at the sender), "pull" (the receiver asked for it),
  "arrived" (it was there). Two watcher threads, one per end, wait for
  values in the order they were offered or pulled and stamp them: a
  stamp may be late (behind an earlier value, or a busy core), never
  early. The main thread never waits for them.

  ``events``: ``(what, transfer key, seconds)``, what in "offer", "ready",
  "pull", "arrived"; complete once ``close`` returned.
  """

  def __init__(self):
    self.events = []
    self.closed = False
    self._queues = {"ready": queue.Queue(), "arrived": queue.Queue()}
    self._threads = [
      threading.Thread(target=self._watch, args=(what, q), daemon=True)
      for what, q in self._queues.items()
    ]
    for t in self._threads:
      t.start()

  def offered(self, uuid: int, arrays) -> None:
    if not self.closed:
      self.events.append(("offer", uuid, time.perf_counter()))
      self._queues["ready"].put((uuid, list(arrays)))

  def pulled(self, uuid: int, arrays) -> None:
    if not self.closed:
      self.events.append(("pull", uuid, time.perf_counter()))
      self._queues["arrived"].put((uuid, list(arrays)))

  def close(self) -> list:
    """Stops stamping: waits for every value stamped so far, stops the
    watchers; returns ``events``."""
    self.closed = True
    for q in self._queues.values():
      q.put(None)
    for t in self._threads:
      t.join()
    return self.events

  def _watch(self, what, q):
    while (item := q.get()) is not None:
      uuid, arrays = item
      try:
        jax.block_until_ready(arrays)
      except Exception:  # noqa: BLE001 -- a failed transfer: no stamp
        continue
      self.events.append((what, uuid, time.perf_counter()))


def _processes(place: StagePlacement) -> tuple[int, ...]:
  """The processes of ``place``'s devices, in order."""
  return tuple(sorted({d.process_index for d in place.devices}))


def _first_in(place: StagePlacement, process: int):
  """The first device of ``place`` in ``process``."""
  return next(d for d in place.devices if d.process_index == process)
