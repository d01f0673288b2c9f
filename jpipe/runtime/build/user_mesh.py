"""The pipeline's work kept out of a mesh its caller has set.

Code written for SPMD sets a mesh for everything it runs (``jax.set_mesh
(mesh)``, as a context or globally). Under it every ``jax.jit`` call is
checked against the mesh's devices, so the pipeline's programs, each
placed on its own stage's devices, fail ("Received incompatible devices
for jitted computation"), and a model's ``nn.with_logical_constraint``
traces to constraints over the whole mesh. The pipeline places stages
itself: ``outside_user_mesh`` runs a class's public methods with no mesh
set (the caller's is back on return), which also makes the model's
logical constraints the no-ops they are without a mesh. The model's code
is traced on the caller's mesh (``partition.calling_from``), so
annotations naming its axes (``P("data")`` constraints, ``out_sharding=``,
``reshard``) trace as they do for the caller. Arrays typed on an
``Explicit`` mesh (their type carries their sharding) come in as plain
arrays, each whole on one of their devices (leaves taken in turn, so a
sharded model's parameters spread over its devices, not all on one), each
remembering its spec for traces (``partition/_caller_axes.py``). Global
arrays on a caller's mesh over several processes' devices (multi-host
code: a batch each process holds its rows of) are gathered whole on every
process, as the pipeline's processes each read the data they need; with
no mesh set, in a multi-process run, so are global arrays on any mesh but
the pipeline's own (``own_mesh``: a replica group's, a transfer's).

Such a caller runs device collectives of its own across processes
between the pipeline's calls (a jitted step over its mesh, a
``process_allgather``). A collective entered while a peer still pulls a
value from this process's device waits forever (``distributed._sync``,
rule 2), and a pipeline call returns in a sender before its receivers
have pulled the last values. So once a call has seen the caller's
multi-process arrays or mesh, every call that moves values between
processes (``every_process``) returns at a quiet point. A caller whose
multi-process code passes the pipeline only local values calls
``jpipe.distributed.quiet`` before its own collectives.
"""

import functools
import inspect

import jax
from jax.sharding import NamedSharding

from jpipe import distributed
from jpipe import partition as partition_lib


def _mesh_set() -> bool:
  return not (
    jax.sharding.get_abstract_mesh().empty and jax.sharding.get_mesh().empty
  )


# Whether a call in this process has seen a caller's arrays or mesh over
# several processes (the same in every process: each makes the same
# calls on the same global arrays).
_caller_spans_processes = False


def every_process(fn):
  """Marks a public method that every process of a multi-process run
  calls, in the same order, and that moves values between processes:
  ``without_mesh`` ends it at a quiet point for an SPMD caller (module
  docstring)."""
  fn.every_process = True
  return fn


def without_mesh(fn):
  """``fn`` run with no mesh set (as it is where none is); an
  ``every_process`` one returning at a quiet point where the caller
  spans processes."""
  if not getattr(fn, "every_process", False):
    return _without_mesh(fn)
  plain = _without_mesh(fn)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    out = plain(*args, **kwargs)
    if _caller_spans_processes:
      distributed.quiet(fn.__name__)
    return out

  return run


def _without_mesh(fn):
  @functools.wraps(fn)
  def run(*args, **kwargs):
    try:
      mesh_set = _mesh_set()
    except ValueError as e:  # (jax.sharding.get_mesh inside a trace.)
      if "jax.jit" not in str(e):
        raise
      raise TypeError(
        f"jpipe's {fn.__name__}() was called inside jax.jit (or another JAX "
        "transformation): a jpipe pipeline compiles and dispatches its own "
        "programs on its devices; call it outside any jit, grad or vmap"
      ) from None
    if not mesh_set:  # (The common case: nothing to swap.)
      if jax.process_count() > 1:  # (Global arrays made with no mesh set.)
        args, kwargs = _plain((args, kwargs), None)
      return fn(*args, **kwargs)
    caller = jax.sharding.get_mesh()
    if caller.empty:  # (Only an abstract one: jax.sharding.use_abstract_mesh.)
      caller = jax.sharding.get_abstract_mesh()
    elif len({d.process_index for d in caller.devices.flat}) > 1:
      _note_caller_spans_processes()
    args, kwargs = _plain((args, kwargs), caller)
    with jax.set_mesh(None), partition_lib.calling_from(caller):
      return fn(*args, **kwargs)

  return run


