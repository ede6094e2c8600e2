"""Read a ``torch_dist`` checkpoint written by Bridge (in a fresh process: megatron and TE stay
out of the test process) and say, per layer-wise Muon weight, whether the saved weight is the
fp32 master of that step as the model holds it: ``bf16(master)``, or its MXFP8 rounding.

Usage: ``python -m tests.support.bridge_checkpoint_check ITER_DIR`` prints JSON
``{"matched": [...], "stale": [...]}``.
"""

from __future__ import annotations

import json
import sys

import torch

MASTER_PREFIX = "chained_0.optimizer.state.fp32_param."


def check(directory: str) -> dict[str, list[str]]:
    import torch.distributed.checkpoint as dcp

    from nemo_lw_fp8.cpu.layers.mxfp8_linear import quantize_dequantize

    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    names = [key[len(MASTER_PREFIX) :] for key in metadata if key.startswith(MASTER_PREFIX)]
    state = {}
    for key in names + [MASTER_PREFIX + name for name in names]:
        meta = metadata[key]
        state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, checkpoint_id=directory, no_dist=True)  # tensors only: no pickled objects
    out: dict[str, list[str]] = {"matched": [], "stale": []}
    for name in sorted(names):
        saved, bf16 = state[name], state[MASTER_PREFIX + name].to(torch.bfloat16)
        candidates = [bf16]
        # MXFP8 blocks run along the last dim; an expert stack (E, out, in) is E matrices.
        rows = bf16.numel() // max(bf16.shape[-1], 1)
        if bf16.dim() >= 2 and bf16.shape[-1] % 32 == 0 and rows % 32 == 0:
            flat = bf16.reshape(rows, bf16.shape[-1])
            candidates.append(quantize_dequantize(flat).reshape(bf16.shape))
        same = any(torch.equal(saved, c.to(saved.dtype)) for c in candidates)
        out["matched" if same else "stale"].append(name)
    return out


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1])))
