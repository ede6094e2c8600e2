"""Hugging Face in and out on CPU, as docs/hf.md shows it: a random tiny Qwen3-MoE checkpoint
(``tiny_hf.py``) goes through ``nemo-lw-fp8 hf-import``; ``tiny_qwen3_30b_a3b`` (MXFP8 weights,
FP8 param gather, single grouped expert weights owned in runs of experts, layer-wise Muon)
starts from it as ``checkpoint.pretrained_checkpoint`` on 2 gloo ranks, trains 2 steps, saves;
``nemo-lw-fp8 hf-export`` writes the result, which transformers loads.

* after the load, every master of the run (whole weights and expert runs; the Q/K/V parts'
  case is ``tests/bridge/test_pretrained_load.py``'s) equals the HF tensor it came from,
  bitwise (control: the run of the same recipe from its own random init does not);

* ``--weights masters`` holds bf16 of the run's fp32 masters (Muon's saved
  ``fp32_param`` entries) and, for Adam's parameters, the model entries; ``--weights compute``
  holds the model entries (the dequantized MXFP8 weights); the two differ on the FP8 weights;
* transformers' fp32 logits on the export match megatron's fp32 logits of the same weights
  within the bound derived below, with the same argmax; control: the export with gate and up
  projections swapped breaks the bound; the same for a trained tiny DeepSeek-V3 run (routed
  top-4, as transformers routes it; with its MTP layer).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf import cli_runs, layout, tiny_hf
from tests.support import bridge_runs

pytestmark = pytest.mark.usefixtures("bridge_installed")

RECIPE = "tiny_qwen3_30b_a3b"
#: tiny_deepseek_v3 routed as transformers routes DeepSeek-V3 (tests/hf/tiny_hf.py), with MTP.
DEEPSEEK = ("tiny_deepseek_v3", *tiny_hf.DEEPSEEK_OVERRIDES)
HERE = Path(__file__).parent
LAYERS, GROUPS, EXPERTS = 2, 2, 8
#: Unit roundoff of fp32, and the longest sum in a product of either tiny model (the dense
#: fc2 of DeepSeek's first layer sums 256 terms; everything else at most 128).
FP32_U = 2.0**-24
LONGEST_SUM = 256


def logit_bound(layers: int, max_logit: float) -> float:
    """Both sides compute in fp32 from the same bf16 numbers; they differ only in the order of
    fp32 operations. Summed in another order, a length-K dot product moves by at most
    gamma_K ~ K u relative to its magnitude; to first order each of the layers and the output
    layer adds one such step, so the logits agree within (layers + 1) K u max(1, max|logit|):
    5e-5 for the Qwen3-MoE run (measured 3e-7), 2e-4 for DeepSeek-V3 (measured 2e-6)."""
    return (layers + 1) * LONGEST_SUM * FP32_U * max(1.0, max_logit)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_export")


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> Path:
    return tiny_hf.make(RECIPE, folder / "hf")


TRAIN = ("train.train_iters=2", "train.global_batch_size=4", "validation.eval_interval=100",
         "optimizer.grouped_weight_ownership=expert")  # fmt: skip


@pytest.fixture(scope="module")
def trained(folder: Path, hf_model: Path) -> dict:
    """hf-import, then ``pretrain`` from the import (launched by torchrun, as a user does)."""
    imported = folder / "import"
    cli_runs.ok("hf-import", str(hf_model), str(imported), "--recipe", RECIPE)
    return bridge_runs.pretrain(
        folder, "hf-run", RECIPE, *TRAIN, f"checkpoint.pretrained_checkpoint={imported}",
        *bridge_runs.saving_at(folder, 2), launcher="torchrun", state_tensors=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(folder: Path, trained: dict) -> Path:
    return folder / "ckpt"


def _start_masters(run_record: dict) -> dict[str, torch.Tensor]:
    return {
        name: kinds["master"]
        for rank in run_record["tensors"]["start"]
        for name, kinds in rank["state"].items()
        if "master" in kinds
    }


def _from_hf(hf: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]) -> list[str]:
    """The whole MXFP8 weights (``linear_proj``) and expert runs (fc2, per expert) among
    ``masters`` whose value is not their HF tensor's, as fp32."""
    wrong, seen = [], 0
    for layer in range(LAYERS):
        prefix = f"pp0/chunk0/decoder.layers.{layer}."
        pairs = {prefix + "self_attention.linear_proj.weight": "self_attn.o_proj.weight"}
        for expert in range(EXPERTS):
            pairs[f"{prefix}mlp.experts.linear_fc2.weight/expert{expert}"] = (
                f"mlp.experts.{expert}.down_proj.weight"
            )
        for name, hf_name in pairs.items():
            seen += 1
            if not torch.equal(masters[name], hf[layout.L.format(layer) + hf_name].float()):
                wrong.append(name)
    assert seen == LAYERS * (1 + EXPERTS)
    return wrong


def test_pretrained_masters_are_the_hf_tensors(hf_model: Path, trained: dict) -> None:
    assert trained["expert_slices"] > 0, trained  # expert runs are among the masters
    hf = cli_runs.weights(hf_model)
    assert _from_hf(hf, _start_masters(trained)) == []


def test_control_a_run_from_its_own_init_has_other_masters(folder: Path, hf_model: Path) -> None:
    fresh = bridge_runs.pretrain(
        folder, "hf-fresh", RECIPE, *TRAIN[1:], "train.train_iters=1", state_tensors=True,
    )  # fmt: skip
    hf = cli_runs.weights(hf_model)
    assert len(_from_hf(hf, _start_masters(fresh))) == LAYERS * (1 + EXPERTS)


