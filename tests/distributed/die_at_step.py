"""``python -m tests.distributed.die_at_step PROCESS:STEP MODULE ARGS...``:
runs ``python -m MODULE ARGS...`` with process PROCESS of a run that did
not resume killed by SIGKILL (no clean-up) once step STEP is trained: a
process dying mid-run, for the launcher's restarts. The restarted run
resumes, so it does not die again."""

import os
import runpy
import signal
import sys

import jax

from jpipe.train import loop


def _die_after(process: int, step: int) -> None:
  """Wraps the training loop's unit so that it dies where asked."""
  train_unit = loop._Loop._train

  def train_unit_then_die(self, state, unit, first):
    out = train_unit(self, state, unit, first)
    done = (unit + 1) * self.mode.unit_steps
    if not self.start and done == step and jax.process_index() == process:
      os.kill(os.getpid(), signal.SIGKILL)
    return out

  loop._Loop._train = train_unit_then_die


def main() -> None:
  spec, module, *args = sys.argv[1:]
  process, step = (int(x) for x in spec.split(":"))
  _die_after(process, step)
  sys.argv = [module, *args]
  runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
