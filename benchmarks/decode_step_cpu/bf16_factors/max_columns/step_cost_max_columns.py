"""The step-cost table with the fast path's column limit set to MAXCOLS (16 or 64), for the A/B of README.md:

    GOMP_SPINCOUNT=3000 MAXCOLS=16 python benchmarks/decode_step_cpu/bf16_factors/max_columns/step_cost_max_columns.py \
        --columns 1,2,3,4 --batch-sizes 8 --paths fast --repeats 11 --threads 2 --out sc_cols16
"""

import os
import sys

import mars.decoding.fastpath as fastpath
import mars.decoding.lean as lean
from mars.evaluation.step_cost import main

limit = int(os.environ.get("MAXCOLS", "16"))
fastpath.MAX_COLUMNS = lean.MAX_COLUMNS = limit  # both bindings: lean imports the name
sys.exit(main(sys.argv[1:]))
