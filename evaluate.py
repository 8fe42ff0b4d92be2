"""Benchmark evaluation entry point (see conf/evaluate.yaml):

python evaluate.py threshold=0.9
python evaluate.py thresholds=[1.0,0.95,0.9,0.8,0.7,0.6,0.5] benchmarks=paper model=qwen2.5-0.5b
python evaluate.py checkpoint=outputs/train/<run>/hf limit=20
"""

import os
import sys

# `python evaluate.py` puts this folder first on sys.path, where this very file would shadow the
# Hugging Face `evaluate` package that lm-eval's metrics import (e.g. HumanEval's code_eval).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from mars.threads import apply_process_defaults  # noqa: E402

apply_process_defaults()  # the OpenMP wait for this machine's load unless set: libgomp reads it when torch loads

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import mars.evaluation  # noqa: F401, E402  (registers the run-name resolver used by evaluate.yaml)


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from mars.evaluation import run

    outcome = run(cfg)
    print(outcome.table)
    print(f"results: {outcome.output_dir}")


if __name__ == "__main__":
    main()
