"""The small-M GEMM's horizontal sums done a tile at a time (`vsum_each`) against the kernel at a git revision (one
`vsum` per output), built beside it under the namespace ab_old: whether every output is the same bits, over the
column counts of every tile shape (1-70 columns: decode steps, batches, kernel prefills), row counts that leave
part-tiles (N = 1-37 and the step's 576-3072), K with and without a tail past the last whole vector, with and
without a bias, and with a gated rank-8 LoRA at some columns (`fused_linear`, the groups a decode step runs):

    python benchmarks/decode_step_cpu/emerald_rapids/gemm_sums/bits_ab.py [revision, default HEAD]
"""

import itertools
import sys

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

import mars.kernels as kernels  # noqa: E402
from mars.threads import configure_threads  # noqa: E402


def main(rev: str = "HEAD") -> None:
    configure_threads("auto")
    kernels.small_linear_op()  # builds and loads this checkout's kernels
    kernels.load_revision(rev)
    new, old = torch.ops.mars, torch.ops.ab_old
    g = torch.Generator().manual_seed(0)
    same = cases = 0
    for m, n, k, bias in itertools.product(
        (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64, 70), (1, 5, 13, 37, 576, 3072), (576, 1536, 100), (False, True)
    ):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        same += torch.equal(new.small_linear(x, w, b), old.small_linear(x, w, b))
        cases += 1
    for m, names in itertools.product((1, 2, 3, 4, 8, 64), ((576, 192, 192), (1536, 1536), (576,))):
        x = torch.randn(m, 576, generator=g)
        ws = [torch.randn(n, 576, generator=g) for n in names]
        a = [torch.randn(8, 576, generator=g) / 24 for _ in names]
        bs = [torch.randn(n, 8, generator=g) / 3 for n in names]
        cols = torch.arange(1, m) if m > 1 else None
        outs = [
            op.fused_linear(x, ws, [None] * len(ws), a, [op.pack_lowrank(b) for b in bs], [2.0] * len(ws), cols)
            for op in (new, old)
        ]
        same += all(torch.equal(p, q) for p, q in zip(*outs))
        cases += 1
    print(f"{same} of {cases} cases bitwise equal to {rev}'s kernel ({kernels.kernel_isa()})")


if __name__ == "__main__":
    main(*sys.argv[1:])
