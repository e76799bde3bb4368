"""The console's noise filter (``arctic_rl/console.py``): known library notices are dropped, and a record
it cannot read passes through unchanged instead of raising into the library that logged it."""

from __future__ import annotations

import io
import logging

from arctic_rl.console import NoiseFilter

# vLLM 0.32's engine arguments log this with seed None (model.init_args.sampling.seed: null before the engine got a seed)
SEED_FORMAT = "The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False"


def vllm_record(args: tuple) -> logging.LogRecord:
    return logging.LogRecord("vllm.engine.arg_utils", logging.WARNING, "arg_utils.py", 1945, SEED_FORMAT, args, None)


def test_a_record_whose_args_do_not_fit_its_format_passes_unchanged():
    record = vllm_record((None,))
    assert NoiseFilter().filter(record) is True
    assert (record.msg, record.args, record.levelno, record.name) == (SEED_FORMAT, (None,), logging.WARNING, "vllm.engine.arg_utils")
    assert NoiseFilter().filter(vllm_record((0,))) is False  # the same notice, readable: known noise, dropped


def test_a_filtered_handler_does_not_raise_into_the_logging_call(capsys):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(NoiseFilter())
    logger = logging.getLogger("arctic_rl.tests.console_filter")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("a real number %d", None)  # raised TypeError out of the call when the filter let it escape
        logger.warning("%s steps", 2)
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "2 steps\n"  # the unreadable record is reported by logging, not written
    assert "--- Logging error ---" in capsys.readouterr().err
