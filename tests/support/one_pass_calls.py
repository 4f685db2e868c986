"""What a sharded table's one pass (hps/gpu/sharded_query.py) returned from its compiled
calls, for tests that check which way a lookup went."""

from __future__ import annotations

from typing import Any


def record_compiled_calls(one_pass: Any) -> list[int]:
    """Wraps the one pass's compiled calls (releasing the GIL and keeping it) so each
    call's result (a miss count, FALLBACK, TIMED_OUT) is appended to the list returned."""
    results: list[int] = []

    def recorded(call: Any) -> Any:
        def run(*args: Any) -> int:
            results.append(int(call(*args)))
            return results[-1]
        return run

    free, held = one_pass._fast
    one_pass._fast = (recorded(free), recorded(held))
    return results
