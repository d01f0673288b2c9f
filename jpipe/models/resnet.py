"""Wide ResNet (Zagoruyko & Komodakis) with BatchNorm, for small images.

WRN-d-k: depth d = 6n + 4 (n blocks per group, 3 groups), width factor k.
FTPipe's canonical model is WRN-28-10 on CIFAR-100 (``SIZES["28-10"]``:
36,536,884 parameters: pre-activation blocks with 1x1 projection shortcuts).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

SIZES = {
  "16-4": dict(depth=16, width=4, num_classes=10),
  "28-10": dict(depth=28, width=10, num_classes=100),
}


class BasicBlock(nn.Module):
  """Pre-activation residual block: BN-ReLU-conv-BN-ReLU-conv (+ shortcut)."""

  features: int
  strides: int = 1
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool):
    norm = lambda name: nn.BatchNorm(  # noqa: E731
      use_running_average=not train, momentum=0.9, name=name
    )
    y = nn.relu(norm("bn_0")(x))
    shortcut = x
    if x.shape[-1] != self.features or self.strides != 1:
      shortcut = nn.Conv(
        self.features,
        (1, 1),
        (self.strides,) * 2,
        use_bias=False,
        name="shortcut",
      )(y)
    y = nn.Conv(
      self.features, (3, 3), (self.strides,) * 2, use_bias=False, name="conv_0"
    )(y)
    y = nn.relu(norm("bn_1")(y))
    if self.dropout:
      y = nn.Dropout(self.dropout, deterministic=not train)(y)
    y = nn.Conv(self.features, (3, 3), use_bias=False, name="conv_1")(y)
    return y + shortcut


class Model(nn.Module):
  """WRN: stem conv, 3 groups of blocks (strides 1, 2, 2), BN-ReLU-pool-head.

  Input: float [B, H, W, C]; output: logits [B, num_classes]. Batch
  statistics live in the ``batch_stats`` collection.
  """

  depth: int = 16
  width: int = 4
  num_classes: int = 10
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    if (self.depth - 4) % 6:
      raise ValueError(f"WRN depth must be 6n + 4, got {self.depth}")
    n = (self.depth - 4) // 6
    x = nn.Conv(16, (3, 3), use_bias=False, name="stem")(x)
    index = 0
    for group, (features, stride) in enumerate(
      [(16 * self.width, 1), (32 * self.width, 2), (64 * self.width, 2)]
    ):
      for i in range(n):
        x = BasicBlock(
          features, stride if i == 0 else 1, self.dropout, name=f"block_{index}"
        )(x, train)
        index += 1
      del group
    x = nn.relu(
      nn.BatchNorm(
        use_running_average=not train, momentum=0.9, name="bn_final"
      )(x)
    )
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="head")(x)
