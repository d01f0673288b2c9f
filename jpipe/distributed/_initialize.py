"""Joining a multi-process run: environment, ``jax.distributed``, faults.

The environment (set by ``python -m jpipe.launch``, or by hand):

=========================  =================================================
``JAX_COORDINATOR_ADDRESS``  host:port of process 0's coordinator
``JAX_NUM_PROCESSES``        processes in the run
``JAX_PROCESS_ID``           this process's rank, 0 .. N - 1
``JPIPE_CPU_DEVICES``        CPU devices of this process (CPU runs)
=========================  =================================================

Without them, under SLURM (``SLURM_JOB_ID`` and more than one task) JAX's
cluster detection fills them in; otherwise the run is one process.

Faults never hang (spec/multiprocess.md): the coordination service's
heartbeat aborts every process within ~``heartbeat_timeout_s`` of one being
killed or stopped, and an uncaught exception prints its traceback and
ends the process at once (``os._exit``), so its peers' next transfer
fails instead of waiting in the shutdown barrier for minutes.
"""

import errno
import os
import socket
import sys
import threading
import traceback

import jax

# What an uncaught exception in a multi-process run exits with.
EXIT_EXCEPTION = 1


def _env_int(name):
  value = os.environ.get(name)
  if value is None or value == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name}={value!r} is not an integer") from None


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  cpu_devices: int | None = None,
  heartbeat_timeout_s: int = 10,
  shutdown_timeout_s: int = 10,
  initialization_timeout_s: int = 120,
) -> bool:
  """Joins the multi-process run the arguments or environment describe.

  Call it first, before any other JAX call. Arguments left None are read
  from the environment (see the module docstring).

  Args:
    coordinator_address: "host:port" of process 0.
    num_processes, process_id: the run's size and this process's rank.
    cpu_devices: CPU devices this process exposes (CPU runs).
    heartbeat_timeout_s: a process silent this long is declared dead and
      every process is stopped.
    shutdown_timeout_s: how long a normal exit waits for the others.
    initialization_timeout_s: how long to wait for every process to join.

  Returns:
    Whether several processes run (False: a one-process run, nothing was
    initialised beyond ``cpu_devices``).
  """
  if cpu_devices is None:
    cpu_devices = _env_int("JPIPE_CPU_DEVICES")
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  coordinator_address = coordinator_address or os.environ.get(
    "JAX_COORDINATOR_ADDRESS"
  )
  if num_processes is None:
    num_processes = _env_int("JAX_NUM_PROCESSES")
  if process_id is None:
    process_id = _env_int("JAX_PROCESS_ID")
  slurm = _env_int("SLURM_NTASKS") or 0
  if num_processes is None and slurm <= 1:
    return False
  if num_processes == 1:
    return False
  if num_processes is not None and (
    coordinator_address is None or process_id is None
  ):
    raise ValueError(
      f"{num_processes} processes need JAX_COORDINATOR_ADDRESS (host:port "
      "of process 0) and JAX_PROCESS_ID (0 .. N-1) too: start the run "
      "with `python -m jpipe.launch --nprocs N -- ...` or set them"
    )
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(
      f"JAX_PROCESS_ID={process_id} is not in 0 .. {num_processes - 1}"
    )
  if process_id == 0 and coordinator_address:
    _check_port_free(coordinator_address)
  # gloo runs CPU collectives (the transfers between stages).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX aborts (C++, no Python error) when not every process joins in
  # time, saying only "another task died": say first who waited for what.
  late = threading.Timer(
    max(initialization_timeout_s - 3, 1),
    _say_not_joined,
    (coordinator_address, num_processes, process_id, initialization_timeout_s),
  )
  late.daemon = True
  late.start()
  try:
    jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
      shutdown_timeout_seconds=shutdown_timeout_s,
      initialization_timeout=initialization_timeout_s,
    )
  finally:
    late.cancel()
  sys.excepthook = _exit_at_once
  return True


def _check_port_free(address: str) -> None:
  """Process 0 serves the coordinator at ``address``'s port: a port in
  use (another run's coordinator) crashed it with a segmentation fault."""
  port = address.rsplit(":", 1)[-1]
  if not port.isdigit():
    raise ValueError(
      f"JAX_COORDINATOR_ADDRESS={address!r} has no port: give host:port"
    )
  with socket.socket() as s:
    # (A closed run's connections in TIME_WAIT do not count; a listener
    # does, on Linux, even with this.)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("", int(port)))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        return  # (Not ours to judge: JAX reports it.)
      raise ValueError(
        f"JAX_COORDINATOR_ADDRESS={address}: port {port} is in use on "
        "this host (another run's coordinator?); choose a free port "
        "(python -m jpipe.launch picks one)"
      ) from None


def _say_not_joined(address, num_processes, process_id, timeout_s) -> None:
  sys.stderr.write(
    f"jpipe: process {process_id} has waited {timeout_s - 3} s for all "
    f"{num_processes} processes to join at {address} (JAX gives up at "
    f"{timeout_s} s): start every process (python -m jpipe.launch --nprocs "
    f"{num_processes} starts them all), each with its own JAX_PROCESS_ID, "
    "and check the address is process 0's host and port, reachable from "
    "here\n"
  )
  sys.stderr.flush()


def is_main_process() -> bool:
  """Whether this process writes logs, metrics and pictures (process 0)."""
  return jax.process_index() == 0


def _exit_at_once(kind, value, tb):
  """An uncaught exception: its traceback, then exit now (a normal exit
  would wait in the shutdown barrier while the peers wait on this
  process's transfers)."""
  sys.stderr.write(
    f"process {jax.process_index()} of {jax.process_count()} failed:\n"
  )
  sys.stderr.write("".join(traceback.format_exception(kind, value, tb)))
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(EXIT_EXCEPTION)