def _plain(tree, caller):
  """``tree`` with the caller's arrays made plain, each on one of this
  process's devices (the k-th such leaf on the k-th of its devices, in
  turn): arrays typed on an ``Explicit`` mesh (``partition.plain_array``)
  and global arrays on the caller's multi-process mesh (gathered whole,
  ``distributed.whole_arrays``: every process passes them), each typed one
  remembering its mesh and spec; ``tree`` itself where it has none."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_own_value)
  spread = [i for i, x in enumerate(leaves) if _global_on(x, caller)]
  typed = [i for i, x in enumerate(leaves) if partition_lib.typed_on_mesh(x)]
  if spread:
    _note_caller_spans_processes()
  if not spread and not typed:
    return tree
  gather = [i for i in spread if not leaves[i].sharding.is_fully_replicated]
  wholes = {}
  if gather:  # (A collective: every process passes the same arrays.)
    got = distributed.whole_arrays([leaves[i] for i in gather])
    wholes = dict(zip(gather, got, strict=True))
  for k, i in enumerate(sorted({*spread, *typed})):
    x = leaves[i]
    if i in wholes:
      local = jax.local_devices()
      leaves[i] = jax.device_put(wholes[i], local[k % len(local)])
    elif i in spread:  # (Replicated: every process holds it whole.)
      leaves[i] = x.addressable_shards[0].data
    else:
      leaves[i] = partition_lib.plain_array(x, k)
    if partition_lib.typed_on_mesh(x):
      spec = jax.typeof(x).sharding.spec
      partition_lib.remember_type(leaves[i], x.sharding.mesh, spec)
  return jax.tree.unflatten(treedef, leaves)


def _note_caller_spans_processes() -> None:
  global _caller_spans_processes
  _caller_spans_processes = True


def _global_on(x, caller) -> bool:
  """Whether ``x`` is an array with shards in other processes on the
  caller's mesh (where none is set: on any mesh but the pipeline's own)."""
  if not (
    isinstance(x, jax.Array)
    and isinstance(x.sharding, NamedSharding)
    and not x.is_fully_addressable
  ):
    return False
  mesh = x.sharding.mesh
  if caller is None:
    return mesh not in _OWN_MESHES
  return mesh.abstract_mesh == getattr(caller, "abstract_mesh", caller)


# The meshes the pipeline makes itself (a replica group's, a transfer's
# pair): arrays on them are its own, never the caller's.
_OWN_MESHES: set = set()


def own_mesh(mesh):
  """Registers ``mesh`` as one the pipeline made; returns it."""
  _OWN_MESHES.add(mesh)
  return mesh


# Types whose values hold only the pipeline's own arrays (its state):
# ``_plain`` never looks into them, which keeps a step's per-call check to
# the batch's leaves (a state's hundreds of leaves cost ~300 us a call).
_OWN_TYPES: tuple[type, ...] = ()


def own_type(cls):
  """Class decorator: registers ``cls`` as a type whose values hold only
  arrays the pipeline placed (never the caller's); returns it."""
  global _OWN_TYPES
  _OWN_TYPES = (*_OWN_TYPES, cls)
  return cls


def _own_value(x) -> bool:
  return isinstance(x, _OWN_TYPES)


def outside_user_mesh(cls):
  """Class decorator: ``__init__`` and every public method of ``cls``
  (its bases' too) run ``without_mesh``; properties are left as they
  are (they compute nothing on devices)."""
  for name in ["__init__", *dir(cls)]:
    if name.startswith("_") and name != "__init__":
      continue
    attr = inspect.getattr_static(cls, name)
    if inspect.isfunction(attr):
      setattr(cls, name, without_mesh(attr))
  return cls
