r"""SD-Pipe's experiment shape on this machine: 4 pipelines x 2 stages.

The MLP of ``configs/default.py`` on the embedded digits, split into 2
stages; 4 copies of that pipeline on the 8 devices (fake CPU devices
here), each an asynchronous 1F1B pipeline with weight stashing (as
SD-Pipe), on its own shard of the data, their stage replicas averaged by
SD-Pipe's partial reduce. Each forward and backward spends a simulated
4 ms and, with probability 0.1, SD-Pipe's hetero delay of 0.05 s on top
(set both to 0 to train at the machine's own speed).

Run:
  python -m jpipe.train --config configs/sdpipe.py --workdir /tmp/jpipe_sdpipe

Expected: the consensus model (the replicas' mean) near 97 % test
accuracy after 15 epochs (above 90 % from about the 5th), in about 20 s
of training on 2 CPU cores (plus compilation); each epoch line shows the
batches every pipeline ran and the mean averaging-group size
(experiments/sdpipe: the same shape for every policy and delay).

Across processes, one pipeline each:
  python -m jpipe.launch --nprocs 4 --devices-per-process 2 -- \
      python -m jpipe.train --config configs/sdpipe.py --workdir /tmp/jpipe_sdpipe4

Or a process per stage, as SD-Pipe runs it (each process one stage of all
4 pipelines):
  python -m jpipe.launch --nprocs 2 --devices-per-process 4 -- \
      python -m jpipe.train --config configs/sdpipe.py \
      --config.data_parallel.placement=stage --workdir /tmp/jpipe_sdpipe_stages

Variants: --config.data_parallel.sync=allreduce|adpsgd|hetpipe,
--config.data_parallel.hetero=0.1, --config.data_parallel.slowdown=0:3.0
(device 0, pipeline 0's first stage, 3x slower).
"""

from configs import default


def get_config():
  c = default.get_config()
  c.data.batch_size = 32  # Per pipeline.
  c.pipeline.num_stages = 2
  c.pipeline.num_microbatches = 2
  c.schedule.name = "async"
  c.staleness.stashing = True
  c.optimizer.learning_rate = 0.03  # Stable for async pipelines here.
  c.data_parallel.pipelines = 4
  c.data_parallel.sync = "preduce"
  c.data_parallel.epoch_batches = 12  # ~24 steps per pipeline per epoch
  c.data_parallel.hetero = 0.05
  c.data_parallel.simulated_ms = 4.0
  c.train.steps = 180  # 15 epochs
  return c
