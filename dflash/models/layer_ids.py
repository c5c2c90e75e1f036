"""The DFlash rule for which target layers feed the drafter, and the check every layer id passes.

One rule, used by the target (:class:`dflash.models.target.TargetModel`), the run config
(:func:`resolve_layer_ids`) and the drafter's config (:class:`dflash.models.drafter_config.DFlashConfig`).

Formulas: layer ids ``round(1 + i*(N-4)/(L-1))`` and "output of layer id = ``hidden_states[id+1]``"
are docs/DFLASH.md, Target layer ids (DFlash paper arXiv 2602.06036; z-lab/dflash ``build_target_layer_ids``).
"""

from __future__ import annotations

import logging
from typing import Optional

from dflash.config import ConfigError

__all__ = ["default_layer_ids", "last_feature_layer", "check_layer_ids", "resolve_layer_ids"]

logger = logging.getLogger(__name__)


def default_layer_ids(num_target_layers: int, num_drafter_layers: int) -> list[int]:
    """The DFlash rule for which target layers feed the drafter (docs/DFLASH.md, Target layer ids).

    ``ids[i] = round(1 + i * (N - 4) / (L - 1))`` for i = 0..L-1, evenly spaced from layer 1 to
    layer N-3 (Qwen3-8B: N=36, L=5 → [1, 9, 17, 25, 33]). ``round`` is Python's round-half-to-even
    on the float quotient, exactly as the public DFlash code (z-lab/dflash ``build_target_layer_ids``)
    and SGLang compute it, so that engines which recompute the ids from ``num_target_layers`` agree
    with us (N=30, L=5 → [1, 8, 14, 20, 27]; half-up rounding would give 21 instead of 20).
    L = 1 → ``[N // 2]`` (the middle layer), also as the public code does.

    Args:
        num_target_layers: N, decoder layers of the target (>= 1).
        num_drafter_layers: L, drafter layers = number of fused target layers (>= 1).

    Raises:
        ValueError: N or L < 1, or the rule names a layer outside the engines' range
            (:func:`check_layer_ids`; N < 4 with L >= 2, or N < 3 with L = 1: set
            ``target.layer_ids`` explicitly).
    """
    n, k = int(num_target_layers), int(num_drafter_layers)
    if n < 1 or k < 1:
        raise ValueError(f"need >= 1 target and drafter layers, got N={n}, L={k}")
    if k == 1:
        ids = [n // 2]
        if ids[0] > last_feature_layer(n):
            raise ValueError(f"target.layer_ids: a {n}-layer target has no layer the engines can take "
                             f"features from (valid ids 0..{last_feature_layer(n)})")
        return ids
    ids = [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]
    if min(ids) < 0 or max(ids) > last_feature_layer(n):
        raise ValueError(
            f"target.layer_ids: the DFlash rule gives {ids} for a {n}-layer target; valid ids are "
            f"0..{last_feature_layer(n)}; set target.layer_ids explicitly")
    if len(set(ids)) < len(ids):
        logger.warning("target.layer_ids: the DFlash rule repeats layers for N=%d, L=%d: %s", n, k, ids)
    return ids


def last_feature_layer(num_target_layers: int) -> int:
    """The largest valid layer id, N − 2, for a target of N decoder layers.

    Serving engines take the feature of layer ``id`` as ``hidden_states[id + 1]`` (vLLM
    ``qwen3_dflash.py`` and SGLang ``models/dflash.py`` add the 1 themselves): the input of decoder
    layer ``id + 1``, which exists for ``id + 1 <= N − 1``. An id of N − 1 points past the layers.
    """
    return int(num_target_layers) - 2


def check_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """``layer_ids`` as ints when every id is valid under the engines' indexing (0..N−2, see
    :func:`last_feature_layer`), non-empty and without duplicates.

    The one rule for target layer ids: the config (:func:`resolve_layer_ids`), the target model
    (:class:`dflash.models.target.TargetModel`) and the drafter's config
    (:class:`dflash.models.drafter_config.DFlashConfig`) all use it.

    Raises:
        ConfigError: ``target.layer_ids: ...`` naming the bad id and the valid range.
    """
    ids = [int(i) for i in layer_ids]
    last = last_feature_layer(num_target_layers)
    if not ids:
        raise ConfigError("target.layer_ids: must not be empty")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"target.layer_ids: has duplicates: {ids}")
    for i in ids:
        if not 0 <= i <= last:
            raise ConfigError(
                f"target.layer_ids: layer {i} is out of range for a {num_target_layers}-layer target: valid ids "
                f"are 0..{last} (engines read the feature of layer id as hidden_states[id + 1], the input of "
                f"layer id + 1)")
    return ids


def resolve_layer_ids(layer_ids: Optional[list[int]], num_target_layers: int,
                      num_drafter_layers: int) -> list[int]:
    """``layer_ids`` (the ``target.layer_ids`` override) validated, else :func:`default_layer_ids`.

    The override's length need not equal the drafter depth (the drafter's ``fc`` takes L·D inputs
    for whatever L is given), but every id must pass :func:`check_layer_ids`.

    Raises:
        ConfigError: ``target.layer_ids: ...`` (empty, negative, duplicate or > N − 2).
    """
    if layer_ids is None:
        try:
            return default_layer_ids(num_target_layers, num_drafter_layers)
        except ValueError as exc:
            raise ConfigError(str(exc) if str(exc).startswith("target.") else f"target.layer_ids: {exc}") from None
    return check_layer_ids(layer_ids, num_target_layers)
