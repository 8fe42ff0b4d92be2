"""``python evaluate.py`` / ``mars-eval``: benchmark tables at one or several thresholds (Hydra overrides; see
conf/evaluate.yaml).  ``--config-dir <folder>`` adds configs under new names, ``--config-path <folder>``
replaces them all."""

from mars.hardware import apply_process_defaults
from mars.logs import quiet_library_notices

apply_process_defaults()  # the OpenMP wait for this machine's load unless set: libgomp reads it when torch loads
quiet_library_notices()  # no deprecation notice about the libraries' own calls on every run

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import mars.cli.help  # noqa: F401, E402  (registers the resolver of --help: conf/hydra/help/evaluate.yaml)
import mars.evaluation  # noqa: F401, E402  (registers the run-name resolver used by evaluate.yaml)
from mars.paths import conf_dir  # noqa: E402


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from mars.cli.preflight import check_sources, check_tree_spelling, refuse
    from mars.evaluation import prepare, run

    try:  # a bad setting, or a model that cannot be fetched: one message, before the model loads or a folder is made
        check_tree_spelling()
        check_sources(cfg)
        plan = prepare(cfg)
    except (ConnectionError, FileNotFoundError, ValueError) as err:
        refuse(err)
    outcome = run(cfg, plan=plan)
    print(outcome.table)
    print(f"results: {outcome.output_dir}")


if __name__ == "__main__":
    main()
