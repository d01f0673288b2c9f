"""The state side of ``DataParallelPipelines``: every pipeline's state,
the consensus model (the replicas' mean) to evaluate, and checkpoints.

A base class of ``DataParallelPipelines`` (``_pipelines.py``), which sets
the attributes read here: ``pipelines`` / ``all_pipelines`` (this
process's and every pipeline), ``ranks``, ``reporter``, ``policy``,
``hub``, ``num_pipelines``, ``num_stages``, ``_idle`` and
``_params_template``. Every process calls every method, in the same
order; lists of states are this process's pipelines' (``ranks``).
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jpipe.runtime import Pipeline, PipelineState, is_key, trees_everywhere


class ConsensusStateMethods:
  """Init, consensus, evaluation and state dicts of P pipelines."""

  def init(self, params: Any, model_state: Any = None) -> list[PipelineState]:
    """Every pipeline's state from the same params."""
    states = [pipe.init(params, model_state) for pipe in self.pipelines]
    self._idle = {
      p: pipe.init(params, model_state)  # Nothing placed: no stage here.
      for p, pipe in enumerate(self.all_pipelines)
      if p not in self.ranks
    }
    self.policy.start(self.all_pipelines[0].stage_params_of(params))
    return states

  def _everyone(self, states) -> list[PipelineState]:
    """Every pipeline's state, by rank (an empty one where this process
    runs none of its stages)."""
    mine = dict(zip(self.ranks, states, strict=True))
    return [mine.get(p, self._idle.get(p)) for p in range(self.num_pipelines)]

  def _from_reporters(self, trees, template) -> list:
    """Per pipeline, its tree as the process of its last stage has it,
    on every process (``trees``: this process's, None where it has
    none; ``template``: the shapes and dtypes)."""
    if jax.process_count() == 1:
      return list(trees)
    me = jax.process_index()
    got = trees_everywhere(
      [
        t if r == me else None
        for t, r in zip(trees, self.reporter, strict=True)
      ],
      [template] * len(trees),
      self.reporter,
      to_every_process=True,
    )
    # (The broadcast makes 64-bit values 32-bit: this process's dtypes;
    # typed PRNG keys come back as keys, which NumPy cannot hold.)
    return [
      jax.tree.map(
        lambda x, a: x if is_key(a) else np.asarray(x, a.dtype), t, template
      )
      for t in got
    ]

  def consensus_params(self, states: Sequence[PipelineState]) -> Any:
    """The mean of all pipelines' params (host arrays, on every process):
    the model to evaluate. Needs drained pipelines."""
    gathered = [
      pipe.gather_params(s)
      for pipe, s in zip(
        self.all_pipelines, self._everyone(states), strict=True
      )
    ]
    return mean_trees(self._from_reporters(gathered, self._params_template))

  def consensus_state(
    self, states: Sequence[PipelineState]
  ) -> tuple[Pipeline, PipelineState | None]:
    """(pipeline 0, its drained state with every stage's params the mean
    over all P pipelines'; None in a process that runs none of its
    stages): the consensus model on pipeline 0's stages, to evaluate
    through them (``evaluate_consensus``). Each stage's mean is taken
    on the stage's devices as the sync averages (a collective, or
    ``PeerMean`` where pipelines span processes); nothing is gathered to
    a host. Model state (BatchNorm statistics)
    stays pipeline 0's own. Every process calls it."""
    everyone = self._everyone(states)
    self._consensus_calls += 1  # (Every process counts alike.)
    means = []
    for s in range(self.num_stages):
      here = sorted(self.policy.local[s])
      if not here:  # The stage's replicas all run elsewhere.
        means.append(None)
        continue
      every = range(self.num_pipelines)
      devices = {r: self.policy.devices[r][s] for r in every}
      trees = [everyone[r].stage_params[s] for r in here]
      if self.policy.peers is not None:  # (As the sync averages.)
        key = ("consensus", self._consensus_calls, s)
        out = self.policy.peers(key, trees, here, tuple(every), devices)
      else:
        out = self.policy.mean(trees, [devices[r] for r in every])
      means.append(dict(zip(here, out, strict=True)).get(0))
    first = self.all_pipelines[0]
    if 0 not in self.ranks:
      return first, None
    return first, first.with_stage_params(everyone[0], means)

  def first_model_state(self, states) -> Any:
    """Pipeline 0's model state (host arrays; None without one), on its
    processes (process 0 among them). Every process calls it."""
    return self.all_pipelines[0].gather_model_state(self._everyone(states)[0])

  def evaluate_consensus(self, states, evaluate: Callable) -> dict:
    """``evaluate(pipeline, state)`` -> ``{name: float}`` at the
    consensus (``consensus_state``), run by pipeline 0's processes;
    every process gets the metrics. Every process calls it."""
    pipe, state = self.consensus_state(states)
    metrics = None
    if state is not None:
      metrics = {k: float(v) for k, v in evaluate(pipe, state).items()}
    if jax.process_count() == 1:
      return metrics
    got = self.hub.all_gather("consensus metrics", metrics)
    return got[self.reporter[0]]

  def state_dict(self, states: Sequence[PipelineState]) -> dict:
    """``{"pipelines": [every pipeline's state_dict, by rank]}`` (host
    arrays, on every process)."""
    dicts = [
      pipe.state_dict(s)
      for pipe, s in zip(
        self.all_pipelines, self._everyone(states), strict=True
      )
    ]
    template = jax.tree.map(leaf_aval, next(d for d in dicts if d is not None))
    dicts = self._from_reporters(dicts, template)
    for d in dicts:
      d["step"] = int(d["step"])
    return {"pipelines": dicts}

  def load_state_dict(self, tree: dict) -> list[PipelineState]:
    """This process's pipelines' states from ``state_dict``'s output.
    Saved with as many pipelines: each resumes its own replica. With
    another count, every pipeline starts from the replicas' mean (params,
    optimizer and model state; the largest step)."""
    saved = list(tree["pipelines"])
    if len(saved) != self.num_pipelines:
      saved = [_mean_state_dict(saved)] * self.num_pipelines
    states = [
      pipe.load_state_dict(saved[p])
      for p, pipe in zip(self.ranks, self.pipelines, strict=True)
    ]
    self._idle = {
      p: pipe.load_state_dict(saved[p])  # Nothing placed: no stage here.
      for p, pipe in enumerate(self.all_pipelines)
      if p not in self.ranks
    }
    first = self.all_pipelines[0]
    self.policy.start(first.stage_params_of(saved[0]["params"]))
    return states


def mean_trees(trees):
  """The element-wise mean of pytrees of host arrays; integer, non-numeric
  leaves and PRNG keys (an optimizer's step count, an NNX RNG stream) stay
  as the first's."""

  def mean(*xs):
    if is_key(xs[0]):
      return xs[0]
    x0 = np.asarray(xs[0])
    if not np.issubdtype(x0.dtype, np.inexact):
      return xs[0]
    return np.mean(np.stack([np.asarray(x) for x in xs]), axis=0).astype(
      x0.dtype
    )

  return jax.tree.map(mean, *trees)


def leaf_aval(x) -> jax.ShapeDtypeStruct:
  """A leaf's shape and dtype (a leaf without ``dtype``, e.g. a lazily
  read checkpoint's, is converted to learn it)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:  # (A NumPy dtype's truth is its field count: no ``or``.)
    dtype = np.asarray(x).dtype
  return jax.ShapeDtypeStruct(np.shape(x), dtype)


def _mean_state_dict(dicts):
  """The mean of state dicts (``mean_trees``), with the largest step."""
  out = mean_trees([{k: v for k, v in d.items() if k != "step"} for d in dicts])
  out["step"] = max(int(d["step"]) for d in dicts)
  return out
