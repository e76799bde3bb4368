"""``arctic-rl prepare``'s bad inputs: one line naming the file or record and the fix, exit status 2,
no traceback (through the real CLI), and a failed run leaves the previous output byte for byte. The command lines
run together in ``cli_runs`` (``run_cli_many``: the CLI's imports paid once), each test reading its own."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arctic_rl.errors import ConfigError
from arctic_rl.recipes import bird, gsm8k, multihop_qa
from tests.helpers import REPO, cli_env, run_cli_many

FIXTURES = Path(__file__).parent / "fixtures"
_spec = importlib.util.spec_from_file_location("make_databases", FIXTURES / "bird/make_databases.py")
make_databases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_databases)


def prepare_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arctic_rl.cli", "prepare", *args], cwd=REPO, env={**cli_env(), **env},
                          capture_output=True, text=True, timeout=300)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (temporary files included) and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def gsm8k_source(tmp_path: Path, bad_split: str) -> Path:
    """The GSM8K fixture with the 5th record of ``bad_split`` answered without ``#### n``."""
    source = tmp_path / f"bad_{bad_split}"
    shutil.copytree(FIXTURES / "gsm8k", source)
    lines = (source / f"{bad_split}.jsonl").read_text().splitlines()
    index = min(4, len(lines) - 1)
    record = json.loads(lines[index])
    record["answer"] = "It is 624."
    lines[index] = json.dumps(record)
    (source / f"{bad_split}.jsonl").write_text("\n".join(lines) + "\n")
    return source


def prepared(out: Path, recipe, source: Path, counts: dict) -> dict[str, bytes]:
    """``out`` prepared from a good ``source`` (``counts`` rows per split); its files and their bytes."""
    assert recipe.prepare(out, source) == counts
    return snapshot(out)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path, dict[str, bytes], Path]]:
    """``{case: (finished arctic-rl prepare, --source, the output before, --out)}``: each case's output
    directory is prepared from the good source first, then the bad source is given to the CLI on it."""
    root = tmp_path_factory.mktemp("prepare_cli")
    cases = {}
    out = root / "gsm8k_out"
    cases["gsm8k_rerun"] = ("gsm8k", gsm8k_source(root, "train"), prepared(out, gsm8k, FIXTURES / "gsm8k", {"train": 8, "test": 2}), out)
    cut = root / "cut.json"
    cut.write_text('[\n {"_id": "a1",\n  "question": "Which river')  # a download that stopped early
    for name, source in (("multihop_cut", cut), ("multihop_missing", root / "missing.json")):
        out = root / f"{name}_out"
        cases[name] = ("multihop_qa", source, prepared(out, multihop_qa, FIXTURES / "multihop_qa/hotpot_train_v1.1.json", {"train": 4}), out)
    for name in ("bird_no_sql", "bird_corrupt_database"):
        source, out = make_databases.build(root / f"{name}_source"), root / f"{name}_out"
        cases[name] = ("bird", source, prepared(out, bird, source, {"train": 6}), out)
    records = json.loads((cases["bird_no_sql"][1] / "train.json").read_text())
    del records[1]["SQL"]
    (cases["bird_no_sql"][1] / "train.json").write_text(json.dumps(records, indent=1))
    (cases["bird_corrupt_database"][1] / "train_databases/school/school.sqlite").write_bytes(b"not a database " * 100)
    commands = {name: ["prepare", recipe, "--source", str(source), "--out", str(out)] for name, (recipe, source, _, out) in cases.items()}
    done = run_cli_many(commands, root)
    return {name: (done[name], source, before, out) for name, (_, source, before, out) in cases.items()}


def assert_refused(run, message: str) -> None:
    """Exit status 2, nothing on stdout, ``message`` alone on stderr, the output as it was before."""
    proc, _, before, out = run
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", message)
    assert snapshot(out) == before


