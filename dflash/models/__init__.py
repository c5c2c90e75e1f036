"""The models: the frozen target and its context features (``target``), the DFlash drafter (``drafter``),
its attention masks (``masks``), and the stand-alone module an exported drafter ships with
(``modeling_dflash``)."""
