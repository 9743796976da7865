"""The container recipes in docker/, checked without a Docker engine.

What is checked: the images install what pyproject.toml declares (torch inside its range,
the runtime dependencies and the lab and hf extras, pinned inside their ranges), the
notebooks and the entrypoint go in, the image runs as a non-root user with a health check,
the compose file reserves GPUs, and hadolint/shellcheck pass. What is not: building or
running the images (no engine, no registry here) — the entrypoint's own behaviour is tested
in test_docker_entrypoint.py with a real bash.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.delivery.dockerfile import Recipe, option_values

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
# The extras the images install besides the runtime dependencies: JupyterLab, transformers.
IMAGE_EXTRAS = ["lab", "hf"]
RECIPES = {"gpu": DOCKER / "Dockerfile.gpu", "cpu": DOCKER / "Dockerfile.cpu"}
ENTRYPOINT_NAME = "fsdp-interactive-entrypoint"
HEALTHCHECK_NAME = "fsdp-interactive-healthcheck"


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _declared_requirements() -> list[Requirement]:
    """What the images must install: runtime dependencies plus the lab and hf extras."""
    project = _project()
    return [Requirement(text) for text in project["dependencies"]] + [
        Requirement(text)
        for extra in IMAGE_EXTRAS
        for text in project["optional-dependencies"][extra]
    ]


def _torch_requirement() -> Requirement:
    (torch,) = [req for req in _declared_requirements() if req.name == "torch"]
    return torch


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _tool(name: str) -> str:
    """A linter from the dev extra: next to this interpreter, else on PATH; never skipped."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]' brings it")
    return found


@pytest.fixture(scope="module", params=sorted(RECIPES))
def recipe(request: pytest.FixtureRequest) -> Recipe:
    return Recipe(RECIPES[request.param])


def _torch_install(recipe: Recipe) -> list[str]:
    installs = [
        words for _, words in recipe.pip_installs() if any(w.startswith("torch==") for w in words)
    ]
    assert len(installs) == 1, f"{recipe.path.name}: expected one pip install of torch"
    return installs[0]


# --- what the images install -------------------------------------------------------------


def test_torch_build_is_pinned_inside_the_project_range(recipe: Recipe) -> None:
    words = _torch_install(recipe)
    (spec,) = [w for w in words if w.startswith("torch==")]
    version = Version(spec.removeprefix("torch=="))
    variant = recipe.variables["TORCH_VARIANT"]
    assert version.local == variant, f"{spec}: the local label must name the wheel variant"
    assert Version(version.public) in _torch_requirement().specifier, (
        f"{recipe.path.name} installs {spec}, outside pyproject.toml's {_torch_requirement()}"
    )
    assert option_values(words, "--index-url") == [f"https://download.pytorch.org/whl/{variant}"]
    expected = "cpu" if recipe.path == RECIPES["cpu"] else "cu"
    assert variant.startswith(expected), f"{recipe.path.name}: torch variant {variant!r}"


def test_gpu_base_image_matches_the_torch_cuda_build() -> None:
    recipe = Recipe(RECIPES["gpu"])
    image = recipe.last("FROM").arguments.split()[0]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-[\w-]+-ubuntu[\d.]+", image)
    assert match, f"GPU base {image!r} is not a tagged nvidia/cuda Ubuntu image"
    cuda = f"cu{match.group(1)}{match.group(2)}"
    assert recipe.variables["TORCH_VARIANT"] == cuda, (
        f"base image has CUDA {match.group(1)}.{match.group(2)}, torch is built for "
        f"{recipe.variables['TORCH_VARIANT']}"
    )


def test_base_images_carry_an_explicit_tag(recipe: Recipe) -> None:
    image = recipe.last("FROM").arguments.split()[0]
    name, _, tag = image.rpartition(":")
    assert name and tag and tag != "latest" and "$" not in image, image


