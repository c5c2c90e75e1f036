"""The on-disk cache of a tokenised corpus: plain ``.npy`` arrays (no pickle) and the data report.

One directory per key under ``data.cache_dir`` (default ``<cache_root>/data``). The key covers the
data file's identity (path, size, modification time; those of ``data.extra_datasets`` too), the
tokenizer's fingerprint (vocabulary, special tokens, chat template), ``max_length``,
``max_conversations``, ``enable_thinking`` and :data:`DATA_CACHE_VERSION`. A directory is complete once ``report.json`` is in it (written last,
then the directory is renamed into place), so a reader never sees half a corpus.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

from dflash.config import RunConfig
from dflash.data import assets
from dflash.data.report import DataReport
from dflash.data.sources import dataset_path
from dflash.utils import atomic_directory

__all__ = ["DATA_CACHE_VERSION", "CACHED_ARRAYS", "cache_key", "cache_root", "load_cached", "save_cached"]

#: Bump when tokenisation or the cache layout changes (invalidates cached data).
DATA_CACHE_VERSION = 5
#: Sub-directory of :func:`dflash.data.assets.cache_root` for cached data when ``data.cache_dir`` is null.
DATA_CACHE_DIR = "data"
#: Length of the hexadecimal cache key (a sha256 prefix).
CACHE_KEY_CHARS = 16
#: The arrays of a cached corpus (see :class:`dflash.data.corpus.TokenizedCorpus`), one ``<name>.npy`` each.
CACHED_ARRAYS = ("tokens", "loss_mask", "offsets", "source_rows", "source_groups")


def cache_root(cfg: RunConfig) -> Path:
    """The directory holding the cached corpora: ``data.cache_dir``, else ``<cache_root>/data``."""
    d = cfg.data
    return Path(d.cache_dir) if d.cache_dir else assets.cache_root() / DATA_CACHE_DIR


def cache_key(cfg: RunConfig, path: Path, fingerprint: str) -> str:
    """The key (:data:`CACHE_KEY_CHARS` hex characters) of the corpus ``cfg.data`` makes from the data
    file ``path`` (and the files of ``data.extra_datasets``) with a tokenizer of ``fingerprint``
    (:func:`dflash.data.tokenizer.tokenizer_fingerprint`)."""
    stat = path.stat()
    d = cfg.data
    extra = {}
    if d.extra_datasets:  # (absent otherwise: the keys of caches without extra rows stay as they were)
        stats = [(f.resolve(), f.stat()) for f in map(dataset_path, d.extra_datasets)]
        extra = {"extra": [[str(f), st.st_size, st.st_mtime_ns] for f, st in stats]}
        if d.extra_token_ratio is not None:  # which extra rows are kept: the ratio and the order's seed
            extra["extra_sample"] = [d.extra_token_ratio, d.seed]
    payload = {**extra,
        "version": DATA_CACHE_VERSION,
        "file": [str(path.resolve()), stat.st_size, stat.st_mtime_ns],
        "tokenizer": fingerprint,
        "max_length": d.max_length,
        "max_conversations": d.max_conversations,
        "enable_thinking": d.enable_thinking,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:CACHE_KEY_CHARS]


def load_cached(directory: Path) -> Optional[tuple[dict[str, np.ndarray], DataReport]]:
    """The arrays (memory-mapped, read-only) and report of a complete cache directory, or None when
    there is none (``report.json`` missing). The report has ``from_cache`` set."""
    if not (directory / "report.json").is_file():
        return None
    arrays = {name: np.load(directory / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in CACHED_ARRAYS}
    report = DataReport.from_dict(json.loads((directory / "report.json").read_text()))
    report.from_cache = True
    return arrays, report


def save_cached(directory: Path, arrays: dict[str, np.ndarray], report: DataReport, meta: dict) -> None:
    """Write the arrays and report into a temporary directory, then rename it into place."""
    with atomic_directory(directory) as tmp:  # another process may write the same key first: its copy is as good
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        # report.json last: its presence marks a complete directory.
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=1, sort_keys=True))
