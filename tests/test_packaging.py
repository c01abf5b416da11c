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
