"""Layer-wise buffer layouts: who owns which parameter, where it sits in the compact buffer, and
megatron-core's own layouts to compare against. Pure arithmetic over shapes: nothing here imports
megatron-core at module load, and nothing here reads a run's settings (that vocabulary is
:mod:`nemo_lw_fp8.vocabulary`'s)."""
