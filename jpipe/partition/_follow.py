"""Cut another function of the same model by a loss's plan.

An evaluation or prediction function calls the model's modules as the
loss does (in inference mode, with other heads or metrics around them,
or through one of its methods); traced at the loss's depth, its nodes
carry the same module paths. Each goes to the stage that holds the loss's
node of the same module, so a stage's forward reads the params that
stage already holds and nothing moves but activations.
"""

from collections.abc import Sequence

import jax.extend.core as jcore

from jpipe.partition._trace import TracedModel


def follow_plan(
  traced: TracedModel, reference: TracedModel, stage_of_node: Sequence[int]
) -> list[int]:
  """The stage of each of ``traced``'s nodes under ``reference``'s
  node -> stage assignment ``stage_of_node``, by the first rule that
  applies:

  1. a node named as one of the reference's goes to its stage;
  2. the same module path once a root method's scope is dropped (a
     function calling ``model.apply(..., method="encode")`` has nodes
     ``embed``, ``encoder/...`` where a loss through ``__call__`` has
     ``Model.encode/embed``...), k-th call to k-th call; a further call
     goes to the last call's stage;
  3. a node reading params goes to a stage of a reference node reading
     one of them (the first at or after the previous node's stage);
  4. otherwise it stays with the node before it (the first node: with
     the first that has a stage);

  then a node reading no params moves to the latest stage of the nodes
  whose values it reads, where that is later.
  """
  if reference.depth != traced.depth:
    raise ValueError(
      f"trace at the reference's depth {reference.depth}, not {traced.depth}"
    )
  if len(stage_of_node) != reference.num_nodes:
    raise ValueError(
      f"stage_of_node has {len(stage_of_node)} entries for the reference's "
      f"{reference.num_nodes} nodes"
    )
  stage_of_node = [int(s) for s in stage_of_node]
  by_name = dict(zip(reference.node_names, stage_of_node, strict=True))
  by_module, last_call = {}, {}
  for key, stage in zip(
    _module_calls(reference.node_names), stage_of_node, strict=True
  ):
    by_module[key] = last_call[key[0]] = stage
  stages_of_leaf = {}
  for leaves, stage in zip(
    reference.node_param_leaves(), stage_of_node, strict=True
  ):
    for leaf in leaves:
      stages_of_leaf.setdefault(leaf, set()).add(stage)
  found = []
  for name, key, leaves in zip(
    traced.node_names,
    _module_calls(traced.node_names),
    traced.node_param_leaves(),
    strict=True,
  ):
    stage = by_name.get(name, by_module.get(key, last_call.get(key[0])))
    if stage is None and leaves:
      candidates = set().union(*(stages_of_leaf.get(i, set()) for i in leaves))
      previous = next((s for s in reversed(found) if s is not None), 0)
      later = sorted(s for s in candidates if s >= previous)
      stage = later[0] if later else max(candidates, default=None)
    found.append(stage)
  first = next((s for s in found if s is not None), 0)
  stages, previous = [], first
  for stage in found:
    previous = previous if stage is None else stage
    stages.append(previous)
  return _after_inputs(traced, stages)


def _after_inputs(traced: TracedModel, stages: list[int]) -> list[int]:
  """``stages`` with each node that reads no params at or after the
  stages of the nodes it reads from (in node order, so such a node's
  readers follow it).

  Why: a module's code between its submodules' calls is named by call
  count (``attention#2``...), and a function that skips a submodule call
  the loss makes shifts those counts -- a cached decoding step's cross-
  attention reads its keys and values instead of projecting them, so
  its ``attention#2`` (the heads merged after the attention) takes the
  loss's ``attention#2`` (between the key and value projections): an
  earlier stage than the attention it reads, where the plan cuts inside
  the module. Such code holds no params, so its inputs decide; a node
  reading params stays with them (reading a later stage's value there
  is the function's own order, which ``Stages`` refuses)."""
  producers = traced.producers()
  reads_params = [bool(leaves) for leaves in traced.node_param_leaves()]
  stages = list(stages)
  for eqn, node in zip(traced.jaxpr.eqns, traced.eqn_node, strict=True):
    if reads_params[node]:
      continue
    for v in eqn.invars:
      source = None if isinstance(v, jcore.Literal) else producers.get(v)
      if source is not None and source != node:
        stages[node] = max(stages[node], stages[source])
  return stages


def _module_calls(node_names: Sequence[str]) -> list[tuple[str, int]]:
  """Each node's (module path, which call of it): its name without the
  call count and without a leading root-method scope (``Model.encode/
  embed`` -> ``embed``), calls counted anew over these paths."""
  counts, keys = {}, []
  for name in node_names:
    path = name.split("#", 1)[0].split("/")
    if len(path) > 1 and "." in path[0]:
      path = path[1:]
    module = "/".join(path)
    counts[module] = counts.get(module, 0) + 1
    keys.append((module, counts[module]))
  return keys
