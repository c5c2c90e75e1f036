"""The models: the frozen target and its context features (``target``), the DFlash drafter and its
attention masks (``drafter``), and the stand-alone module an exported drafter ships with
(``modeling_dflash``)."""
