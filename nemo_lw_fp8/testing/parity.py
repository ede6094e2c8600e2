"""Bitwise comparisons of two training runs, shared by the parity tests and the demo."""

from __future__ import annotations

import torch


def assert_fp8_gather_parity(off: list[dict], on: list[dict]) -> None:
    """Losses, eval losses, forward output, every main_grad, every fp32 master, the weights the
    GEMMs see, and every parameter that is not MXFP8: equal to the last bit on every rank."""
    for rank, (a, b) in enumerate(zip(off, on, strict=True)):
        where = f"rank {rank}"
        assert a["losses"] == b["losses"], f"{where}: losses {a['losses']} != {b['losses']}"
        assert a["eval_losses"] == b["eval_losses"], f"{where}: eval losses differ"
        assert torch.equal(a["probe_output"], b["probe_output"]), f"{where}: forward output"
        for step, (ga, gb) in enumerate(zip(a["main_grads"], b["main_grads"], strict=True)):
            for name, grad in ga.items():
                assert torch.equal(grad, gb[name]), f"{where}: main_grad of {name}, step {step}"
        assert a["masters"].keys() == b["masters"].keys()
        for name, master in a["masters"].items():
            assert torch.equal(master, b["masters"][name]), f"{where}: fp32 master of {name}"
        for name, weight in a["effective_weights"].items():
            assert torch.equal(weight, b["effective_weights"][name]), f"{where}: {name} weight"
        # MXFP8 weights were compared above as the values the GEMMs use; the rest bit for bit.
        mxfp8_weights = {f"{name}.weight" for name in a["effective_weights"]}
        for name, value in a["params"].items():
            if name not in mxfp8_weights:
                assert torch.equal(value, b["params"][name]), f"{where}: param {name}"
    assert len({r["digest"] for r in on}) == 1, "ranks hold different parameters"
