"""``Pipeline``'s memory prediction: per stage and per device, and the
auto schedule's fit to a memory limit by it."""

from jpipe.runtime._assemble import with_schedule
from jpipe.runtime.build.memory import StageMemory, device_totals
from jpipe.runtime.build.pipeline_memory import predict_pipeline_memory


class PipelineMemoryMethods:
  """A base of ``Pipeline``: its predicted memory (``_memory`` caches it;
  ``parts``, ``plan`` and ``memory_limit`` are the pipeline's)."""

  def _fit_auto_schedule(self) -> None:
    """``schedule="auto"``: where this pipeline's own prediction (finer
    than the partitioner's model auto ranked with) puts the chosen
    schedule over the limit, the next row of auto's table that fits by
    both; none: as chosen (the memory check then names the fixes)."""
    first, over = self.parts, []
    for row in first.request.schedule_choice.rows:
      if not row.fits:
        break
      choice = first.request.schedule_choice.moved_to(row.name, over)
      self.parts, self._memory = with_schedule(first, choice), None
      if max(self.device_memory.values()) <= self.memory_limit:
        return
      over.append(row.name)
    self.parts, self._memory = first, None

  @property
  def memory(self) -> tuple[StageMemory, ...]:
    """Per stage, the bytes it is predicted to hold on each of its devices
    at its peak (``StageMemory``: params x versions, gradients, optimizer
    state, microbatches in flight x what each keeps, one program's
    working buffers), for this schedule and microbatch count. From
    abstract shapes: nothing compiles."""
    if self._memory is None:
      self._memory = predict_pipeline_memory(self)
    return self._memory

  @property
  def device_memory(self) -> dict[int, int]:
    """``{device index: predicted peak bytes}``: the stages each device
    runs (``memory``) added up, one program's working buffers counted
    once per device."""
    return device_totals(self.memory, self.plan.stage_devices)
