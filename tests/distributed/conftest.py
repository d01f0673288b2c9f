"""Environment for the processes the distributed tests start."""

import os

import pytest

ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


@pytest.fixture
def process_env():
  """``env(**extra)``: this environment without proxies (gRPC would route
  127.0.0.1 through them) and without the fake-device flag (each process
  sets its own device count), on CPU with quick compiles (the tests are
  compile-bound on 2 cores; both sides of a comparison alike)."""

  def env(**extra):
    out = {
      k: v
      for k, v in os.environ.items()
      if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    out.pop("XLA_FLAGS", None)
    out["JAX_PLATFORMS"] = "cpu"
    out["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    out["PYTHONPATH"] = ROOT + os.pathsep + out.get("PYTHONPATH", "")
    out.update(extra)
    return out

  return env
