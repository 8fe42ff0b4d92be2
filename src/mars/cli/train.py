"""``python train.py`` / ``mars-train``: MARS or AR SFT training (Hydra overrides; see conf/train.yaml).

The configs are the ones of this checkout or, installed, the ones shipped with the package (:mod:`mars.paths`):
Hydra's ``--config-dir <folder>`` adds configs under new names (``model/mine.yaml``), ``--config-path <folder>``
replaces them all (a copy of ``python -m mars.paths conf``, edited).
"""

import logging

import hydra
from omegaconf import DictConfig

import mars.cli.help  # noqa: F401  (registers the resolver of --help: conf/hydra/help/train.yaml)
import mars.training  # noqa: F401  (registers the run-name resolver used by train.yaml)
from mars.cli.preflight import in_multirun
from mars.logs import quiet_library_notices
from mars.paths import conf_dir

quiet_library_notices()
log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="train")
def main(cfg: DictConfig) -> None:
    from mars.cli.preflight import refuse
    from mars.models import HubUnreachableError
    from mars.training.refusals import RunRefused
    from mars.training.run import run

    try:
        run(cfg)
    except Exception as err:
        report_failed_job(err)
        if isinstance(err, (RunRefused, HubUnreachableError)) and not in_multirun():
            # refused before anything loaded: the message says what to run instead, a traceback adds nothing, and
            # the run folder Hydra made for it holds nothing of a run
            refuse(err)
        raise


def report_failed_job(err: Exception) -> None:
    """In a multirun, say at once that a job failed or was refused, and why: Hydra runs the other jobs first
    and raises the first failure only when the whole sweep is done."""
    from hydra.core.hydra_config import HydraConfig

    if not in_multirun():
        return  # a single run: Hydra reports it now
    job = HydraConfig.get().job
    overrides = " ".join(HydraConfig.get().overrides.task)
    log.error("job #%s (%s) failed, the sweep goes on: %s: %s", job.num, overrides, type(err).__name__, err)


if __name__ == "__main__":
    main()
