import torch
from tests.support.harness import run_on_ranks
from tests.support.scenarios import Scenario
from tests.support.training import train
COMPACT = Scenario(optimizer="muon", distribution="layerwise_compact", plugin=True)
def probe(scenario):
    import pytest
    from nemo_lw_fp8.mechanics import compact
    seen = {}
    orig = compact._muon_splits_qkv
    orig_pieces = compact.compact_pieces
    def spy(opts):
        r = orig(opts); seen["split"] = len(r); seen["opts"] = [type(getattr(o,"optimizer",o)).__name__ + str(getattr(getattr(o,"optimizer",o),"split_qkv",None)) for o in opts]; return r
    def spy2(params, *a):
        r = orig_pieces(params, *a); seen.setdefault("pieces", []).append([(tuple(p.shape), type(p).__name__, o) for p, o in r]); return r
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compact, "_muon_splits_qkv", spy)
        mp.setattr(compact, "compact_pieces", spy2)
        out = train(scenario)
    out["seen"] = {"parts": out["qkv_parts"]}
    return out
def test_probe():
    c = run_on_ranks(probe, COMPACT.with_(model="gpt", steps=1))
    print(c[0]["seen"])
    assert False
