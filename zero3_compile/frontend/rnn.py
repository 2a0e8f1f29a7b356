"""Recurrent modules (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) read their weights through the getters
for the length of one forward instead of caching full copies in ``_flat_weights``."""

from __future__ import annotations

import torch.nn as nn

from .._torch.modules import own_parameters, rnn_flat_weight_names
from .classes import BASE, register_methods


def _rnn_flat_weights(self):
    bound = self.__dict__.get("_zero3_flat")
    if bound is not None:
        return bound
    return [
        getattr(self, wn) if own_parameters(self).get(wn) is not None else None
        for wn in rnn_flat_weight_names(self)
    ]


def _rnn_forward(self, *args, **kwargs):
    # gather each weight once for this forward, drop the full copies when it ends
    self.__dict__["_zero3_flat"] = _rnn_flat_weights(self)
    try:
        return type(self).__dict__[BASE].forward(self, *args, **kwargs)
    finally:
        self.__dict__["_zero3_flat"] = None


def _rnn_noop(self, *args, **kwargs) -> None:
    return None


def _rnn_init_flat_weights(self) -> None:
    self.__dict__["_flat_weight_refs"] = []


RNN_METHODS = {
    "_flat_weights": property(_rnn_flat_weights, _rnn_noop),
    "forward": _rnn_forward,
    "_init_flat_weights": _rnn_init_flat_weights,
    "_update_flat_weights": _rnn_noop,
    "flatten_parameters": _rnn_noop,
    "_weights_have_changed": lambda self: False,
}

register_methods(RNN_METHODS, applies_to=nn.RNNBase)
