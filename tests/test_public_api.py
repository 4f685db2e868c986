from __future__ import annotations

import hps


def test_all_lists_exactly_the_public_names() -> None:
    public = {n for n in vars(hps) if not n.startswith("_") or n == "__version__"}
    public.discard("annotations")  # the __future__ import
    modules = {name for name, value in vars(hps).items() if type(value).__name__ == "module"}
    assert set(hps.__all__) == public - modules


def test_every_error_is_an_hps_error_with_a_kind() -> None:
    errors = [getattr(hps, n) for n in hps.__all__ if n.endswith("Error")]
    assert len(errors) >= 15
    kinds = set()
    for err in errors:
        assert issubclass(err, hps.HPSError) and err.__doc__
        kinds.add(err.kind)
    assert len(kinds) == len(errors)
