"""``mars-serve``: ``serve.py`` for an installed package, the OpenAI-compatible server (the same Hydra
overrides; see conf/serve.yaml and docs/serving.md), with the configs shipped in the package."""

import hydra
from omegaconf import DictConfig

from mars.paths import conf_dir


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="serve")
def main(cfg: DictConfig) -> None:
    from mars.serving.server import run

    run(cfg)


if __name__ == "__main__":
    main()
