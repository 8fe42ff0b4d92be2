"""The decode fast path: the small-M GEMM kernel, its batch invariance, its cache key, the nn.Linear
switch (on, off, fallback with one warning) and the thread setting."""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from decoding_fixtures import (  # noqa: F401
    MASK_ID,
    build_model,
    hf_greedy,
    kernel_or_skip,
    model,
    random_prompts,
    tokenizer,
)

from mars import hardware as threads
from mars.decoding import fastpath, generate, kernels
from mars.decoding import forward as forward_module
from mars.decoding.kernels import KernelUnavailable


@pytest.mark.parametrize("n,k", [(96, 64), (37, 19), (1, 8), (130, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_f_linear(n, k, bias):
    op = kernel_or_skip()
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for shape in [(1, k), (3, k), (2, 5, k), (17, k), (4, 1, 3, k)]:
        x = torch.randn(*shape, generator=g)
        y = op(x, w, b)
        assert y.shape == (*shape[:-1], n)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_small_linear_rejects_bad_input():
    op = kernel_or_skip()
    with pytest.raises(RuntimeError, match="do not match"):
        op(torch.randn(2, 5), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match="float32 only"):
        op(torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64), None)


def test_a_row_does_not_depend_on_the_other_columns():
    """Batch invariance: each column's output is bit-identical whether computed alone or among 1..16."""
    op = kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 300, generator=g), torch.randn(16, 300, generator=g)
    alone = torch.cat([op(x[i : i + 1], w, None) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(op(x[:m], w, None), alone[:m]), m
    # MKL does not promise this (and on this CPU it does not keep it): the kernel is what guarantees it
    assert torch.equal(op(x[5:9], w, None), alone[5:9])


@pytest.mark.parametrize("n,r", [(576, 32), (100, 5), (7, 64), (1536, 16)])
def test_lowrank_linear_is_a_batch_invariant_up_product(n, r):
    """A LoRA up factor's product: close to F.linear for any number of rows (panel-aligned or not, more than 16
    included), and each row's output the same bits whatever rides along."""
    kernel_or_skip()
    op = kernels.lowrank_linear_op()
    g = torch.Generator().manual_seed(n + r)
    b, x = torch.randn(n, r, generator=g), torch.randn(20, r, generator=g)
    alone = torch.cat([op(x[i : i + 1], b) for i in range(20)])
    torch.testing.assert_close(alone, F.linear(x, b), rtol=1e-5, atol=1e-4)
    for m in (2, 3, 4, 5, 16, 20):
        assert torch.equal(op(x[:m], b), alone[:m]), m
    assert op(x.view(4, 5, r), b).shape == (4, 5, n)
    packed = kernels.pack_lowrank_op()(b)
    assert packed.dim() == 3 and packed.shape[1] == r and packed.shape[0] * packed.shape[2] >= n
    assert torch.equal(op(x, packed, n), alone)  # packed once by the caller: the same bits
    with pytest.raises(RuntimeError, match="needs its row count"):
        op(x, packed)
    torch.library.opcheck(op, (x[:3], b))
    # the fast path packs a factor once and again after an in-place update (its version moves)
    first = fastpath.packed_lowrank(b)
    assert fastpath.packed_lowrank(b) is first
    b.mul_(2.0)
    again = fastpath.packed_lowrank(b)
    assert again is not first and torch.equal(again, kernels.pack_lowrank_op()(b))


def test_custom_op_has_a_working_fake_for_compile():
    op = kernel_or_skip()
    torch.library.opcheck(op, (torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)))


@pytest.mark.parametrize("rank,k,sizes", [(32, 72, (48, 16, 16)), (5, 72, (48, 16, 16)), (16, 576, (1000, 192, 330))])
def test_fused_linear_is_the_separate_linears_and_gated_lora_terms_bit_for_bit(rank, k, sizes):
    """One pass over q/k/v-like weights (with and without bias, one without an adapter) equals the separate
    kernel calls, and its LoRA term at the given rows equals peft's ``y + B(A(x) * gate) * scaling`` with the
    up factor through ``lowrank_linear`` (the order the fused pass adds it in)."""
    op = kernel_or_skip()
    fused = kernels.fused_linear_op()
    g = torch.Generator().manual_seed(rank)
    # the large case: several threads' row ranges, split inside the up factor's panels
    weights = [torch.randn(n, k, generator=g) for n in sizes]
    biases = [torch.randn(sizes[0], generator=g), None, torch.randn(sizes[2], generator=g)]
    a = [torch.randn(rank, k, generator=g), None, torch.randn(rank, k, generator=g)]
    b = [torch.randn(n, rank, generator=g) for n in sizes]
    b[1] = None
    scalings = [2.0, 0.0, 0.5]
    lowrank = kernels.lowrank_linear_op()
    packed = [None if f is None else kernels.pack_lowrank_op()(f) for f in b]
    for m in (1, 2, 3, 4, 7, 16, 40):
        x = torch.randn(m, k, generator=g)
        plain = fused(x, weights, biases, [], [], [], None)
        for y, w, bias in zip(plain, weights, biases):
            assert torch.equal(y, op(x, w, bias))
        # the last columns carry masks (read in place), or scattered ones (rows of a batch: copied together)
        for rows in (torch.arange(m)[m // 2 :], torch.arange(m)[::2]):
            gate = torch.zeros(m, 1)
            gate[rows] = 1.0
            gated = fused(x, weights, biases, a, packed, scalings, rows)
            for i, y in enumerate(gated):
                expected = op(x, weights[i], biases[i])
                if a[i] is not None:
                    expected = expected + lowrank(op(x, a[i], None) * gate, b[i]) * scalings[i]
                assert torch.equal(y, expected), (m, rows, i)
            assert not torch.equal(gated[0][rows], plain[0][rows])  # the adapter acted at its rows only
            others = gate.squeeze(1) == 0
            assert torch.equal(gated[0][others], plain[0][others])


@pytest.mark.parametrize("rank,k,sizes", [(32, 576, (576, 192, 1536)), (5, 72, (48, 16, 20))])
def test_bf16_factors_give_the_bits_of_their_fp32_values(rank, k, sizes):
    """LoRA factors whose values are bf16 numbers, passed as bfloat16 (half the bytes the kernel streams), give
    the fused pass's and the up product's fp32 results bit for bit, each factor alone or both; the fp32 input
    and weights are untouched by it."""
    kernel_or_skip()
    fused, pack, lowrank = kernels.fused_linear_op(), kernels.pack_lowrank_op(), kernels.lowrank_linear_op()
    g = torch.Generator().manual_seed(rank)
    weights = [torch.randn(n, k, generator=g) for n in sizes]
    a = [torch.randn(rank, k, generator=g).to(torch.bfloat16) for _ in sizes]
    b = [torch.randn(n, rank, generator=g).to(torch.bfloat16) for n in sizes]
    packed = {dt: [pack(f.to(dt)) for f in b] for dt in (torch.float32, torch.bfloat16)}
    assert all(p.dtype == torch.bfloat16 for p in packed[torch.bfloat16])
    for m, rows in ((1, [0]), (3, [1, 2]), (7, [0, 3, 6])):
        x = torch.randn(m, k, generator=g)
        rows = torch.tensor(rows)
        wide = fused(x, weights, [None] * 3, [f.float() for f in a], packed[torch.float32], [2.0] * 3, rows)
        for down, up in (
            (torch.bfloat16, torch.bfloat16),
            (torch.bfloat16, torch.float32),
            (torch.float32, torch.bfloat16),
        ):
            narrow = fused(x, weights, [None] * 3, [f.to(down) for f in a], packed[up], [2.0] * 3, rows)
            assert all(torch.equal(u, v) for u, v in zip(narrow, wide)), (m, down, up)
        low = torch.randn(m, rank, generator=g)
        for f, p32, p16 in zip(b, packed[torch.float32], packed[torch.bfloat16]):
            assert torch.equal(lowrank(low, p16, f.shape[0]), lowrank(low, p32, f.shape[0]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        pack(torch.randn(8, 3).half())


def test_streamed_factor_narrows_only_exact_bf16_values(monkeypatch):
    """A factor streams as bf16 only when every value is a bf16 number, is computed once per factor version,
    and ``MARS_BF16_FACTORS=0`` keeps fp32."""
    from mars.decoding.fastpath import packed_lowrank, streamed_factor

    kernel_or_skip()
    exact = torch.randn(6, 4).to(torch.bfloat16).float()
    inexact = exact.clone()
    inexact[2, 1] += 2**-20 * inexact[2, 1].abs().clamp(min=1)
    assert streamed_factor(exact).dtype == torch.bfloat16
    assert torch.equal(streamed_factor(exact).float(), exact)
    assert streamed_factor(exact) is streamed_factor(exact)  # kept, not narrowed again per step
    assert streamed_factor(inexact).data_ptr() == inexact.data_ptr()  # as it is: fp32, not copied
    assert packed_lowrank(exact).dtype == torch.bfloat16 and packed_lowrank(inexact).dtype == torch.float32
    with torch.no_grad():
        exact[0, 0] += 2**-20  # an in-place update: no longer bf16 numbers, narrowed again -> kept fp32
    assert streamed_factor(exact).dtype == torch.float32
    monkeypatch.setenv("MARS_BF16_FACTORS", "0")
    assert streamed_factor(torch.randn(6, 4).to(torch.bfloat16).float()).dtype == torch.float32


def test_fused_linear_rejects_factors_that_do_not_fit():
    kernel_or_skip()
    fused = kernels.fused_linear_op()
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    pack = kernels.pack_lowrank_op()
    up = pack(torch.randn(4, 3))
    for wrong in (torch.randn(4, 5), torch.randn(200, 3)):  # another rank; another size (by panels)
        with pytest.raises(RuntimeError, match="do not fit"):
            fused(x, [w], [None], [torch.randn(3, 8)], [pack(wrong)], [1.0], torch.tensor([1]))
    with pytest.raises(RuntimeError, match="do not fit"):  # an up factor not packed
        fused(x, [w], [None], [torch.randn(3, 8)], [torch.randn(4, 3)], [1.0], torch.tensor([1]))
    with pytest.raises(RuntimeError, match="outside the 2 input rows"):
        fused(x, [w], [None], [torch.randn(3, 8)], [up], [1.0], torch.tensor([2]))
    with pytest.raises(RuntimeError, match="one entry per weight"):
        fused(x, [w, w], [None, None], [torch.randn(3, 8)], [up], [1.0], torch.tensor([1]))
    wide = torch.randn(1025, 8)  # more adapted columns than the kernel's low-rank buffer holds
    with pytest.raises(RuntimeError, match="at most 1024 adapted columns"):
        fused(wide, [w], [None], [torch.randn(3, 8)], [up], [1.0], torch.arange(1025))
    torch.library.opcheck(kernels.fused_linear_op(), (x, [w], [None], [], [], [], None))


@pytest.mark.parametrize("changed", ["small_gemm.cpp", "decoder_step.cpp", "small_gemm.h"])
def test_build_key_changes_with_torch_version_and_source(monkeypatch, tmp_path, changed):
    key = kernels.build_key()
    monkeypatch.setattr(torch, "__version__", "9.9.9+other")
    assert kernels.build_key() != key and "9_9_9" in kernels.build_key()
    monkeypatch.undo()
    files = {p.name: p for p in (*kernels.SOURCES, *kernels.HEADERS)}
    copy = tmp_path / changed
    copy.write_text(files[changed].read_text() + "\n// changed\n")
    swap = lambda paths: tuple(copy if p.name == changed else p for p in paths)  # noqa: E731
    monkeypatch.setattr(kernels, "SOURCES", swap(kernels.SOURCES))
    monkeypatch.setattr(kernels, "HEADERS", swap(kernels.HEADERS))
    assert kernels.build_key() != key


def test_kernel_isa_follows_the_cpu_and_an_override(monkeypatch):
    monkeypatch.delenv("MARS_KERNEL_ISA", raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert kernels.kernel_isa() == "avx512" and "-mavx512f" in kernels.cflags()
    wide = kernels.build_key()
    monkeypatch.setenv("MARS_KERNEL_ISA", "avx2")
    assert kernels.kernel_isa() == "avx2" and "-mavx512f" not in kernels.cflags()
    assert kernels.build_key() != wide  # another ISA is another build, never the cached one
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.delenv("MARS_KERNEL_ISA")
    assert kernels.kernel_isa() == "avx2"
    monkeypatch.setenv("MARS_KERNEL_ISA", "avx512")
    with pytest.raises(KernelUnavailable, match="no AVX-512F"):
        kernels.kernel_isa()
    monkeypatch.setenv("MARS_KERNEL_ISA", "sse4")
    with pytest.raises(KernelUnavailable, match="choose one of"):
        kernels.build_key()


def test_fast_path_patches_only_inside_the_block_and_restores_on_error(model):  # noqa: F811
    kernel_or_skip()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with pytest.raises(ZeroDivisionError), fastpath.fast_linear(model) as on:
        assert on and all("forward" in m.__dict__ for m in linears)
        with fastpath.fast_linear(model) as inner:  # re-entrant: the outer block keeps ownership
            assert inner
        assert all("forward" in m.__dict__ for m in linears)
        raise ZeroDivisionError("decode failed")
    assert not any("forward" in m.__dict__ for m in linears)


def test_fast_path_routes_small_inputs_to_the_kernel_and_large_ones_to_f_linear(monkeypatch):
    op = kernel_or_skip()
    layer = torch.nn.Linear(32, 8)
    calls = []
    monkeypatch.setattr(kernels, "small_linear_op", lambda: lambda *a: calls.append(a[0].shape) or op(*a))
    x_small = torch.randn(2, 3, 32)
    with torch.inference_mode(), fastpath.fast_linear(layer):
        small = layer(x_small)
        layer(torch.randn(fastpath.MAX_COLUMNS + 1, 32))
    assert calls == [(2, 3, 32)]
    torch.testing.assert_close(small, F.linear(x_small, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 32, requires_grad=True)  # training: autograd needs F.linear
    with fastpath.fast_linear(layer):
        layer(x).sum().backward()
    assert x.grad is not None and len(calls) == 1


@pytest.mark.parametrize("decoder_kwargs", [dict(threshold=1.0), dict(verify=True), dict(decoder="ar")])
def test_greedy_outputs_through_the_fast_path_equal_eager_hf_greedy(model, tokenizer, decoder_kwargs):  # noqa: F811
    kernel_or_skip()
    prompts = random_prompts((6, 19), seed=5)
    reference = hf_greedy(model, tokenizer, prompts, 12)  # eager, outside any fast path
    fast = generate(model, tokenizer, prompts, block_size=4, max_new_tokens=12, mask_token_id=MASK_ID, **decoder_kwargs)
    assert fast.token_ids == reference


def test_env_switch_turns_the_fast_path_off(model, monkeypatch):  # noqa: F811
    monkeypatch.setenv(fastpath.ENV, "0")
    with fastpath.fast_linear(model) as on:
        assert not on
        assert not any("forward" in m.__dict__ for m in model.modules())
    monkeypatch.setenv(fastpath.ENV, "maybe")
    with pytest.raises(ValueError, match="MARS_FAST_PATH='maybe'"):
        fastpath.enabled_by_env()


def test_model_the_kernel_cannot_serve_warns_once_and_decodes_the_same(tokenizer, monkeypatch):  # noqa: F811
    """A bf16 model (the kernel is fp32-only): one warning naming why, eager outputs unchanged."""
    model16 = build_model().to(torch.bfloat16)
    monkeypatch.setattr(fastpath, "_warned", set())
    prompts = random_prompts((7,), seed=9)
    with pytest.warns(RuntimeWarning, match="fast path off.*bfloat16.*float32-only") as caught:
        first = generate(model16, tokenizer, prompts, threshold=1.0, max_new_tokens=6, mask_token_id=MASK_ID)
    assert sum("fast path off" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no second warning
        again = generate(model16, tokenizer, prompts, threshold=1.0, max_new_tokens=6, mask_token_id=MASK_ID)
    assert again.token_ids == first.token_ids == hf_greedy(model16, tokenizer, prompts, 6)


def test_unavailable_kernel_falls_back_with_one_warning(model, tokenizer, monkeypatch):  # noqa: F811
    def broken():
        raise KernelUnavailable("no C++ compiler (c++ or $CXX) to build the small-M GEMM kernel")

    monkeypatch.setattr(kernels, "small_linear_op", broken)
    monkeypatch.setattr(fastpath, "_warned", set())
    prompts = random_prompts((8,), seed=4)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        out = generate(model, tokenizer, prompts, threshold=1.0, max_new_tokens=6, mask_token_id=MASK_ID)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 6)


def test_thread_setting_is_clamped_and_validated(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    assert threads.resolve_threads(None) == 2
    assert threads.resolve_threads(1) == 1
    with pytest.warns(RuntimeWarning, match="threads=64 is more than the 2 CPUs"):
        assert threads.resolve_threads(64) == 2
    monkeypatch.setenv(threads.THREADS_ENV, "8")
    with pytest.warns(RuntimeWarning, match="MARS_THREADS=8"):
        assert threads.resolve_threads(None) == 2
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            threads.resolve_threads(bad)


def test_padding_columns_of_a_mixed_batch_are_skipped_with_the_same_outputs(model, tokenizer, monkeypatch):  # noqa: F811
    """A threshold-1.0 row beside rows with masks: its padding columns are not multiplied, outputs unchanged."""
    op = kernel_or_skip()
    columns = []

    def counting(x, w, b):
        columns.append(x.numel() // x.shape[-1])
        return op(x, w, b)

    monkeypatch.setattr(kernels, "small_linear_op", lambda: counting)
    prompts = random_prompts((6, 9, 7), seed=11)
    kwargs = dict(block_size=4, max_new_tokens=10, mask_token_id=MASK_ID, threshold=[1.0, 0.3, 1.0])
    skipped = generate(model, tokenizer, prompts, **kwargs)
    skipped_columns, columns[:] = sum(columns), []
    monkeypatch.setattr(forward_module, "only_columns", lambda live: contextlib.nullcontext())
    padded = generate(model, tokenizer, prompts, **kwargs)
    assert skipped.token_ids == padded.token_ids
    assert skipped.token_ids[0] == hf_greedy(model, tokenizer, prompts[:1], 10)[0]
    assert skipped_columns < 0.8 * sum(columns)


def test_wait_policy_follows_the_load_before_torch_loads_and_an_explicit_one_wins(monkeypatch):
    import os
    import subprocess
    import sys

    assert threads.wait_policy(0.1) == {"GOMP_SPINCOUNT": threads.SHORT_SPIN}  # idle: spin briefly
    assert threads.wait_policy(2.5) == {"OMP_WAIT_POLICY": "PASSIVE"}  # busy: sleep at once
    assert threads.wait_policy(None) == {"OMP_WAIT_POLICY": "PASSIVE"}

    def run(env, load):  # a fresh process (torch not loaded yet) on a machine at ``load``
        code = (
            f"import mars.hardware as t; t._load_now = lambda: {load}; "
            "print(t.apply_process_defaults(), t.describe_wait_policy())"
        )
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.split()

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert run(env, 0.1) == ["True", f"GOMP_SPINCOUNT={threads.SHORT_SPIN}"]
    assert run(env, 3.0) == ["True", "OMP_WAIT_POLICY=PASSIVE"]
    assert run({**env, "OMP_WAIT_POLICY": "ACTIVE"}, 0.1) == ["True", "OMP_WAIT_POLICY=ACTIVE"]
    assert run({**env, "GOMP_SPINCOUNT": "50"}, 3.0) == ["True", "GOMP_SPINCOUNT=50"]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert threads.apply_process_defaults() is False  # torch is loaded in this process: too late, left alone
    assert "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ


def test_the_load_is_the_tasks_running_now_besides_this_one(monkeypatch):
    """The wait follows what runs now (the kernel's runnable count, less this process), not the 1-minute
    average a job that just ended leaves behind; without /proc/stat the 1-minute average is the fallback."""
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (2.0, 2.0, 2.0))  # a job that just ended
    readings = iter([1, 1, 3, 1])
    monkeypatch.setattr(threads, "_procs_running", lambda: next(readings))
    assert threads._load_now(samples=4, interval=0.0) == 0.5
    monkeypatch.setattr(threads, "_procs_running", lambda: 1)
    assert threads.wait_policy(threads._load_now(interval=0.0)) == {"GOMP_SPINCOUNT": threads.SHORT_SPIN}
    monkeypatch.setattr(threads, "_procs_running", lambda: None)
    assert threads._load_now(interval=0.0) == 2.0
    monkeypatch.undo()
    assert os.path.exists("/proc/stat") == (threads._procs_running() is not None)
    if threads._procs_running() is not None:
        assert threads._procs_running() >= 1  # this process is running while it reads


def test_the_decoding_stages_of_a_job_choose_their_own_wait_when_they_start():
    """make demo / make reproduce / the recipe search hand their decoding stages no OpenMP wait: evaluate.py and
    the throughput command each choose one from the tasks running when they start (the job's finished stages do
    not count), before torch loads."""
    import os
    import subprocess
    import sys

    from mars.paths import CHECKOUT

    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_VARIABLES}
    show = "import os; print(sorted(k for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT') if k in os.environ))"
    for load in ("import runpy; runpy.run_path('evaluate.py', run_name='stage')", "import mars.bench.throughput"):
        out = subprocess.run(
            [sys.executable, "-c", f"{load}; {show}"], cwd=CHECKOUT, env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip().splitlines()[-1] in ("['GOMP_SPINCOUNT']", "['OMP_WAIT_POLICY']"), out.stderr


def test_a_half_finished_kernel_build_is_redone_and_a_finished_one_reused(tmp_path, monkeypatch):
    builds = []

    def fake_build(target, name):
        builds.append(target)
        target.mkdir(parents=True, exist_ok=True)
        (target / f"{name}.so").write_text("library")

    monkeypatch.setattr(kernels, "_build", fake_build)
    target = tmp_path / "small_gemm-key"
    target.mkdir()
    (target / f"{kernels.NAME}.so").write_text("truncated by a killed build")  # no `complete` marker
    library = kernels.ensure_built(target)
    assert builds == [target] and library.read_text() == "library" and (target / "complete").is_file()
    assert kernels.ensure_built(target) == library and len(builds) == 1  # finished: reused, no compiler run
