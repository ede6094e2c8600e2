"""nemo_lw_fp8.planner: sizes, tiny twins, parallelism defaults, planner view."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from nemo_lw_fp8 import planner as A
from nemo_lw_fp8.planner import SPECS, param_shapes, total_params

ARCHS = list(A.ARCHITECTURES.values())
IDS = [a.name for a in ARCHS]

# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_count_within_one_percent_of_published(arch):
    ours, delta = A.published_comparison(arch)
    assert abs(delta) < 0.01, (arch.name, ours, arch.published_total_params)


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_count_agrees_with_model_spec_shapes(arch):
    """Two independent derivations: the analytic breakdown and the per-parameter shapes."""
    for mtp in (False, True):
        spec = A.to_model_spec(arch, include_mtp=mtp)
        assert total_params(spec.params()) == A.count_parameters(arch, include_mtp=mtp)
    mtp_part = A.parameter_breakdown(arch, include_mtp=True)["mtp"]
    assert (mtp_part > 0) == bool(arch.mtp_num_layers)


def _without_expert_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controls' mutation: the analytic count forgets the router's ``expert_bias`` buffer
    (one entry per expert and MoE layer, in the checkpoint though not trained)."""
    from nemo_lw_fp8.planner import counting

    original = counting._mlp_params

    def mlp_params(a: A.MoEArchitecture, moe: bool) -> dict[str, int]:
        out = original(a, moe)
        if moe and a.moe_router_enable_expert_bias:
            out["router"] -= a.num_moe_experts
        return out

    monkeypatch.setattr(counting, "_mlp_params", mlp_params)


def test_control_count_without_the_expert_bias_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control of ``test_count_agrees_with_model_spec_shapes`` and of the count in
    ``test_matches_existing_planner_specs``: an analytic count without the expert-bias buffer
    disagrees with the per-parameter shapes by exactly that buffer on every model that has one
    (DeepSeek-V3: 58 MoE layers x 256 experts), and agrees on the others."""
    _without_expert_bias(monkeypatch)
    for arch in ARCHS:
        spec = A.to_model_spec(arch)
        missing = total_params(spec.params()) - A.count_parameters(arch)
        moe_layers = sum(arch.moe_layer_pattern())
        bias = moe_layers * arch.num_moe_experts if arch.moe_router_enable_expert_bias else 0
        assert missing == bias, arch.name
    assert A.count_parameters(A.DEEPSEEK_V3) != total_params(param_shapes("deepseek-v3"))
    assert any(arch.moe_router_enable_expert_bias for arch in ARCHS)


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-235b-a22b"])
def test_matches_existing_planner_specs(name):
    arch = A.get_architecture(name)
    ours = [dataclasses.astuple(s) for s in A.to_model_spec(arch).params()]
    theirs = [dataclasses.astuple(s) for s in param_shapes(name)]
    assert ours == theirs
    assert A.count_parameters(arch) == total_params(param_shapes(name))


def test_known_sizes_and_conventions():
    dsv3 = A.parameter_breakdown(A.DEEPSEEK_V3, include_mtp=True)
    assert 11e9 < dsv3["mtp"] < 12e9  # the 14B MTP module minus its own embedding and head
    assert dsv3["router"] == 58 * 256 * (7168 + 1)  # router weight + expert_bias buffer
    assert A.QWEN3_5_35B_A3B.vision_params_in_published == pytest.approx(0.45e9, rel=0.02)
    assert A.get_architecture("qwen3_5_35b_a3b") is A.QWEN3_5_35B_A3B
    assert A.get_architecture("deepseek_v2_lite") is A.DEEPSEEK_V2_LITE
    with pytest.raises(KeyError, match="known"):
        A.get_architecture("gpt-5")


def test_new_models_registered_with_the_planner():
    for name in ("deepseek-v2-lite", "qwen3-30b-a3b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b"):
        arch = A.ARCHITECTURES[name]
        assert SPECS[name].published_params == arch.published_total_params
        assert total_params(param_shapes(name)) == A.count_parameters(arch)


def test_patterns():
    assert A.DEEPSEEK_V3.first_k_dense == 3 and A.DEEPSEEK_V2_LITE.first_k_dense == 1
    assert A.QWEN3_30B_A3B.first_k_dense == 0
    pattern = A.QWEN3_NEXT_80B_A3B.linear_attention_pattern()
    assert pattern[:4] == [1, 1, 1, 0] and sum(pattern) == 36
    assert A.QWEN3_5_35B_A3B.linear_attention_pattern().count(0) == 10
    kw = A.DEEPSEEK_V2_LITE.provider_kwargs()
    assert kw["q_lora_rank"] is None  # not megatron's default 512
    assert kw["share_embeddings_and_output_weights"] is False
    assert isinstance(kw["moe_layer_freq"], list)


def test_provider_kwargs_build_megatron_configs():
    """megatron-core's own __post_init__ validation accepts every model and its tiny twin."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    provider_only = {
        "share_embeddings_and_output_weights",
        "make_vocab_size_divisible_by",
        "position_embedding_type",
        "seq_length",
        "vocab_size",
        "rotary_base",  # GPTModelProvider's for GQA, MLATransformerConfig's for MLA
        "rotary_percent",
    }
    for arch in ARCHS + [A.tiny(a) for a in ARCHS]:
        cls = MLATransformerConfig if arch.multi_latent_attention else TransformerConfig
        names = {f.name for f in dataclasses.fields(cls)}
        kw = arch.provider_kwargs()
        assert set(kw) - names <= provider_only, arch.name
        cls(**{k: v for k, v in kw.items() if k in names})


