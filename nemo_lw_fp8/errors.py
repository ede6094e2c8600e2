"""What every layer of the plugin may raise at a user, in one module below them all.

A configuration that cannot run is refused before training with one line naming the rule, the
flag and the fix (:class:`ConfigError`); a bad command line likewise (:class:`UsageError`). The
CLI turns both into one line on stderr and exit status 2; ``--debug`` or :data:`DEBUG_ENV` shows
the traceback instead. Nothing here imports anything of the plugin's, so a rule, a recipe, a patch
or a command can raise these without importing the layer that reports them.
"""

from __future__ import annotations

#: Set to 1 for tracebacks instead of one-line errors (the CLI's ``--debug``).
DEBUG_ENV = "NEMO_LW_FP8_DEBUG"
#: How to get Megatron-Bridge (the Makefile does all of it).
BRIDGE_INSTALL_HINT = (
    "run `make env` (or pip install 'nemo-lw-fp8[bridge]' and megatron-bridge==0.6.2 --no-deps)"
)


class ConfigError(ValueError):
    """An unsupported combination of settings, caught before training starts."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[nemo_lw_fp8:{rule}] {message}")
        self.rule = rule


class UsageError(ValueError):
    """A bad command line: ``problem`` (what is wrong) and ``fix`` (what to do)."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix
