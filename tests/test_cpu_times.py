"""``--cpu-times`` (tests/cpu_times.py) on a made-up suite in a pytest of
its own: a test's CPU seconds are its own process's plus those of the
processes it waited for, each test apart, the busiest first."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE = """
import subprocess
import sys
import time


def _spin(seconds):
  end = time.process_time() + seconds
  while time.process_time() < end:
    pass


def test_own():
  _spin(0.4)


def test_child():
  spin = "import time; e = time.process_time() + 0.6\\n"
  spin += "while time.process_time() < e: pass"
  subprocess.run([sys.executable, "-c", spin], check=True)


def test_idle():
  time.sleep(0.3)
"""


def test_each_test_is_charged_its_own_and_its_childrens_cpu(tmp_path):
  (tmp_path / "test_made_up.py").write_text(textwrap.dedent(SUITE))
  (tmp_path / "pytest.ini").write_text("[pytest]\n")  # (Not jpipe's options.)
  done = subprocess.run(
    [
      *(sys.executable, "-m", "pytest", "-p", "tests.cpu_times"),
      *("-p", "no:cacheprovider", "--cpu-times=3", "-q", str(tmp_path)),
    ],
    cwd=tmp_path,
    env=dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0, done.stdout[-3000:]
  rows = {}
  for line in done.stdout.splitlines():
    parts = line.split()
    if len(parts) == 4 and parts[3].startswith("test_made_up.py::"):
      rows[parts[3].split("::")[1]] = [float(x) for x in parts[:3]]
  assert list(rows) == ["test_child", "test_own", "test_idle"], done.stdout
  total, own, children = rows["test_child"]
  assert children >= 0.55 and own < 0.2
  assert abs(total - (own + children)) <= 0.11  # (Each printed to 0.1.)
  total, own, children = rows["test_own"]
  assert own >= 0.38 and children == 0.0
  assert rows["test_idle"][0] < 0.2  # A sleep is no CPU.
