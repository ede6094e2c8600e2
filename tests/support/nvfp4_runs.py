"""Inside a rank: what the NVFP4 layer-wise Muon runs on TE's own modules set up and report.

The NVFP4 compute run (``test_nvfp4_layer_wise.py``), its FP4 param gather counterpart
(``test_nvfp4_param_gather.py``) and the grouped-expert variant
(``test_fp4_grouped_param_gather.py``) train on megatron's own NVFP4 recipe with stochastic
rounding off and check what TE's GEMMs were given. The set-up and the report are one thing in
all of them, so a change to how the recipe is pinned or the GEMMs are counted applies alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def nvfp4_on_blackwell() -> Iterator[pytest.MonkeyPatch]:
    """Inside a rank: the plugin applied, the devices answered as a B200 would, and megatron's
    NVFP4 recipe pinned without stochastic rounding; yields the monkeypatch the run adds its
    own recorders and mutations to (all undone when the block ends)."""
    import nemo_lw_fp8
    from nemo_lw_fp8.cpu.te import device as te_device

    nemo_lw_fp8.apply()
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        pin_recipe_without_stochastic_rounding(mp)
        yield mp


def pin_recipe_without_stochastic_rounding(mp: pytest.MonkeyPatch) -> None:
    """megatron's own NVFP4 recipe (``get_fp4_context`` calls ``get_fp4_recipe``) with
    stochastic rounding off: TE reads its environment switch only when it is imported, and the
    emulation refuses stochastic rounding by name (docs/nvfp4.md)."""
    import dataclasses

    from megatron.core import fp4_utils

    megatron_recipe = fp4_utils.get_fp4_recipe
    mp.setattr(
        fp4_utils,
        "get_fp4_recipe",
        lambda config: dataclasses.replace(
            megatron_recipe(config), disable_stochastic_rounding=True
        ),
    )


def record_gemm_operands(mp: pytest.MonkeyPatch, kinds: list[str]) -> None:
    """Append the class of each TE GEMM's first operand to ``kinds`` (``NVFP4Tensor`` when the
    GEMM really took NVFP4 operands)."""
    import transformer_engine_torch as tex

    original_gemm = tex.generic_gemm

    def counting_gemm(a, *args, **kwargs):
        kinds.append(type(a).__name__)
        return original_gemm(a, *args, **kwargs)

    mp.setattr(tex, "generic_gemm", counting_gemm)


def record_owner_gathers(mp: pytest.MonkeyPatch, sends: list[dict[str, Any]]) -> None:
    """Append what each owner-packed gather sent to ``sends``: this rank's payload, the
    elements sent and their dtype (``torch.uint8`` when FP4 bytes went on the wire)."""
    from nemo_lw_fp8.mechanics import owner_gather

    original_collective = owner_gather.all_gather_segments

    def recording_collective(gathered, send, sizes, even, process_group, async_op):
        rank = process_group.rank()
        sends.append({"payload": sizes[rank], "sent": send.numel(), "dtype": str(send.dtype)})
        return original_collective(gathered, send, sizes, even, process_group, async_op)

    mp.setattr(owner_gather, "all_gather_segments", recording_collective)


def gemm_counts(kinds: list[str]) -> dict[str, int]:
    """How many TE GEMMs ran, and how many of them took NVFP4 operands."""
    return {"gemms": len(kinds), "nvfp4_gemms": sum(kind.startswith("NVFP4") for kind in kinds)}


def train_and_report(
    scenario: Any, module: Any, config: Any, steps: tuple[int, int], **checkpointing: Any
) -> tuple[dict[str, Any], Any]:
    """Wrap ``module`` and build its optimizer for ``scenario``, train ``steps`` (with the
    ``torch_dist`` load / save / nudge of ``checkpointing``); returns the losses, eval losses
    and this rank's masters and momenta, and the optimizer for further checks."""
    from tests.support import resumable, training

    model, optimizer = training.wrap_and_build_optimizer(module, config, scenario)
    losses, eval_losses = resumable.train_steps(scenario, model, optimizer, steps, **checkpointing)
    state = training.state_by_part(optimizer, model[0].module)
    return {"losses": losses, "eval_losses": eval_losses, "state": state}, optimizer
