"""Whole tensors out of a ``torch_dist`` checkpoint, read in one process.

Why: megatron writes each entry once under a global key and shape (layers stacked on the first
axis, experts on the next), whatever the parallelism of the run, so one process can read any
entry whole without megatron's parallel state. The export reads a run's fp32 masters this way
(layer-wise Muon saves them as ``<chained_N>.optimizer.state.fp32_param.<model key>``, with the
model entry's shape), and the tests read imports and runs this way.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: The key infix under which megatron's optimizers save a parameter's fp32 master.
MASTER_INFIX = ".optimizer.state.fp32_param."


def iteration_dir(path: str) -> Path:
    """``path`` itself when it holds a checkpoint's ``metadata.json``, else the iteration its
    ``latest_checkpointed_iteration.txt`` names (a run's or an import's save folder)."""
    folder = Path(path)
    if (folder / ".metadata").is_file() or (folder / "metadata.json").is_file() and any(
        folder.glob("*.distcp")
    ):
        return folder
    tracker = folder / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text().strip()
        step = int(text) if text.isdigit() else None
        if step is not None and (folder / f"iter_{step:07d}").is_dir():
            return folder / f"iter_{step:07d}"
    raise FileNotFoundError(f"{path} holds no torch_dist checkpoint")


def shapes(ckpt: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor entry: global shape and dtype."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt)).read_metadata()
    out = {}
    for key, entry in metadata.state_dict_metadata.items():
        size = getattr(entry, "size", None)
        if size is not None:
            out[key] = (tuple(size), entry.properties.dtype)
    return out


def read(ckpt: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The entries ``keys``, whole, on the CPU."""
    from torch.distributed.checkpoint import FileSystemReader, load

    known = shapes(ckpt)
    state = {key: torch.empty(known[key][0], dtype=known[key][1]) for key in keys}
    load(state, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    return state


def masters(ckpt: Path) -> dict[str, str]:
    """Model key -> the key of its fp32 master, for every parameter the optimizer saved one."""
    out = {}
    for key in shapes(ckpt):
        if MASTER_INFIX in key:
            out[key.split(MASTER_INFIX, 1)[1]] = key
    return out
