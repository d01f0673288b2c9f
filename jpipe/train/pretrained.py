"""Fine-tuning: pretrained params into a model, and frozen params.

``load_params(source, template)`` reads pretrained parameters from

- a jpipe training workdir, or one of its checkpoints (the params of its
  latest / that step);
- any other orbax checkpoint of a params pytree (``StandardSave`` /
  ``PyTreeSave``, e.g. ``ocp.StandardCheckpointer().save(path, params)``);
- a Flax msgpack file (``flax.serialization.to_bytes(params)``; also what
  a HuggingFace Flax model's ``flax_model.msgpack`` holds);
- ``"hf:PATH"``: a HuggingFace safetensors checkpoint (PyTorch names),
  by the model's name map (``jpipe.train.hf_checkpoint``);
- ``"package.module:name"``: a Python callable returning params (or an
  object with ``.params``, such as a HuggingFace ``FlaxPreTrainedModel``),
  or such a value itself;

Files are read without trusting them: a damaged msgpack file
(``jpipe.train.msgpack_params``), orbax checkpoint or safetensors file
(``hf_checkpoint``) is a one-line ``PretrainedError`` naming the file and
the array. The params are checked leaf by leaf against the model's own
freshly initialised params (``template``): same paths, same shapes. A
mismatch is an error naming the first path that differs; ``keep_init``
(regular expressions on the path) keeps chosen leaves of the fresh init
instead -- a new head of another size. Values are cast to the template's
dtypes.

``freeze(tx, patterns)`` is ``optax.multi_transform`` that zeroes the
updates of the leaves whose path matches. A pipeline's stage optimizer
sees its leaves as a flat ``{"a/b/kernel": leaf}`` dict; the labels here
are computed from each leaf's path string, which is the same in that dict
and in the nested params, so the same transform works on both (a labels
*pytree* shaped like the nested params would not).
"""

import difflib
import importlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from jpipe import parallel
from jpipe.runtime.build import stage_optimizer
from jpipe.train import hf_checkpoint, msgpack_params, process_arrays
from jpipe.train.checkpoint import checksums, orbax_error, quiet_late_reads
from jpipe.train.errors import (
  PretrainedCheckpointError,
  PretrainedError,
  UsageError,
)


def flat_paths(tree) -> dict[str, Any]:
  """``{"a/b/c": leaf}`` in flatten order."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {stage_optimizer.path_name(path): leaf for path, leaf in flat}


def path_patterns(patterns: str | Sequence[str]) -> list[re.Pattern]:
  """Compiled regular expressions from a comma-separated string (or a
  list); a UsageError names a bad one."""
  try:
    return stage_optimizer.path_patterns(patterns)
  except ValueError as e:
    raise UsageError(str(e)) from e


def matching(patterns: str | Sequence[str], tree) -> list[str]:
  """Paths of ``tree``'s leaves that any pattern (``re.search``) finds."""
  compiled = path_patterns(patterns)
  return [p for p in flat_paths(tree) if any(c.search(p) for c in compiled)]


def freeze(
  tx: optax.GradientTransformation, patterns: str | Sequence[str]
) -> optax.GradientTransformation:
  """``tx`` for every leaf but those whose path matches a pattern, which
  get zero updates (and no optimizer state).

  Args:
    tx: the optimizer of the trained leaves.
    patterns: regular expressions searched in each leaf's ``"a/b/c"``
      path (a comma-separated string or a list), e.g. ``"^embed/"``.
  """
  compiled = path_patterns(patterns)
  if not compiled:
    return tx

  def labels(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: (
        "frozen"
        if any(c.search(stage_optimizer.path_name(path)) for c in compiled)
        else "trained"
      ),
      params,
    )

  return optax.multi_transform(
    {"trained": tx, "frozen": optax.set_to_zero()}, labels
  )


