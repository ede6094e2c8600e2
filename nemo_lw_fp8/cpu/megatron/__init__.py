"""Stand-ins for the few non-TE GPU call sites megatron-core and Megatron-Bridge reach on CPU (CUDA
runtime calls, APEX's wgrad kernel, TE's FusedAdam state, fla's Gated DeltaNet kernels), and
Bridge's ``pretrain`` on CPU ranks. Each stand-in is undoable and names what it replaces."""
