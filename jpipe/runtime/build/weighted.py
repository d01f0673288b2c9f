"""A stage's programs on a replica group that splits each microbatch
unevenly: DynPipe's DP-stage load balancing (spec: DynPipe, B4).

Replica j of a weighted group (``StagePlacement.rows``) takes ``rows[j]``
of a microbatch's examples, so a slower device can be given fewer. XLA's
SPMD programs need equal shards, so each replica runs its slice as its
own program (the stage's, compiled per slice size) at its own copy of the
replicated params. A microbatch's values wait whole on the group's first
device: a run slices them out to the replicas and gathers the replicas'
outputs (concatenated in example order) and input cotangents back there.
Each replica accumulates its own gradient (the group's accumulator is the
tuple of them); a step sums them over the group
(``StagePlacement.sum_replicas``).

The math is the one-device stage's: a loss that is a mean over the
microbatch's examples is the replicas' means weighted by ``rows[j] / n``,
so replica j's loss and its cotangent are scaled by that share (exact up
to float rounding of the sum). Values without the microbatch on their
leading axis go whole to every replica, and their cotangents are summed.
"""

import functools

import jax
import jax.numpy as jnp

from jpipe.runtime.build.placement import put


class WeightedStage:
  """The forward, backward and fused programs of stage ``s`` over the
  weighted group ``place``, with the signatures of ``StagePrograms``'s.

  Args:
    s: the stage.
    place: its ``StagePlacement`` (``weighted``).
    spec: its ``StageSpec`` (which inputs and outputs carry the
      microbatch: leading axis = the microbatch size).
    programs: the ``StagePrograms`` whose one-device programs it runs.
  """

  def __init__(self, s, place, spec, programs):
    self.s, self.place, self.programs = s, place, programs
    n = place.microbatch_size
    self.input_rows = tuple(_carries(v.aval, n) for v in spec.inputs)
    self.output_rows = tuple(_carries(v.aval, n) for v in spec.outputs)
    self.results = tuple(spec.results)
    if any(r != 0 for r in self.results):  # Checked when built.
      raise ValueError(f"stage {s}: a weighted group has no model state")

  def prepare(self) -> None:
    """The stages of each slice size of the current split, cut now."""
    for r in self.place.rows:
      if r:
        self._at(r)

  def _at(self, rows: int):
    """The one-device programs of a slice of ``rows`` examples: XLA
    programs have fixed shapes, so each slice size has its own, cut from
    the model traced on that many examples."""
    if rows == self.place.microbatch_size:
      return self.programs
    return self.programs.at_rows(rows)

  # -- the programs ---------------------------------------------------------

  def forward(self, theta, local, acts):
    """``(outputs, results)`` (recompute)."""
    rows, runs = self._forwards("forward", theta, local, acts)
    return self._outputs(runs), self._results(runs, rows, 1)

  def forward_saving(self, theta, local, acts):
    """``(outputs, results, residuals)``; the residuals stay on the
    replicas, with the split they were made at (a backward splits its
    cotangents the same way, even after ``set_rows``)."""
    rows, runs = self._forwards("forward_saving", theta, local, acts)
    residuals = (rows, {j: run[2] for j, run in runs.items()})
    return self._outputs(runs), self._results(runs, rows, 1), residuals

  def backward_from_residuals(
    self, acc, theta, residuals, out_cots, result_cots
  ):
    """``(acc + grads, act_cots)`` from ``forward_saving``'s residuals."""
    rows, saved = residuals
    cots = self._scatter(out_cots, self.output_rows, rows)
    return self._backwards(
      acc, theta, rows, result_cots, lambda j: (saved[j], cots[j])
    )

  def backward(self, acc, theta, local, acts, out_cots, result_cots):
    """``(acc + grads, act_cots)``, recomputing each replica's forward."""
    rows = self.place.rows
    locs, ins = self._inputs(local, acts, rows)
    cots = self._scatter(out_cots, self.output_rows, rows)
    return self._backwards(
      acc, theta, rows, result_cots, lambda j: (locs[j], ins[j], cots[j])
    )

  def forward_backward(self, acc, theta, local, acts, result_cots):
    """``(results, acc + grads, act_cots)`` of an output-free stage."""
    rows = self.place.rows
    locs, ins = self._inputs(local, acts, rows)
    accs, runs = self._accs(acc), {}
    for j in _active(rows):
      run = self._at(rows[j]).plain_forward_backward(self.s, accs[j] is None)
      results, accs[j], act = run(
        accs[j],
        self.place.on_device(theta, j),
        locs[j],
        ins[j],
        self._scaled(result_cots, rows, j),
      )
      runs[j] = (results, act)
    act_cots = self._input_cotangents({j: r[1] for j, r in runs.items()})
    return self._results(runs, rows, 0), tuple(accs), act_cots

  def _forwards(self, kind, theta, local, acts):
    """``(rows, {j: replica j's forward of its slice})``."""
    rows = self.place.rows
    locs, ins = self._inputs(local, acts, rows)
    runs = {
      j: self._at(rows[j]).stage_program(kind, self.s)(
        self.place.on_device(theta, j), locs[j], ins[j]
      )
      for j in _active(rows)
    }
    return rows, runs

  def _backwards(self, acc, theta, rows, result_cots, args_of):
    """Each replica's backward (``args_of(j)``: its arguments between
    the params and the result cotangents) into its accumulator."""
    accs, out = self._accs(acc), {}
    for j in _active(rows):
      run = self._at(rows[j]).plain_backward(self.s, accs[j] is None)
      accs[j], out[j] = run(
        accs[j],
        self.place.on_device(theta, j),
        *args_of(j),
        self._scaled(result_cots, rows, j),
      )
    return tuple(accs), self._input_cotangents(out)

  # -- slicing and gathering ------------------------------------------------

  def _inputs(self, local, acts, rows) -> tuple[dict, dict]:
    """Each replica's batch leaves and input activations."""
    return (
      self._scatter(local, None, rows),
      self._scatter(acts, self.input_rows, rows),
    )

  def _accs(self, acc) -> list:
    """The group's accumulator as a list per replica (None: none yet)."""
    return list(acc) if acc is not None else [None] * len(self.place.devices)

  def _scatter(self, values, carries, rows) -> dict:
    """``{j: replica j's tuple of values}``: a value carrying the
    microbatch (``carries[i]``; None: by its leading axis) sliced to its
    rows, the others whole, each on replica j's device."""
    n = self.place.microbatch_size
    per = {j: [] for j in _active(rows)}
    for i, x in enumerate(values):
      sliced = carries[i] if carries is not None else _carries(x, n)
      if x is None:
        parts = dict.fromkeys(per)
      elif sliced:
        parts = dict(zip(_active(rows), _slices(x, rows), strict=True))
      else:
        parts = dict.fromkeys(per, x)
      for j in per:
        per[j].append(
          None if parts[j] is None else put(parts[j], self.place.devices[j])
        )
    return {j: tuple(v) for j, v in per.items()}

  def _outputs(self, runs) -> tuple:
    """Each output of the replicas' forwards (``run[0]``) concatenated on
    the first device, in example order."""
    out = []
    for i, carries in enumerate(self.output_rows):
      if not carries:
        raise ValueError(
          f"stage {self.s}: an output without the microbatch on its "
          "leading axis cannot be gathered from a weighted replica group; "
          "use replica_routing='split'"
        )
      out.append(self._gather([runs[j][0][i] for j in runs]))
    return tuple(out)

  def _results(self, runs, rows, index) -> tuple:
    """The loss: the replicas' means weighted by their rows' shares."""
    if not self.results:
      return ()
    n = self.place.microbatch_size
    losses = [put(runs[j][index][0], self.place.device) for j in runs]
    weights = tuple(rows[j] / n for j in runs)
    return (_weighted_sum(tuple(losses), weights),)

  def _scaled(self, result_cots, rows, j) -> tuple:
    """The loss cotangent of replica j: times its share of the mean."""
    share = rows[j] / self.place.microbatch_size
    return tuple(
      None if c is None else _times(c, share, self.place.devices[j])
      for c in result_cots
    )

  def _input_cotangents(self, per_replica: dict) -> tuple:
    """The replicas' input cotangents on the first device: concatenated
    where the input carries the microbatch, else summed."""
    out = []
    for i, carries in enumerate(self.input_rows):
      parts = [per_replica[j][i] for j in per_replica]
      if parts[0] is None:
        out.append(None)
      elif carries:
        out.append(self._gather(parts))
      else:
        moved = [put(x, self.place.device) for x in parts]
        out.append(functools.reduce(jnp.add, moved))
    return tuple(out)

  def _gather(self, parts):
    """Row slices (in replica order) as one array on the first device."""
    moved = tuple(put(x, self.place.device) for x in parts)
    return moved[0] if len(moved) == 1 else _concatenate(moved)


def _active(rows) -> list[int]:
  """The replicas that take examples."""
  return [j for j, r in enumerate(rows) if r > 0]


def _carries(x, n) -> bool:
  """Whether a value (array or aval) has the microbatch on axis 0."""
  shape = getattr(x, "shape", ())
  return bool(shape) and shape[0] == n


def _slices(x, rows) -> tuple:
  """``x``'s consecutive row slices of the active replicas' sizes."""
  return _split(x, tuple(r for r in rows if r > 0))


@functools.partial(jax.jit, static_argnums=1)
def _split(x, sizes):
  offsets = [0]
  for r in sizes:
    offsets.append(offsets[-1] + r)
  return tuple(x[a:b] for a, b in zip(offsets, offsets[1:], strict=False))


@jax.jit
def _concatenate(parts):
  return jnp.concatenate(parts, axis=0)


@functools.partial(jax.jit, static_argnums=1)
def _weighted_sum(values, weights):
  return sum(
    v * jnp.asarray(w, v.dtype) for v, w in zip(values, weights, strict=True)
  )


def _times(c, share, device):
  """A loss cotangent times a replica's share, on that replica."""
  if isinstance(c, (int, float)):
    return c * share
  return put(c, device) * share
