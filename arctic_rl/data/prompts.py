"""Prompt data: a LightningDataModule over a local JSONL, Parquet or ``datasets`` directory.

Each row has a prompt column (a string, or a list of chat messages) and any other columns, which
pass through untouched to ``GRPOModule.reward(..., **columns)``. Prompts are tokenized once at
``setup`` with the module's tokenizer (applying its chat template when asked) and checked against
``max_prompt_length``, so a bad row fails before any model or engine starts.

The train loader is resumable: its ``state_dict`` records the epoch and how many batches were
consumed, and a resumed run continues with the very next batch of the same shuffled order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from arctic_rl.data.lookahead import LookaheadIterator
from arctic_rl.errors import ConfigError

PROMPT = "prompt"  # the prompt column, whatever ``prompt_field`` it came from
PROMPT_IDS = "prompt_token_ids"  # column added at setup: the tokenized prompt


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read every row of a ``.jsonl``/``.json`` file, a ``.parquet`` file, or a directory written by
    ``datasets.Dataset.save_to_disk``."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"prompt data not found: {path} does not exist")
    if path.is_dir():
        import datasets

        return list(datasets.load_from_disk(str(path)))
    if path.suffix in (".jsonl", ".json"):
        return _load_json_rows(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ConfigError(f"unsupported prompt file {path}: use .jsonl, .parquet or a datasets directory")


def read_text(path: Path) -> str:
    """``path`` as UTF-8 text; bytes that are not UTF-8 are a ``ConfigError`` naming the file, line and byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: byte 0x{data[e.start]:02x} is not UTF-8 ({e.reason}); save the file as UTF-8") from None


def check_messages(where: str, messages: list) -> None:
    """A chat prompt is a list of ``{"role": str, "content": str | list}`` messages, each with content."""
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(f"{where}: message {j} must be an object with a 'role', got {message!r:.80}")
        content = message.get("content")
        if not isinstance(content, (str, list)) or not content:
            shown = "no 'content'" if "content" not in message else f"content {content!r:.40}"
            raise ConfigError(f"{where}: message {j} ({message['role']}) has {shown}; every message needs a non-empty 'content'")


