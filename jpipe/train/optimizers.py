"""``config.optimizer`` -> an optax optimizer: by name, with its arguments.

``sgd``, ``adam`` and ``adamw`` are jpipe's staleness suite's (weight
prediction and Gap-Aware know their state); any other optax optimizer
that takes a ``learning_rate`` is taken by name (``adafactor``, ``lamb``,
``lion``, ``rmsprop``, ``lars``, ...) with ``config.optimizer.args``
("b2=0.98,eps=1e-6": its keyword arguments as Python literals). Each
stage applies the optimizer to its own leaves, which for these
optimizers (per-leaf updates, LAMB's and LARS's per-leaf trust ratios
included) is the single-device step; the global gradient norm clipping
needs is the pipeline's (``clip_global_norm``); one that is not per leaf
(``lbfgs`` reads the loss) is refused at the pipeline's build
(``jpipe.OptimizerError``, a UsageError here). ``no_decay`` masks weight
decay by param path (each stage's optimizer sees its leaves at their
model paths, so the mask is the one-device one).
"""

import ast
import inspect

import jax
import optax

from jpipe.runtime.build import stage_optimizer
from jpipe.train import pretrained
from jpipe.train.errors import UsageError

# Optimizers whose state the staleness transforms read (prediction, GA).
STALENESS_AWARE = ("sgd", "adam", "adamw")


def parse_args(text: str) -> dict:
  """``"b2=0.98,eps=1e-6"`` -> ``{"b2": 0.98, "eps": 1e-06}``: keyword
  arguments as Python literals ("" -> {})."""
  if not text.strip():
    return {}
  try:
    call = ast.parse(f"f({text})", mode="eval").body
    if call.args:
      raise ValueError("positional")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
  except (SyntaxError, ValueError) as e:
    raise UsageError(
      f"config.optimizer.args={text!r}: not keyword=literal pairs ({e}); "
      "write e.g. 'b2=0.98,eps=1e-6'"
    ) from None


def optax_function(name: str):
  """``optax.<name>``, an optimizer taking a learning rate; a UsageError
  naming the choices otherwise."""
  fn = getattr(optax, name, None)
  try:
    takes_lr = fn is not None and "learning_rate" in _parameters(fn)
  except (TypeError, ValueError):
    takes_lr = False
  if not takes_lr:
    raise UsageError(
      f"config.optimizer.name={name!r} is not an optax optimizer taking a "
      "learning_rate: use sgd, adam, adamw, adafactor, lamb, lion, "
      "rmsprop, ... (optax's names)"
    )
  return fn


def check(config) -> None:
  """The optimizer's name and arguments, before any work."""
  opt = config.optimizer
  fn = optax_function(opt.name)
  if opt.no_decay and not opt.weight_decay:
    raise UsageError(
      f"config.optimizer.no_decay={opt.no_decay!r} with weight_decay=0: "
      "there is no weight decay to skip; set config.optimizer.weight_decay "
      "or leave no_decay empty"
    )
  pretrained.path_patterns(opt.no_decay)
  known = _parameters(fn)
  if opt.no_decay and "weight_decay" in known and "mask" not in known:
    raise UsageError(
      f"config.optimizer.no_decay: optax.{opt.name} takes no weight-decay "
      "mask; leave no_decay empty or choose adamw, lamb, lion, ..."
    )
  args = parse_args(opt.args)
  for key in args:
    if key not in known or key == "learning_rate":
      raise UsageError(
        f"config.optimizer.args: optax.{opt.name} takes no {key!r}; it "
        f"takes {', '.join(k for k in known if k != 'learning_rate')} (the "
        "learning rate is config.optimizer.learning_rate)"
      )


def build(config, lr, **override) -> optax.GradientTransformation:
  """The config's optimizer with learning rate ``lr`` (a number or an
  optax schedule). ``weight_decay`` is the optimizer's own argument
  where it has one (decoupled: adamw, lamb, lion, ...), else L2 added to
  the gradient; ``momentum`` is SGD's (others take theirs in ``args``);
  ``override``: arguments of the optax function over the config's (e.g.
  ``nesterov=True``)."""
  opt = config.optimizer
  fn = optax_function(opt.name)
  kwargs = {"learning_rate": lr}
  if opt.name == "sgd":
    kwargs["momentum"] = opt.momentum or None
  kwargs |= parse_args(opt.args) | override
  decoupled = "weight_decay" in _parameters(fn)
  mask = decay_mask(opt.no_decay)
  if decoupled and "weight_decay" not in kwargs:
    kwargs["weight_decay"] = opt.weight_decay
  if decoupled and mask is not None:
    kwargs["mask"] = mask  # (``check``: the optimizer takes one.)
  tx = fn(**kwargs)
  if opt.weight_decay and not decoupled:
    decay = optax.add_decayed_weights(opt.weight_decay, mask=mask)
    tx = optax.chain(decay, tx)
  return tx


def decay_mask(patterns: str):
  """A weight-decay mask function from ``config.optimizer.no_decay``
  (comma-separated regular expressions searched in each leaf's
  ``"a/b/c"`` path): True (decayed) where none matches; None for ""."""
  compiled = pretrained.path_patterns(patterns)
  if not compiled:
    return None

  def mask(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: (
        not any(c.search(stage_optimizer.path_name(path)) for c in compiled)
      ),
      params,
    )

  return mask


def _parameters(fn) -> list[str]:
  return list(inspect.signature(fn).parameters)
