"""The deployment files, checked by the real tools."""

import subprocess
from pathlib import Path

from tests.deploy.tools import compose, hadolint, promtool

ROOT = Path(__file__).resolve().parents[2]


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def test_compose_config_gpu_and_cpu() -> None:
    binary = compose()
    gpu = run(binary, "-f", "docker-compose.yml", "config", "-q")
    assert gpu.returncode == 0, gpu.stderr
    cpu = run(binary, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "config", "-q")
    assert cpu.returncode == 0, cpu.stderr
    gpu_full = run(binary, "-f", "docker-compose.yml", "config").stdout
    cpu_full = run(
        binary, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "config"
    ).stdout
    assert "driver: nvidia" in gpu_full and "driver: nvidia" not in cpu_full
    assert "VARIANT: cpu" in cpu_full and "/models" in cpu_full and "read_only: true" in cpu_full


def test_hadolint_dockerfile() -> None:
    result = run(hadolint(), "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_both_images_install_the_pinned_torch_and_copy_what_exists() -> None:
    """Each variant's torch comes from constraints.txt's pin (the GPU one PyPI's CUDA
    build, not a base image's own torch), kvserve is installed as its built wheel under
    the same constraints, and every path the Dockerfile copies is in the repository."""
    text = (ROOT / "Dockerfile").read_text()
    pin = (ROOT / "constraints.txt").read_text()
    assert "torch==2.13.0" in pin
    stages = text.split("\nFROM ")
    gpu = next(s for s in stages if s.startswith("base AS torch-gpu"))
    cpu = next(s for s in stages if s.startswith("base AS torch-cpu"))
    for stage in (gpu, cpu):
        assert "pip install --no-cache-dir -c constraints.txt torch==2.13.0" in stage
    assert "download.pytorch.org/whl/cpu" in cpu and "whl/cpu" not in gpu
    assert "pytorch/pytorch" not in text  # no base image with a torch of its own
    # the runtime installs the built wheel (what users install), not the source tree
    assert "pip wheel --no-cache-dir --no-deps -w /wheels ." in text
    assert "pip install --no-cache-dir -c constraints.txt /wheels/kvserve-*.whl" in text
    assert "gcc" in text  # the C kernels and Triton's launcher compile at run time
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is missing"


def test_promtool_check_config() -> None:
    result = run(promtool(), "check", "config", "deploy/prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