def load_params(
  source: Any,
  template: Any,
  *,
  keep_init: str | Sequence[str] = (),
  hf_names: dict[str, tuple[str, bool]] | None = None,
  lazy: bool = False,
) -> Any:
  """Pretrained params shaped like ``template``.

  Args:
    source: a path (workdir, orbax checkpoint, msgpack file), a
      ``"module:name"`` string, or a params pytree / callable / object
      with ``.params``.
    template: the model's own params (arrays or ShapeDtypeStructs): the
      structure, shapes and dtypes to fill.
    keep_init: path patterns whose leaves keep ``template``'s values (they
      may be missing from, or differ in shape in, the pretrained params).
    hf_names: for a ``hf:PATH`` source, the model's name map
      (``jpipe.models.<name>.hf_names(model)``).
    lazy: a ``hf:PATH`` source's leaves stay ``hf_checkpoint.LazyTensor``
      (read when ``Pipeline.init`` places each on its stage: the host
      never holds the whole model); else NumPy arrays.

  Raises:
    PretrainedError: unreadable source, or params that do not fit; the
      message names the first path that differs.
  """
  if hf_checkpoint.is_hf(source):
    if hf_names is None:
      raise PretrainedError(
        f"{source}: this model has no HuggingFace name map; models that "
        "take HuggingFace checkpoints define hf_names (jpipe.models.t5_v1, "
        "gpt2, bert)"
      )
    # Keys "a/b/c" flatten to the same paths as the nested params.
    loaded = hf_checkpoint.params(source[len(hf_checkpoint.PREFIX) :], hf_names)
  else:
    loaded = _consensus(_read(source))
  want = flat_paths(template)
  got = flat_paths(loaded)
  if "params" in {p.split("/")[0] for p in got} and not any(
    p.startswith("params/") for p in want
  ):  # {"params": ...} around the params (Flax variables, a state dict).
    got = {
      p[len("params/") :]: x for p, x in got.items() if p.startswith("params/")
    }
  keep = path_patterns(keep_init)
  kept = {p for p in want if any(c.search(p) for c in keep)}
  where = _describe(source)
  missing = [p for p in want if p not in got and p not in kept]
  if missing:
    raise PretrainedError(
      f"pretrained params {where} have no {missing[0]!r} "
      f"({len(missing)} of the model's {len(want)} leaves missing)"
      f"{_closest(missing[0], got)}; keep the fresh init of new leaves "
      "with keep_init (config.init_keep) or load a checkpoint of this model"
    )
  unexpected = [p for p in got if p not in want]
  if unexpected:
    raise PretrainedError(
      f"pretrained params {where} have {unexpected[0]!r}, which the model "
      f"has not ({len(unexpected)} such leaves){_closest(unexpected[0], want)}"
      "; check the model's config (model.kwargs) against the pretrained one"
    )
  leaves = []
  for path, like in want.items():
    if path in kept:
      leaves.append(like)
      continue
    value = got[path]
    if isinstance(value, hf_checkpoint.LazyTensor | hf_checkpoint.LazyStack):
      # Read when placed.
      shape, cast = value.shape, value.astype
    else:
      value = np.asarray(value)
      shape, cast = value.shape, value.astype
    if tuple(shape) != tuple(like.shape):
      raise PretrainedError(
        f"pretrained params {where}: {path!r} has shape "
        f"{tuple(shape)}, the model's {tuple(like.shape)}; check "
        "model.kwargs against the pretrained model, or keep the fresh init "
        "of this leaf with keep_init (config.init_keep)"
      )
    _check_kind(where, path, value.dtype, like.dtype)
    value = cast(like.dtype)
    leaves.append(value if lazy else np.asarray(value))
  return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _check_kind(where: str, path: str, saved, model) -> None:
  """A PretrainedError where casting ``saved`` to ``model`` (dtypes)
  would change what the numbers mean: integers (a quantized checkpoint,
  its scales elsewhere) into a float param, or floats into an integer
  one. Float widths (bfloat16 -> float32) cast silently."""
  floating = [
    jax.numpy.issubdtype(d, jax.numpy.inexact) for d in (saved, model)
  ]
  if floating[0] != floating[1]:
    hint = (
      "a quantized checkpoint? Dequantize it first (or load its unquantized "
      "weights)"
      if floating[1]
      else "check the model's dtypes against the pretrained one"
    )
    raise PretrainedError(
      f"pretrained params {where}: {path!r} is {np.dtype(saved).name}, the "
      f"model's {np.dtype(model).name}: {hint}"
    )


