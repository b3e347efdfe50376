"""What to check and how the result reads: target resolution, usage errors, the report's forms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.checks.report import (
    CHECK_IDS,
    CheckReport,
    CheckResult,
    failed,
    format_figure,
    passed,
    print_report_table,
)
from jobs.checks.target import UsageError, needs_legacy_keras, resolve_target
from tests.checks.tables import ROOT

PLUGIN = "examples/plugins/sign_momentum.py:SignMomentum"


def test_a_registered_name_resolves_to_its_registry_entry() -> None:
    target = resolve_target("lion", framework="torch")
    assert (target.name, target.style, target.framework) == ("lion", "torch", "torch")
    assert target.qualname == "optimizers.torch.lion.Lion"
    assert target.class_location().endswith("optimizers/torch/lion.py:" + str(_class_line(target.cls)))


def test_a_file_reference_and_a_module_reference_resolve_to_their_classes() -> None:
    plugin = resolve_target(PLUGIN)
    assert (plugin.style, plugin.cls.__name__) == ("torch", "SignMomentum")
    rmsprop = resolve_target("torch.optim:RMSprop")
    # The class's own name, not the snake_case a registry would derive (`rm_sprop`).
    assert (rmsprop.name, rmsprop.style) == ("RMSprop", "torch")
    assert "lr" in rmsprop.entry.params


@pytest.mark.parametrize(
    ("text", "options", "message"),
    [
        ("no/such/file.py:Opt", {}, "file not found: no/such/file.py"),
        ("no_such_package.mod:Opt", {}, "no module named 'no_such_package.mod'"),
        ("torch.optim:NoSuchClass", {}, "has no class 'NoSuchClass'; it defines: "),
        (
            "collections:OrderedDict",
            {},
            "is not an optimizer class: expected a subclass of torch.optim.Optimizer",
        ),
        (
            "torch.optim:SGD",
            {"framework": "tensorflow"},
            "is a torch optimizer; it cannot be checked as tensorflow",
        ),
        ("torch.optim:1SGD", {}, "'1SGD' after the colon is not a class name"),
        (":SGD", {}, "':SGD': nothing before the colon; give path/to/file.py:ClassName or package"),
        ("no_such_optimizer", {"framework": "torch"}, "no optimizer named 'no_such_optimizer' is registered"),
        ("lion", {"framework": "jax"}, "--framework must be torch or tensorflow; received 'jax'"),
        (
            "lion",
            {"framework": "tensorflow", "style": "torch"},
            "--style torch is not a tensorflow style (tensorflow: keras, tf_legacy); give one of those",
        ),
    ],
)
def test_usage_errors_say_what_is_wrong(text: str, options: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError) as caught:
        resolve_target(text, **options)
    assert message in str(caught.value)


def test_legacy_targets_are_recognised_before_any_import(tmp_path: Path) -> None:
    legacy_file = tmp_path / "mine.py"
    legacy_file.write_text("import tf_keras\nclass Mine(tf_keras.optimizers.legacy.Optimizer):\n    pass\n")
    assert needs_legacy_keras(f"{legacy_file}:Mine")
    assert needs_legacy_keras("tf_keras.optimizers.legacy:SGD")
    assert needs_legacy_keras("lion", style="tf_legacy")
    assert not needs_legacy_keras("torch.optim:SGD")
    assert not needs_legacy_keras("lion")
    assert not needs_legacy_keras(PLUGIN)


# A package written for tf.keras, as TensorFlow Recommenders is: it refuses to import under Keras 3.
KERAS2_PACKAGE = {
    "__init__.py": (
        "import os\n"
        "if os.environ.get('TF_USE_LEGACY_KERAS') != '1':\n"
        "    raise ImportError('recs requires tf.keras to be Keras 2: set TF_USE_LEGACY_KERAS=1')\n"
    ),
    "optimizers/__init__.py": "",
    "optimizers/plain.py": (
        "import tensorflow as tf\n\n\n"
        "class PlainSGD(tf.keras.optimizers.legacy.Optimizer):\n"
        "    def __init__(self, learning_rate=0.01, name='PlainSGD', **kwargs):\n"
        "        super().__init__(name, **kwargs)\n"
        "        self._set_hyper('learning_rate', learning_rate)\n\n"
        "    def _resource_apply_dense(self, grad, var, apply_state=None):\n"
        "        return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * grad)\n\n"
        "    def get_config(self):\n"
        "        config = super().get_config()\n"
        "        config['learning_rate'] = self._serialize_hyperparameter('learning_rate')\n"
        "        return config\n"
    ),
}


def test_a_module_of_a_package_written_for_tf_keras_is_checked_in_a_legacy_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its source is read to decide, as a file's is, without running the package's code (which
    would raise here); the command line then checks it with no --style."""
    for name, text in KERAS2_PACKAGE.items():
        (tmp_path / "recs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "recs" / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert needs_legacy_keras("recs.optimizers.plain:PlainSGD")
    assert "recs" not in sys.modules
    assert not needs_legacy_keras("recs.optimizers.missing:PlainSGD")

    env = {**os.environ, "OPTLAB_PLUGIN_DIRS": "", "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    env.pop("TF_USE_LEGACY_KERAS", None)
    command = [sys.executable, "-m", "jobs.checks", "recs.optimizers.plain:PlainSGD", "--only", "construct"]
    checked = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert checked.returncode == 0, checked.stderr
    assert "(tf_legacy, recs.optimizers.plain.PlainSGD)" in checked.stderr


def test_the_report_reads_as_json_markdown_and_summary() -> None:
    report = CheckReport("lion", "torch", "torch", "lion", "optimizers.torch.lion.Lion", {"lr": 0.001})
    report.checks = [
        CheckResult("construct", **_fields(passed("built", 3.0))),
        CheckResult("sparse", **_fields(failed("a raw TypeError", fix="handle sparse", where="x.py:3"))),
    ]
    data = report.to_json()
    assert data["checks"][1] == {
        "id": "sparse",
        "status": "fail",
        "detail": "a raw TypeError (at x.py:3). Fix: handle sparse",
        "figure": None,
        "where": "x.py:3",
        "duration_s": 0.0,
    }
    assert data["summary"]["fail"] == 1 and data["summary"]["failed"] == ["sparse"]
    assert not report.ok
    markdown = report.to_markdown()
    assert "| sparse | fail |  | a raw TypeError (at x.py:3). Fix: handle sparse |" in markdown
    assert json.loads(json.dumps(data)) == data
    assert [format_figure(f) for f in (None, 0.0, 2.5, 1e-9)] == ["", "0", "2.5", "1.00e-09"]


def test_the_table_prints_a_detail_quoting_brackets_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    # gloo's errors open with their source line in brackets, which rich would read as a closing tag
    # and raise on (MarkupError): `optlab check` printed a traceback instead of its report.
    quoted = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/tcp/pair.cc:553] closed; lr=[red]"
    report = CheckReport("wolfe", "torch", "torch", "wolfe", "[/x.py]:Wolfe", {})
    report.checks = [CheckResult("distributed", **_fields(failed(quoted, fix="see the line")))]
    print_report_table(report.to_json())
    # The table folds long text over lines between its borders.
    printed = "".join(capsys.readouterr().out.replace("│", " ").split())
    assert "".join(quoted.split()) in printed
    assert "[/x.py]:Wolfe" in printed


def test_the_command_line_exits_2_on_usage_errors_and_writes_the_json_report(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "OPTLAB_PLUGIN_DIRS": ""}
        command = [sys.executable, "-m", "jobs.checks", *args]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)

    unknown = run("no/such/file.py:Opt")
    assert unknown.returncode == 2 and "file not found: no/such/file.py" in unknown.stderr
    bad_params = run("torch.optim:SGD", "--params", "[1]")
    assert bad_params.returncode == 2 and "--params must be a JSON object" in bad_params.stderr
    out_of_range = run("lion", "--framework", "torch", "--params", '{"lr": -1}')
    assert out_of_range.returncode == 2 and "lr must be a number > 0; received -1" in out_of_range.stderr
    unfinished = tmp_path / "unfinished.py"
    unfinished.write_text(
        "import tf_keras\n\n\nclass NoApply(tf_keras.optimizers.legacy.Optimizer):\n    pass\n"
    )
    no_apply = run(f"{unfinished}:NoApply", "--style", "tf_legacy")
    assert no_apply.returncode == 2
    assert "NoApply defines no _resource_apply_dense(), so it updates nothing" in no_apply.stderr

    path = tmp_path / "report.json"
    ok = run("torch.optim:SGD", "--only", "construct,dense_step", "--json", str(path))
    assert ok.returncode == 0, ok.stderr
    data = json.loads(path.read_text())
    assert (data["optimizer"], data["framework"], data["style"]) == ("SGD", "torch", "torch")
    assert [c["id"] for c in data["checks"]] == ["construct", "dense_step"]
    assert {c["status"] for c in data["checks"]} == {"pass"}
    assert "construct" in ok.stdout and "dense_step" in ok.stdout


