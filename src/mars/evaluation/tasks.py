"""Benchmark suites: which lm-eval tasks to run, with which settings, scored by which metric.

A suite (``conf/benchmarks/*.yaml``) names lm-eval tasks or groups.  Each entry is a table column;
its leaf tasks are the unit of work and of resume (one samples file per leaf and threshold), and a
group's score is the size-weighted mean of its leaves (lm-eval's ``weight_by_size``).
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars.paths import eval_dir, project_root

log = logging.getLogger(__name__)

REPO_ROOT = project_root()  # holds conf/, eval/, data/: the checkout, or the installed package's copy
EVAL_ROOT = eval_dir()
# The sandbox every task of eval/ runs model-written code in (a plain file: lm-eval loads task helpers
# by path, so it lives beside them and is loaded by path here too, as one module).
SANDBOX_IN_EVAL = Path("offline") / "humaneval" / "sandbox.py"
CODE_SANDBOX = EVAL_ROOT / SANDBOX_IN_EVAL


class UnknownTaskError(ValueError):
    pass


@dataclass
class TaskSpec:
    name: str  # lm-eval task or group name, as in the suite
    label: str  # column title
    metric: str | None = None  # primary metric; None = the first one lm-eval reports
    filter: str | None = None  # lm-eval filter of the primary metric; None = the first one
    num_fewshot: int | None = None  # None = the task's own default
    leaves: list[str] = field(default_factory=list)


@dataclass
class Suite:
    name: str
    tasks: list[TaskSpec]
    include_path: list[str]
    include_defaults: bool = True
    apply_chat_template: bool = True
    fewshot_as_multiturn: bool = True
    system_instruction: str | None = None
    confirm_run_unsafe_code: bool = False

    @property
    def leaves(self) -> list[str]:
        return [leaf for spec in self.tasks for leaf in spec.leaves]

    def spec_of_leaf(self, leaf: str) -> TaskSpec:
        for spec in self.tasks:
            if leaf in spec.leaves:
                return spec
        raise KeyError(leaf)


def resolve_path(path: str | os.PathLike) -> Path:
    """A path from a config: absolute, else relative to the working directory, else to the project root
    (the checkout, or the installed package's copy of conf/, eval/ and data/)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    if (Path.cwd() / p).exists():
        return Path.cwd() / p
    return REPO_ROOT / p


def _entry_spec(entry: Any) -> TaskSpec:
    if isinstance(entry, str):
        return TaskSpec(name=entry, label=entry)
    entry = dict(entry)
    if "name" not in entry:
        raise ValueError(f"a benchmarks task entry needs a 'name' (lm-eval task or group), got {entry}")
    return TaskSpec(
        name=str(entry["name"]),
        label=str(entry.get("label") or entry["name"]),
        metric=entry.get("metric"),
        filter=entry.get("filter"),
        num_fewshot=entry.get("num_fewshot"),
    )


def suite_from_config(cfg: dict) -> Suite:
    """Read a ``benchmarks`` config into a Suite (leaves not yet expanded)."""
    tasks = [_entry_spec(e) for e in (cfg.get("tasks") or [])]
    if not tasks:
        raise ValueError(f"benchmarks={cfg.get('name')!r} names no tasks")
    include = cfg.get("include_path") or []
    if isinstance(include, str):
        include = [include]
    return Suite(
        name=str(cfg.get("name", "custom")),
        tasks=tasks,
        include_path=[str(resolve_path(p)) for p in include],
        include_defaults=bool(cfg.get("include_defaults", True)),
        apply_chat_template=bool(cfg.get("apply_chat_template", True)),
        fewshot_as_multiturn=bool(cfg.get("fewshot_as_multiturn", True)),
        system_instruction=cfg.get("system_instruction"),
        confirm_run_unsafe_code=bool(cfg.get("confirm_run_unsafe_code", False)),
    )


def task_manager(suite: Suite):
    """lm-eval's TaskManager over the suite's folders (indexes YAMLs; loads no data)."""
    from lm_eval.tasks import TaskManager

    for path in suite.include_path:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"benchmarks={suite.name}: include_path {path} is not a folder")
    return TaskManager(include_path=suite.include_path or None, include_defaults=suite.include_defaults)


def _expand(name: str, index: dict, seen: tuple[str, ...] = ()) -> list[str]:
    from lm_eval.tasks._index import Kind

    entry = index.get(name)
    if entry is None:
        raise KeyError(name)
    if name in seen:
        raise ValueError(f"task group cycle: {' -> '.join(seen + (name,))}")
    if entry.kind in (Kind.TASK, Kind.PY_TASK):
        return [name]
    if entry.kind == Kind.TAG:
        return sorted(leaf for member in entry.tags for leaf in _expand(member, index, seen + (name,)))
    if entry.kind == Kind.GROUP:
        children = (entry.cfg or {}).get("task") or []
        if isinstance(children, str):
            children = [children]
        leaves: list[str] = []
        for child in children:
            if not isinstance(child, str):
                raise ValueError(
                    f"group {name!r} defines an inline task config; name its tasks in their own YAML files "
                    "so each can be run and resumed on its own"
                )
            leaves.extend(_expand(child, index, seen + (name,)))
        return leaves
    raise KeyError(name)


