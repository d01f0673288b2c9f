"""A Flax NNX module class as the model of a built-in task.

The built-in tasks call a model the linen way -- ``init(key, *inputs)``
gives ``{"params": ..., "batch_stats": ...}`` and ``apply(variables,
*inputs, rngs=..., mutable=...)`` runs it as a pure function -- so an NNX
class named by ``config.model.name`` is wrapped in :class:`NnxModel`,
which does what an NNX training step does (``nnx.split`` once,
``nnx.merge`` per call) behind that interface:

- ``params``: the ``nnx.Param`` variables, as nested dicts of arrays whose
  keys are strings (a list's index ``0`` is ``"0"``: checkpoint keys);
- ``batch_stats``: every other variable but RNG state and sown
  intermediates (``nnx.BatchStat``'s running means, a counter, a buffer),
  the model state a training call returns updated; absent if none;
- RNG streams (``nnx.Dropout(rngs=...)``) are not state: each training
  call reseeds every stream from the batch's ``dropout`` key, as linen
  models draw their masks, so a resumed run draws the same masks; a
  ``__call__`` taking ``rngs`` gets ``nnx.Rngs(dropout=key)`` too;
- sharding annotations (``nnx.with_partitioning``) are kept as metadata,
  not applied: each stage is placed whole on its devices (no mesh);
- variables made as hijax types or array references
  (``nnx.var_defaults(hijax=True)`` / ``ref=True``) are made ordinary
  (``jpipe.runtime.array_variables``): the params are arrays;
- training or evaluation mode: ``module.train()`` / ``module.eval()``
  (Dropout's ``deterministic``, BatchNorm's ``use_running_average``), plus
  the module's own ``train`` / ``training`` / ``deterministic`` keyword
  where its ``__call__`` takes one.

Module calls are found by the partitioner through ``nnx.merge``
(``jpipe.partition``'s NNX scopes), so stages split at NNX submodules.
"""

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jpipe.runtime import array_variables, is_key
from jpipe.train import errors

_MODE_KEYWORDS = ("train", "training", "deterministic")
# Variables that are not the model's state: RNG streams (reseeded per
# call) and values sown for inspection.
_NOT_STATE = (nnx.RngState, nnx.Intermediate)


