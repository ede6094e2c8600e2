"""Where each architecture trains on each GPU family: :class:`ParallelismDefaults`.

:data:`PARALLELISM` holds, per model and GPU family (:data:`GPU_FAMILIES`), the best published
Megatron-Bridge 0.6.2 recipe adapted to layer-wise Muon; :func:`parallelism` looks one up.
:meth:`ParallelismDefaults.stages` lays the model out over (virtual) pipeline stages, which the
planner uses to find each pipeline rank's parameters (:mod:`.pipeline`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from nemo_lw_fp8.recipes.architectures import MoEArchitecture, get_architecture


@dataclass(frozen=True, kw_only=True)
class ParallelismDefaults:
    """Where one model trains on one GPU family, with Muon-specific choices explained.

    ``pipeline_layout`` is megatron's layout string (``E`` embedding, ``t`` decoder layer, ``m``
    MTP layer, ``L`` loss, ``|`` between virtual stages listed in megatron's order: all PP ranks
    of virtual stage 0, then of stage 1, ...). ``None`` means megatron's even split, with the
    embedding / loss counted as a layer when the ``account_for_*`` flags say so.
    """

    recipe: str  # the Bridge 0.6.2 recipe function this starts from
    muon_change: str = ""  # why it differs from that (Adam) recipe; "" if it does not
    nodes: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    global_batch_size: int
    seq_length: int = 4096
    pipeline_layout: str | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """Dense data-parallel size: world / (TP * PP * CP)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_data_parallel_size(self) -> int:
        """Expert data-parallel size: world / (ETP * EP * PP)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def model_kwargs(self) -> dict[str, Any]:
        """The parallelism fields of a Bridge model provider (megatron names)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
            "context_parallel_size": self.cp,
            "sequence_parallel": self.sequence_parallel,
            "seq_length": self.seq_length,
            "pipeline_model_parallel_layout": self.pipeline_layout,
            "account_for_embedding_in_pipeline_split": self.account_for_embedding_in_pipeline_split,
            "account_for_loss_in_pipeline_split": self.account_for_loss_in_pipeline_split,
        }

    def train_kwargs(self) -> dict[str, int]:
        """The batch fields of Bridge's ``TrainingConfig``."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
        }

    def stages(self, arch: MoEArchitecture) -> list[list[str]]:
        """Virtual pipeline stages in megatron's order, each a list of "E", "t", "m", "L"."""
        count = self.pp * (self.vpp or 1)
        if self.pipeline_layout is not None:
            return _unroll_layout(self.pipeline_layout)
        mtp = arch.mtp_num_layers or 0
        units = arch.num_layers + self.account_for_embedding_in_pipeline_split
        units += self.account_for_loss_in_pipeline_split
        if units % count:
            raise ValueError(f"{arch.name}: {units} layers do not split into {count} stages")
        per = units // count
        stages: list[list[str]] = []
        left = arch.num_layers
        for s in range(count):
            n = per
            n -= self.account_for_embedding_in_pipeline_split and s == 0
            n -= self.account_for_loss_in_pipeline_split and s == count - 1
            stages.append((["E"] if s == 0 else []) + ["t"] * n)
            left -= n
        stages[-1] += ["m"] * mtp + ["L"]
        assert left == 0
        return stages

    def rank_stages(self, arch: MoEArchitecture, pp_rank: int) -> list[str]:
        """Everything pipeline rank ``pp_rank`` holds (all its virtual stages)."""
        stages = self.stages(arch)
        return [x for s in stages[pp_rank :: self.pp] for x in s]


def _unroll_layout(layout: str) -> list[list[str]]:
    """Megatron's layout grammar: ``(...)*n`` and ``x*n`` repeat, ``|`` separates stages."""
    text = layout.replace(",", "")
    while "(" in text:
        unrolled = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        if unrolled == text:
            raise ValueError(f"bad pipeline layout {layout!r}")
        text = unrolled
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return [list(stage) for stage in text.split("|")]


# DeepSeek-V3's 16-stage layout from Bridge's set_deepseek_v3_pipeline_model_parallel_layout
# ((16,1), (8,2), (4,4) share it): embedding + 4 layers, 14 x 4 layers, 1 layer + MTP + loss.
_DSV3_16_STAGES = "Et*4|(t*4|)*14tmL"
# The 32-stage layout Bridge's H100 recipe passes (PP 8 x VP 4): embedding + 1 layer, 30 x 2
# layers, then MTP + loss on a stage of their own.
_DSV3_H100_32_STAGES = "Et|(tt|)*30mL"

GPU_FAMILIES = ("h100", "b200", "gb200")

