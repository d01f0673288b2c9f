"""VGG (Simonyan & Zisserman): conv-ReLU stacks with max pooling.

PipeDream's canonical image model (VGG-16). ``config`` lists output
channels with "M" for a 2x2 max pool.
"""

import flax.linen as nn
import jax

VGG16 = (
  64,
  64,
  "M",
  128,
  128,
  "M",
  256,
  256,
  256,
  "M",
  512,
  512,
  512,
  "M",
  512,
  512,
  512,
  "M",
)


class Model(nn.Module):
  """Input: float [B, H, W, C]; output: logits [B, num_classes]."""

  config: tuple = VGG16
  hidden: int = 512
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    del train
    layer = 0
    for item in self.config:
      if item == "M":
        x = nn.max_pool(x, (2, 2), (2, 2))
      else:
        x = nn.relu(nn.Conv(int(item), (3, 3), name=f"conv_{layer}")(x))
        layer += 1
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden, name="fc_0")(x))
    x = nn.relu(nn.Dense(self.hidden, name="fc_1")(x))
    return nn.Dense(self.num_classes, name="head")(x)
