"""What every test module shares: the Hypothesis profiles and ``forced_isa``.

``HYPOTHESIS_PROFILE=ci`` (default) or ``soak``: soak runs every ``@given`` test ``SOAK_FACTOR`` times longer.
A test states its budget for ``ci`` with ``@scaled(n)``, never with a bare ``max_examples``, so the profile
reaches it. ``forced_isa`` forces a kernel ISA for a block and restores the previous setting exactly.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

import pagedkv_rs

CI_EXAMPLES = 400
SOAK_FACTOR = 12.5

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=CI_EXAMPLES, stateful_step_count=40, **_common)
settings.register_profile("soak", max_examples=int(CI_EXAMPLES * SOAK_FACTOR), stateful_step_count=80, **_common)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)  # an unknown name is an error here


def scaled(examples: int) -> settings:
    """The loaded profile with ``examples`` scaled by its budget relative to ``ci`` (x1 in ci, x12.5 in soak)."""
    factor = settings.get_profile(PROFILE).max_examples / CI_EXAMPLES
    return settings(settings.get_profile(PROFILE), max_examples=max(1, round(examples * factor)))


class forced_isa:
    """``with forced_isa("scalar"): ...`` runs the block with that ISA, then restores the setting before it."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> str:
        self.prev = pagedkv_rs.get_isa()
        pagedkv_rs.set_isa(self.name)
        return self.name

    def __exit__(self, *exc: object) -> None:
        pagedkv_rs.set_isa(self.prev)
