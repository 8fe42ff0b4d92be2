"""Benchmark tables: `python evaluate.py threshold=0.9`, `thresholds=[1.0,0.9,0.8]` (see conf/evaluate.yaml)."""

import os
import sys

# This file's folder, first on sys.path, would shadow the Hugging Face `evaluate` package lm-eval imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]

from mars.cli.evaluate import main  # noqa: E402

if __name__ == "__main__":
    main()
