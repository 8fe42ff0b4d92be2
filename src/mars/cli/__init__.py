"""The entry points: the root ``train.py``, ``evaluate.py`` and ``serve.py`` and the console scripts
(``mars-train``, ``mars-eval``, ``mars-serve``, ``mars-bench``, ``mars-lm-eval``) all call these."""
