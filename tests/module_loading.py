"""Load a plain Python file (a script, an lm-eval task helper) as a module, as lm-eval and the scripts' own
command lines do: such files are not importable from a package."""

import importlib.util
import sys
from pathlib import Path


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module