def expand_suite(suite: Suite, manager=None) -> Suite:
    """Check every task name against lm-eval's index and fill in the leaf tasks (before any model load)."""
    manager = manager or task_manager(suite)
    index = manager.task_index
    for spec in suite.tasks:
        try:
            spec.leaves = _expand(spec.name, index)
        except KeyError as missing:
            known = sorted(index)
            close = difflib.get_close_matches(spec.name, known, n=5, cutoff=0.6)
            where = ", ".join(suite.include_path) or "lm-eval's built-in tasks"
            hint = f"; did you mean {close}?" if close else ""
            raise UnknownTaskError(
                f"benchmarks={suite.name}: unknown lm-eval task or group {spec.name!r} (missing: {missing}) "
                f"in {where}{' and the built-in tasks' if suite.include_defaults and suite.include_path else ''}{hint}"
            ) from None
    seen: dict[str, str] = {}
    for spec in suite.tasks:
        for leaf in spec.leaves:
            if leaf in seen:
                raise ValueError(f"task {leaf!r} appears in both {seen[leaf]!r} and {spec.name!r}")
            seen[leaf] = spec.name
    return suite


def code_sandbox():
    """eval/offline/humaneval/sandbox.py as a module (the same instance the task helpers use)."""
    import importlib.util
    import sys

    name = "mars_eval_code_sandbox"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CODE_SANDBOX)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def in_mars_eval_tree(task_yaml: str | os.PathLike) -> bool:
    """True for a task of a mars ``eval/`` folder, whose helpers run code in that folder's sandbox: this
    package's own, or a copy of it (another checkout that uses this checkout's environment, a user's
    edited copy).  Recognised by the sandbox file that the helpers load by path
    (``<eval>/offline/humaneval/sandbox.py``), which lm-eval's own task folders do not have."""
    path = Path(task_yaml).resolve()
    return any((folder / SANDBOX_IN_EVAL).is_file() for folder in path.parents)


def code_tasks(suite: Suite, manager) -> tuple[list[str], list[str]]:
    """Leaves that execute model-written code (``unsafe_code: true``): (ours, run in the sandbox of a
    mars eval/ folder; others, e.g. lm-eval's built-in humaneval/mbpp, which run code uncontained)."""
    ours, others = [], []
    for leaf in suite.leaves:
        entry = manager.task_index.get(leaf)
        if entry is None or not (entry.cfg or {}).get("unsafe_code"):
            continue
        (ours if entry.yaml_path and in_mars_eval_tree(entry.yaml_path) else others).append(leaf)
    return ours, others


def check_code_execution(suite: Suite, manager) -> str | None:
    """Before any model loads: tasks that run model-written code may run here.

    Ours need a working sandbox (bubblewrap) or the explicit opt-in ``MARS_ALLOW_UNSANDBOXED_CODE=1``;
    tasks that run code outside our sandbox are refused without that opt-in.  Returns a line saying how
    code will run (None when no task runs code)."""
    ours, others = code_tasks(suite, manager)
    if not ours and not others:
        return None
    if not suite.confirm_run_unsafe_code:
        raise ValueError(
            f"benchmarks={suite.name}: tasks {ours + others} execute model-written code; set "
            "confirm_run_unsafe_code: true in the benchmarks config to run them (in a sandbox)"
        )
    sandbox = code_sandbox()
    if others and not sandbox.unsandboxed_allowed():
        raise sandbox.SandboxUnavailable(
            f"benchmarks={suite.name}: tasks {others} execute model-written code outside the mars sandbox "
            f"(lm-eval runs it in a fork of the process holding the model, uncontained). Use the sandboxed "
            f"copies in eval/ (e.g. humaneval_instruct_sandboxed, mars_humaneval) or set "
            f"{sandbox.OPT_IN_ENV}=1 to run them anyway."
        )
    how = sandbox.require_sandbox(f"the code written for {ours + others}")
    log.info("tasks %s execute model-written code: %s", ours + others, how)
    return how


def primary_metric(task_results: dict[str, Any], metric: str | None, filt: str | None) -> tuple[str, float]:
    """Pick the suite's metric out of lm-eval's ``results[task]`` (keys ``"<metric>,<filter>"``)."""
    keys = [k for k in task_results if "," in k and not k.split(",")[0].endswith("_stderr")]
    for key in keys:
        name, key_filter = key.split(",", 1)
        if (metric is None or name == metric) and (filt is None or key_filter == filt):
            value = task_results[key]
            return key, float(value) if value is not None else float("nan")
    raise KeyError(
        f"metric {metric!r} with filter {filt!r} is not among lm-eval's results {sorted(keys)}; "
        "fix 'metric'/'filter' of this task in the benchmarks config"
    )