def _consensus(loaded):
  """A data-parallel run's checkpoint (``{"pipelines": [state dict,
  ...]}``) as the mean of its pipelines' params, the model its
  evaluation reads; anything else as it is."""
  if not (isinstance(loaded, dict) and set(loaded) == {"pipelines"}):
    return loaded
  return parallel.mean_trees([p["params"] for p in loaded["pipelines"]])


def check_source(source: str) -> None:
  """A cheap check before any work: the path exists, or it has the
  ``module:name`` form."""
  if hf_checkpoint.is_hf(source):
    source = source[len(hf_checkpoint.PREFIX) :]
    if not os.path.exists(os.path.expanduser(source)):
      raise PretrainedError(
        f"hf:{source}: no such file or directory (a HuggingFace model "
        "directory with model.safetensors, flax_model.msgpack or "
        "pytorch_model.bin, or such a file)"
      )
    return
  if os.path.exists(os.path.expanduser(source)):
    return
  module_name, colon, name = source.partition(":")
  if not (colon and module_name and name):
    raise PretrainedError(
      f"no file or directory {source!r}: give a jpipe workdir or "
      "checkpoint, an orbax checkpoint directory, a Flax msgpack file or "
      "module:callable"
    )


def _describe(source) -> str:
  return f"from {source}" if isinstance(source, str) else "given"


def _closest(path: str, paths) -> str:
  near = difflib.get_close_matches(path, list(paths), n=2, cutoff=0.6)
  return f" (closest: {', '.join(near)})" if near else ""


def _read(source: Any) -> Any:
  """The pytree a source names (see ``load_params``)."""
  if not isinstance(source, str):
    return _unwrap(_call(source, "the given callable"))
  path = os.path.expanduser(source)
  if os.path.isfile(path):
    if path.endswith(".safetensors"):
      raise PretrainedError(
        f"{source} is a safetensors file: give hf:{source} (read by the "
        "model's HuggingFace name map)"
      )
    return msgpack_params.read(path)
  if os.path.isdir(path):
    return _read_orbax(path)
  check_source(source)
  module_name, _, name = source.partition(":")
  try:
    value = getattr(importlib.import_module(module_name), name)
  except (ImportError, AttributeError) as e:
    raise PretrainedError(
      f"cannot load pretrained params from {source!r}: {e}"
    ) from e
  return _unwrap(_call(value, source))


def _call(value, where: str):
  """``value()`` when callable (else ``value``): a callable that fails is
  a PretrainedError naming it, not a traceback from inside it."""
  if not callable(value):
    return value
  try:
    return value()
  except Exception as e:
    raise PretrainedError(
      f"pretrained params from {where}: calling it failed "
      f"({type(e).__name__}: {e}); name a callable that takes no arguments "
      "and returns params (or a model with .params), or a params value"
    ) from e


def _unwrap(value):
  """A HuggingFace Flax model (or anything with ``.params``) -> params."""
  params = getattr(value, "params", None)
  return value if params is None or callable(params) else params


def _read_orbax(path: str):
  """A jpipe workdir / checkpoint's params, or an orbax params pytree."""
  steps = os.path.join(path, "checkpoints")
  if os.path.isdir(steps):  # A jpipe workdir.
    path = steps
  numbered = sorted((d for d in os.listdir(path) if d.isdigit()), key=int)
  if numbered:  # A CheckpointManager directory: its latest step.
    try:
      return _read_step(os.path.join(path, numbered[-1]))
    except PretrainedError as e:
      if len(numbered) == 1:
        raise
      earlier = os.path.join(path, numbered[-2])
      raise type(e)(
        f"{e}. The checkpoint before it: init_from={earlier}"
      ) from e
  if path == steps:
    raise PretrainedError(
      f"{os.path.dirname(steps)} is a jpipe workdir without a checkpoint "
      f"({steps} holds no step); train it until it saves one "
      "(config.train.checkpoint_every) or initialise from another"
    )
  return _read_step(path)


