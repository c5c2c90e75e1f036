"""The models: the frozen target (``target_loader`` loads it from ``gguf_cache``, a Hugging Face
directory or ``random_target``; ``target`` computes its context features; ``layer_ids`` says which
layers), the DFlash drafter (``drafter``, with ``drafter_config`` and ``drafter_io``), its layers
(``modeling_dflash``: stand-alone, the same file an exported drafter ships with) and its attention
masks (``masks``)."""
