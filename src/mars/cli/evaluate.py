"""``mars-eval``: ``evaluate.py`` for an installed package (the same Hydra overrides; see
conf/evaluate.yaml).  The configs and the benchmark tasks are the ones shipped with the package
(:mod:`mars.paths`); ``--config-dir <folder>`` adds configs under new names, ``--config-path <folder>``
replaces them all."""

import hydra
from omegaconf import DictConfig

import mars.evaluation  # noqa: F401  (registers the run-name resolver used by evaluate.yaml)
from mars.paths import conf_dir


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from mars.evaluation import run

    outcome = run(cfg)
    print(outcome.table)
    print(f"results: {outcome.output_dir}")


if __name__ == "__main__":
    main()
