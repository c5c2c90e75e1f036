"""The models: the frozen target (``target_loader`` loads it from ``gguf_cache``, a Hugging Face
directory or ``random_target``; ``target`` computes its context features; ``layer_ids`` says which
layers), the DFlash drafter (``drafter``, with ``drafter_config``, ``drafter_layers`` and
``drafter_io``), its attention masks (``masks``), and the stand-alone module an exported drafter
ships with (``modeling_dflash``)."""
