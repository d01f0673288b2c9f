"""Flax linen models with ordered, named units (each module exports Model).

Submodules are named so that the partitioner's nodes read as layers
(``block_3``, ``layer_7``); the classes are ordinary Flax modules.
"""

from jpipe.models import gpt, mlp, resnet, t5, vgg

__all__ = ["gpt", "mlp", "resnet", "t5", "vgg"]
