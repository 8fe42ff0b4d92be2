"""One validated decoding-settings object for generate, the engine, the YAML configs, the lm-eval adapter
and the server; dtype resolution by hardware."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import CONF
from hydra import compose, initialize_config_dir

from mars import hardware
from mars.decoding.settings import DecodingSettings, validate_threshold


def test_every_decoding_config_builds_the_settings_it_writes():
    """Each conf/decoding/*.yaml, composed as ``decoding=<name>``, decodes with the values it writes itself
    and mars.yaml's for the rest (a defaults list with ``_self_`` before ``mars`` would let mars.yaml win),
    under its own name (the run name and the results label)."""
    import yaml

    def written(name: str) -> dict:
        """The values a config writes, over those of the config its defaults list names (mars.yaml at the root)."""
        data = yaml.safe_load((CONF / "decoding" / f"{name}.yaml").read_text())
        parents = [d for d in data.pop("defaults", []) if d != "_self_"]
        inherited = written(parents[0]) if parents else {}
        return {**inherited, **data}

    base = written("mars")
    decoders = {}
    for path in sorted((CONF / "decoding").glob("*.yaml")):
        own = written(path.stem)
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="evaluate", overrides=[f"decoding={path.stem}"])
        settings = DecodingSettings.from_mapping(dict(cfg.decoding))
        assert settings == DecodingSettings.from_mapping({**base, **own}), path.name
        assert cfg.decoding.name == path.stem
        decoders[path.stem] = (settings.decoder, settings.verify)
    assert decoders["ar"] == ("ar", False) and decoders["jacobi"] == ("jacobi", False)
    assert decoders["mars"] == ("mars", False) and decoders["mars_verified"] == ("mars", True)


def test_unknown_keys_and_bad_values_name_the_field():
    with pytest.raises(ValueError, match=r"unknown decoding setting\(s\) \['treshold'\]; allowed: \["):
        DecodingSettings.from_mapping({"treshold": 0.9})
    with pytest.raises(ValueError, match="cache_block must be an integer >= 1, got 0"):
        DecodingSettings.from_mapping({"cache_block": 0})
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        DecodingSettings(temperature=-1)


def test_strings_from_cli_arguments_are_coerced():
    s = DecodingSettings.from_mapping({"threshold": "0.9", "block_size": "8", "verify": "false", "window": "none"})
    assert (s.threshold, s.block_size, s.verify, s.window) == (0.9, 8, False, None)
    # "none" is a value of cache and fallback, not a missing value
    s = DecodingSettings.from_mapping({"cache": "none", "fallback": "none", "max_accept": "null"})
    assert (s.cache, s.fallback, s.max_accept) == ("none", "none", None)


def test_threshold_rules_are_shared_with_the_evaluation_config():
    from mars.evaluation.config import check_threshold

    for value, metric in [(1.5, "probability"), (0.0, "margin"), (-1.0, "entropy")]:
        with pytest.raises(ValueError) as a:
            validate_threshold(value, metric)
        with pytest.raises(ValueError) as b:
            check_threshold(value, metric)
        assert str(a.value) == str(b.value)


def test_settings_import_no_torch():
    code = "import sys, mars.decoding.settings, mars.hardware; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_verify_derived_values():
    s = DecodingSettings(verify=True, block_size=4)
    assert s.effective_window == 4 and s.effective_draft_length == 3
    assert DecodingSettings(verify=True, window=6, draft_length=2).effective_draft_length == 2


# ---------------------------------------------------------------------------------------------
# dtype=auto
# ---------------------------------------------------------------------------------------------
def test_auto_dtype_follows_native_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert hardware.resolve_dtype_name("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert hardware.resolve_dtype_name("auto", "cpu") == "float32"
    assert hardware.resolve_dtype_name("auto", "cuda:0") == "bfloat16"
    assert hardware.resolve_dtype_name("float32", "cpu") == "float32"


def test_auto_dtype_for_decoding_is_fp32_where_the_cpu_fast_path_runs(monkeypatch):
    from mars.decoding import fastpath, kernels

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)
    monkeypatch.setattr(kernels, "build_dir", lambda: Path("/nonexistent-mars-build"))
    monkeypatch.setenv("CXX", "sh")  # a compiler on PATH: the kernel could be built here
    monkeypatch.delenv("MARS_FAST_PATH", raising=False)
    assert fastpath.decode_dtype_name("auto", "cpu") == "float32"
    assert fastpath.decode_dtype_name("auto", "cuda:0") == "bfloat16"
    assert fastpath.decode_dtype_name("bfloat16", "cpu") == "bfloat16"  # an explicit dtype is kept
    monkeypatch.setenv("MARS_FAST_PATH", "0")  # no fast path: native bf16 is the faster decoder again
    assert fastpath.decode_dtype_name("auto", "cpu") == "bfloat16"
    monkeypatch.delenv("MARS_FAST_PATH")
    monkeypatch.setenv("CXX", "no-such-compiler-mars")  # nothing to build the kernel with, no finished build
    assert fastpath.decode_dtype_name("auto", "cpu") == "bfloat16"

    def no_kernel():
        raise kernels.KernelUnavailable("not x86-64")

    monkeypatch.setenv("CXX", "sh")
    monkeypatch.setattr(kernels, "check_cpu", no_kernel)
    assert fastpath.decode_dtype_name("auto", "cpu") == "bfloat16"


def test_bf16_without_native_support_warns_and_is_honoured(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="50-100x slower than in float32"):
        assert hardware.resolve_dtype_name("bfloat16", "cpu") == "bfloat16"
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hardware.resolve_dtype_name("bfloat16", "cpu") == "bfloat16"


def test_unknown_dtype_lists_the_allowed_values():
    with pytest.raises(
        ValueError, match=r"unknown dtype 'fp8'; choose one of \['auto', 'float32', 'bfloat16', 'float16'\]"
    ):
        hardware.validate_dtype("fp8")


def test_native_bf16_probe_agrees_with_cpuinfo():
    flags = hardware._cpuinfo_flags()
    if flags:  # Linux: PyTorch's probe and the kernel's flags must agree
        assert hardware.cpu_has_native_bf16() == bool(flags & set(hardware.BF16_CPU_FLAGS))
