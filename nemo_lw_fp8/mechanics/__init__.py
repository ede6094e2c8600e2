"""The plugin's mechanisms, as plain functions over megatron objects.

Patches (:mod:`nemo_lw_fp8.patches`) decide *whether* megatron needs a behaviour and *where* it
hooks in; the code that does the work lives here, one module per mechanism, so a reader can
follow one parameter through a step without reading the wiring:

* :mod:`.masters`       fp32 masters of FP8 weights: TE's high-precision init values, no
                        re-quantization in the inner step;
* :mod:`.staging`       the bf16 cast of owned masters into DDP's param buffer, and re-staging
                        whenever that buffer is zeroed or a gather finds it stale;
* :mod:`.bucket_owners` which optimizer gathers which bucket of a (mixed) bucket group;
* :mod:`.owner_gather`  megatron's start/finish contract for one owner-packed collective;
* :mod:`.owner_reduce`  megatron's grad-sync contract for reducing each gradient to its owner;
* :mod:`.compact`       the compact layout: no padding, balanced ownership, one gather and one
                        owner reduce per group;
* :mod:`.blockwise`     blockwise FP8 gather: owner-quantized codes + tile scales on the wire;
* :mod:`.nvfp4_gather`  NVFP4 primary weights on that gather: FP4 codes + 16x16 tile scales +
                        the amax on the wire, the columnwise copy derived by receivers;
* :mod:`.grouped`       single grouped expert weights as E matrices for Muon;
* :mod:`.expert_slices` a run of experts of a grouped weight as an optimizer parameter;
* :mod:`.grouped_checkpoint` single grouped weights and runs of their experts in ``torch_dist``;
* :mod:`.qkv_parts`     the Q, K or V rows of a fused QKV weight as an optimizer parameter, and
                        their ``torch_dist`` entries;
* :mod:`.lifecycle`     the steps features add around the layer-wise optimizer's ``__init__``;
* :mod:`.pretrained_load` a model-only load (``checkpoint.pretrained_checkpoint``) into FP8 / FP4
                        weights: the masters start from the checkpoint's values.

Functions here are called through their module (``staging.stage_owned_masters(...)``), so a
test can replace one with ``monkeypatch`` and show what breaks without it. Per-object state is
kept in :mod:`nemo_lw_fp8.state`, settings are read through :mod:`nemo_lw_fp8.config`.
"""
