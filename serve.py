"""OpenAI-compatible MARS server (see conf/serve.yaml and docs/serving.md):

python serve.py                                        # embedded SmolLM2-135M on 127.0.0.1:8000
python serve.py checkpoint=outputs/train/<run>/hf port=8000
python serve.py tau_policy=adaptive tau_min=0.8       # lower tau under load, raise it when load falls
python serve.py model=tiny-random port=8001           # a tiny random model (smoke tests)
"""

from mars.threads import apply_process_defaults

apply_process_defaults()  # the OpenMP wait for this machine's load unless set: libgomp reads it when torch loads

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    from mars.serving.server import run

    run(cfg)


if __name__ == "__main__":
    main()