@pytest.fixture(scope="module")
def exports(folder: Path, run: Path) -> dict[str, Path]:
    out = {}
    for weights in ("masters", "compute"):
        out[weights] = folder / f"export-{weights}"
        cli_runs.ok("hf-export", str(run), str(out[weights]), "--weights", weights)
    return out


def _checkpoint(run: Path) -> dict[str, torch.Tensor]:
    from nemo_lw_fp8.hf import torch_dist

    ckpt = torch_dist.iteration_dir(str(run))
    keys = [k for k in torch_dist.shapes(ckpt) if "_extra_state" not in k and "chained_1" not in k]
    return torch_dist.read(ckpt, keys)


def _as_entries(export: Path) -> dict[str, torch.Tensor]:
    return layout.entries(cli_runs.weights(export), LAYERS, GROUPS, EXPERTS)


def test_exports_hold_masters_or_compute_weights(run: Path, exports: dict[str, Path]) -> None:
    saved = _checkpoint(run)
    infix = ".optimizer.state.fp32_param."
    masters = {k.split(infix, 1)[1]: v for k, v in saved.items() if infix in k}
    model = {k: v for k, v in saved.items() if ".optimizer." not in k}
    assert {layout.QKV, layout.FC1, layout.FC2} <= set(masters)
    expected = {k: masters[k].to(torch.bfloat16) if k in masters else v for k, v in model.items()}
    exported = _as_entries(exports["masters"])
    assert layout.diverging({k: expected[k] for k in exported}, exported) == []
    compute = _as_entries(exports["compute"])
    assert layout.diverging({k: model[k] for k in compute}, compute) == []
    # The FP8 weights' compute values are not bf16 of their masters: the two exports differ.
    assert {layout.QKV, layout.FC1, layout.FC2} <= set(layout.diverging(exported, compute))
    record = json.loads((exports["masters"] / "nemo_lw_fp8_export.json").read_text())
    assert record["weights"] == "masters"
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in record["from_masters"]
    assert "embedding.word_embeddings.weight" in record["from_model_entries"]


def _megatron_logits(run: Path, folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    torch.save(tokens, folder / "tokens.pt")
    out = folder / f"megatron-logits-{run.parent.name}.pt"
    done = subprocess.run(
        [sys.executable, str(HERE / "megatron_logits.py"), str(run), "masters",
         str(folder / "tokens.pt"), str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def _hf_logits(export: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


def _tokens() -> torch.Tensor:
    seeded = torch.Generator().manual_seed(3)
    return torch.randint(0, tiny_hf.QWEN3_MOE["vocab_size"], (2, 16), generator=seeded)


def _assert_logits_match(export: Path, run: Path, folder: Path, layers: int) -> None:
    """transformers on ``export`` = megatron on ``run``'s masters within the bound, same
    argmax; control: every expert's gate and up projections exchanged in the export."""
    tokens = _tokens()
    reference = _megatron_logits(run, folder, tokens)
    logits = _hf_logits(export, tokens)
    bound = logit_bound(layers, float(reference.abs().max()))
    assert float((logits - reference).abs().max()) <= bound
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    tensors = cli_runs.weights(export)
    for name in [n for n in tensors if n.endswith("gate_proj.weight") and ".experts." in n]:
        up = name.replace("gate_proj", "up_proj")
        tensors[name], tensors[up] = tensors[up], tensors[name]
    swapped = cli_runs.rewrite(export, folder / f"{export.name}-swapped", tensors)
    assert float((_hf_logits(swapped, tokens) - reference).abs().max()) > 10 * bound


def test_transformers_logits_match_megatron(
    folder: Path, run: Path, exports: dict[str, Path]
) -> None:
    _assert_logits_match(exports["masters"], run, folder, LAYERS)


@pytest.mark.extended  # the Qwen3-MoE export's claim again, on DeepSeek-V3 (75 s)
def test_deepseek_v3_export_logits_match_megatron(folder: Path) -> None:
    """A trained tiny DeepSeek-V3 run (MLA with YaRN rotary, sigmoid group-limited routing with
    expert bias, a shared expert, a dense first layer, an MTP layer: exported as
    ``model.layers.3.*`` as DeepSeek ships it, which transformers does not load)."""
    run = folder / "deepseek"
    run.mkdir()
    bridge_runs.pretrain(
        run, "hf-deepseek", DEEPSEEK[0], *DEEPSEEK[1:], "train.train_iters=2",
        "train.global_batch_size=4", "validation.eval_interval=100",
        *bridge_runs.saving_at(run, 2), launcher="torchrun",
    )  # fmt: skip
    export = folder / "deepseek-export"
    done = cli_runs.ok("hf-export", str(run / "ckpt"), str(export))
    assert "hf-export: warning" not in done.stderr
    config = json.loads((export / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["num_nextn_predict_layers"] == 1
    assert "model.layers.3.eh_proj.weight" in cli_runs.weights(export)
    _assert_logits_match(export, run / "ckpt", folder, layers=3)


def test_masters_read_entry_by_entry_export_the_same(
    folder: Path, run: Path, exports: dict[str, Path]
) -> None:
    """The masters arrive in batches of about ``MASTER_BATCH_BYTES`` (each checkpoint entry
    whole); one entry per load gives the export of one load, bit for bit."""
    out = folder / "export-batched"
    code = (
        "from nemo_lw_fp8.hf import exporter\n"
        "exporter.MASTER_BATCH_BYTES = 1\n"
        f"exporter.export_hf({str(run)!r}, {str(out)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    one, batched = cli_runs.weights(exports["masters"]), cli_runs.weights(out)
    assert set(one) == set(batched)
    assert layout.diverging(one, batched) == []
