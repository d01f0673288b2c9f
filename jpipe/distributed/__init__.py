"""Several processes (hosts, GPUs) through ``jax.distributed``.

``initialize()`` starts this process's part of a multi-process run from
the environment (``python -m jpipe.launch`` sets it; SLURM is detected by
JAX); a ``jpipe.Pipeline`` built afterwards over ``jax.devices()`` runs
each stage in the process that owns its devices.
"""

from jpipe.distributed._initialize import initialize, is_main_process
from jpipe.distributed._sync import (
  PeerTimeout,
  agree,
  allgather,
  arrays_everywhere,
  barrier,
  broadcast,
  client,
  exchange,
  host_address,
  note_received,
  quiet,
  text_from_process_zero,
  whole_arrays,
)

__all__ = [
  "PeerTimeout",
  "agree",
  "allgather",
  "arrays_everywhere",
  "barrier",
  "broadcast",
  "client",
  "exchange",
  "host_address",
  "initialize",
  "is_main_process",
  "note_received",
  "quiet",
  "text_from_process_zero",
  "whole_arrays",
]
