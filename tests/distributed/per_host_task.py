"""examples/my_task.py with a batch_at that differs by process (as one
reading host-local files, or seeded by the host): refused at start-up
(test_train_processes)."""

import dataclasses

import jax

from examples import my_task


def build_task(config):
  task = my_task.build_task(config)
  offset = jax.process_index()
  return dataclasses.replace(
    task, batch_at=lambda step: task.batch_at(step + offset)
  )