def test_a_failed_gsm8k_rerun_names_the_record_and_leaves_the_previous_output(cli_runs):
    before = cli_runs["gsm8k_rerun"][2]
    assert sorted(before) == ["test.jsonl", "train.jsonl"] and before["train.jsonl"].count(b"\n") == 8
    source = cli_runs["gsm8k_rerun"][1]
    assert_refused(cli_runs["gsm8k_rerun"], f"error: {source}/train.jsonl line 5: not a GSM8K answer (no '####'): 'It is 624.';"
                                            " fix or remove that record\n")


def test_both_gsm8k_files_or_neither(tmp_path):
    out = tmp_path / "out"
    gsm8k.prepare(out, FIXTURES / "gsm8k")
    before = snapshot(out)
    source = gsm8k_source(tmp_path, "test")  # train.jsonl is complete before test.jsonl fails
    with pytest.raises(ConfigError, match=r"test.jsonl line 2: not a GSM8K answer"):
        gsm8k.prepare(out, source)
    assert snapshot(out) == before


def test_gsm8k_offline_without_source_says_to_use_source(tmp_path):
    proc = prepare_cli("gsm8k", "--out", str(tmp_path / "out"), HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert (proc.returncode, proc.stdout) == (2, "")
    head, reason, tail = proc.stderr.partition("(ConnectionError: ")  # the reason is datasets' own words
    assert head == "error: could not load openai/gsm8k (train) from the Hugging Face hub " and proc.stderr.count("\n") == 1
    assert reason and tail.endswith("); download the dataset's files and pass them with --source (see the recipe's README)\n")
    assert not (tmp_path / "out").exists()


def test_multihop_qa_malformed_json_and_a_missing_file(cli_runs):
    cut, missing = cli_runs["multihop_cut"][1], cli_runs["multihop_missing"][1]
    assert_refused(cli_runs["multihop_cut"],
                   f"error: {cut} line 3 column 15: not valid JSON (Unterminated string starting at); is the file complete?\n")
    assert_refused(cli_runs["multihop_missing"], f"error: {missing}: no such file; give a .json, .jsonl or .parquet file\n")


def test_multihop_qa_record_without_a_context_is_named(tmp_path):
    source = tmp_path / "musique.jsonl"
    records = [json.loads(line) for line in (FIXTURES / "multihop_qa/musique_ans_v1.0_train.jsonl").read_text().splitlines()]
    records[1] = {"id": "x", "question": "q", "answer": "a"}
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ConfigError) as error:
        multihop_qa.prepare(tmp_path / "out", source)
    assert str(error.value) == f"{source} line 2: the record has no 'context' field; fix or remove that record"
    assert not (tmp_path / "out/train.jsonl").exists()


def test_bird_record_without_sql_and_a_corrupt_database(cli_runs):
    source = cli_runs["bird_no_sql"][1]
    assert_refused(cli_runs["bird_no_sql"], f"error: {source}/train.json record 2: the record has no 'SQL' field; fix or remove that record\n")
    source = cli_runs["bird_corrupt_database"][1]
    database = source / "train_databases/school/school.sqlite"
    assert_refused(cli_runs["bird_corrupt_database"], f"error: {source}/train.json record 4: {database} is not a readable SQLite"
                                                      " database (file is not a database); unpack BIRD's databases archive again\n")


def test_gsm8k_source_that_is_not_a_directory_of_the_files(tmp_path):
    (tmp_path / "file.jsonl").write_text("{}\n")
    (tmp_path / "empty").mkdir()
    cases = {
        tmp_path / "nope": f"--source {tmp_path}/nope: no such directory; give the directory holding GSM8K's train.jsonl and test.jsonl",
        tmp_path / "file.jsonl": f"--source {tmp_path}/file.jsonl: not a directory; give the directory holding GSM8K's train.jsonl and test.jsonl",
        tmp_path / "empty": f"--source {tmp_path}/empty: no train.jsonl or train.parquet in it (grade_school_math/data has both splits)",
    }
    for source, message in cases.items():
        with pytest.raises(ConfigError) as error:
            gsm8k.prepare(tmp_path / "out", source)
        assert str(error.value) == message
    assert not (tmp_path / "out").exists()
