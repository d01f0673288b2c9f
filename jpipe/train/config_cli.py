"""The training command line's flags: short errors and a help that lists
the config's fields.

absl and ml_collections report a bad override as a Python traceback (an
unknown key ends in ``AttributeError: "'num_steps'"``). ``parse_flags``
(``app.run``'s ``flags_parser``) turns any flag error into a few lines:
the flag, the value, what is allowed and the closest valid key; ``--help``
prints every config field with its value and meaning (from the comments
of ``base_config.py``).
"""

import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
import textwrap

import ml_collections
from absl import flags

from jpipe.train import base_config
from jpipe.train.config_plan import load_config_file

USAGE = """\
usage: python -m jpipe.train --config CONFIG.py[:VARIANT] --workdir DIR \
[--config.KEY=VALUE ...]

Trains a model split into pipeline stages (one per device) as CONFIG says,
writing checkpoints, metrics.jsonl, TensorBoard events, the resolved config
and the plan into DIR; a DIR with a checkpoint resumes, one a live run
holds is refused. Any config field can be overridden:
--config.train.steps=1000 --config.schedule.name=async. Several
processes: python -m jpipe.launch --nprocs N -- python -m jpipe.train ... .
Exit status: 0 finished, 2 bad flags, config or workdir, 143 / 130
stopped by SIGTERM / SIGINT after saving a checkpoint (run the same
command to resume), 1 any other error.
"""

_HELP_FLAGS = ("-h", "--help", "--helpshort", "-?")


@dataclasses.dataclass(frozen=True)
class Command:
  """A command taking ``--config``: its module, usage and own flags."""

  module: str
  usage: str
  flag_lines: tuple[str, ...]
  needs_workdir: bool = False


_CONFIG_LINE = "  --config: the training config file (configs/*.py[:VARIANT])."
TRAIN = Command(
  "jpipe.train",
  USAGE,
  (
    _CONFIG_LINE,
    "  --workdir: where checkpoints, logs and pictures go (resumes).",
  ),
  needs_workdir=True,
)


def command_of_flags(module: str, usage: str, names) -> Command:
  """A ``Command`` listing the absl flags ``names`` with their help."""
  lines = [_CONFIG_LINE]
  for name in names:
    flag = flags.FLAGS[name]
    lines.append(f"  --{name}: {flag.help} (default {flag.default!r})")
  return Command(module, usage, tuple(lines))


def parse_flags(argv: list[str], command: Command = TRAIN) -> list[str]:
  """``absl.app.run``'s flag parser: absl's, with errors and ``--help``
  rewritten for people (``functools.partial`` it with another
  ``Command``). Exits with status 2 on a bad flag."""
  if any(arg in _HELP_FLAGS for arg in argv[1:]):
    print(help_text(argv, command))
    sys.exit(0)
  try:
    rest = flags.FLAGS(argv)
    # ml_collections defers a config file's load errors to the first read.
    if flags.FLAGS["config"].present:
      flags.FLAGS.config.to_dict()
  except Exception as e:  # absl's flag errors and the overrides' raw ones.
    why = explain(argv, e, needs_workdir=command.needs_workdir)
  else:
    if len(rest) == 1:
      return rest
    why = stray_arguments(argv, rest[1:])  # (absl leaves them to main.)
  sys.stderr.write(
    f"error: {why}\n(python -m {command.module} --help lists every config "
    "field)\n"
  )
  sys.exit(2)


def stray_arguments(argv: list[str], stray: list[str]) -> str:
  """The line for arguments no flag took (``stray``, in order): each
  option is a flag. The usual cause is a boolean field given its value
  after a space (absl's booleans take none: ``--config.KEY=false``)."""
  first = stray[0]
  before = argv[argv.index(first) - 1] if first in argv[1:] else ""
  if before.startswith("--config.") and "=" not in before:
    key = before[len("--config.") :]
    return (
      f"{before} {first}: a boolean field takes its value after '=' "
      f"(--config.{key}={first.lower()})"
    )
  return (
    f"unexpected argument{'s' if len(stray) > 1 else ''} "
    f"{' '.join(stray)}: every option is a flag (--workdir DIR, "
    "--config.KEY=VALUE)"
  )


