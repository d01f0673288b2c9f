"""The pipeline runtime: stages on devices, driven by a schedule."""

from jpipe.runtime._pipeline import Pipeline, PipelineState

__all__ = ["Pipeline", "PipelineState"]
