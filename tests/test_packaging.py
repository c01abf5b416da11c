"""A regular (non-editable) install ships every package of the source tree: pyproject.toml's
explicit package list names each folder of Python modules under the mapped top-level folders
(an editable install finds an unlisted one anyway, so nothing else would notice it missing)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_folder_is_listed_and_mapped():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {Path(folder): name for name, folder in setup["package-dir"].items()}
    assert set(setup["packages"]) == set(mapped.values())
    tops = [folder for folder in mapped if folder != Path(".") and len(folder.parts) == 1]
    found = {py.parent.relative_to(ROOT) for top in tops for py in (ROOT / top).rglob("*.py")
             if "__pycache__" not in py.parts}
    assert found <= set(mapped), sorted(map(str, found - set(mapped)))


def test_a_deploy_install_goes_without_torch():
    """torch backs only the transformers oracle (tests, benchmarks): TVM's FFI imports it
    whenever it is installed, so a deploy install must not pull it in; the code a deploy runs
    never imports it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("torch") for dep in project["dependencies"])
    for extra in ("test", "bench"):
        assert "torch==2.13.0" in project["optional-dependencies"][extra]
    deploy = [py for top in ("compile", "runtime", "serve") for py in (ROOT / top).rglob("*.py")]
    deploy += [ROOT / "cli.py", ROOT / "repl.py", ROOT / "progress.py"]
    assert not [str(p) for p in deploy
                if "import torch" in p.read_text() or "from torch" in p.read_text()]
