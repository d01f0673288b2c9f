"""A Flax NNX model on a built-in task: copy this file.

``config.model.name`` may name an ``nnx.Module`` class as well as a linen
one; the CLI builds it with ``config.model.kwargs`` and
``rngs=nnx.Rngs(seed)`` and trains it on the task of the config's data
(images here). From the repository's root:

  python -m jpipe.train --config configs/default.py --workdir /tmp/my_nnx_net \\
      --config.model.name=examples.nnx_model:CNN

What the CLI does with it (``jpipe.train.nnx_models``): ``nnx.Param``
variables are the params; BatchNorm's running statistics (any variable
but RNG state) are model state, updated by each training step on the
stage that holds them; ``module.train()`` / ``module.eval()`` set the
mode; Dropout's RNG stream is reseeded from the batch's key at every
training call, so a resumed run draws the masks an uninterrupted one
would. The pipeline splits it at its submodules (``conv1``, ``bn1``,
``dense[0]``, ...).
"""

from flax import nnx


class CNN(nnx.Module):
  """Two 3x3 convolutions with BatchNorm, average pooling, dense layers
  of ``hidden`` units with dropout, and a dense head (the Flax NNX MNIST
  tutorial's shape, sized for the 8x8 digits). Input float32
  [B, 8, 8, 1]; output logits [B, num_classes]."""

  def __init__(
    self,
    channels: tuple[int, int] = (4, 8),
    hidden: tuple[int, ...] = (64,),
    num_classes: int = 10,
    dropout: float = 0.1,
    *,
    rngs: nnx.Rngs,
  ):
    self.conv1 = nnx.Conv(1, channels[0], (3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(channels[0], rngs=rngs)
    self.conv2 = nnx.Conv(channels[0], channels[1], (3, 3), rngs=rngs)
    self.bn2 = nnx.BatchNorm(channels[1], rngs=rngs)
    sizes = (channels[1] * 4 * 4, *hidden)
    self.dense = nnx.List(
      [
        nnx.Linear(a, b, rngs=rngs)
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
      ]
    )
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), (2, 2))
    x = x.reshape(x.shape[0], -1)
    for layer in self.dense:
      x = self.dropout(nnx.relu(layer(x)))
    return self.head(x)