def test_declared_dependencies_are_installed_from_pyproject(recipe: Recipe) -> None:
    # The recipe turns pyproject.toml into a requirements file with this script ...
    generate = [
        (instruction, words)
        for instruction, words in recipe.run_commands()
        if words[:2] == ["python", "/tmp/build/pyproject_requirements.py"]
    ]
    assert len(generate) == 1, f"{recipe.path.name}: requirements are not generated once"
    instruction, words = generate[0]
    assert words[2] == "/tmp/build/pyproject.toml"
    assert option_values(words, "--extra") == IMAGE_EXTRAS
    requirements_file = words[words.index(">") + 1]
    # ... from the repository's own files, copied in before that step ...
    copied = {Path(s).name: c.destination for c in recipe.copies() for s in c.sources}
    for name in ("pyproject.toml", "pyproject_requirements.py", "constraints.txt"):
        assert copied.get(name) == "/tmp/build/", f"{name} is not copied to /tmp/build/"
    # ... and installs exactly that file under the pinned constraints.
    (install,) = [words for item, words in recipe.pip_installs() if item is instruction]
    assert option_values(install, "--requirement", "-r") == [requirements_file]
    assert option_values(install, "--constraint", "-c") == ["/tmp/build/constraints.txt"]

    # Run the very script on pyproject.toml: it yields the runtime and lab requirements.
    output = subprocess.run(
        [
            sys.executable,
            DOCKER / "pyproject_requirements.py",
            REPO / "pyproject.toml",
            *(word for extra in IMAGE_EXTRAS for word in ("--extra", extra)),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    project = _project()
    extras = [text for extra in IMAGE_EXTRAS for text in project["optional-dependencies"][extra]]
    assert output == project["dependencies"] + extras


def test_requirement_script_rejects_an_unknown_extra() -> None:
    result = subprocess.run(
        [
            sys.executable,
            DOCKER / "pyproject_requirements.py",
            REPO / "pyproject.toml",
            "--extra",
            "nope",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--extra" in result.stderr and "'nope'" in result.stderr


def test_constraints_pin_every_declared_requirement_inside_its_range() -> None:
    pins = _constraints()
    declared = {canonicalize_name(req.name): req for req in _declared_requirements()}
    del declared["torch"]  # each recipe installs its own torch build first
    assert "torch" not in pins, "torch is pinned per recipe (TORCH_VERSION), not in constraints"
    assert sorted(pins) == sorted(declared), "constraints.txt and pyproject.toml disagree on names"
    for name, requirement in declared.items():
        assert Version(pins[name]) in requirement.specifier, (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )


def test_package_is_installed_after_its_dependencies_without_changing_them(recipe: Recipe) -> None:
    installs = recipe.pip_installs()
    (package_step,) = [(item, words) for item, words in installs if "/tmp/build" in words]
    instruction, words = package_step
    assert "--no-deps" in words
    run_words = [words for item, words in recipe.run_commands() if item is instruction]
    assert ["pip", "check"] in run_words, "the package step does not run pip check"
    source_copy = next(
        item for item in recipe.all("COPY") if item.arguments.startswith("fsdp_interactive ")
    )
    dependency_step = next(item for item, words in installs if "--requirement" in words)
    # Dependencies first: editing the source must not invalidate the dependency layer.
    assert recipe.index(dependency_step) < recipe.index(source_copy) < recipe.index(instruction)


# --- what goes into the image -------------------------------------------------------------


def test_notebooks_are_copied_for_the_lab_user(recipe: Recipe) -> None:
    user = recipe.last("USER").arguments
    notebook_dir = recipe.env()["FSDP_INTERACTIVE_NOTEBOOK_DIR"]
    copies = [c for c in recipe.copies() if c.sources == ["notebooks"]]
    assert any(
        c.destination == notebook_dir and c.flags.get("chown") == f"{user}:{user}" for c in copies
    ), f"{recipe.path.name}: notebooks/ is not copied to {notebook_dir} owned by {user}"
    # The wheel ships them as data files too, so the package build needs them.
    assert any(c.destination == "/tmp/build/notebooks" for c in copies)


def test_every_copied_path_exists_and_reaches_the_build_context(recipe: Recipe) -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".git" in patterns and ".venv" in patterns
    for copy in recipe.copies():
        for source in copy.sources:
            assert (REPO / source).exists(), f"{recipe.path.name} copies missing {source}"
            for pattern in patterns:
                excluded = fnmatch.fnmatch(source, pattern.removeprefix("**/")) or fnmatch.fnmatch(
                    source, pattern
                )
                assert not excluded, f".dockerignore pattern {pattern!r} drops {source}"


def test_entrypoint_is_installed_executable_and_used(recipe: Recipe) -> None:
    script = DOCKER / "entrypoint.sh"
    assert os.access(script, os.X_OK), "docker/entrypoint.sh is not executable"
    assert script.read_text(encoding="utf-8").startswith("#!/usr/bin/env bash\n")
    installed = [c for c in recipe.copies() if c.sources == ["docker/entrypoint.sh"]]
    assert [(c.destination, c.flags.get("chmod")) for c in installed] == [
        (f"/usr/local/bin/{ENTRYPOINT_NAME}", "0755")
    ]
    entrypoint = recipe.last("ENTRYPOINT").exec_form()
    assert entrypoint is not None, "ENTRYPOINT must use the exec form (signals reach tini)"
    assert entrypoint[0] == "tini" and entrypoint[-1] == ENTRYPOINT_NAME, entrypoint
    assert not recipe.all("CMD"), "a CMD would be passed to the entrypoint as arguments"


def test_image_runs_as_a_non_root_user(recipe: Recipe) -> None:
    user = recipe.last("USER").arguments
    assert user and user not in ("root", "0") and not user.startswith("0:"), user
    created = [
        words for _, words in recipe.run_commands() if words[0] == "useradd" and words[-1] == user
    ]
    assert len(created) == 1, f"{recipe.path.name}: user {user!r} is not created with useradd"
    assert int(option_values(created[0], "--uid")[0]) > 0
    # Everything after USER runs unprivileged; the entrypoint comes after it.
    assert recipe.index(recipe.last("USER")) < recipe.index(recipe.last("ENTRYPOINT"))


def test_healthcheck_probes_the_lab_server(recipe: Recipe) -> None:
    healthcheck = recipe.last("HEALTHCHECK")
    assert healthcheck.exec_form() == [HEALTHCHECK_NAME]
    for option in ("--interval", "--timeout", "--start-period", "--retries"):
        assert option in healthcheck.arguments
    installed = [c for c in recipe.copies() if c.sources == ["docker/healthcheck.py"]]
    assert [(c.destination, c.flags.get("chmod")) for c in installed] == [
        (f"/usr/local/bin/{HEALTHCHECK_NAME}", "0755")
    ]
    assert os.access(DOCKER / "healthcheck.py", os.X_OK)


def test_exposed_port_is_the_lab_port(recipe: Recipe) -> None:
    assert recipe.last("EXPOSE").arguments == recipe.env()["JUPYTER_PORT"] == "8888"
    assert recipe.env()["JUPYTER_IP"] == "0.0.0.0", "a published port needs a non-loopback bind"


# --- compose -------------------------------------------------------------------------------


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text(encoding="utf-8"))


def _shm_bytes(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(text).lower())
    assert match, f"shm_size {text!r}"
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


def test_compose_gpu_service_reserves_gpus() -> None:
    service = _compose()["services"]["lab-gpu"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        device.get("driver") == "nvidia"
        and "gpu" in device.get("capabilities", [])
        and (device.get("count") == "all" or int(device.get("count", 0)) >= 1)
        for device in devices
    ), devices
    assert _shm_bytes(service["shm_size"]) >= 1024**3, "NCCL needs more than Docker's 64 MB"


@pytest.mark.parametrize(("service_name", "variant"), [("lab-gpu", "gpu"), ("lab-cpu", "cpu")])
def test_compose_services_match_their_recipes(service_name: str, variant: str) -> None:
    compose = _compose()
    service = compose["services"][service_name]
    context = (DOCKER / service["build"]["context"]).resolve()
    assert context == REPO, "the build context must be the repository root"
    assert (context / service["build"]["dockerfile"]).resolve() == RECIPES[variant]
    recipe = Recipe(RECIPES[variant])
    env = recipe.env()
    (port,) = service["ports"]
    assert str(port).rsplit(":", 1)[1] == env["JUPYTER_PORT"]
    assert "JUPYTER_TOKEN" in service["environment"]
    (volume,) = service["volumes"]
    name, target = volume.split(":", 1)
    assert name in compose["volumes"], f"{name} is not a declared named volume"
    assert target == env["FSDP_INTERACTIVE_NOTEBOOK_DIR"] + "/work"
    assert _shm_bytes(service["shm_size"]) > 64 * 1024**2


# --- linters -------------------------------------------------------------------------------


def test_hadolint_reports_problems_it_is_shown() -> None:
    """The linter below really lints: a recipe with known faults fails."""
    result = subprocess.run(
        [_tool("hadolint"), "-"],
        input="FROM python\nRUN pip install requests\n",
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "DL3006" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_pass_hadolint(name: str) -> None:
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", RECIPES[name]], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_passes_shellcheck() -> None:
    shellcheck = _tool("shellcheck")
    bad = subprocess.run(
        [shellcheck, "-"], input="#!/bin/bash\nrm $1\n", capture_output=True, text=True
    )
    assert bad.returncode != 0, "shellcheck did not flag an unquoted expansion"
    result = subprocess.run([shellcheck, DOCKER / "entrypoint.sh"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