def _read_step(path: str):
  """The params of one checkpoint directory (jpipe's, or orbax's)."""
  held = {"state", process_arrays.ITEM, "_METADATA"}
  if os.path.basename(path).isdigit() and not held & set(os.listdir(path)):
    raise PretrainedError(
      f"{path} is an incomplete checkpoint (no state in it: a save cut "
      "short, or a partial copy)"
    )
  arrays = os.path.join(path, process_arrays.ITEM)
  if os.path.isdir(arrays):  # A jpipe checkpoint written per process.
    try:
      return process_arrays.read_tree(arrays)
    except ValueError as e:
      raise PretrainedError(
        f"{path}: {e}; initialise from another checkpoint of that run (a "
        "numbered directory beside it) or a fresh copy"
      ) from e
  saved = None
  if os.path.isdir(os.path.join(path, "state")):  # jpipe's composite item.
    saved = _saved_checksums(path)
    path = os.path.join(path, "state")
  tree = _restored(path)
  if saved:  # A jpipe checkpoint is checked as resuming checks it.
    # Restored without a template, named tuples come back as dicts:
    # ".trace" was saved, "['trace']" is read.
    saved = {_as_dict_path(k): v for k, v in saved.items()}
    for leaf, crc in checksums(tree).items():
      if saved.get(_as_dict_path(leaf)) != crc:
        raise PretrainedError(
          f"{os.path.dirname(path)} fails its checksum at {leaf}: its files "
          "changed after they were written (disk or copy damage); "
          "initialise from another checkpoint of that run (a numbered "
          "directory beside it) or a fresh copy"
        )
  return tree


def _restored(path: str):
  """The pytree of the orbax checkpoint at ``path``; a one-line error
  saying whether it is none (no ``_METADATA``: what it is instead, where
  that is clear) or a damaged one (the array and the cause)."""
  quiet_late_reads()  # A failed read's siblings would print tracebacks.
  try:
    return ocp.StandardCheckpointer().restore(os.path.abspath(path))
  except Exception as e:
    if not os.path.exists(os.path.join(path, "_METADATA")):
      raise PretrainedError(
        f"{path} is not an orbax checkpoint (it has no _METADATA)"
        f"{_what_else(path)}; give a jpipe workdir or checkpoint, an orbax "
        "checkpoint directory, a Flax msgpack file, hf:PATH or "
        "module:callable"
      ) from e
    why = orbax_error(e)
    raise PretrainedCheckpointError(
      f"{path} is a damaged orbax checkpoint ({why}): its files "
      "changed or went missing after it was written; initialise from "
      "another checkpoint (a numbered directory beside it) or a fresh copy"
    ) from e


def _what_else(path: str) -> str:
  """What a directory that is no orbax checkpoint holds instead, as a
  hint: a HuggingFace model's msgpack or safetensors files."""
  names = os.listdir(path)
  if "flax_model.msgpack" in names:
    return f" but flax_model.msgpack: give {path}/flax_model.msgpack"
  if any(n.endswith(".safetensors") for n in names):
    return f" but safetensors files: give hf:{path}"
  return ""


def _as_dict_path(keystr: str) -> str:
  """A ``jax.tree_util.keystr`` path with attributes written as keys."""
  return re.sub(r"\.(\w+)", r"['\1']", keystr)


def _saved_checksums(step_dir: str) -> dict | None:
  """The CRC-32 per array that a jpipe checkpoint recorded when saved
  (None: none recorded, as in checkpoints written before checksums)."""
  try:
    with open(os.path.join(step_dir, "meta", "metadata")) as f:
      return json.load(f).get("checksums")
  except (OSError, ValueError) as e:
    raise PretrainedError(
      f"{step_dir}/meta is unreadable ({type(e).__name__}: {e}): the "
      "checkpoint is incomplete or damaged; initialise from another "
      "checkpoint of that run or a fresh copy"
    ) from e
