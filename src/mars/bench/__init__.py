"""Benchmarks: every tool that measures speed or cost, behind one command (``mars-bench <tool>``, the same as
``python -m mars.bench <tool>``).

Each tool is a command module with a ``main(argv)``; :mod:`~mars.bench.cli_options` gives them one command-line
style (shared flags, prompt files read by :mod:`mars.prompt_files`, the decoding flags derived from
:class:`~mars.decoding.settings.DecodingSettings`).  The throughput figures are a library the commands share, with
typed arguments and no command line below them: :mod:`~mars.bench.decoders` (the timed decoders by name),
:mod:`~mars.bench.loading` (the model, threads and fast path, the run's record), :mod:`~mars.bench.timing` (the
interleaved timing loop) and :mod:`~mars.bench.tables` (the figures and tables); ``calibrate`` fits from the
teacher-forced mask scores of :mod:`~mars.bench.mask_scores`.  The product packages (training, decoding,
evaluation, serving) never import from here.
"""

# tool name -> module under mars.bench (the name ``mars-bench`` takes, as listed by ``mars-bench --help``)
TOOLS = {
    "throughput": ("throughput", "tokens/s of MARS decoders against the best AR decoder, outputs checked"),
    "spec": ("spec", "speculative decoding per prompt category: acceptance length and speed-up over AR"),
    "step-cost": ("step_cost", "the cost of one decode step per width and batch size"),
    "step-breakdown": ("step_breakdown", "where verified decoding's time goes at batch 1, step by step, against AR"),
    "probe": ("probe", "a quick look at a checkpoint: tokens per forward and fidelity on held-out prompts"),
    "reliability": ("reliability", "how far mask confidence can be trusted, and the acceptance frontier"),
    "calibrate": ("calibrate", "fit per-depth temperatures to a checkpoint's mask confidences, stored with it"),
    "train-step": ("train_step", "the cost of one training step: AR SFT against MARS, precision paths"),
    "loadtest": ("loadtest", "a bounded load test of a running server: requests/s and latency per policy"),
}
