"""The package's version is in one place and the changelog names it; a built wheel carries
the package and its data (the performance model's profiles)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import megatron_parm
from launch import REPO, build_wheel, without_hidden


def test_the_changelog_names_the_package_version():
    headings = re.findall(r"^## (\d+\.\d+\.\d+)\b", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert headings, "CHANGELOG.md has no '## X.Y.Z' entry"
    assert headings[0] == megatron_parm.__version__, (
        f"CHANGELOG.md's newest entry is {headings[0]}, megatron_parm.__version__ is "
        f"{megatron_parm.__version__}: add an entry or move the version")
    assert headings[-1] == "0.1.0"


def test_pyproject_reads_the_version_from_the_package():
    text = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text
    assert 'version = {attr = "megatron_parm.__version__"}' in text
    assert not (REPO / "setup.py").exists(), "pyproject.toml is the one build source"


def test_a_wheel_holds_the_package_and_its_profiles(tmp_path):
    """`pip wheel --no-deps .` from a copy of the sources (launch.build_wheel)."""
    wheel = build_wheel(tmp_path)
    assert wheel.name.startswith(f"megatron_parm-{megatron_parm.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    profiles = sorted(p.name for p in (REPO / "megatron_parm/perf_model/profiles").glob("*.yaml"))
    assert profiles and all(f"megatron_parm/perf_model/profiles/{p}" in names for p in profiles)
    assert "megatron_parm/__init__.py" in names and "megatron_parm/dispatchers/parm_auto.py" in names
    assert not any(n.startswith(("tests/", "tools/")) for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Requires-Dist: megatron-core==0.16.1" in text
    assert "Provides-Extra: test" in text


def test_a_checkpoint_manifest_records_the_package_version():
    from types import SimpleNamespace

    from megatron_parm.checkpointing.verify import manifest_from_metadata

    manifest = manifest_from_metadata(SimpleNamespace(state_dict_metadata={}), {"iteration": 3})
    assert manifest["megatron_parm_version"] == megatron_parm.__version__
    assert manifest["iteration"] == 3


def test_test_files_have_distinct_names():
    """tests/ has no __init__.py files, so pytest imports each test file by its bare name: two
    files named alike in different folders stop the collection of the whole suite."""
    seen: dict[str, str] = {}
    clashes = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(REPO))
        if path.name in seen:
            clashes.append(f"{seen[path.name]} and {rel}")
        seen.setdefault(path.name, rel)
    assert not clashes, "test files share a name: " + "; ".join(clashes)


def test_the_processes_the_tests_start_run_without_the_test_extra():
    """Ranks and tools started by the tests cannot import transformers (tests/hidden says why);
    without_hidden gives it back to a process that needs it."""
    check = [sys.executable, "-c", "import transformers"]
    hidden = subprocess.run(check, capture_output=True, text=True)
    assert hidden.returncode == 1 and "tests/hidden/transformers" in hidden.stderr
    assert "ModuleNotFoundError" in hidden.stderr
    shown = subprocess.run(check, capture_output=True, text=True,
                           env=without_hidden(dict(os.environ)))
    try:
        import transformers  # noqa: F401  (installed with the test extra)
    except ImportError:
        return
    assert shown.returncode == 0, shown.stderr
