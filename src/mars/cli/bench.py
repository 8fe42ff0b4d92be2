"""``mars-bench <tool> [flags]``: every benchmarking tool behind one command (``mars-bench --help`` lists them,
``mars-bench <tool> --help`` shows a tool's flags); the dispatcher is :mod:`mars.bench.__main__`."""

from mars.bench.__main__ import main
from mars.logs import quiet_library_notices

quiet_library_notices()  # no deprecation notice about the libraries' own calls on every run

if __name__ == "__main__":
    raise SystemExit(main())
