"""``mars-lm-eval``: lm-eval's own command line with the ``mars`` model registered (every lm-eval flag works:
``--model mars --model_args pretrained=<dir>,threshold=0.9,...``)."""

from mars.hardware import apply_process_defaults
from mars.logs import quiet_library_notices


def main(argv: list[str] | None = None) -> None:
    apply_process_defaults()  # the OpenMP wait for this machine's load, before torch loads libgomp
    quiet_library_notices()  # no deprecation notice about the libraries' own calls on every run
    from mars.evaluation.lm_eval_model import lm_eval_main

    lm_eval_main(argv)


if __name__ == "__main__":
    main()
