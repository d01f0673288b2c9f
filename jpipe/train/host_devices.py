"""The commands' CPU devices: 8 fake host devices unless the user's
``XLA_FLAGS`` names a count, so a pipeline has devices to run on without
an accelerator (harmless on GPU machines)."""

import os

COUNT_FLAG = "--xla_force_host_platform_device_count"


def default_cpu_device_count(count: int = 8) -> None:
  """Adds ``COUNT_FLAG=count`` to ``XLA_FLAGS`` unless it names one.

  Must run before JAX starts its backend (the first ``jax.devices()``).
  A user's other XLA flags are kept: with ``setdefault`` any of them
  (``--xla_dump_to``, say) left one CPU device."""
  flags = os.environ.get("XLA_FLAGS", "")
  if COUNT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {COUNT_FLAG}={count}".strip()


def cpu_count_hint(platform: str, have: int) -> str:
  """``, on CPU ...``: how to get more fake CPU devices, for a message
  saying there are too few; empty on other platforms."""
  if platform != "cpu":
    return ""
  return (
    f"; on CPU, XLA_FLAGS={COUNT_FLAG}=N sets the device count (this "
    f"run's: {have})"
  )
