r"""DynPipe's situation on this machine: a device slows down mid-run.

A 7-hidden-layer MLP on the embedded digits in a 4-stage
asynchronous 1F1B pipeline with weight stashing (as DynPipe runs it).
Every forward + backward of the whole model spends a simulated 40 ms per
microbatch, split among the stages by their cost shares (sleeps: CPU
timings are then honest); device 1 runs 3x slower from step 60 to step
140. Every 10 steps one step is profiled; jpipe's policy re-partitions
when a stage slot's slowdown moves by 2x and the predicted gain over the
next 50 steps pays for the switch, keeping every bit of optimizer state.

Run:
  python -m jpipe.train --config configs/dynpipe.py --workdir /tmp/jpipe_dynpipe

Expected: a line "re-partition at step 80: [0:2 | 2:4 | 4:6 | 6:8] ->
[0:2 | 2:3 | 3:5 | 5:8]" (slot 1 measured ~2.6x slower in the windows
at 70 and 80: a node leaves it); after step 140 a move back to the
first plan (no new pipeline) when the predicted gain pays for it (it is
small here: a few %); WORKDIR/dynamic.png shows the step time and the
slowdowns per window; eval accuracy 0.7-0.95 after 200 steps (this
asynchronous run swings between evaluations), in about 50 s on 2 CPU
cores (most of it the simulated compute).
In one process one host thread sleeps for every stage, so the step time
falls less than a pipeline of one process per stage would show.

Variants: --config.dynamic.policy=dynpipe (DynPipe's candidate cuts and
1F1B score) or static (measure only, never move: the baseline);
--config.dynamic.inject=2:4.0:50 (device 2, 4x, from step 50 on);
--config.dynamic.predictor=PATH (DynPipe's random forest, fitted by
`python -m jpipe.train.slowdowns --config configs/dynpipe.py --out PATH`).
"""

from configs import default


def get_config():
  c = default.get_config()
  c.model.kwargs.hidden = (256,) * 7  # 9 nodes: room to move layers.
  c.optimizer.learning_rate = 0.01  # Stable with 3 steps of delay.
  c.pipeline.num_stages = 4
  c.schedule.name = "async"
  c.staleness.stashing = True
  c.dynamic.enabled = True
  c.dynamic.policy = "jpipe"
  c.dynamic.window = 10
  c.dynamic.horizon_steps = 50
  c.dynamic.simulated_ms = 40.0
  c.dynamic.inject = "1:3.0:60:140"
  c.train.steps = 200
  return c
