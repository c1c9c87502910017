"""Actor processes raise the cyclic collector's thresholds (engine.runtime.loop.tune_gc),
and a rebuild pauses the collector only while it folds."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from engine.runtime.loop import GC_THRESHOLD, tune_gc
from engine.runtime.rebuild import gc_paused


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    before, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*before)
    (gc.enable if enabled else gc.disable)()


def test_tune_gc_raises_the_thresholds_and_never_lowers_one() -> None:
    gc.set_threshold(700, 10, 10)
    tune_gc()
    assert gc.get_threshold() == GC_THRESHOLD
    gc.set_threshold(GC_THRESHOLD[0] * 2, 1, 1000)
    tune_gc()
    assert gc.get_threshold() == (GC_THRESHOLD[0] * 2, GC_THRESHOLD[1], 1000)


def test_the_fold_pause_restores_the_collector() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()  # a collector the caller switched off stays off
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
