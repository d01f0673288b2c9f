"""Your own model and task through ``python -m jpipe.train``: copy this file.

``python -m jpipe.train`` trains a Task: a model's loss, its initial
params, its training batches and its evaluation (the protocol:
``jpipe.train.tasks.Task``). Name a function of the config that returns
one, by import path, and every CLI feature applies to it: checkpoints and
resume, TensorBoard logs, evaluation, every partition method, schedule
and staleness mitigation, several pipelines in data parallel (SD-Pipe),
re-partitioning (DynPipe), several processes. From the repository's root:

  python -m jpipe.train --config configs/default.py --workdir /tmp/my_task \\
      --config.task=examples.my_task:build_task

A copy next to you is ``--config.task=my_task:build_task`` (the working
directory and PYTHONPATH are on the import path). The config's fields are
yours to read (here: the data's name, batch size and splits, the seed);
a config file of your own may add fields (start it from
``jpipe.train.base_config.base_config()``).

Only the model, not the task, of your own? A Flax module on a built-in
task (the config's data's: images classify, text is modelled) is named
the same way, with ``config.model.kwargs`` as its arguments:

  python -m jpipe.train --config configs/default.py --workdir /tmp/my_net \\
      --config.model.name=examples.my_task:ConvNet

The pipeline splits the loss into stages at the modules it calls (here
the four ``Conv`` layers and the head): give it at least as many module
calls as stages. The evaluation's function is cut the same way (each
module runs on the stage that trains it) and runs forward through the
stages: nothing is gathered to one device, so a model too big for one
device evaluates too. It returns sums over a batch's examples, which add
up over microbatches and batches; ``metrics`` turns the totals into
numbers.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jpipe.train import evaluation, input_pipeline
from jpipe.train.tasks import Task


class ConvNet(nn.Module):
  """A small CNN: 3x3 convolutions of ``hidden`` channels, then a dense
  head. Input float32 [B, H, W, C]; output logits [B, num_classes]."""

  hidden: tuple[int, ...] = (32, 32, 32, 32)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train  # No dropout or BatchNorm here; the CLI passes it anyway.
    for width in self.hidden:
      x = nn.relu(nn.Conv(width, (3, 3))(x))
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


def build_task(config) -> Task:
  """The task ``--config.task=examples.my_task:build_task`` trains: the
  ConvNet on the config's image data (the embedded digits by default, or
  any TFDS image dataset: ``--config.data.name=cifar10``)."""
  train, test = input_pipeline.load_images(config)
  model = ConvNet(num_classes=int(train.labels.max()) + 1)

  def batch_at(step):  # A pure function of the step: resumes exactly.
    # Epochs: each a shuffle seeded by (seed, epoch), every example once
    # (the last partial batch dropped). Your own arrays work the same:
    # input_pipeline.ArrayData(images, labels).
    return input_pipeline.image_batch_at(
      train, step, config.data.batch_size, config.seed
    )

  def loss_fn(params, batch):  # The batch's mean loss, a scalar.
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  def sums(params, batch):  # Sums over one held-out batch's examples.
    logits = model.apply({"params": params}, batch["x"], train=False)
    hits = (jnp.argmax(logits, -1) == batch["y"]) * batch["weight"]
    return {"correct": jnp.sum(hits), "count": jnp.sum(batch["weight"])}

  # The held-out split in training-size batches (the last padded with
  # examples of weight 0), run forward through the pipeline's stages.
  held_out = evaluation.padded_batches(
    {"x": test.images, "y": test.labels}, config.data.batch_size
  )
  accuracy = evaluation.Evaluation(
    sums_fn=sums,
    batches=lambda: held_out,
    metrics=lambda totals: {"accuracy": totals["correct"] / totals["count"]},
  )

  params = model.init(jax.random.key(config.seed), batch_at(0)["x"][:1])
  return Task(
    kind="classification",
    loss_fn=loss_fn,
    params=params["params"],
    model_state=None,
    batch_at=batch_at,
    evaluation=accuracy,
  )
