"""Model state carried across microbatches: update it where it is read.

A model-state leaf (BatchNorm statistics, a counter) is an input of every
microbatch's forward and one of its results: microbatch b must read what
microbatch b - 1 wrote, as a single-device loop over the microbatches
would. Stages run their forwards in microbatch order and the runtime
updates a leaf when the stage that returns it runs, so the update is exact
when the stage that reads the old value also computes the new one. When
the new value comes out of a later stage -- a BatchNorm written for
``pmap`` run under ``jax.vmap(axis_name=...)`` returns its statistics
batched and the loss takes ``[0]`` of them after the model -- the reader's
next microbatch would run before that update (or, with the reader later
than the writer, after the current one).

``place_state_updates`` moves the equations that only compute the new
value (nothing the loss needs: ``[0]``, a broadcast, the running-average
arithmetic) to the stage that reads the old value. Where that is not
possible -- the loss itself needs the new value, it is computed from values
of a later stage, or several stages read the old one -- it raises, naming
the leaf and the two stages.
"""

import re
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore


def place_state_updates(
  jaxpr: jcore.Jaxpr,
  eqn_stage: Sequence[int],
  num_param_leaves: int,
  carried: Sequence[tuple[int, int]],
  leaf_paths: Sequence[str] = (),
) -> list[int]:
  """Every equation's stage, with state updates moved to their readers.

  Args:
    jaxpr: the traced loss (inputs: param leaves, then batch leaves).
    eqn_stage: the stage of every equation under the partition.
    num_param_leaves: how many leading inputs are parameters.
    carried: ``(batch leaf, result)`` pairs: result ``result`` of the loss
      function is the new value of batch leaf ``batch leaf``, which the
      next microbatch reads.
    leaf_paths: every input leaf's path, for messages.

  Returns:
    The stage of every equation (a new list).

  Raises:
    ValueError: a leaf whose update cannot be made exact, naming it and the
      stages that read and write it.
  """
  eqn_stage = [int(s) for s in eqn_stage]
  eqns = jaxpr.eqns
  producer = {
    v: i
    for i, eqn in enumerate(eqns)
    for v in eqn.outvars
    if not isinstance(v, jcore.DropVar)
  }
  consumers: dict[Any, list[int]] = {}
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if isinstance(v, jcore.Var):
        consumers.setdefault(v, []).append(i)
  loss_needs = _ancestors(eqns, producer, [jaxpr.outvars[0]], frozenset())
  for leaf, result in carried:
    old, new = jaxpr.invars[num_param_leaves + leaf], jaxpr.outvars[result]
    if isinstance(new, jcore.Literal) or new is old:
      continue  # Constant, or passed through unchanged: nothing to order.
    name = (
      leaf_paths[num_param_leaves + leaf]
      if leaf_paths
      else f"model-state input {leaf}"
    )
    if new not in producer:  # Another input returned as the new value.
      raise ValueError(
        f"model state {name}: its new value is another input of the loss, "
        "not computed from this microbatch; return the state it replaces "
        "or a value computed in the model"
      )
    writer = eqn_stage[producer[new]]
    # The equations that compute only the new value (the loss needs none).
    update = _ancestors(eqns, producer, [new], loss_needs)
    # Stages that read the old value for the model itself.
    readers = sorted(
      {eqn_stage[i] for i in consumers.get(old, ()) if i not in update}
    )
    if len(readers) > 1:
      raise ValueError(
        f"model state {name} is read on stages {readers[0]} and "
        f"{readers[1]}: one microbatch's update cannot reach both before "
        "the next microbatch reads it. " + _fix(name)
      )
    reader = readers[0] if readers else writer
    if {eqn_stage[i] for i in update} | {writer} == {reader}:
      continue  # Read and written on one stage: in microbatch order.
    if not update:
      raise ValueError(
        f"model state {name} is read on stage {reader} but its new value is "
        f"computed on stage {writer} and the loss needs it there: the next "
        "microbatch would read it before (or after) this one's update. "
        + _fix(name)
      )
    late = [
      eqn_stage[producer[v]]
      for i in update
      for v in eqns[i].invars
      if isinstance(v, jcore.Var)
      and v in producer
      and producer[v] not in update
      and eqn_stage[producer[v]] > reader
    ]
    early = [
      eqn_stage[j]
      for i in update
      for v in eqns[i].outvars
      for j in consumers.get(v, ())
      if j not in update and eqn_stage[j] < reader
    ]
    if late or early:
      why = (
        f"from values of stage {late[0]}"
        if late
        else f"and stage {early[0]} reads values computed with it"
      )
      raise ValueError(
        f"model state {name} is read on stage {reader} but its new value is "
        f"computed on stage {writer} {why}: the next microbatch would read "
        "it before (or after) this one's update. " + _fix(name)
      )
    for i in update:
      eqn_stage[i] = reader
  return eqn_stage


def _fix(name: str) -> str:
  """How to keep a model-state leaf's updates on one stage; an NNX RNG
  stream's own way where ``name`` is one's key or count."""
  if re.search(r"\['(count|key)'\]", name):
    return (
      "It is an NNX RNG stream's, advanced by modules on several stages "
      "(one nnx.Rngs passed to their calls): give each module its own "
      "stream (nnx.Dropout(rate, rngs=rngs) at construction), or keep them "
      "in one stage (a Plan, or fewer stages)"
    )
  return "Keep its modules in one stage (a Plan, or fewer stages)"


def _ancestors(eqns, producer, roots, stop) -> set[int]:
  """Equations the ``roots`` values depend on, not crossing ``stop``."""
  found: set[int] = set()
  todo = [
    producer[v] for v in roots if isinstance(v, jcore.Var) and v in producer
  ]
  while todo:
    i = todo.pop()
    if i in found or i in stop:
      continue
    found.add(i)
    todo.extend(
      producer[v]
      for v in eqns[i].invars
      if isinstance(v, jcore.Var) and v in producer
    )
  return found
