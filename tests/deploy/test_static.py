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


def test_promtool_check_config() -> None:
    result = run(promtool(), "check", "config", "deploy/prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
