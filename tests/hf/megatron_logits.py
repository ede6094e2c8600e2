"""Megatron's fp32 logits of a run's checkpoint, in a fresh process (the reference of the export
tests): ``python megatron_logits.py RUN_DIR masters|compute TOKENS.pt OUT.pt``.

The model is the run's, rebuilt by :mod:`nemo_lw_fp8.hf` as the export rebuilds it, with fp32
parameters holding exactly the bf16 values the export writes (bf16 -> fp32 is exact), so
megatron and transformers compute in fp32 from the same numbers.
"""

from __future__ import annotations

import sys

import torch


def main(run_dir: str, weights: str, tokens_file: str, out_file: str) -> None:
    from nemo_lw_fp8.hf import exporter, setup, torch_dist

    setup.boot()
    ckpt = torch_dist.iteration_dir(run_dir)
    provider = exporter.run_provider(ckpt)
    with setup.one_rank():
        setup.conversion_provider(provider)
        provider.bf16 = False
        provider.params_dtype = torch.float32
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        exporter.load_compute(model, ckpt)
        if weights == "masters":
            exporter.load_masters(model, ckpt)
        module = model[0]
        module.eval()
        tokens = torch.load(tokens_file)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            logits = module(input_ids=tokens, position_ids=positions, attention_mask=None)
        torch.save(logits.float().contiguous(), out_file)


if __name__ == "__main__":
    main(*sys.argv[1:5])
