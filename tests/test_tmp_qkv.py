import torch
from tests.support.harness import run_on_ranks
from tests.support.scenarios import Scenario
from tests.support.training import train
COMPACT = Scenario(optimizer="muon", distribution="layerwise_compact", plugin=True)
def test_probe():
    gpt = Scenario(optimizer="muon", model="gpt", steps=3)
    ref = run_on_ranks(train, gpt)
    c = run_on_ranks(train, COMPACT.with_(model="gpt", steps=3, overlap=True))
    print("parts", [r["qkv_parts"] for r in c])
    for a,b in zip(ref,c):
        print(a["losses"]==b["losses"], all(torch.equal(v,b["params"][k]) for k,v in a["params"].items()))
    assert False
