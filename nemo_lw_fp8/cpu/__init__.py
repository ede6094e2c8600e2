"""The CPU backend: real megatron-core / Megatron-Bridge training on CPU ranks over gloo.

What it is
    Everything a run needs when there is no GPU: stand-ins for the few CUDA runtime call sites in
    megatron-core (:mod:`~nemo_lw_fp8.cpu.megatron.standins`) and Megatron-Bridge
    (:mod:`~nemo_lw_fp8.cpu.megatron.bridge_pretrain`), megatron's local layer specs with emulated
    MXFP8 linears (:mod:`~nemo_lw_fp8.cpu.layers.specs`) and a fused norm + linear where TE's spec
    fuses one (:mod:`~nemo_lw_fp8.cpu.layers.norm_linear`), and an expert layer that presents its
    weights as TE's
    ``GroupedLinear`` does (:mod:`~nemo_lw_fp8.cpu.layers.grouped_experts`). The FP8 arithmetic
    itself is :mod:`nemo_lw_fp8.cpu.te`'s.

When production uses it
    Only on request: ``nemo-lw-fp8 pretrain --cpu`` (and ``make demo``, which runs that) installs
    it; the test suite installs it in its rank workers. Nothing here is imported by importing
    :mod:`nemo_lw_fp8` or by a GPU run.

What it never does
    Shadow a working Transformer Engine or GPU: the MXFP8 emulation is booted only where TE's
    real extension cannot load (:func:`nemo_lw_fp8.cpu.te.backend.activate`), and every
    stand-in is undoable and names the call site it replaces; megatron's and Bridge's sources
    are never edited.
"""
