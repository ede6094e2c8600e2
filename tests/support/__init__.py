"""What the tests run on: CPU rank pools (:mod:`~tests.support.harness`), training scenarios
(:mod:`~tests.support.scenarios`, :mod:`~tests.support.training`,
:mod:`~tests.support.checkpoints`) and their bitwise comparisons (:mod:`~tests.support.parity`).

Test code only; the CPU backend that production ``--cpu`` runs use is :mod:`nemo_lw_fp8.cpu`.
"""