# ----------------------------------------------------------------------------- tiny twins


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_tiny_keeps_structure(arch):
    t = A.tiny(arch)
    assert t.attention_kind == arch.attention_kind
    assert (t.first_k_dense > 0) == (arch.first_k_dense > 0)
    assert 0 < t.first_k_dense < t.num_layers or arch.first_k_dense == 0
    assert bool(t.moe_shared_expert_intermediate_size) == bool(
        arch.moe_shared_expert_intermediate_size
    )
    assert t.moe_shared_expert_gate == arch.moe_shared_expert_gate
    assert bool(t.mtp_num_layers) == bool(arch.mtp_num_layers)
    assert (t.q_lora_rank is None) == (arch.q_lora_rank is None)
    assert t.moe_router_enable_expert_bias == arch.moe_router_enable_expert_bias
    assert t.moe_router_score_function == arch.moe_router_score_function
    assert bool(t.moe_router_num_groups) == bool(arch.moe_router_num_groups)
    assert t.attention_output_gate == arch.attention_output_gate
    if arch.experimental_attention_variant:
        assert set(t.linear_attention_pattern()) == {0, 1}
    assert 2 <= t.num_layers <= 4 and t.seq_length == 64 and t.vocab_size <= 512
    assert t.num_moe_experts % 2 == 0 and t.moe_router_topk == 2
    # small enough for seconds per step on 2 CPU ranks (experts 128 wide: TE's grouped MXFP8 layout)
    assert A.count_parameters(t, include_mtp=True) < 4_000_000
    for s in A.to_model_spec(t, include_mtp=True).params():
        if s.quantized:  # TE linear weights: MXFP8 blocks of 32 both ways
            assert all(d % 32 == 0 for d in s.shape), (s.name, s.shape)


TINY_BUILT = ("deepseek-v3", "qwen3-30b-a3b")


