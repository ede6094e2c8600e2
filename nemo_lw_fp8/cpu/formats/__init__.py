"""The arithmetic of TE 2.20.2's quantized formats in plain torch: MXFP8, blockwise FP8 and NVFP4
(bytes, scales, layouts, the distributed-optimizer sharded casts). Nothing here imports
Transformer Engine or megatron-core; the ``tex`` kernels in :mod:`nemo_lw_fp8.cpu.te.tex` call
it."""
