"""The catalogue keeps every load error a person must see: `merge_parts` had dropped each error of a
file that registered any optimizer (meant for a file that fails only in the tf_legacy process), so a
class refused in a file beside a good one vanished with `errors: []`."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.catalogue import build_part, merge_parts
from optimizers.registry import PLUGIN_DIRS_ENV

HALF = '''
import torch


class HalfFine(torch.optim.SGD):
    """A fine class defined first."""


class HalfBad(torch.optim.SGD):
    """A class whose declaration is wrong."""

    optlab_hyperparameters = {"lr": {"hi": 1.0}}


class Lion(torch.optim.SGD):
    """The user's own Lion, named like the built-in."""
'''


@pytest.fixture(autouse=True)
def _forget_plugin_modules() -> Iterator[None]:
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("optlab_plugin_"):
            del sys.modules[name]


def test_a_half_registered_files_refused_classes_stay_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    half = tmp_path / "zz_half.py"
    half.write_text(textwrap.dedent(HALF))
    monkeypatch.setenv(PLUGIN_DIRS_ENV, str(tmp_path))
    part = build_part(["torch"])
    legacy_part = {"optimizers": [], "errors": []}
    catalogue = merge_parts([part, legacy_part])
    names = {optimizer["name"] for optimizer in catalogue["optimizers"]}
    assert "half_fine" in names and "half_bad" not in names
    lion = next(o for o in catalogue["optimizers"] if o["name"] == "lion")
    assert lion["source"] == "builtin:optimizers.torch.lion"  # the built-in keeps its name
    errors = [error for error in catalogue["errors"] if error["source"] == str(half)]
    assert [sorted(error) for error in errors] == [["error", "source"]] * 2  # the published shape
    bad, own_lion = sorted(errors, key=lambda error: error["error"])
    assert "HalfBad.optlab_hyperparameters['lr']: unknown key 'hi'" in bad["error"]
    assert own_lion["error"].startswith("class zz_half.py:Lion (line 15) is not registered")
    assert "builtin:optimizers.torch.lion" in own_lion["error"]


def test_a_file_that_failed_whole_in_one_process_and_registered_in_another_is_no_error() -> None:
    """A legacy tf.keras plugin that cannot import beside Keras 3 loads in the legacy process; its
    error from the first is not one. An error of one of its classes in that same process still is."""
    source = "/plugins/legacy_only.py"
    registered = {
        "name": "mine",
        "framework": "tensorflow",
        "style": "tf_legacy",
        "source": f"plugin {source}",
    }
    failed_whole = {"source": source, "error": "ImportError: tf_keras' legacy API", "scope": "file"}
    refused_class = {
        "source": source,
        "error": "class legacy_only.py:Other is not registered",
        "scope": "class",
    }
    in_process = {"optimizers": [], "errors": [failed_whole]}
    legacy = {"optimizers": [registered], "errors": [refused_class]}
    assert merge_parts([in_process, legacy])["errors"] == [
        {"source": source, "error": "class legacy_only.py:Other is not registered"}
    ]
    # A class refused in the process that failed the file whole elsewhere is kept too.
    in_process_refusal = {"optimizers": [], "errors": [refused_class]}
    legacy_whole = {"optimizers": [registered], "errors": []}
    assert len(merge_parts([in_process_refusal, legacy_whole])["errors"]) == 1
