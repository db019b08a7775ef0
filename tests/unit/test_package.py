"""The package as it would be published: a wheel built from this checkout installs the whole
package, the vLLM plugin entry point and the console script, at the one version there is."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import vllm_kvguard

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_is_complete_and_installs(tmp_path: Path) -> None:
    # No isolation: the test needs no network (`make package` does the isolated build + twine).
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("vllm_kvguard-*.whl")
    assert wheel.name == f"vllm_kvguard-{vllm_kvguard.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "vllm_kvguard").rglob("*.py")}
    assert sources and sources <= names, sorted(sources - names)
    dist = f"vllm_kvguard-{vllm_kvguard.__version__}.dist-info"
    entry_points = zipfile.ZipFile(wheel).read(f"{dist}/entry_points.txt").decode()
    assert "[vllm.general_plugins]\nkvguard = vllm_kvguard.plugin:register" in entry_points
    assert "[console_scripts]\nkvguard = vllm_kvguard.tools.cli:main" in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"{dist}/METADATA").decode()
    assert f"Version: {vllm_kvguard.__version__}\n" in metadata
    assert (
        "Requires-Dist: xxhash" in metadata
        and "Requires-Dist: numba" in metadata
        and "Requires-Dist: vllm" not in metadata.split("Provides-Extra")[0]
    )

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from importlib.metadata import entry_points, version;"
        "import vllm_kvguard; assert vllm_kvguard.__file__.startswith(sys.argv[1]), vllm_kvguard.__file__;"
        "print(version('vllm-kvguard'), [e.value for e in entry_points(group='vllm.general_plugins')"
        " if e.name == 'kvguard' and e.dist.locate_file('').as_posix().startswith(sys.argv[1])])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)], check=True, capture_output=True, text=True, cwd=tmp_path
    ).stdout
    assert out.strip() == f"{vllm_kvguard.__version__} ['vllm_kvguard.plugin:register']"