def explain(
  argv: list[str], error: Exception, needs_workdir: bool = True
) -> str:
  """One or a few lines saying which flag is wrong and how to fix it."""
  spec = _flag_value(argv, "config")
  if spec is None:
    return (
      "--config is required: --config configs/default.py (any configs/*.py)"
    )
  try:
    config = load_config_file(spec)
  except Exception as e:
    return f"--config {spec}: cannot load it ({type(e).__name__}: {e})"
  keys = sorted(flatten(config))
  for key, value in _overrides(argv):
    if key not in keys and not any(k.startswith(key + ".") for k in keys):
      if key.startswith("model.kwargs."):
        return _new_model_kwarg(key, value, config.model.kwargs.to_dict())
      return _unknown_key(key, value, keys)
  message = str(error).strip().splitlines()[0] if str(error) else repr(error)
  match = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", message)
  if match:
    key, value, why = match.groups()
    now = flatten(config).get(key)
    return (
      f"--config.{key}={value}: expected {type(now).__name__} like its "
      f"current value {now!r} ({why})"
    )
  if needs_workdir and _flag_value(argv, "workdir") is None:
    return "--workdir is required: where checkpoints and logs go"
  return message.removeprefix("flag ")


def load_with_overrides(spec: str, argv: list[str]):
  """``spec``'s config (``PATH[:VARIANT]``) with the ``--config.KEY=VALUE``
  (or ``--config.KEY VALUE``) overrides in ``argv`` applied by absl's
  parser, as ``python -m jpipe.train`` applies them. Raises ValueError
  with ``explain``'s lines on a bad override or an unloadable file, and
  on any other argument."""
  from ml_collections import config_flags

  others = [
    a
    for i, a in enumerate(argv)
    if not a.startswith("--config.")
    and not (
      i and argv[i - 1].startswith("--config.") and "=" not in argv[i - 1]
    )
  ]
  if others:
    raise ValueError(f"unrecognized arguments: {' '.join(others)}")
  full = ["jpipe", "--config", spec, *argv]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file(  # (Its overrides are read from sys_argv.)
    "config",
    None,
    "the config",
    flag_values=values,
    lock_config=True,
    sys_argv=full,
  )
  try:
    values(full)
    config = values.config
    config.to_dict()  # (The file's own errors surface at the first read.)
  except Exception as e:
    raise ValueError(explain(full, e, needs_workdir=False)) from None
  return config


