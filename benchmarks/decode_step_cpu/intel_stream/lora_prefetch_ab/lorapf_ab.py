"""A/B of MARS_LORA_PF on a step's 120 fused_linear passes at 3 columns, 2 of them adapted (lora_wait_ab/lora_ab.py):
PF=0 builds the kernel without the burst, PF=1 with it (the Intel default).  Run from the repository root:
PF=0 python benchmarks/decode_step_cpu/intel_stream/lora_prefetch_ab/lorapf_ab.py, then PF=1, alternating."""

import os
import sys
from pathlib import Path

import mars.kernels as kernels

mode = os.environ["PF"]
flags = tuple(f for f in kernels.STREAM_FLAGS["GenuineIntel"] if not f.startswith("-DMARS_LORA_PF"))
kernels.STREAM_FLAGS["GenuineIntel"] = (*flags, f"-DMARS_LORA_PF={mode}")
sys.argv = [sys.argv[0], "benchmarks/reproduce_smollm2-135m-amx/adapter_rank8", "3"]
exec((Path(__file__).parent.parent / "lora_wait_ab" / "lora_ab.py").read_text())
