"""A stage's optimizer step from its packed gradient, as one program (a
base of ``StageOptimizer``, ``stage_optimizer.py``, whose fields it reads:
``_grad_layout``, ``_packed_updates``, ``_donate_grads``, ``_options`` and
``apply_tied``)."""

from collections.abc import Sequence
from typing import Any

import jax


class PackedSteps:
  """``update_packed`` / ``update_packed_tied``: the step reading the
  gradient as the accumulator's flat buffers, unpacked inside."""

  def update_packed(
    self,
    flat,
    opt_state,
    params,
    stale_params=None,
    scale=1.0,
    update_scale=1.0,
    *,
    donate_state=False,
  ):
    """``update`` from the gradient as the layout's buffers (unpacked
    inside the program). Consumes (donates) ``flat``'s own buffers -- the
    big leaves; its packed small-leaf buffers are kept -- and, with
    ``donate_state``, ``opt_state``: what is consumed may not be used
    afterwards."""
    *new, _ = self.update_packed_tied(
      flat,
      {},
      (),
      opt_state,
      params,
      stale_params,
      scale,
      update_scale,
      donate_state=donate_state,
    )
    return tuple(new)

  def update_packed_tied(
    self,
    flat,
    added: dict[int, Any],
    replicas: Sequence[int],
    opt_state,
    params,
    stale_params=None,
    scale=1.0,
    update_scale=1.0,
    *,
    donate_state=False,
  ):
    """``update_packed`` for a stage holding tied leaves, as one program:
    ``added`` (``{position: gradient}``, the holders' gradients of the
    leaves this stage owns) is added to those leaves' gradients, and the
    gradients at ``replicas`` (positions of leaves another stage owns,
    which this stage does not step) are returned for their owners.
    Returns ``(params, opt_state, replica gradients)``. Consumes ``flat``
    and (``donate_state``) ``opt_state`` as ``update_packed`` does. No
    unpacked gradient crosses the host: on an H100 the separate unpack,
    eager adds and leaf-wise update cost ~3 ms of host time per step."""
    # One program per (added positions, replicas, donate_state).
    if self._grad_layout is None:
      raise ValueError("update_packed needs the StageOptimizer's grad_layout")
    positions, replicas = tuple(sorted(added)), tuple(replicas)
    key = (positions, replicas, bool(donate_state))
    if key not in self._packed_updates:
      unpack = self._grad_layout.unpack

      def update(own, packed, added_grads, *args):
        grads = unpack((*own, *packed))
        return self.apply_tied(grads, positions, added_grads, replicas, *args)

      # The gradient's own buffers are donated (the new params are written
      # into them instead of fresh memory: on a CPU core an SGD step over
      # 16 MiB took 9.7 ms with fresh buffers -- page faults -- and 1.4 ms
      # in donated ones), and with ``donate_state`` the optimizer state
      # too. The small leaves' flat buffer matches no output: kept.
      donate = (0,) if self._donate_grads else ()
      self._packed_updates[key] = jax.jit(
        update,
        donate_argnums=(*donate, 3) if donate_state else donate,
        compiler_options=self._options,
      )
    n = self._grad_layout.num_own if self._grad_layout.packed else 0
    flat = tuple(flat)
    return self._packed_updates[key](
      flat[:n],
      flat[n:],
      tuple(added[p] for p in positions),
      opt_state,
      params,
      stale_params,
      scale,
      update_scale,
    )
