"""The private tuning table (moe_fp8_ext._tuning, docs/TUNING.md): set, restore, reject."""

import threading

import pytest

from moe_fp8_ext import _C, _tuning


def test_override_sets_and_restores():
    assert all(_tuning.get(name) is None for name in _tuning.KNOBS)
    with _tuning.override(cols_plan="2,64", rows_gather=1):
        assert _tuning.get("cols_plan") == "2,64" and _tuning.get("rows_gather") == "1"
        with _tuning.override(cols_plan=None, dual_l2_bytes="0"):
            assert _tuning.get("cols_plan") is None and _tuning.get("dual_l2_bytes") == "0"
        assert _tuning.get("cols_plan") == "2,64" and _tuning.get("dual_l2_bytes") is None
    assert all(_tuning.get(name) is None for name in _tuning.KNOBS)


def test_override_restores_on_error():
    with pytest.raises(KeyError), _tuning.override(rows_runs="0"):
        raise KeyError
    assert _tuning.get("rows_runs") is None


def test_set_tuning_returns_previous():
    assert _C._set_tuning("rows_dynamic", "0") is None
    assert _C._set_tuning("rows_dynamic", None) == "0"
    assert _C._get_tuning("rows_dynamic") is None


@pytest.mark.parametrize("call", [lambda: _C._set_tuning("nope", "1"), lambda: _C._get_tuning("MOE_FP8_COLS_PLAN"),
                                  lambda: _tuning.get("nope")])
def test_unknown_names(call):
    with pytest.raises(ValueError, match="expected one of cols_plan, cols_block_plan, .*, got"):
        call()


def test_unknown_override_name_sets_nothing():
    with pytest.raises(ValueError, match="expected one of"), _tuning.override(cols_plan="1,8", nope="1"):
        pass
    assert _tuning.get("cols_plan") is None


@pytest.mark.parametrize("args", [(1, "1"), ("cols_plan", 3), ("cols_plan",), ("cols_plan", "1", "2")])
def test_bad_arguments(args):
    with pytest.raises(TypeError):
        _C._set_tuning(*args)


def test_threads():
    # concurrent writers and readers: every read is a value some writer set
    values = {None, "1,8", "2,64"}
    seen = set()

    def work(v):
        for _ in range(2000):
            _C._set_tuning("cols_plan", v)
            seen.add(_C._get_tuning("cols_plan"))

    threads = [threading.Thread(target=work, args=(v,)) for v in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen <= values
