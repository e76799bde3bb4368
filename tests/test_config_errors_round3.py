"""Settings given twice, sections of the wrong shape and the CLI's own mistakes, through the real ``arctic-rl``
(each case its own process, forked from one that imported the dependencies once: ``tests/cli_forks.py``): one
line naming the field(s) and the fix, exit status 2, before any model or engine starts; help exits 0."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import quickstart_config, run_cli_many, write_config

OLD = "(the flat keys and loss_kwargs are deprecated)"
SAMPLING_FIELDS = "group_size, max_prompt_length, max_response_length, temperature, top_p, seed"


def _hotpot_source(d, records):
    path = d / "source.json"
    path.write_text(json.dumps(records))
    return ["prepare", "search_agent", "--source", str(path), "--out", str(d / "out")], str(path)


BAD_CONTEXT = [{"_id": "a", "question": "q?", "answer": "x", "context": [["Title", ["one."]], ["Lonely title"]]}]

FIT_CASES = {  # name: (changes to the quickstart, extra arguments, message pattern of the last line)
    "flat_temperature_beside_sampling": (
        {"model.init_args.temperature": 1.3, "model.init_args.sampling.temperature": 0.7}, [],
        r"^error: model.init_args.temperature and model.init_args.sampling.temperature both set one option: keep only"
        rf" model.init_args.sampling.temperature {re.escape(OLD)}$",
    ),
    "flat_learning_rate_beside_optim": (
        {"model.init_args.learning_rate": 0.1}, [],  # the quickstart sets optim.learning_rate
        r"^error: model.init_args.learning_rate and model.init_args.optim.learning_rate both set one option: keep only"
        r" model.init_args.optim.learning_rate ",
    ),
    "loss_kwargs_beside_loss": (
        {"model.init_args.loss_kwargs": {"clip_high": 0.5}, "model.init_args.loss.clip_high": 0.28}, [],
        r"^error: model.init_args.loss_kwargs.clip_high and model.init_args.loss.clip_high both set one option: keep only"
        r" model.init_args.loss.clip_high ",
    ),
    "flat_flag_beside_section_flag": (
        {}, ["--model.init_args.temperature", "1.3", "--model.init_args.sampling.temperature", "0.7"],
        r"^error: --model.init_args.temperature and --model.init_args.sampling.temperature both set one option",
    ),
    "sampling_a_list": (
        {"model.init_args.sampling": [8, 32, 8]}, [],
        rf"^error: model.init_args.sampling must be a mapping of its fields \({SAMPLING_FIELDS}\), e.g. sampling:"
        r" \{group_size: ...\}; got list \[8, 32, 8\]$",
    ),
    "rollout_null": (
        {"model.init_args.rollout": "__null__"}, [],
        r"^error: model.init_args.rollout must be a mapping of its fields \(advantage_estimator, .*environment, agent\), e.g."
        r" rollout: \{advantage_estimator: ...\}; got null \(leave the section out for its defaults\)$",
    ),
    "sampling_misspelt_field": (
        {"model.init_args.sampling.temprature": 0.7}, [],
        rf"^error: model.init_args.sampling has no field 'temprature' \(did you mean 'temperature'\?\); its fields are {SAMPLING_FIELDS}$",
    ),
    "environment_as_class_path": (
        {"model.init_args.rollout.environment": {"class_path": "my_env.Search", "init_args": {"tag": "5"}}}, [],
        r"^error: model.init_args.rollout.environment is given as env_class and env_args, not class_path / init_args: e.g."
        r" environment: \{env_class: my_env.Search, env_args: \{tag: '5'\}\}$",
    ),
    "tree_dedup_on_a_hybrid": (
        {"__source__": "configs/quickstart_hybrid.yaml", "model.init_args.compute": {"zorro_dedup": "tree"}}, [],
        r"^error: model.compute.zorro_dedup 'tree': model type 'qwen3_next' has linear-attention layers, .* set"
        r" model.compute.zorro_dedup: group$",
    ),
}

OTHER_CASES = {  # name: (argv or a function of the case's dir giving (argv, path), exit status, pattern of stdout + stderr)
    "misspelt_builtin_config": (
        ["fit", "--config", "quickstrat"], 2,
        r"^error: --config quickstrat: No such file or directory; did you mean --config quickstart\? the built-in configs"
        r" are quickstart; otherwise give the path of a YAML file$",
    ),
    "prepare_help": (["prepare", "--help"], 0, r"^usage: arctic-rl prepare \{gsm8k\|multihop_qa\|bird\|search_agent\}"),
    "prepare_recipe_help": (["prepare", "search_agent", "--help"], 0, r"^usage: arctic-rl prepare search_agent \[-h\] --out OUT"),
    "search_agent_empty_source": (
        lambda d: _hotpot_source(d, []), 2,
        r"^error: {path}: holds no records \(an empty file or array\); --source needs at least one$",
    ),
    "search_agent_context_of_the_wrong_shape": (
        lambda d: _hotpot_source(d, BAD_CONTEXT), 2,
        r"^error: {path} record 1: 'context' item 1 must be a \[title, \[sentence, ...\]\] pair, got \['Lonely title'\];"
        r" fix or remove that record$",
    ),
}


def _fit_case(toy_task, d, changes: dict, args: list[str]) -> list[str]:
    changes = dict(changes)
    source = changes.pop("__source__", "configs/quickstart.yaml")
    config = quickstart_config(toy_task, d / "run", source, **{"trainer.max_steps": 1})
    init = config["model"]["init_args"]
    for dotted, value in changes.items():  # set as given, None included (quickstart_config deletes on None)
        *parents, leaf = dotted.removeprefix("model.init_args.").split(".")
        node = init
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = None if value == "__null__" else value
    return ["fit", "--config", str(write_config(config, d / "c.yaml")), *args]


@pytest.fixture(scope="module")
def results(tmp_path_factory, toy_task):
    """``{case: (finished arctic-rl process, exit status wanted, pattern, case dir)}`` of every case."""
    commands, wanted = {}, {}
    for name, (changes, args, pattern) in FIT_CASES.items():
        d = tmp_path_factory.mktemp(name)
        commands[name], wanted[name] = _fit_case(toy_task, d, changes, args), (2, pattern, d)
    for name, (argv, code, pattern) in OTHER_CASES.items():
        d = tmp_path_factory.mktemp(name)
        path = ""
        if callable(argv):
            argv, path = argv(d)
        commands[name], wanted[name] = argv, (code, pattern.replace("{path}", re.escape(path)), d)
    d = tmp_path_factory.mktemp("flat_key_alone")  # test_a_flat_key_alone_loads_with_one_warning_naming_the_new_key
    config = quickstart_config(toy_task, d / "run", **{"model.init_args.sampling.temperature": None, "model.init_args.temperature": 1.3})
    commands["flat_key_alone"], wanted["flat_key_alone"] = ["fit", "--config", str(write_config(config, d / "c.yaml")), "--print_config"], (0, "", d)
    done = run_cli_many(commands, tmp_path_factory.mktemp("cli_many"))
    return {name: (done[name], *wanted[name]) for name in commands}


@pytest.mark.parametrize("case", [*FIT_CASES, *OTHER_CASES])
def test_one_line_naming_the_field_and_the_fix(case, results):
    proc, code, pattern, case_dir = results[case]
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if code == 0:
        assert re.search(pattern, proc.stdout), proc.stdout
        return
    last = proc.stderr.splitlines()[-1]
    assert re.search(pattern, last), last
    assert not (case_dir / "run" / "checkpoints").exists()  # nothing trained


def test_a_flat_key_alone_loads_with_one_warning_naming_the_new_key(results):
    """``model.init_args.temperature: 1.3`` without ``sampling.temperature`` (a case of ``results``)."""
    proc = results["flat_key_alone"][0]
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "is deprecated" in line]
    assert len(warnings) == 1 and warnings[0].endswith("DeprecatedOptionKey: model.init_args.temperature is deprecated and"
                                                       " will be removed in the next release; use model.init_args.sampling.temperature")
    assert re.search(r"\n    sampling:\n(      .*\n)*      temperature: 1.3\n", proc.stdout), proc.stdout
