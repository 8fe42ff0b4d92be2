"""A kill for runs in a subprocess: ``+callbacks.kill._target_=kill_after.KillAfter +callbacks.kill.steps=N``
(with this folder on ``PYTHONPATH``) raises on every rank when the batch after ``N`` optimizer steps starts, as
a crash would; the checkpoints written until then stay."""

from lightning.pytorch.callbacks import Callback


class Killed(RuntimeError):
    pass


class KillAfter(Callback):
    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.steps:
            raise Killed(f"killed after step {trainer.global_step}")
