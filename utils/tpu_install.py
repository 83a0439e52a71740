"""What the TPU path needs installed, read from torch_xla's own package metadata (torch_xla is
not imported): libtpu through its `tpu` extra, and jax + jaxlib at the versions its `pallas`
extra pins, since the Pallas attention kernels are traced by jax. A newer jax is not a
substitute: `jax[tpu]` brings its own libtpu, which replaces the one torch_xla 2.9 was built for.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re

# What every message names: the project's `tpu` extra installs torch_xla[tpu,pallas] (pyproject.toml).
INSTALL = "pip install -e '.[tpu]'"


def extra_pins(extra: str, package: str = "torch_xla") -> dict[str, str]:
    """{requirement name: pinned version} of `package`'s extra, e.g. pallas -> {jax: 0.7.1, jaxlib: 0.7.1}."""
    pins = {}
    for requirement in importlib.metadata.requires(package) or []:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*==\s*([^;\s]+)\s*;\s*extra\s*==\s*[\"']([^\"']+)[\"']",
                             requirement.strip())
        if match and match.group(3) == extra:
            pins[match.group(1)] = match.group(2)
    return pins


def missing_for(extra: str, package: str = "torch_xla") -> list[str]:
    """What keeps `package[extra]` from being installed as pinned: one line per package, [] if none."""
    problems = []
    for name, version in extra_pins(extra, package).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed ({package}'s {extra} extra pins {name}=={version})")
            continue
        if installed != version:
            problems.append(f"{name} {installed} is installed, {package}'s {extra} extra pins {name}=={version}")
    return problems


def pallas_problem() -> str | None:
    """Why the Pallas kernels cannot be traced with this install (None: they can)."""
    problems = missing_for("pallas")
    return "; ".join(problems) + f" ({INSTALL})" if problems else None


def libtpu_problem() -> str | None:
    """Why torch_xla would find no TPU runtime here (None: libtpu is installed, or TPU_LIBRARY_PATH
    names one, as some managed notebook images do)."""
    if os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu") is not None:
        return None
    return f"libtpu is not installed (torch_xla's tpu extra pins libtpu=={extra_pins('tpu').get('libtpu')}; {INSTALL})"