@pytest.fixture(scope="module")
def tiny_models_built() -> dict[str, list[int]]:
    """For the tiny twins of ``TINY_BUILT``: [parameters of the model megatron-core builds
    (local specs, CPU), count_parameters(include_mtp=True)], computed once for the test and its
    control. A subprocess keeps the process group and CPU stand-ins out of this one."""
    script = textwrap.dedent(
        """
        import dataclasses, json, os
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from nemo_lw_fp8.cpu.megatron import standins
        standins.install()
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel()
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec, get_gpt_mtp_block_spec)
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.transformer_config import (
            MLATransformerConfig, TransformerConfig)
        from nemo_lw_fp8 import planner as A

        class DPA(DotProductAttention):  # megatron 0.19.2's local MLA spec passes k_channels
            def __init__(self, *args, k_channels=None, v_channels=None, **kw):
                super().__init__(*args, **kw)

        out = {}
        for name in NAMES:
            a = A.tiny(A.ARCHITECTURES[name])
            cls = MLATransformerConfig if a.multi_latent_attention else TransformerConfig
            names = {f.name for f in dataclasses.fields(cls)}
            kw = {k: v for k, v in a.provider_kwargs().items() if k in names}
            cfg = cls(**kw, use_cpu_initialization=True)
            spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
            for layer in spec.layer_specs:
                if a.multi_latent_attention:
                    layer.submodules.self_attention.submodules.core_attention = DPA
            mtp = None
            if a.mtp_num_layers:
                mtp = get_gpt_mtp_block_spec(
                    cfg, spec.layer_specs[-1], use_transformer_engine=False)
            model = GPTModel(cfg, spec, vocab_size=a.vocab_size,
                             max_sequence_length=a.seq_length,
                             share_embeddings_and_output_weights=False,
                             position_embedding_type="rope", mtp_block_spec=mtp)
            n = sum(p.numel() for p in model.parameters())
            n += sum(b.numel() for k, b in model.named_buffers() if k.endswith("expert_bias"))
            out[name] = [n, A.count_parameters(a, include_mtp=True)]
        print("RESULT" + json.dumps(out))
        """
    )
    script = f"NAMES = {TINY_BUILT!r}\n" + script
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[0][6:])


def test_tiny_models_build_in_megatron_with_the_counted_size(tiny_models_built):
    """GQA and MLA tiny twins built by megatron-core (local specs, CPU): parameter count equals
    count_parameters(include_mtp=True). Gated DeltaNet needs TE's spec, so the hybrids are
    covered by the shape cross-check only."""
    assert sorted(tiny_models_built) == sorted(TINY_BUILT)
    for name, (built, counted) in tiny_models_built.items():
        assert built == counted, name