class NnxModel:
  """``module_class(**kwargs, rngs=nnx.Rngs(key))`` as a linen-style model.

  Attributes:
    module_class: the ``nnx.Module`` subclass.
    kwargs: its constructor's keyword arguments (``config.model.kwargs``).
  """

  def __init__(self, module_class: type, **kwargs):
    self.module_class = module_class
    self.kwargs = kwargs
    init_params = inspect.signature(module_class.__init__).parameters
    self._takes_rngs = "rngs" in init_params
    self._init_params = init_params
    call = inspect.signature(module_class.__call__)
    self._call_takes_rngs = "rngs" in call.parameters
    self._own_mode = next(
      (k for k in _MODE_KEYWORDS if k in call.parameters), None
    )

  def __getattr__(self, name: str) -> Any:
    """A constructor argument (``model.num_classes``), given or default."""
    if name.startswith("_") or name not in self.__dict__.get(
      "_init_params", {}
    ):
      raise AttributeError(name)
    if name in self.kwargs:
      return self.kwargs[name]
    default = self._init_params[name].default
    if default is inspect.Parameter.empty:
      raise AttributeError(name)
    return default

  def __repr__(self) -> str:
    return f"NnxModel({self.module_class.__qualname__}, {self.kwargs})"

  @property
  def call_signature(self) -> inspect.Signature:
    """The module's ``__call__`` signature, with a keyword-only ``train``
    added where it takes no mode keyword (the wrapper sets the mode)."""
    call = inspect.signature(self.module_class.__call__)
    if self._own_mode:
      return call
    train = inspect.Parameter("train", inspect.Parameter.KEYWORD_ONLY)
    params = [p for p in call.parameters.values() if p.kind != p.VAR_KEYWORD]
    extra = [p for p in call.parameters.values() if p.kind == p.VAR_KEYWORD]
    return call.replace(parameters=[*params, train, *extra])

  @property
  def draws_random(self) -> bool:
    """Whether training calls need a ``dropout`` key: the module keeps RNG
    streams other than ``params`` or its ``__call__`` takes ``rngs``."""
    return self._call_takes_rngs or bool(self._structure["streams"])

  def _build(self, key) -> nnx.Module:
    kwargs = dict(self.kwargs)
    if self._takes_rngs:
      kwargs["rngs"] = nnx.Rngs(key)
    try:
      # Sharding annotations (nnx.with_partitioning) stay metadata: the
      # pipeline places each stage whole on its devices, with no mesh.
      with nnx.use_eager_sharding(False):
        return array_variables(self.module_class(**kwargs))
    except TypeError as e:  # An unknown or missing keyword.
      raise errors.model_kwargs_error(
        self.module_class.__qualname__, e, self.kwargs
      ) from e

  @functools.cached_property
  def _structure(self) -> dict:
    """The module's graph and each kind of variable's abstract state,
    from an abstract construction (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: self._build(jax.random.key(0)))
    graphdef, params, rng, _, state = nnx.split(
      abstract, nnx.Param, nnx.RngState, nnx.Intermediate, ...
    )
    streams = sorted(
      {
        node.tag
        for _, node in nnx.iter_graph(abstract)
        if isinstance(node, nnx.RngStream) and node.tag != "params"
      }
    )
    return {
      "graphdef": graphdef,
      "params": params,
      "state": state,
      "rng": rng,
      "streams": streams,
    }

  def init(self, key, *inputs, **mode) -> dict:
    """``{"params": ..., "batch_stats": ...}`` of a module built with
    ``nnx.Rngs(key)`` (``inputs`` and ``mode`` unused: an NNX module's
    shapes are its constructor's)."""
    del inputs, mode
    _, params, _, state = nnx.split(
      self._build(key), nnx.Param, _NOT_STATE, ...
    )
    variables = {"params": _to_dict(params)}
    if jax.tree.leaves(state):
      variables["batch_stats"] = _to_dict(state)
    return variables

  def apply(self, variables, *inputs, rngs=None, mutable=False, **kwargs):
    """The module's ``__call__(*inputs, **kwargs)`` with ``variables``;
    with ``mutable``, ``(output, {"batch_stats": new state})``.

    Args:
      variables: ``init``'s dict (or one of the same structure).
      rngs: ``{"dropout": key}`` for a training call that draws masks.
      mutable: truthy: also return the updated model state.
      kwargs: the mode keyword (``call_signature``'s) and any other
        keyword of the module's ``__call__``.
    """
    structure = self._structure
    module = nnx.merge(
      structure["graphdef"],
      _to_state(structure["params"], variables["params"]),
      _to_state(structure["state"], variables.get("batch_stats", {})),
      # Placeholders made in this trace (NNX mutates only variables made at
      # the trace level it runs in); every stream is reseeded before use.
      jax.tree.map(_placeholder, structure["rng"]),
    )
    train = self._set_mode(module, kwargs)
    key = (rngs or {}).get("dropout")
    if train and key is not None:
      self._reseed(module, key)
      if self._call_takes_rngs:
        kwargs["rngs"] = nnx.Rngs(dropout=key)
    out = module(*inputs, **kwargs)
    if not mutable:
      return out
    _, _, state = nnx.split(module, (nnx.Param, *_NOT_STATE), ...)
    return out, {"batch_stats": _to_dict(state)}

  def _set_mode(self, module, kwargs) -> bool:
    """Sets training or evaluation mode from the mode keyword (popped if
    it is the wrapper's own); returns whether training."""
    if self._own_mode:
      value = kwargs.get(self._own_mode, self._own_mode == "deterministic")
      train = not value if self._own_mode == "deterministic" else bool(value)
    else:
      train = bool(kwargs.pop("train", False))
    if train:
      module.train()
    else:
      module.eval()
    return train

  def _reseed(self, module, key) -> None:
    streams = self._structure["streams"]
    nnx.reseed(
      module,
      policy="match_shape",
      **{tag: jax.random.fold_in(key, i) for i, tag in enumerate(streams)},
    )


def _placeholder(leaf):
  """A concrete value of an abstract RNG-state leaf's shape and dtype."""
  if is_key(leaf):
    return jnp.broadcast_to(jax.random.key(0), leaf.shape)
  return jnp.zeros(leaf.shape, leaf.dtype)


def _to_dict(state) -> dict:
  """An NNX state as nested dicts of its values, every key a string."""
  flat = {
    tuple(str(p) for p in path): var.get_value()
    for path, var in nnx.to_flat_state(state)
  }
  return nnx.traversals.unflatten_mapping(flat)


def _to_state(template, values: dict):
  """``template``'s state (abstract) holding ``values`` (``_to_dict``'s
  layout) instead."""
  flat = []
  for path, var in nnx.to_flat_state(template):
    value = values
    for part in path:
      value = value[str(part)]
    flat.append((path, var.replace(value)))
  return nnx.from_flat_state(flat)
