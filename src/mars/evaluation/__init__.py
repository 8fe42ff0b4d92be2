"""Evaluation: the lm-eval model (``MarsLM``, registered as ``mars``), threshold sweeps over
benchmark suites, aggregation into points, paper-style tables, Pareto plots and W&B logging.

``from mars.evaluation import run; run(cfg)`` is evaluate.py's body (implemented in
:mod:`mars.evaluation.runner`).  Importing this package is cheap (no torch/lm-eval): it registers the
``mars_eval_name`` resolver that evaluate.yaml's run name uses.

No submodule may be called ``run``: importing a submodule sets it as an attribute of its package, so a
``mars.evaluation.run`` module would replace this ``run`` function on first import (``evaluate.py -m``
would then fail from its second job with "'module' object is not callable").
"""

from mars.evaluation.config import prepare, register_resolvers, run_name

register_resolvers()


def run(cfg, lm=None, plan=None):
    """Run or resume the evaluation described by an ``evaluate.yaml`` config (see mars.evaluation.runner)."""
    from mars.evaluation.runner import run as _run

    return _run(cfg, lm=lm, plan=plan)


def __getattr__(name):
    # heavy pieces on first use only
    if name == "MarsLM":
        from mars.evaluation.lm_eval_model import MarsLM

        return MarsLM
    if name == "log_to_wandb":
        from mars.evaluation.wandb_log import log_to_wandb

        return log_to_wandb
    raise AttributeError(name)


__all__ = ["MarsLM", "log_to_wandb", "prepare", "register_resolvers", "run", "run_name"]
