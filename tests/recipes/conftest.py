"""The recipes' smoke runs, shared by their tests (one unit of work for pytest-xdist: the root ``conftest.py``)."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def recipe_smokes(tmp_path_factory):
    """``{recipe: Smoke}``: every recipe's smoke config, prepared by its test module's ``smoke_setup`` and fit
    (``recipe_smoke.fit_smokes``); search_agent where bm25s (the search extra) is installed."""
    from tests.recipes import test_bird_recipe, test_gsm8k_recipe, test_multihop_qa_recipe
    from tests.recipes.recipe_smoke import fit_smokes

    modules = {"gsm8k": test_gsm8k_recipe, "multihop_qa": test_multihop_qa_recipe, "bird": test_bird_recipe}
    if importlib.util.find_spec("bm25s") is not None:
        from tests.recipes import test_search_agent_recipe

        modules["search_agent"] = test_search_agent_recipe
    setups = {name: module.smoke_setup(tmp_path_factory.mktemp(f"smoke_{name}")) for name, module in modules.items()}
    return fit_smokes(setups, tmp_path_factory.mktemp("recipe_smokes"))
