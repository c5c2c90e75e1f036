"""Training: anchor sampling (``anchors``), the DFlash objective (``objective``) and its chunked
LM-head cross-entropy (``chunked_ce``), one drafter's optimizer step (``trainer``), the
learning-rate schedule (``optim``), checkpoints (``checkpoint``), what a launch resumes from and
whether it may (``resume``), the single-process reference trainer the pipeline is checked against
(``reference``), and the components a config builds (``factory``)."""
