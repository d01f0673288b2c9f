"""``Pipeline.generate`` across processes (``jpipe.launch``, one stage per
process): every process gets the tokens one process generates -- GPT-2
with prompts of different lengths and an end token, and an
encoder-decoder whose encoder outputs each decoder stage reads from the
cache (moved to the other processes), and scanned layers whose stacked
cache rows stay on their stages. The worker is
``generate_worker.py`` beside this file."""

import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "generate_worker.py")


def _run(command, env):
  done = subprocess.run(
    command, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
  )
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  return done


@pytest.mark.slow
def test_generate_across_processes_equals_one_process(tmp_path, process_env):
  ref, got = str(tmp_path / "ref"), str(tmp_path / "got")
  _run([sys.executable, WORKER, ref], process_env(JPIPE_CPU_DEVICES="3"))
  launch = [sys.executable, "-m", "jpipe.launch", "--nprocs", "3"]
  launch += ["--devices-per-process", "1", "--", sys.executable, WORKER, got]
  _run(launch, process_env())
  want = np.load(ref + ".p0.npz")
  # The end token ended some sequences early, not all.
  ended = want["gpt2"] == want["gpt2"][0, 1]
  assert ended.any() and not ended.all()
  for p in range(3):
    have = np.load(f"{got}.p{p}.npz")
    for name in ("gpt2", "seq2seq", "scanned"):
      np.testing.assert_array_equal(have[name], want[name], err_msg=name)