def flatten(config, prefix: str = "") -> dict:
  """``{"train.steps": 300, ...}`` for every leaf field."""
  out = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict):
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def write_config_json(workdir: str, config) -> None:
  """The resolved config as ``workdir/config.json`` (beside the
  checkpoints, as Flax examples and big_vision users expect it)."""
  text = config.to_json_best_effort(indent=2, sort_keys=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(text + "\n")


def saved_fields(path: str) -> dict:
  """``{"a.b": value}`` of the config.json at ``path`` (a run's resolved
  config); {} where there is none (or it does not parse)."""
  try:
    with open(path) as f:
      before = json.load(f)
  except (OSError, ValueError):
    return {}
  return flatten(ml_collections.ConfigDict(before))


def changed_fields(path: str, config) -> str:
  """``"a.b: 1 -> 2; ..."`` between the config.json at ``path`` (a run's
  resolved config) and ``config``; "" when there is none or nothing
  changed."""
  old = saved_fields(path)
  if not old:
    return ""
  # (Both from JSON: a tuple and its list compare equal.)
  now = json.loads(config.to_json_best_effort())
  new = flatten(ml_collections.ConfigDict(now))
  return "; ".join(
    f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
    for k in sorted(old.keys() | new.keys())
    if old.get(k) != new.get(k)
  )


def field_docs(text_data: bool = False) -> dict[str, str]:
  """Each field's meaning, from the comments beside and above its line in
  ``base_config.py`` (``d.x`` there is ``data.x``, from ``text_data`` or
  ``image_data``)."""
  skip = "image_data" if text_data else "text_data"
  docs, block, function = {}, [], None
  for line in inspect.getsource(base_config).splitlines():
    stripped = line.strip()
    if line.startswith("def "):
      function = line[4:].split("(")[0]
    if stripped.startswith("#"):
      block.append(stripped.lstrip("# "))
      continue
    match = re.match(r"([cd])\.([\w.]+)\s*=\s*(.*)$", stripped)
    if match and function != skip:
      kind, key, rest = match.groups()
      if rest.startswith("ml_collections.ConfigDict()"):
        continue  # (A section: its comment opens its first field's.)
      key = f"data.{key}" if kind == "d" else key
      trailing = rest.split("  # ", 1)[1] if "  # " in rest else ""
      # The first commented assignment documents a field (variants set
      # it again without one).
      if not docs.get(key):
        docs[key] = " ".join([*block, trailing]).strip()
    block = []
  return docs


def help_text(argv: list[str], command: Command = TRAIN) -> str:
  """The usage, the flags, and the fields of ``--config`` (when given and
  loadable; else the fields every config has)."""
  spec = _flag_value(argv, "config")
  title = "Config fields (every config has these; CONFIG sets its own values)"
  try:
    config = load_config_file(spec) if spec else None
  except Exception:
    config = None
  if config is None:
    config = base_config.base_config()
    config.data = base_config.image_data()
  else:
    title = f"Fields of {spec} (override any: --config.KEY=VALUE)"
  docs = field_docs(text_data="text_key" in config.get("data", {}))
  lines = [command.usage, "flags:", *command.flag_lines, ""]
  lines.append(f"{title}:")
  for key, value in flatten(config).items():
    lines.append(f"  {key} = {value!r}")
    if docs.get(key):
      lines += textwrap.wrap(
        docs[key], 78, initial_indent=" " * 6, subsequent_indent=" " * 6
      )
  return "\n".join(lines)


def _new_model_kwarg(key, value, kwargs: dict) -> str:
  """A model keyword the config does not set yet (``model.kwargs.dtype``):
  absl overrides only existing fields, so the whole dict, with it."""
  name = key.removeprefix("model.kwargs.")
  whole = {**kwargs, name: value}
  return (
    f"--config.{key}={value}: config.model.kwargs sets no {name} yet, and "
    f"a flag can only change a field it has; pass the whole dict with it: "
    f'--config.model.kwargs="{whole!r}"'
  )


def _unknown_key(key, value, keys) -> str:
  section = key.rpartition(".")[0]
  close = difflib.get_close_matches(key, keys, n=2, cutoff=0.6)
  last = key.rpartition(".")[2]
  close += [k for k in keys if k.rpartition(".")[2] == last and k not in close]
  hint = f"; did you mean {' or '.join(f'config.{k}' for k in close)}?"
  siblings = [k for k in keys if k.rpartition(".")[0] == section]
  if not close:
    hint = (
      f"; config.{section} has {', '.join(k.rpartition('.')[2] for k in siblings)}"
      if siblings
      else ""
    )
  return f"--config.{key}={value}: config has no field {key}{hint}"


def _overrides(argv):
  """(key, value) of every ``--config.KEY=VALUE`` / ``--config.KEY VALUE``."""
  out = []
  for i, arg in enumerate(argv):
    if arg.startswith("--config."):
      key, eq, value = arg[len("--config.") :].partition("=")
      if not eq and i + 1 < len(argv):
        value = argv[i + 1]
      out.append((key, value))
  return out


def _flag_value(argv, name):
  """The value of ``--name=X`` or ``--name X`` in argv (the last one, as
  absl takes it), else None."""
  value = None
  for i, arg in enumerate(argv):
    if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
      value = argv[i + 1]
    for prefix in (f"--{name}=", f"-{name}="):
      if arg.startswith(prefix):
        value = arg[len(prefix) :]
  return value
