"""The oversubscription warning's text (the warning itself: tests/mpi/test_oversubscribed.py)."""

from __future__ import annotations

from mpidp.runtime.oversubscribed import oversubscribed_message


def test_the_message_names_only_the_fixes_not_in_effect():
    both = oversubscribed_message("h", 4, 2, 2, True, {})
    assert (
        "set OMP_NUM_THREADS=1 (each rank runs 2 torch threads now) and "
        "MPIR_CVAR_ENABLE_HEAVY_YIELD=1" in both
    )
    done = oversubscribed_message("h", 4, 2, 1, True, {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"})
    assert (
        "Fix: run at most 2 ranks per node. Already in effect: one torch thread per rank, "
        "MPIR_CVAR_ENABLE_HEAVY_YIELD=1." in done
    )
    assert "MPIR_CVAR" not in oversubscribed_message("h", 4, 2, 1, False, {})
