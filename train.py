"""MARS / AR-SFT training entry point: `python train.py model=qwen2.5-7b block=4` (see conf/train.yaml)."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    from mars.train import run

    run(cfg)


if __name__ == "__main__":
    main()