def test_control_tiny_model_count_without_the_expert_bias_differs(
    tiny_models_built: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control of ``test_tiny_models_build_in_megatron_with_the_counted_size``: the same built
    models against a count without the router's expert-bias buffer: the tiny DeepSeek-V3 (it
    has the buffer, and MTP's MoE layer too) differs by its MoE layers x experts, the tiny
    Qwen3-30B-A3B (no buffer) still equals."""
    _without_expert_bias(monkeypatch)
    for name, (built, _) in tiny_models_built.items():
        tiny = A.tiny(A.ARCHITECTURES[name])
        mutated = A.count_parameters(tiny, include_mtp=True)
        moe_layers = sum(tiny.moe_layer_pattern()) + (tiny.mtp_num_layers or 0)
        bias = moe_layers * tiny.num_moe_experts if tiny.moe_router_enable_expert_bias else 0
        assert built - mutated == bias, name
    assert tiny_models_built["deepseek-v3"][0] != A.count_parameters(
        A.tiny(A.DEEPSEEK_V3), include_mtp=True
    )


# ----------------------------------------------------------------------------- parallelism


CASES = [(a, g) for a in ARCHS for g in A.GPU_FAMILIES]


@pytest.mark.parametrize(("arch", "gpu"), CASES, ids=[f"{a.name}-{g}" for a, g in CASES])
def test_parallelism_is_consistent(arch, gpu):
    p = A.parallelism(arch, gpu)
    world = p.world_size
    assert p.gpus_per_node in (4, 8) and world == p.nodes * p.gpus_per_node
    assert p.etp == 1  # whole experts per rank (FP8 gather at ETP > 1 is not verified)
    # Whole matrices for layer-wise Muon, except Bridge's TP 2 + SP kept on the two H100 recipes
    # that ship it (Qwen3-235B, DeepSeek-V3).
    kept_tp2 = gpu == "h100" and arch.name in ("qwen3-235b-a22b", "deepseek-v3")
    assert (p.tp, p.sequence_parallel) == ((2, True) if kept_tp2 else (1, False))
    assert world % (p.tp * p.pp * p.cp) == 0 and world % (p.etp * p.ep * p.pp) == 0
    assert arch.num_moe_experts % p.ep == 0
    # megatron's expert grid: a stage's TP x CP x DP ranks are ETP x EP x expert DP
    assert (p.tp * p.cp * p.data_parallel_size) % (p.etp * p.ep) == 0
    assert p.global_batch_size % (p.micro_batch_size * p.data_parallel_size) == 0
    assert p.num_microbatches >= p.pp  # enough microbatches to fill the pipeline
    assert p.seq_length <= arch.max_position_embeddings
    stages = p.stages(arch)
    flat = [x for s in stages for x in s]
    assert len(stages) == p.pp * (p.vpp or 1)
    assert flat.count("t") == arch.num_layers and flat.count("m") == (arch.mtp_num_layers or 0)
    assert flat[0] == "E" and flat[-1] == "L" and all(s for s in stages)
    owned = sum(len(A.stage_param_specs(arch, p, r)) for r in range(p.pp))
    assert owned == len(A.to_model_spec(arch, include_mtp=True).params())
    assert p.recipe and p.model_kwargs()["expert_model_parallel_size"] == p.ep


def test_layouts_parse_like_megatron():
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    for arch, gpu in CASES:
        p = A.parallelism(arch, gpu)
        if p.pipeline_layout is None:
            continue
        layout = PipelineParallelLayerLayout(p.pipeline_layout, p.pp)
        layout.validate_layer_layout(arch.num_layers, arch.mtp_num_layers)
        ours = [x for s in p.stages(arch) for x in s]
        assert len(ours) == len(layout.flatten_layout)
        assert layout.virtual_pipeline_model_parallel_size == (p.vpp or 1)


def test_unknown_gpu_family():
    with pytest.raises(KeyError, match="known"):
        A.parallelism("deepseek-v3", "tpu")
    assert A.parallelism("deepseek_v3", "Blackwell") is A.PARALLELISM["deepseek-v3"]["gb200"]


# ----------------------------------------------------------------------------- planner


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_tiny_at_tensor_parallel_keeps_whole_blockwise_tiles_per_shard(arch):
    """``tiny(arch, tensor_parallel=tp)``: at TP 1 the widths every tiny recipe has; at TP 2 and
    4 (standard attention and MLA: hybrid layers are refused at TP > 1) each TP shard of every
    width TP splits is whole 128-wide blockwise tiles, and the query groups divide by TP. The
    TP-1 widths at TP 2 split a tile (``test_recipes.py``'s ``twin-tp2-tp1-widths``)."""
    assert A.tiny(arch, tensor_parallel=1) == A.tiny(arch)
    if arch.experimental_attention_variant:
        return
    for tp in (2, 4):
        t = A.tiny(arch, tensor_parallel=tp)
        assert (t.hidden_size, t.moe_ffn_hidden_size) == (128, 128)  # not split (ETP 1)
        if arch.multi_latent_attention:
            heads = t.num_attention_heads
            assert heads % tp == 0
            # linear_proj columns, q up projection rows, kv up projection rows
            widths = [heads * t.v_head_dim, heads * (t.qk_head_dim + t.qk_pos_emb_head_dim),
                      heads * (t.qk_head_dim + t.v_head_dim)]
        else:
            assert t.num_query_groups % tp == 0
            assert t.num_attention_heads % t.num_query_groups == 0
            widths = [t.num_attention_heads * t.kv_channels,
                      (t.num_attention_heads + 2 * t.num_query_groups) * t.kv_channels]
        widths += [w for w in (t.ffn_hidden_size, t.moe_shared_expert_intermediate_size) if w]
        assert all(w % (tp * 128) == 0 for w in widths), (tp, widths)
    base = A.tiny(arch)
    if arch.multi_latent_attention:  # 4 heads of 32 value channels: 64 columns per TP-2 shard
        assert base.num_attention_heads * base.v_head_dim // 2 == 64
    else:
        assert base.num_attention_heads * base.kv_channels // 2 == 64  # the TP-1 widths at TP 2


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_planner_runs_on_tiny_twins(arch):
    from nemo_lw_fp8.planner import rank_plan as planner

    result = planner.plan(A.to_model_spec(A.tiny(arch), include_mtp=True).params(), 2, 2)
    compact = result["layouts"]["compact"]
    assert compact["muon_padding_numel"] == 0 and compact["bytes_per_rank"]["total"] > 0


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_planner_runs_on_gb200_defaults(arch):
    result = A.plan_rank(arch, "gb200")
    stock = result["layouts"]["stock_padded"]["bytes_per_rank"]["total"]
    compact = result["layouts"]["compact"]["bytes_per_rank"]["total"]
    assert 0 < compact <= stock
    assert result["dp"] == A.parallelism(arch, "gb200").data_parallel_size
