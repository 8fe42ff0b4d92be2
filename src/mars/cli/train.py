"""``python train.py`` / ``mars-train``: MARS or AR SFT training (Hydra overrides; see conf/train.yaml).

The configs are the ones of this checkout or, installed, the ones shipped with the package (:mod:`mars.paths`):
Hydra's ``--config-dir <folder>`` adds configs under new names (``model/mine.yaml``), ``--config-path <folder>``
replaces them all (a copy of ``python -m mars.paths conf``, edited).
"""

import hydra
from omegaconf import DictConfig

from mars.paths import conf_dir


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="train")
def main(cfg: DictConfig) -> None:
    from mars.training.run import run

    run(cfg)


if __name__ == "__main__":
    main()
