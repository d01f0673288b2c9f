"""VGG (Simonyan & Zisserman): conv-ReLU stacks with max pooling.

PipeDream's canonical image model (VGG-16). ``config`` lists output
channels with "M" for a 2x2 max pool. ``SIZES["16"]`` is torchvision's
ImageNet VGG-16 (two 4096-wide layers with dropout 0.5 on the 7x7x512
features of a 224x224 image: 138,357,544 parameters);
``SIZES["16-cifar"]`` the 512-wide head DynPipe and FTPipe's CIFAR
experiments use on 32x32 images.
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

SIZES = {
  "11": dict(
    config=(64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    hidden=4096,
    num_classes=1000,
    dropout=0.5,
  ),
  "16": dict(config=VGG16, hidden=4096, num_classes=1000, dropout=0.5),
  "16-cifar": dict(config=VGG16, hidden=512, num_classes=10),
}


class Model(nn.Module):
  """Input: float [B, H, W, C]; output: logits [B, num_classes]."""

  config: tuple = VGG16
  hidden: int = 512
  num_classes: int = 10
  dropout: float = 0.0  # After each hidden dense layer, in training.

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    drop = nn.Dropout(self.dropout, deterministic=not train)
    layer = 0
    for item in self.config:
      if item == "M":
        x = nn.max_pool(x, (2, 2), (2, 2))
      else:
        x = nn.relu(nn.Conv(int(item), (3, 3), name=f"conv_{layer}")(x))
        layer += 1
    x = x.reshape(x.shape[0], -1)
    x = drop(nn.relu(nn.Dense(self.hidden, name="fc_0")(x)))
    x = drop(nn.relu(nn.Dense(self.hidden, name="fc_1")(x)))
    return nn.Dense(self.num_classes, name="head")(x)
