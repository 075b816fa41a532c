"""The suite's two tiers, read from the Hypothesis profile (tests/conftest.py registers it).

`make test` (profile `fast`, the default; tests marked `slow` deselected by pytest.ini):
every module's contracts in process, one real server and MPI launch (tests/conftest.py
says what else is marked slow), with fewer property-test examples and loop-level
sampling-law runs.
`make test-all` (profile `full`, every test): the counts below at their full values.
Test modules call these while they are imported, after pytest has loaded the profile.
"""

from hypothesis import settings


def full() -> bool:
    return settings.get_current_profile_name() == "full"


def examples(n: int) -> int:
    """A property test's example count: n under `full`, a fifth (at least 5) under `fast`."""
    return n if full() else max(5, n // 5)


def law_runs(n: int) -> int:
    """Decode runs of a loop-level sampling-law test: n under `full`, at most 1,000 under
    `fast` (the verifier's law itself is checked at 100,000 draws in one batched call,
    tests/test_rejection_law.py; these runs check that each loop feeds it correctly, and
    each loop's law is checked at full strength by make test-all)."""
    return n if full() else min(n, 1_000)
