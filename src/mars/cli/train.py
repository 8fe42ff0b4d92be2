"""``mars-train``: ``train.py`` for an installed package (the same Hydra overrides; see conf/train.yaml).

The configs are the ones shipped with the package (:mod:`mars.paths`); add your own folder of configs
with Hydra's ``--config-dir <folder>`` (its files win over the shipped ones of the same name).
"""

import hydra
from omegaconf import DictConfig

from mars.paths import conf_dir


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="train")
def main(cfg: DictConfig) -> None:
    from mars.train import run

    run(cfg)


if __name__ == "__main__":
    main()