def _load_json_rows(path: Path) -> list[dict[str, Any]]:
    """JSONL (one object per line); a ``.json`` file may also hold one array of objects."""
    import json

    text = read_text(path)
    if path.suffix == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one JSON document: read it as JSONL
        if isinstance(whole, list):
            for i, row in enumerate(whole):
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}: item {i} of the array is {type(row).__name__} {row!r:.60}, expected an object")
            return whole
    rows = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{path}:{line_no}: expected a JSON object per line ({{\"prompt\": ...}}), got {type(row).__name__} {row!r:.60}"
                )
            rows.append(row)
    return rows


def tokenize_prompt(tokenizer, prompt: str | list[dict], apply_chat_template: bool) -> list[int]:
    """Token ids of one prompt; chat-message lists always go through the chat template."""
    if apply_chat_template or isinstance(prompt, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


class EpochShuffleSampler(DistributedSampler):
    """Shuffles with ``seed + epoch`` each epoch, takes this rank's share (``rank::num_replicas``),
    and can start mid-epoch (``skip`` leading indices of the global order). A ``DistributedSampler``,
    so Lightning uses it as it is instead of wrapping it (a wrapper would reshuffle on its own)."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool, num_replicas: int = 1, rank: int = 0) -> None:
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.skip = epoch, 0

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        usable = self.num_rows - self.num_rows % self.num_replicas  # every rank gets as many rows
        skip, self.skip = self.skip, 0  # a later epoch starts at the beginning
        yield from order[skip:usable][self.rank :: self.num_replicas]

    def __len__(self) -> int:
        """A whole epoch's share, also while resuming mid-epoch (Lightning reads the loader's length
        once and keeps it for every later epoch; the iterator simply ends early after a resume)."""
        usable = self.num_rows - self.num_rows % self.num_replicas
        return usable // self.num_replicas


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning checkpoints (it is ``_Stateful``): it saves the epoch and the number of
    batches the trainer consumed (read from ``consumed_batches``, not from this loader, because
    Lightning prefetches one batch ahead)."""

    def __init__(self, *args, sampler: EpochShuffleSampler, consumed_batches: Callable[[], tuple[int, int]],
                 fingerprint: str = "", changed_data_on_resume: str = "warn", **kwargs):
        super().__init__(*args, sampler=sampler, **kwargs)
        self._consumed_batches = consumed_batches
        self.fingerprint, self.changed_data_on_resume = fingerprint, changed_data_on_resume
        self.batches: LookaheadIterator | None = None  # this epoch's batches; the rollout callback peeks ahead

    def __iter__(self) -> LookaheadIterator:
        self.batches = LookaheadIterator(super().__iter__())
        return self.batches

    def state_dict(self) -> dict[str, int]:
        """``batches_consumed`` is per rank; every rank consumed as many."""
        epoch, batches = self._consumed_batches()
        per_rank = len(self.sampler)
        num_batches = per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)
        if batches >= num_batches:
            epoch, batches = epoch + 1, 0
        return {"epoch": epoch, "batches_consumed": batches, **self._order(), "fingerprint": self.fingerprint}

    def _order(self) -> dict[str, Any]:
        """What fixes the data order and position: a resume must find the same."""
        s = self.sampler
        return {"num_replicas": s.num_replicas, "batch_size": self.batch_size, "num_rows": s.num_rows, "seed": s.seed, "shuffle": s.shuffle}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_replicas"] != self.sampler.num_replicas:
            raise ConfigError(
                f"checkpoint was written by {state['num_replicas']} data-parallel ranks, this run has"
                f" {self.sampler.num_replicas}: the data order cannot be resumed exactly"
            )
        names = {"batch_size": "data.batch_size", "num_rows": "the number of prompts in data.train_path",
                 "seed": "data.seed", "shuffle": "data.shuffle"}
        changed = [f"{names[k]}: {state[k]!r} in the checkpoint, {v!r} now" for k, v in self._order().items() if k in names and k in state and state[k] != v]
        if changed:
            raise ConfigError("cannot resume the data position and order exactly: " + "; ".join(changed))
        self._check_fingerprint(state.get("fingerprint"))
        self.sampler.epoch = state["epoch"]
        self.sampler.skip = state["batches_consumed"] * self.batch_size * self.sampler.num_replicas

    def _check_fingerprint(self, saved: str | None) -> None:
        """The checkpoint's data must be this run's: a different file of as many rows would resume at a
        position in other prompts. Warn, or refuse under ``data.changed_data_on_resume: error``."""
        if not saved or not self.fingerprint or saved == self.fingerprint:
            return  # a checkpoint from before fingerprints, or the same data
        message = (f"the training data differs from the checkpoint's (fingerprint {self.fingerprint[:12]} now,"
                   f" {saved[:12]} in the checkpoint): the run resumes at the same position in other prompts")
        if self.changed_data_on_resume == "error":
            raise ConfigError(f"{message}; resume with the checkpoint's data, or set data.changed_data_on_resume: warn")
        import warnings

        warnings.warn(f"{message} (data.changed_data_on_resume: error refuses this)", stacklevel=2)


def data_fingerprint(rows: list[dict[str, Any]]) -> str:
    """SHA-256 of the rows as loaded (every column, in order): equal for equal data, whatever the file format."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, list]:
    """List of row dicts -> dict of column lists (no tensors: prompts have different lengths)."""
    return {key: [row[key] for row in rows] for key in rows[0]}


class _Rows(Dataset):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


class PromptDataModule(pl.LightningDataModule):
    """Prompts for GRPO from local files.

    Args:
        train_path: ``.jsonl``, ``.parquet`` or a ``datasets.save_to_disk`` directory.
        prompt_field: the column holding the prompt text or chat messages.
        batch_size: prompts per rollout batch (each is sampled G times).
        apply_chat_template: wrap string prompts as a user message and apply the tokenizer's template.
        shuffle: reshuffle the training prompts every epoch (deterministic from ``seed``).
        seed: shuffling seed.
        drop_last: drop a final partial batch (keeps every rollout batch the same size).
        changed_data_on_resume: ``warn`` or ``error`` when a resumed run's data differs from the data the
            checkpoint was trained on (its fingerprint, a hash of every row, is saved in the checkpoint).
    """

    def __init__(
        self,
        train_path: str,
        prompt_field: str = "prompt",
        batch_size: int = 8,
        apply_chat_template: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        changed_data_on_resume: Literal["warn", "error"] = "warn",
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}")
        if changed_data_on_resume not in ("warn", "error"):
            raise ConfigError(f"data.changed_data_on_resume must be 'warn' or 'error', got {changed_data_on_resume!r}")
        self.changed_data_on_resume, self.fingerprint = changed_data_on_resume, ""
        self.train_path = train_path
        self.prompt_field, self.batch_size = prompt_field, batch_size
        self.apply_chat_template, self.shuffle, self.seed, self.drop_last = apply_chat_template, shuffle, seed, drop_last
        self.train_rows: list[dict[str, Any]] = []

    def prepare_rows(self, path: str, tokenizer, max_prompt_length: int) -> list[dict[str, Any]]:
        """Load ``path`` (recording its :func:`data_fingerprint`) and add ``prompt_token_ids`` to every row;
        raise naming the first bad row."""
        rows = load_rows(path)
        if not rows:
            raise ConfigError(f"{path}: no prompts")
        self.fingerprint = data_fingerprint(rows)
        columns = set(rows[0])
        if self.prompt_field not in columns:
            raise ConfigError(f"{path}: row 0 has no prompt column {self.prompt_field!r} (columns: {sorted(columns)}); set data.prompt_field")
        clash = {PROMPT, PROMPT_IDS} & (columns - {self.prompt_field})
        if clash:
            raise ConfigError(f"{path}: columns {sorted(clash)} are reserved; rename them or use one as data.prompt_field")
        for i, row in enumerate(rows):
            if set(row) != columns:
                raise ConfigError(f"{path}: row {i} has columns {sorted(row)} but row 0 has {sorted(columns)}")
            prompt = row[self.prompt_field]
            if not isinstance(prompt, (str, list)) or not prompt:
                raise ConfigError(f"{path}: row {i}: {self.prompt_field!r} must be a non-empty string or message list, got {prompt!r}")
            if isinstance(prompt, list):
                check_messages(f"{path}: row {i}", prompt)
            ids = tokenize_prompt(tokenizer, prompt, self.apply_chat_template)
            if len(ids) > max_prompt_length:
                raise ConfigError(
                    f"{path}: row {i}: prompt is {len(ids)} tokens, longer than model.sampling.max_prompt_length={max_prompt_length}"
                    f" (prompt starts {str(prompt)[:80]!r}); raise the limit or filter the data"
                )
            rows[i] = {PROMPT: prompt, PROMPT_IDS: ids, **{k: v for k, v in row.items() if k != self.prompt_field}}
        return rows

    @property
    def columns(self) -> list[str]:
        """The training rows' columns besides the prompt (what ``reward`` receives by name), after ``setup``."""
        return [k for k in self.train_rows[0] if k not in (PROMPT, PROMPT_IDS)]

    def setup(self, stage: str) -> None:
        module = self.trainer.lightning_module
        self.train_rows = self.prepare_rows(self.train_path, module.tokenizer, module.max_prompt_length)
        if len(self.train_rows) < self.batch_size * self.trainer.world_size:
            raise ConfigError(
                f"data.batch_size={self.batch_size} x {self.trainer.world_size} ranks is more than the"
                f" {len(self.train_rows)} prompts in {self.train_path}"
            )

    def _consumed(self) -> tuple[int, int]:
        # the epoch the consumed batches belong to: after a run stopped mid-epoch (max_steps, SIGTERM),
        # Lightning has already counted that epoch as processed, but not yet started the next one
        loop = self.trainer.fit_loop
        return max(loop.epoch_progress.current.started - 1, 0), loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        sampler = EpochShuffleSampler(
            len(self.train_rows), self.seed, self.shuffle, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank
        )
        return ResumableDataLoader(
            _Rows(self.train_rows),
            batch_size=self.batch_size,
            sampler=sampler,
            consumed_batches=self._consumed,
            fingerprint=self.fingerprint,
            changed_data_on_resume=self.changed_data_on_resume,
            collate_fn=collate_rows,
            drop_last=self.drop_last,
        )
