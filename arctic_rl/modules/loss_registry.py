"""The loss registry's former import path: every name of :mod:`arctic_rl.loss_registry`, for plugins and user code
written against ``arctic_rl.modules.loss_registry`` (the table itself lives there, once)."""

from arctic_rl.loss_registry import (BUILTIN_MODULES, LOADED_PLUGINS, LOSS_GROUP, LOSSES, OPTIONAL_INPUTS, PLUGIN_HINT,
                                     LossAggregation, LossContractError, LossFn, LossInputError, NeedsFn, PluginError,
                                     RegisteredLoss, check_config_dict, check_registration, compute_loss, get_loss,
                                     is_loss, load_builtins, load_plugins, loss_names, loss_needs, register_loss)

__all__ = ["BUILTIN_MODULES", "LOADED_PLUGINS", "LOSS_GROUP", "LOSSES", "OPTIONAL_INPUTS", "PLUGIN_HINT", "LossAggregation",
           "LossContractError", "LossFn", "LossInputError", "NeedsFn", "PluginError", "RegisteredLoss", "check_config_dict",
           "check_registration", "compute_loss", "get_loss", "is_loss", "load_builtins", "load_plugins", "loss_names",
           "loss_needs", "register_loss"]
