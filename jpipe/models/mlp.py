"""A multilayer perceptron classifier."""

import flax.linen as nn
import jax


class Model(nn.Module):
  """Dense-ReLU layers, then a linear classifier.

  Input: float [B, ...] (flattened); output: logits [B, num_classes].
  """

  hidden: tuple[int, ...] = (256, 256, 256)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    del train
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.hidden):
      x = nn.relu(nn.Dense(width, name=f"layer_{i}")(x))
    return nn.Dense(self.num_classes, name="head")(x)
