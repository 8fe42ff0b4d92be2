"""Training: MARS continued training, AR SFT and the ablations through one LightningModule.

The path a training run takes, one module a step: :mod:`~mars.training.config` (train.yaml, checked before
anything loads) -> :mod:`~mars.training.data` and :mod:`~mars.training.self_distill` (rows, self-distilled
answers) -> :mod:`~mars.training.datamodule` (their batches) -> :mod:`~mars.training.module` (the LightningModule)
with :mod:`~mars.training.masking` (the two-stream layout), :mod:`~mars.training.loss_terms` (its losses),
:mod:`~mars.training.objectives` (their settings), :mod:`~mars.training.optim` and :mod:`~mars.training.precision`,
:mod:`~mars.training.budget` and :mod:`~mars.training.budget_callback` (compute budgets) ->
:mod:`~mars.training.checkpointing` (resumable Lightning checkpoints), :mod:`~mars.training.fingerprint`
(which reruns may resume) -> :mod:`~mars.training.export` (the plain Hugging Face checkpoint) and
:mod:`~mars.training.loss_history` (``losses.csv`` and the loss curve).  :func:`mars.training.run.run` is
``train.py``'s body.

Importing this package is cheap: it registers train.yaml's run-name resolver; nothing else loads until a
submodule is imported.
"""

from mars.training.fingerprint import register_resolvers

register_resolvers()  # train.yaml's run name reads the run's length through a resolver
