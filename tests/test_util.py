"""spmdkit.util: the helpers every stage shares."""

import gc

import pytest

from spmdkit.util import gc_paused


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_pauses_the_collector_and_restores_it_as_it_was(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(ValueError), gc_paused():
            raise ValueError("the block fails")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
