"""PromptDataModule: formats, chat template, pass-through columns, errors, resumable order."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from arctic_rl.data.prompts import PROMPT, PROMPT_IDS, EpochShuffleSampler, PromptDataModule, load_rows
from arctic_rl.errors import ConfigError

ROWS = [{"question": "echo 3 :", "answer": "3"}, {"question": "x echo 5 :", "answer": "5"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
def test_load_rows_reads_every_format(tmp_path, fmt):
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    elif fmt == "parquet":
        path = tmp_path / "p.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        import datasets

        path = tmp_path / "ds"
        datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    assert load_rows(path) == ROWS


def test_prepare_rows_tokenizes_and_passes_columns_through(tmp_path, tokenizer):
    dm = PromptDataModule(str(write_jsonl(tmp_path / "p.jsonl", ROWS)), prompt_field="question")
    rows = dm.prepare_rows(dm.train_path, tokenizer, max_prompt_length=16)
    assert rows[0] == {PROMPT: "echo 3 :", PROMPT_IDS: tokenizer("echo 3 :")["input_ids"], "answer": "3"}
    assert [tokenizer.convert_ids_to_tokens(i) for i in rows[1][PROMPT_IDS]] == ["x", "echo", "5", ":"]


def test_chat_template_is_applied_when_asked(tmp_path, tokenizer):
    dm = PromptDataModule(str(write_jsonl(tmp_path / "p.jsonl", ROWS)), prompt_field="question", apply_chat_template=True)
    ids = dm.prepare_rows(dm.train_path, tokenizer, 32)[0][PROMPT_IDS]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "echo", "3", ":", "<|im_end|>", "<|im_start|>", "assistant"]


def test_message_list_prompts_always_use_the_template(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "echo 1 :"}], "answer": "1"}]
    dm = PromptDataModule(str(write_jsonl(tmp_path / "p.jsonl", rows)))
    ids = dm.prepare_rows(dm.train_path, tokenizer, 32)[0][PROMPT_IDS]
    assert tokenizer.convert_ids_to_tokens(ids)[:3] == ["<|im_start|>", "user", "echo"]


def test_too_long_prompt_names_the_row_and_the_limit(tmp_path, tokenizer):
    rows = ROWS + [{"question": "echo " * 20 + "7 :", "answer": "7"}]
    dm = PromptDataModule(str(write_jsonl(tmp_path / "p.jsonl", rows)), prompt_field="question")
    with pytest.raises(ValueError, match=r"row 2: prompt is 22 tokens, longer than model.sampling.max_prompt_length=8"):
        dm.prepare_rows(dm.train_path, tokenizer, max_prompt_length=8)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"text": "a"}], "no prompt column 'question'"),
        ([{"question": "echo", "answer": "1"}, {"question": "x"}], "row 1 has columns"),
        ([{"question": ""}], "row 0: 'question' must be a non-empty"),
        ([{"question": "a", "prompt": "b"}], "reserved"),
    ],
)
def test_bad_rows_are_named(tmp_path, tokenizer, rows, match):
    dm = PromptDataModule(str(write_jsonl(tmp_path / "p.jsonl", rows)), prompt_field="question")
    with pytest.raises(ValueError, match=match):
        dm.prepare_rows(dm.train_path, tokenizer, 16)


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not valid JSON"):
        load_rows(path)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(ConfigError, match="prompt data not found: .*nope.jsonl does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "p.csv").write_text("a\n")
    with pytest.raises(ValueError, match="unsupported prompt file"):
        load_rows(tmp_path / "p.csv")


def test_sampler_is_deterministic_per_epoch_and_resumes_mid_epoch():
    a, b = EpochShuffleSampler(10, seed=3, shuffle=True), EpochShuffleSampler(10, seed=3, shuffle=True)
    epoch0 = list(a)
    assert sorted(epoch0) == list(range(10)) and epoch0 == list(b)
    a.set_epoch(1)
    epoch1 = list(a)
    assert epoch1 != epoch0 and sorted(epoch1) == list(range(10))
    b.epoch, b.skip = 1, 4  # what ResumableDataLoader.load_state_dict sets after 2 batches of 2
    assert list(b) == epoch1[4:]
    assert list(b) == epoch1  # the skip applies to the resumed epoch only


def test_sampler_shards_ranks_disjointly_and_resumes_each():
    ranks = [EpochShuffleSampler(11, seed=1, shuffle=True, num_replicas=2, rank=r) for r in range(2)]
    full = list(EpochShuffleSampler(11, seed=1, shuffle=True))
    assert [list(s) for s in ranks] == [full[0:10:2], full[1:10:2]] and len(ranks[0]) == 5  # row 10 dropped: 5 each
    for s in ranks:
        s.skip = 4  # each rank consumed one batch of 2: 4 rows of the global order
    assert [list(s) for s in ranks] == [full[4:10:2], full[5:10:2]]


def test_a_json_array_of_objects_loads_like_jsonl(tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    (tmp_path / "p.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_rows(tmp_path / "p.json") == load_rows(tmp_path / "p.jsonl") == rows


def _loader_state_of(path, tokenizer, **options):
    """A ``ResumableDataLoader`` over ``path``'s rows (one batch consumed) and the data module that read them."""
    from arctic_rl.data.prompts import ResumableDataLoader, collate_rows

    dm = PromptDataModule(str(path), prompt_field="question", batch_size=1, **options)
    rows = dm.prepare_rows(dm.train_path, tokenizer, 16)
    return ResumableDataLoader(rows, batch_size=1, sampler=EpochShuffleSampler(len(rows), 0, True), collate_fn=collate_rows,
                               consumed_batches=lambda: (0, 1), fingerprint=dm.fingerprint,
                               changed_data_on_resume=dm.changed_data_on_resume)


def test_resuming_on_other_data_of_the_same_length_warns_or_is_refused(tmp_path, tokenizer):
    import warnings

    write_jsonl(tmp_path / "a.jsonl", ROWS)
    write_jsonl(tmp_path / "b.jsonl", [{**ROWS[0], "answer": "4"}, ROWS[1]])  # as many rows, one answer differs
    saved = _loader_state_of(tmp_path / "a.jsonl", tokenizer).state_dict()
    assert len(saved["fingerprint"]) == 64  # SHA-256 of the rows, saved with the position (in the checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loader_state_of(tmp_path / "a.jsonl", tokenizer).load_state_dict(saved)  # the same data: silent
    with pytest.warns(UserWarning, match=r"the training data differs from the checkpoint's \(fingerprint \w{12} now, \w{12} in the checkpoint\)"):
        _loader_state_of(tmp_path / "b.jsonl", tokenizer).load_state_dict(saved)
    strict = _loader_state_of(tmp_path / "b.jsonl", tokenizer, changed_data_on_resume="error")
    with pytest.raises(ConfigError, match=r"the training data differs .*; resume with the checkpoint's data, or set data.changed_data_on_resume: warn"):
        strict.load_state_dict(saved)
