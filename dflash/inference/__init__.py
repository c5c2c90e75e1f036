"""Inference with the target and a trained drafter: static-cache decoding (``generation``, with the
fused decoder layers of ``decode_layers``), the speculative-decoding check (``speculative``), data
regeneration by the target (``regenerate``) and the serving export (``export``)."""
