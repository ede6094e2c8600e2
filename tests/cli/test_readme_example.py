"""The README's megatron-core example runs as shown (on CPU ranks: the harness has initialised
torch.distributed over gloo and megatron's parallel state, and its CPU stand-ins map the example's
``.cuda()`` / ``device="cuda"`` to the CPU, as they do for megatron's own CUDA call sites)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.harness import run_on_ranks

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- megatron-core example -->"


def example_code() -> str:
    text = README.read_text()
    assert MARKER in text, "README.md lost its megatron-core example marker"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], flags=re.S)
    assert block is not None
    return block.group(1)


def run_example(code: str) -> dict:
    """Run the README block; report what it printed and what it left patched."""
    import contextlib
    import io

    import nemo_lw_fp8

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    return {"printed": out.getvalue(), "applied_after": nemo_lw_fp8.applied()}


def test_readme_megatron_core_example_runs_as_shown():
    results = run_on_ranks(run_example, example_code(), world_size=2)
    for result in results:
        lines = result["printed"].splitlines()
        losses = [float(line.split()[1]) for line in lines if re.match(r"^\d+ ", line)]
        assert len(losses) == 3, result["printed"]
        assert all(loss == loss and loss > 0 for loss in losses)  # finite, positive
        assert "compact_layout" in lines[-1] and "muon_fp8_param_gather" in lines[-1]
        assert result["applied_after"] == []
