"""The test suite (not packaged): a package so tests import their helpers as ``tests.support``.

pytest imports each file as ``tests.test_x`` with the repository root on ``sys.path``; the rank
workers of :mod:`tests.support.harness` are spawned with that ``sys.path``, so they unpickle and
import the same module-level rank functions.
"""