def test_check_ids_are_stable() -> None:
    # Users script against these ids and MLflow logs checks/<id>: changing one is a breaking change.
    assert len(CHECK_IDS) == 19 and CHECK_IDS[0] == "construct" and CHECK_IDS[-1] == "deprecations"


def _class_line(cls: type) -> int:
    import inspect

    return inspect.getsourcelines(cls)[1]


def _fields(outcome: object) -> dict[str, object]:
    return {k: getattr(outcome, k) for k in ("status", "detail", "figure", "where")}


def test_a_name_that_is_not_registered_here_says_what_usually_hides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin the service lists (GET /optimizers) but this shell reads no folder for, a file given
    without its class, a plugin that failed to load: each had been only "no optimizer named"."""
    monkeypatch.delenv("OPTLAB_PLUGIN_DIRS", raising=False)
    with pytest.raises(
        UsageError, match=r"OPTLAB_PLUGIN_DIRS is not set in this shell, so no plugin folder was"
    ):
        resolve_target("sign_momentum", framework="torch")
    plugin = tmp_path / "mine.py"
    plugin.write_text("import torch\n\nclass _Helper: ...\n\nclass MineSGD(torch.optim.SGD):\n    pass\n")
    with pytest.raises(
        UsageError,
        match=rf"\. {plugin} is a file: add the class, {plugin}:ClassName \(it defines: MineSGD\)$",
    ):
        resolve_target(str(plugin), framework="torch")
    (tmp_path / "broken.py").write_text("class Broken(:\n")
    monkeypatch.setenv("OPTLAB_PLUGIN_DIRS", str(tmp_path))
    with pytest.raises(UsageError) as caught:
        resolve_target("broken", framework="torch")
    assert "OPTLAB_PLUGIN_DIRS" not in str(caught.value)
    assert f". These failed to load: {tmp_path / 'broken.py'} (SyntaxError: " in str(caught.value)


def test_a_plugin_folder_that_does_not_exist_is_named_beside_an_unknown_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in OPTLAB_PLUGIN_DIRS read only as "no optimizer named ... is registered"."""
    missing = tmp_path / "plugns"
    monkeypatch.setenv("OPTLAB_PLUGIN_DIRS", f"{tmp_path}{os.pathsep}{missing}")
    with pytest.raises(UsageError) as caught:
        resolve_target("sign_momentum", framework="torch")
    assert str(caught.value).endswith(f". OPTLAB_PLUGIN_DIRS names {missing}, which is not a folder here")
