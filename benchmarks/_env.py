"""Where and with what a benchmark ran: date, machine, CPU, load, and every peer's version (read from the
installed distributions, so nothing heavy is imported); and where its results go."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

PACKAGES = ("numpy", "jax", "jaxlib", "torch", "onnx", "onnxruntime", "rich")


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit(where: Path) -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def load_average() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def environment(where: Path) -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.machine(), "cpu": cpu_model(), "cpu_count": os.cpu_count(), "usable_cpus": usable,
            "os": platform.platform(), "python": platform.python_version(),
            "nabla": version("nabla-spmd"), "commit": git_commit(where),
            "versions": {p: version(p) for p in PACKAGES},
            "load_average_at_start": load_average()}


def write_results(res: dict, path: str | None = None) -> None:
    """``res`` (a benchmark's keys) written to ``path`` alone, or, by default, merged into benchmarks/results.json
    (every other key kept: each script owns its own)."""
    if path:
        Path(path).write_text(json.dumps(res, indent=1, default=str) + "\n")
        return
    out = Path(__file__).resolve().parent / "results.json"
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update(res)
    out.write_text(json.dumps(data, indent=1, default=str) + "\n")
