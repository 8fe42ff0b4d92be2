"""``mars-bench <tool> [flags]``: every benchmarking tool behind one command (``mars-bench --help`` lists them,
``mars-bench <tool> --help`` shows a tool's flags); the dispatcher is :mod:`mars.bench.__main__`."""

from mars.bench.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main())
