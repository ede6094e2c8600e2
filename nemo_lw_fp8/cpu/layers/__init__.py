"""The project's own CPU layers (FP8 linears, a fused norm + linear, grouped experts) and the
megatron layer specs that use them: the cross-check beside TE's own modules on CPU."""
