"""``nemo-lw-fp8 hf-import`` on CPU: tiny random HF checkpoints (no tokenizer files) into the
tiny recipes' ``torch_dist`` checkpoints.

* the import holds the HF tensors bitwise, in megatron's layout written out independently of
  Bridge (tests/hf/layout.py); controls: a permuted expert and Q / K swapped in one query group
  of the HF tensors make exactly those entries diverge;
* HF -> import -> export (no training) gives the HF safetensors back bitwise (Qwen3-MoE;
  DeepSeek-V3 without MTP);
* a DeepSeek-V3 checkpoint without MTP weights is refused by name, with the fix;
* the recipe-vs-HF-config check refuses a mismatched dimension with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf import cli_runs, layout, tiny_hf

pytestmark = pytest.mark.usefixtures("bridge_installed")

QWEN = "tiny_qwen3_30b_a3b"
DEEPSEEK = "tiny_deepseek_v3"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_import")


@pytest.fixture(scope="module")
def qwen_hf(folder: Path) -> Path:
    return tiny_hf.make(QWEN, folder / "qwen-hf")


@pytest.fixture(scope="module")
def qwen_import(folder: Path, qwen_hf: Path) -> Path:
    cli_runs.ok("hf-import", str(qwen_hf), str(folder / "qwen-import"), "--recipe", QWEN)
    return folder / "qwen-import"


@pytest.fixture(scope="module")
def deepseek_hf(folder: Path) -> Path:
    return tiny_hf.make(DEEPSEEK, folder / "deepseek-hf")


def _imported(path: Path) -> dict[str, torch.Tensor]:
    from nemo_lw_fp8.hf import torch_dist

    ckpt = torch_dist.iteration_dir(str(path))
    return torch_dist.read(ckpt, [k for k in torch_dist.shapes(ckpt) if "_extra_state" not in k])


def _expected(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    values = tiny_hf.QWEN3_MOE
    return layout.entries(
        hf, values["num_hidden_layers"], values["num_key_value_heads"], values["num_experts"]
    )


def test_import_holds_the_hf_tensors_bitwise(qwen_hf: Path, qwen_import: Path) -> None:
    assert not list(qwen_hf.glob("tokenizer*")), "the weights need no tokenizer files"
    hf = cli_runs.weights(qwen_hf)
    imported = _imported(qwen_import)
    expected = _expected(hf)
    assert set(expected) == set(imported)
    assert layout.diverging(expected, imported) == []
    record = json.loads((qwen_import / "nemo_lw_fp8_import.json").read_text())
    assert record["recipe"] == QWEN and record["parameters"] == 49


def test_permuted_expert_and_swapped_query_key_diverge(qwen_hf: Path, qwen_import: Path) -> None:
    """Controls on the HF tensors: experts 0 and 1 of layer 0 exchanged; in layer 1, query
    group 1's first query head (32 rows) exchanged with its key. Exactly the three entries that
    hold them diverge; the comparison reaches every tensor without failing otherwise."""
    hf = cli_runs.weights(qwen_hf)
    for proj in ("gate", "up", "down"):
        a, b = (f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight" for e in (0, 1))
        hf[a], hf[b] = hf[b], hf[a]
    head = tiny_hf.QWEN3_MOE["head_dim"]
    per_group = head * tiny_hf.QWEN3_MOE["num_attention_heads"] // 2
    q_name, k_name = (f"model.layers.1.self_attn.{p}_proj.weight" for p in "qk")
    q, k = hf[q_name].clone(), hf[k_name].clone()
    q_rows, k_rows = slice(per_group, per_group + head), slice(head, 2 * head)
    q[q_rows], k[k_rows] = k[k_rows].clone(), q[q_rows].clone()
    hf[q_name], hf[k_name] = q, k
    assert layout.diverging(_expected(hf), _imported(qwen_import)) == sorted(
        [layout.FC1, layout.FC2, layout.QKV]
    )


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert set(a) == set(b), (set(a) ^ set(b))
    return layout.diverging(a, b)


def test_import_then_export_gives_the_hf_tensors_back(
    folder: Path, qwen_hf: Path, qwen_import: Path, deepseek_hf: Path
) -> None:
    """No training in between: the export of an import is the HF checkpoint, tensor for tensor
    (names, dtypes, bits); for DeepSeek-V3 through an import without MTP."""
    cli_runs.ok("hf-export", str(qwen_import), str(folder / "qwen-back"), "--weights", "compute")
    assert _same_bits(cli_runs.weights(qwen_hf), cli_runs.weights(folder / "qwen-back")) == []
    imported = folder / "deepseek-import"
    cli_runs.ok("hf-import", str(deepseek_hf), str(imported), "--recipe", DEEPSEEK,
                *tiny_hf.DEEPSEEK_OVERRIDES, "model.mtp_num_layers=0")  # fmt: skip
    cli_runs.ok("hf-export", str(imported), str(folder / "deepseek-back"), "--weights", "compute")
    back = cli_runs.weights(folder / "deepseek-back")
    assert _same_bits(cli_runs.weights(deepseek_hf), back) == []
    record = json.loads((folder / "deepseek-back" / "nemo_lw_fp8_export.json").read_text())
    assert record["weights"] == "compute" and record["from_masters"] == []


def test_deepseek_checkpoint_without_mtp_weights_is_refused_by_name(
    folder: Path, deepseek_hf: Path
) -> None:
    """transformers saves DeepSeek-V3 without its MTP layer; the recipe has one. Refused, naming
    the MTP weights and the fix; nothing written."""
    out = folder / "deepseek-refused"
    done = cli_runs.nemo(
        "hf-import", str(deepseek_hf), str(out), "--recipe", DEEPSEEK, *tiny_hf.DEEPSEEK_OVERRIDES
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = cli_runs.errors(done)
    assert len(lines) == 1, done.stderr[-3000:]
    assert "hf-missing-weights" in lines[0] and "mtp.layers.0.eh_proj.weight" in lines[0]
    assert "model.mtp_num_layers=0" in lines[0]
    assert not (out / "latest_checkpointed_iteration.txt").exists()


def test_recipe_against_hf_config_refuses_a_mismatched_dimension(
    folder: Path, qwen_hf: Path
) -> None:
    """The HF config says 3 layers, the recipe 2: one line naming the field and both values,
    before any weight is read."""
    hf = cli_runs.weights(qwen_hf)
    mismatched = cli_runs.rewrite(qwen_hf, folder / "qwen-3-layers", hf)
    config = json.loads((mismatched / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (mismatched / "config.json").write_text(json.dumps(config))
    done = cli_runs.nemo("hf-import", str(mismatched), str(folder / "x"), "--recipe", QWEN)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = cli_runs.errors(done)
    assert len(lines) == 1, done.stderr[-3000:]
    assert "model.num_layers: recipe 2, HF config 3" in lines[0]
    assert "hf-recipe-mismatch" in lines[0]
