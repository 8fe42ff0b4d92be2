"""``python -m mars.bench <tool> [flags]`` (the console script ``mars-bench``): every benchmarking tool behind
one command (``--help`` lists them, ``<tool> --help`` shows a tool's flags)."""

from __future__ import annotations

import importlib
import sys

from mars.bench import TOOLS
from mars.hardware import apply_process_defaults


def usage() -> str:
    width = max(map(len, TOOLS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in TOOLS.items()]
    return "usage: mars-bench <tool> [flags]   (mars-bench <tool> --help for its flags)\n\ntools:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    tool, rest = args[0], args[1:]
    if tool not in TOOLS:
        print(f"mars-bench: unknown tool {tool!r}; one of: {', '.join(TOOLS)}\n\n{usage()}", file=sys.stderr)
        return 2
    apply_process_defaults()  # the OpenMP wait for this machine's load, before a tool imports torch
    module = importlib.import_module(f"mars.bench.{TOOLS[tool][0]}")
    return module.main(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
