import subprocess
import sys

from hstu.cli import main


def test_help_lists_commands(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "bench" in out


def test_bad_override_is_a_clear_error(capsys):
    assert main(["train", "--backend", "torch", "train.stepz=1"]) == 2
    assert "unknown key 'train.stepz'" in capsys.readouterr().err


def test_core_imports_no_framework():
    """Every core module imports (and the config and plot commands run) with the frameworks
    blocked, also when this suite itself runs with them installed."""
    from hstu.testing import REPO_ROOT

    # from the files, not pkgutil.walk_packages, which imports the backend packages to walk them
    files = sorted((REPO_ROOT / "hstu").rglob("*.py"))
    core = [
        ".".join(p.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in files
        if not {"torch_backend", "jax_backend"} & set(p.parts)
    ]
    code = (
        "import importlib, sys; from hstu.testing import block_backends; block_backends(); "
        f"[importlib.import_module(m) for m in {core!r}]; "
        "from hstu.cli import main; assert main(['config', 'show']) == 0"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_train_help_lists_every_config_key(capsys):
    from hstu.config import describe

    try:
        main(["train", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for key in describe():
        assert key.key in out, key.key
