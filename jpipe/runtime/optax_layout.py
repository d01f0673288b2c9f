"""A state dict's optimizer state to and from optax's own layout.

``Pipeline.state_dict()["opt_state"]`` is laid out as ``optimizer.init``
lays it out for the whole model, except that each params-shaped part
(Adam's moments, a mask's inner state) is a dict keyed by the leaf's
path (``"params/dense_0/kernel"``): what merges the stages' states and
splits again under any partition (``build/params_view.py``). A plain
optax loop holds those parts in the params' own structure. These two
functions move a state between the layouts, so training continues on
one device from a pipeline's checkpoint, or in a pipeline from a plain
optax run's state (``load_state_dict({"params": ..., "opt_state":
opt_state_from_optax(...), "step": ...})``).
"""

from typing import Any

import jax
import numpy as np

from jpipe.runtime._state_dict import select_keyed
from jpipe.runtime.build.params_view import ParamsView
from jpipe.runtime.build.stage_optimizer import leaf_names


def opt_state_to_optax(opt_state: Any, optimizer, params: Any) -> Any:
  """A state dict's ``"opt_state"`` in ``optimizer.init(params)``'s
  layout, its leaves as saved (host arrays).

  Args:
    opt_state: ``Pipeline.state_dict()["opt_state"]``, or one restored
      from a checkpoint (tuples as lists, NamedTuples as dicts are read
      by field).
    optimizer: the optax ``GradientTransformation`` the pipeline stepped
      with (only its ``init`` is traced, on shapes).
    params: the params it steps (arrays or ``jax.ShapeDtypeStruct``):
      the state dict's ``"params"``; with ``frozen`` leaves, the trained
      ones in the model's structure.

  Raises:
    ValueError: naming what differs where the state was saved for
      another model or optimizer.
  """
  view, template = _view_and_template(optimizer, params)
  keyed = view.keyed(template)
  return view.structured(select_keyed(opt_state, keyed))


def opt_state_from_optax(optax_state: Any, params: Any) -> Any:
  """``opt_state_to_optax``'s inverse: a state in ``optimizer.init
  (params)``'s layout as a state dict's ``"opt_state"`` (for
  ``Pipeline.load_state_dict``)."""
  view = _whole_model_view(params)
  return view.keyed(optax_state)


def _view_and_template(optimizer, params):
  """The whole model's ``ParamsView`` and ``optimizer.init``'s state for
  ``params`` as abstract values."""
  if not hasattr(optimizer, "init"):
    raise ValueError(
      f"optimizer must be an optax GradientTransformation, got "
      f"{type(optimizer).__name__}"
    )
  avals = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params
  )
  return _whole_model_view(params), jax.eval_shape(optimizer.init, avals)


def _whole_model_view(params) -> ParamsView:
  """Every leaf of ``params`` managed whole, named by its path, as a
  pipeline's stage names its leaves."""
  treedef = jax.tree.structure(params)
  n = treedef.num_leaves
  return ParamsView(treedef, leaf_names(params), [(i, -1) for i in range(n)])
