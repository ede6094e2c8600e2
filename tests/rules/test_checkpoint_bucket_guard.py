"""Rule ``checkpoint-bucket-resplit`` (nemo_lw_fp8/rules/checkpoint.py): a ``dp_reshardable``
checkpoint is refused before anything is loaded when this run would cut the distributed
optimizer's buckets elsewhere (docs/checkpointing.md, "Another data-parallel size")."""

from __future__ import annotations

import pytest

from nemo_lw_fp8 import rules as guards

WHERE = "/ckpt/iter_0000010"
#: One Adam buffer saved at DP 32 (bucket size 40M): a 40M bucket closed by size, then the rest.
SAVED = {"chained_1.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_x": [40_000_128, 7_000]}


def test_resume_past_dp_40_with_the_default_bucket_size_is_refused_naming_the_fix():
    # Saved at DP 32 (max(40M, 32M) = 40M), resumed at DP 64 (max(40M, 64M) = 64M).
    message = guards.checkpoint_bucket_resplit(False, 40_000_000, 64_000_000, SAVED, WHERE)
    assert message is not None
    assert "ddp.bucket_size=40000000" in message  # the flag, with the value that matches
    assert "Fix: set ddp.bucket_size=40000000" in message
    assert "checkpoint.dist_ckpt_optim_fully_reshardable=true" in message  # the other fix
    assert WHERE in message and len(message.splitlines()) == 1


@pytest.mark.parametrize(
    ("fully", "saved_size", "size", "buckets"),
    [
        (True, 40_000_000, 64_000_000, SAVED),  # fully_reshardable: per-parameter state
        (False, 64_000_000, 64_000_000, SAVED),  # same bucket size: same split
        (False, 40_000_000, 64_000_000, {}),  # no distributed-optimizer buckets saved
        # buckets all below both sizes were not closed by the size: the same split here
        (False, 40_000_000, 64_000_000, {"b": [384, 65_536]}),
    ],
)
def test_resumes_that_keep_the_buckets_pass(fully, saved_size, size, buckets):
    assert guards.checkpoint_bucket_resplit(fully, saved_size, size, buckets, WHERE) is None


def test_a_smaller_bucket_size_that_cuts_a_saved_bucket_is_refused():
    """Not only past DP 40: an explicit smaller ``ddp.bucket_size`` splits the saved 65536."""
    small = {"b": [384, 65_536]}
    assert guards.checkpoint_bucket_resplit(False, 40_000_000, 50_000, small, WHERE)
    assert guards.checkpoint_bucket_resplit(False, 40_000_000, 70_000, small, WHERE) is None


def test_rule_is_listed_with_the_other_checkpoint_rules():
    assert "checkpoint-bucket-resplit" in {name for name, _ in guards.CHECKPOINT_RULES}


def test_bridge_load_check_reads_the_saved_buckets_and_refuses(tmp_path):
    """The wiring: ``check_loadable`` (called when Bridge reads ``run_config.yaml``) reads the
    saved buckets from the checkpoint's metadata and this run's ``ddp.bucket_size``."""
    from types import SimpleNamespace

    import torch
    import torch.distributed.checkpoint as dcp

    from nemo_lw_fp8.mechanics import checkpointing

    buffer = "chained_1.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16)"
    state = {f"{buffer}.bucket_idx_0.param": torch.zeros(100),
             f"{buffer}.bucket_idx_1.param": torch.zeros(30)}  # fmt: skip
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert checkpointing.saved_optimizer_buckets(str(tmp_path)) == {buffer: [100, 30]}
    saved = {"checkpoint": {"dist_ckpt_optim_fully_reshardable": False},
             "ddp": {"bucket_size": 100}}  # fmt: skip

    def cfg(bucket_size: int) -> SimpleNamespace:
        return SimpleNamespace(
            model=SimpleNamespace(), optimizer=SimpleNamespace(),
            checkpoint=SimpleNamespace(ckpt_format="torch_dist"),
            ddp=SimpleNamespace(bucket_size=bucket_size),
        )  # fmt: skip

    run_config = str(tmp_path / "run_config.yaml")
    with checkpointing.loading_into(cfg(100)):
        checkpointing.check_loadable(saved, run_config)  # control: the saved size
    with checkpointing.loading_into(cfg(64)), pytest.raises(guards.ConfigError) as caught:
        checkpointing.check_loadable(saved, run_config)
    assert caught.value.rule == "checkpoint-bucket-resplit"
    assert "Fix: set ddp.bucket_size=100" in str(caught.value)
