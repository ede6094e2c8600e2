"""The control of the resume tests: a resumed run whose first layer-wise fp32 master is moved
by one ulp (every element, up) right after the load.

A resume test compares a resumed run with the run that never stopped, bit for bit. This
mutation is the smallest change a load could make to the state it restores (the last bit of
one master), so a resume comparison that lets it through could not see a load going wrong
either. Only the resumed run is repeated, in the pools the test already has: what is
controlled is the comparison, not the fresh processes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch


def nudge_first_layer_wise_master(optimizer: object) -> None:
    """Move every element of the first layer-wise fp32 master this rank holds up by one ulp."""
    from tests.support.checkpoints import _layer_wise_children

    inner, _ = _layer_wise_children(optimizer)
    for child in inner:
        for group in child.fp32_from_float16_groups:
            for master in group:
                if master.numel():
                    up = torch.full_like(master.data, math.inf)
                    master.data.copy_(torch.nextafter(master.data, up))
                    return
    raise AssertionError("this rank holds no layer-wise fp32 master to nudge")


@contextlib.contextmanager
def nudged_loaded_master() -> Iterator[None]:
    """While active, :func:`tests.support.training.train`'s checkpoint load nudges a master."""
    from tests.support import training

    load = training.load_checkpoint

    def load_and_nudge(model: list, optimizer: object, directory: str) -> None:
        load(model, optimizer, directory)
        nudge_first_layer_wise_master(optimizer)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "load_checkpoint", load_and_nudge)
        yield


def train_with_a_nudged_loaded_master(scenario: object) -> dict:
    """Rank function: :func:`~tests.support.training.train` under :func:`nudged_loaded_master`."""
    from tests.support.training import train

    with nudged_loaded_master():
        return train(scenario)