# Why layer-wise Muon changes what Adam recipes do: Muon orthogonalises whole matrices, one owner
# rank each. TP > 1 splits every dense matrix, so Newton-Schulz needs the shards gathered (the
# recipes' muon_tp_mode "duplicated") or runs on pieces, which is not Muon; ETP > 1 does the same
# to experts, and its FP8 gather is not verified. Hence ETP = 1 everywhere (every cited recipe
# ships it). The two H100 recipes Bridge ships at TP 2 with sequence parallelism keep it:
# Qwen3-235B (standard attention) and DeepSeek-V3 (multi-latent attention, run at TP 2 with FP8
# gather in tests/bridge/test_tp_mla_training.py), widths in whole 128-wide blockwise tiles per
# shard (rules/tensor_parallel.py), each with a TP-2 twin (twins.py). Everything else follows the
# cited recipe; activation recompute is left to the user, as in every recipe here.
PARALLELISM: dict[str, dict[str, ParallelismDefaults]] = {
    "deepseek-v3": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes deepseek_v3_pretrain_1024gpu_h100_fp8cs_config (TP2 SP)",
            nodes=128,
            gpus_per_node=8,
            tp=2,
            sequence_parallel=True,
            pp=8,
            vpp=4,
            ep=64,
            global_batch_size=16384,
            pipeline_layout=_DSV3_H100_32_STAGES,
        ),
        "b200": ParallelismDefaults(
            recipe="perf_recipes deepseek_v3_pretrain_256gpu_b200_fp8mx_config",
            nodes=32,
            gpus_per_node=8,
            pp=8,
            vpp=2,
            ep=8,
            global_batch_size=4096,
            pipeline_layout=_DSV3_16_STAGES,
        ),
        "gb200": ParallelismDefaults(
            recipe="perf_recipes deepseek_v3_pretrain_256gpu_gb200_fp8mx_config",
            nodes=64,
            gpus_per_node=4,
            pp=4,
            vpp=4,
            ep=64,
            global_batch_size=4096,
            pipeline_layout=_DSV3_16_STAGES,
        ),
    },
    "deepseek-v2-lite": {
        "h100": ParallelismDefaults(
            recipe="recipes deepseek_v2_lite_pretrain_8gpu_h100_bf16_config",
            nodes=1,
            gpus_per_node=8,
            ep=8,
            global_batch_size=512,
        ),
        "b200": ParallelismDefaults(
            recipe="recipes deepseek_v2_lite_pretrain_8gpu_h100_bf16_config (no B200 recipe)",
            nodes=1,
            gpus_per_node=8,
            ep=8,
            global_batch_size=512,
        ),
        "gb200": ParallelismDefaults(
            recipe="recipes deepseek_v2_lite_pretrain_8gpu_h100_bf16_config (no GB200 recipe)",
            nodes=2,
            gpus_per_node=4,
            ep=8,
            global_batch_size=512,
        ),
    },
    "qwen3-30b-a3b": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs_config",
            nodes=2,
            gpus_per_node=8,
            ep=16,
            global_batch_size=1024,
        ),
        "b200": ParallelismDefaults(
            recipe="perf_recipes qwen3_30b_a3b_pretrain_8gpu_b200_fp8mx_config",
            nodes=1,
            gpus_per_node=8,
            ep=8,
            micro_batch_size=4,
            global_batch_size=512,
        ),
        "gb200": ParallelismDefaults(
            recipe="perf_recipes qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_config",
            nodes=2,
            gpus_per_node=4,
            ep=8,
            micro_batch_size=4,
            global_batch_size=512,
        ),
    },
    "qwen3-235b-a22b": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes qwen3_235b_a22b_pretrain_256gpu_h100_fp8cs_config (TP2 SP)",
            nodes=32,
            gpus_per_node=8,
            tp=2,
            sequence_parallel=True,
            pp=8,
            vpp=4,
            ep=32,
            global_batch_size=8192,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        "b200": ParallelismDefaults(
            recipe="perf_recipes qwen3_235b_a22b_pretrain_256gpu_b200_fp8mx_config",
            nodes=32,
            gpus_per_node=8,
            pp=8,
            vpp=3,
            ep=8,
            global_batch_size=8192,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        "gb200": ParallelismDefaults(
            recipe="perf_recipes qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config",
            nodes=64,
            gpus_per_node=4,
            pp=8,
            vpp=3,
            ep=32,
            global_batch_size=8192,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
    },
    "qwen3-next-80b-a3b": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes qwen3_next_80b_a3b_pretrain_128gpu_h100_fp8cs_config",
            nodes=16,
            gpus_per_node=8,
            ep=128,
            global_batch_size=1024,
        ),
        "b200": ParallelismDefaults(
            recipe="perf_recipes qwen3_next_80b_a3b_pretrain_64gpu_b200_fp8mx_config",
            nodes=8,
            gpus_per_node=8,
            ep=64,
            global_batch_size=1024,
        ),
        "gb200": ParallelismDefaults(
            recipe="perf_recipes qwen3_next_80b_a3b_pretrain_64gpu_gb200_fp8mx_config",
            nodes=16,
            gpus_per_node=4,
            pp=2,
            vpp=4,
            ep=32,
            micro_batch_size=2,
            global_batch_size=1024,
            pipeline_layout="Et*4|(t*7|)*5t*8|tmL",
        ),
    },
    "qwen3.5-35b-a3b": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes qwen35_vl_35b_a3b_pretrain_16gpu_h100_bf16_config (VL, VP12)",
            muon_change="text only: VP12 was laid out for the vision tower; plain PP2 split",
            nodes=2,
            gpus_per_node=8,
            pp=2,
            ep=8,
            global_batch_size=512,
        ),
        "b200": ParallelismDefaults(
            recipe="recipes qwen35_text_35b_a3b_pretrain_8gpu_gb200_bf16_config (no B200 one)",
            nodes=1,
            gpus_per_node=8,
            ep=8,
            global_batch_size=512,
        ),
        "gb200": ParallelismDefaults(
            recipe="recipes qwen35_text_35b_a3b_pretrain_8gpu_gb200_bf16_config",
            nodes=2,
            gpus_per_node=4,
            ep=8,
            global_batch_size=512,
        ),
    },
}


def parallelism(arch: MoEArchitecture | str, gpu: str) -> ParallelismDefaults:
    """The defaults for ``arch`` on ``gpu`` ("h100"/"hopper", "b200", "gb200"/"blackwell")."""
    name = arch.name if isinstance(arch, MoEArchitecture) else get_architecture(arch).name
    family = {"hopper": "h100", "h200": "h100", "blackwell": "gb200"}.get(gpu.lower(), gpu.lower())
    if family not in GPU_FAMILIES:
        raise KeyError(f"unknown GPU family {gpu!r}; known: {', '.join(GPU_FAMILIES)}")
    return PARALLELISM[name][family]
