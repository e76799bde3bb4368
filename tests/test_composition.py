"""Compose, don't subtract: no class of ours overrides an inherited method to switch it off (a body of only ``pass``,
``...`` or ``raise``), and the service's module and engines share ``fit``'s policy and engine host by composition."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest

import arctic_rl

OPTIONAL = ("arctic_rl.integrations.",)  # adapters that import another framework (verl, SkyRL): CI layers only


def our_classes() -> list[type]:
    classes: dict[str, type] = {}
    for info in pkgutil.walk_packages(arctic_rl.__path__, "arctic_rl."):
        if info.name.endswith(".__main__"):  # entry points: importing one runs it
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            if info.name.startswith(OPTIONAL):
                continue
            raise
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(classes.values())


def switches_off(function) -> bool:
    """Whether ``function``'s body, past its docstring, is one ``pass``, ``...`` or ``raise``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError):
        return False
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    if len(body) != 1:
        return False
    only = body[0]
    return isinstance(only, (ast.Pass, ast.Raise)) or (isinstance(only, ast.Expr) and isinstance(only.value, ast.Constant)
                                                       and only.value.value is Ellipsis)


def test_no_class_overrides_an_inherited_method_to_switch_it_off():
    offenders = []
    for cls in our_classes():
        for name, member in vars(cls).items():
            function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if not inspect.isfunction(function) or name.startswith("__") or not switches_off(function):
                continue
            inherited = [base for base in cls.__mro__[1:] if name in vars(base)]
            if inherited and not getattr(function, "__isabstractmethod__", False):
                offenders.append(f"{cls.__module__}.{cls.__qualname__}.{name} (overrides {inherited[0].__qualname__})")
    assert offenders == []


@pytest.mark.parametrize("source, expected", [
    ("def hook(self):\n    pass", True),
    ("def hook(self):\n    '''Nothing.'''\n    raise RuntimeError('not here')", True),
    ("def hook(self):\n    ...", True),
    ("def hook(self):\n    return 1", False),
    ("def hook(self):\n    '''Doc.'''\n    self.x = 1\n    pass", False),
])
def test_the_check_tells_a_switched_off_body(source, expected, monkeypatch):
    namespace: dict = {}
    exec(compile(source, "<hook>", "exec"), namespace)  # noqa: S102  (test input)
    monkeypatch.setattr(inspect, "getsource", lambda f: source)
    assert switches_off(namespace["hook"]) is expected


def test_the_services_module_and_engines_compose_fits_policy_and_engine_host():
    from arctic_rl.modules.grpo import GRPOModule
    from arctic_rl.modules.policy_module import PolicyModule
    from arctic_rl.rollout.callback import RolloutCallback
    from arctic_rl.rollout.engines.host import EngineHost
    from arctic_rl.serve.service_module import ServiceEngines, ServiceModule

    assert PolicyModule in GRPOModule.__mro__ and PolicyModule in ServiceModule.__mro__
    assert GRPOModule not in ServiceModule.__mro__  # the service takes the policy, not fit's training loop
    assert RolloutCallback not in ServiceEngines.__mro__
    assert isinstance(RolloutCallback().host, EngineHost) and isinstance(ServiceEngines().host, EngineHost)
    assert not hasattr(ServiceModule, "reward")  # rewards are the client's: nothing to switch off
