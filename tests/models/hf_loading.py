"""Shared by the HuggingFace-equality tests: a model's params in shapes
only, their count, and a checkpoint loaded by the model's name map."""

import jax
import numpy as np

from jpipe.train import pretrained


def abstract_params(model, *inputs):
  """The model's params as ShapeDtypeStructs (nothing allocated);
  ``inputs``: arrays or ShapeDtypeStructs, called in inference mode."""
  return jax.eval_shape(
    lambda *a: model.init(jax.random.key(0), *a, train=False), *inputs
  )["params"]


def param_count(model, *inputs) -> int:
  return int(
    sum(
      np.prod(x.shape) for x in jax.tree.leaves(abstract_params(model, *inputs))
    )
  )


def load(model, names, directory, *inputs, lazy=False):
  """``hf:directory`` loaded into ``model``'s params by ``names`` (its
  ``hf_names``), which must name every param exactly once."""
  template = abstract_params(model, *inputs)
  assert set(pretrained.flat_paths(template)) == set(names)
  return pretrained.load_params(
    f"hf:{directory}", template, hf_names=names, lazy=lazy
  )
