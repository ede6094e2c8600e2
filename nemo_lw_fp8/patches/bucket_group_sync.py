"""The param-gather takeover that the compact layout and the blockwise FP8 gather share.

Both patches gather the bucket groups they planned themselves, with one collective of
owner-packed values (an :class:`~nemo_lw_fp8.mechanics.owner_gather.OwnerPackedSync`), and leave
every other group to the ``_ParamAndGradBucketGroup.start_param_sync`` / ``.finish_param_sync``
they wrap. The two wrappers differ only in which mechanics module plans and syncs, so they are
written once here. Not a patch module (it registers nothing): a helper of the patches, as
:mod:`.framework` and :mod:`.symbols` are.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from nemo_lw_fp8.patches.bridge_support import wrap_own
from nemo_lw_fp8.patches.framework import Override


def planned_group_sync(group_cls: type, gather: ModuleType) -> list[Override]:
    """Overrides of ``group_cls.start_param_sync`` and ``.finish_param_sync``: a group for which
    ``gather.plan_of`` has a plan is synced by ``gather.SYNC``, any other by the method wrapped.

    ``gather`` (:mod:`nemo_lw_fp8.mechanics.compact_gather`, :mod:`~nemo_lw_fp8.mechanics.
    blockwise`) is read at each call, as the patches read their mechanics, so a test that
    replaces one of its functions replaces it here too.
    """

    def make_start(original: Any) -> Any:
        def start_param_sync(self: Any, force_sync: bool = False) -> Any:
            if gather.plan_of(self) is not None:
                return gather.SYNC.start(self, force_sync)
            return original(self, force_sync)

        start_param_sync.__wrapped__ = original  # type: ignore[attr-defined]
        return start_param_sync

    def make_finish(original: Any) -> Any:
        def finish_param_sync(self: Any, skip_next_bucket_dispatch: bool = False) -> Any:
            if gather.plan_of(self) is not None:
                return gather.SYNC.finish(self, skip_next_bucket_dispatch)
            return original(self, skip_next_bucket_dispatch)

        finish_param_sync.__wrapped__ = original  # type: ignore[attr-defined]
        return finish_param_sync

    return [
        wrap_own(group_cls, "start_param_sync", make_start),
        wrap_own(group_cls, "finish_param_sync", make_finish),
    ]
