"""``python serve.py`` / ``mars-serve``: the OpenAI-compatible MARS server (Hydra overrides; see conf/serve.yaml
and docs/serving.md)."""

from mars.hardware import apply_process_defaults
from mars.logs import quiet_library_notices

apply_process_defaults()  # the OpenMP wait for this machine's load unless set: libgomp reads it when torch loads
quiet_library_notices()  # no deprecation notice about the libraries' own calls on every run

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import mars.cli.help  # noqa: F401, E402  (registers the resolver of --help: conf/hydra/help/serve.yaml)
from mars.paths import conf_dir  # noqa: E402


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="serve")
def main(cfg: DictConfig) -> None:
    from mars.cli.preflight import check_sources, check_tree_spelling, refuse
    from mars.serving.config import ServeConfig

    try:  # a model that cannot be fetched, a bad setting or stored record: one message, before the model loads
        check_tree_spelling()
        check_sources(cfg)
        settings = ServeConfig.from_cfg(cfg)
    except (ConnectionError, FileNotFoundError, ValueError) as err:
        refuse(err)
    from mars.serving.server import run  # the server and torch load once the settings hold

    run(settings)


if __name__ == "__main__":
    main()
