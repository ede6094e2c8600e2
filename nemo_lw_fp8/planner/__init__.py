"""The layout planner: what each layout of layer-wise Muon costs per rank, without a GPU.

The models it sizes are the recipe catalogue's (:mod:`nemo_lw_fp8.recipes.architectures`,
:mod:`nemo_lw_fp8.recipes.parallel`; re-exported here). Each module imports only the ones listed
before it (no cycle, nothing registered on import):

* :mod:`.counting`: analytic parameter counts; :mod:`.shapes`: per-parameter shapes and the
  planner's model names (:data:`SPECS`);
* :mod:`.rank_plan`: per-rank bytes, Newton-Schulz balance and collectives of each layout, from
  the building blocks of :mod:`.plan_parts`; :mod:`.pipeline`: that plan for one pipeline rank of a
  recipe; :mod:`.recipe_plan`: every pipeline rank of a recipe against its GPU. The command is
  :mod:`nemo_lw_fp8.cli.plan`.

Importing this package does not import megatron-core (the planner does when it runs).
"""

from __future__ import annotations

from nemo_lw_fp8.planner.counting import count_parameters, parameter_breakdown, published_comparison
from nemo_lw_fp8.planner.pipeline import plan_rank, stage_param_specs
from nemo_lw_fp8.planner.rank_plan import plan
from nemo_lw_fp8.planner.shapes import (
    SPECS,
    ModelSpec,
    ParamSpec,
    param_shapes,
    to_model_spec,
    total_params,
)
from nemo_lw_fp8.recipes.architectures import (
    ARCHITECTURES,
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    QWEN3_5_35B_A3B,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    QWEN3_NEXT_80B_A3B,
    MoEArchitecture,
    get_architecture,
    tiny,
)
from nemo_lw_fp8.recipes.parallel import GPU_FAMILIES, PARALLELISM, ParallelismDefaults, parallelism

__all__ = [
    "ARCHITECTURES",
    "DEEPSEEK_V2_LITE",
    "DEEPSEEK_V3",
    "GPU_FAMILIES",
    "PARALLELISM",
    "QWEN3_5_35B_A3B",
    "QWEN3_30B_A3B",
    "QWEN3_235B_A22B",
    "QWEN3_NEXT_80B_A3B",
    "SPECS",
    "ModelSpec",
    "MoEArchitecture",
    "ParallelismDefaults",
    "ParamSpec",
    "count_parameters",
    "get_architecture",
    "param_shapes",
    "parallelism",
    "parameter_breakdown",
    "plan",
    "plan_rank",
    "published_comparison",
    "stage_param_specs",
    "tiny",
    "to_model_spec",
    "total_params",
]
