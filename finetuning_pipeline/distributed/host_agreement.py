"""Hosts agree before the first step, or the run stops at once.

On a pod every host runs main.py itself and plans its phases from its own view of output_dir
(resume_plan.py), but only the master writes checkpoints and adapters, and every replica
loads them at a resume and at the start of a phase built on an earlier one. So output_dir must
be one directory that every host sees. On per-host disks the other hosts would start at step 0
while the master resumes at step N (their votes then pair different steps), and phase 2 would
find no phase-1 adapter on them: hours of TPU time lost before anything failed. Two checks, both host
collectives (no device), before any model is loaded:

1. The master writes a file with a fresh token into output_dir; every replica must read it.
2. Every replica describes what it will run (the phases, where each starts, a digest of the
   checkpoint and of the earlier phases' adapters it will load); all must match the master's.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run.checkpointing import COMPLETE, PREFIX
from finetuning_pipeline.run.resume_plan import PhasePlan
from finetuning_pipeline.run.run_layout import RunLayout
from utils.file_digest import sha256_file

SHARED_STORAGE_HELP = ("On a pod, put output_dir on storage every host mounts at the same path (a Filestore NFS "
                       "share, or a Cloud Storage bucket through gcsfuse; docs/tpu.md: \"On a TPU pod\"), and run "
                       "the same command with the same config on every host")
SEEN_WITHIN_S = 10.0  # a network file system may show a new file to other hosts a little late


def check_hosts_agree(layout: RunLayout, plans: list[PhasePlan], collectives, lineage) -> None:
    """Raises ConfigError (exit 2) on every replica when output_dir is not shared or the
    replicas' plans differ; does nothing for a world of one. lineage: RunConfig.lineage."""
    if collectives.world == 1:
        return
    check_shared_output_dir(layout.root, collectives)
    views = collectives.gather({"host": socket.gethostname(), "plan": plan_view(layout, plans, lineage)})
    differ = [rank for rank, view in enumerate(views) if view["plan"] != views[0]["plan"]]
    if differ:
        described = "; ".join(f"replica {rank} on {views[rank]['host']}: {describe(views[rank]['plan'])}"
                              for rank in [0, *differ])
        raise ConfigError(f"the replicas do not agree on what to run ({described}). {SHARED_STORAGE_HELP}")


def check_shared_output_dir(root: Path, collectives) -> None:
    """Every replica reads the token the master wrote into `root`."""
    token = uuid.uuid4().hex if collectives.rank == 0 else None
    probe = None
    if token:
        probe = root / f".shared-check-{token}"
        probe.write_text(token)
    try:
        token = collectives.gather(token)[0]  # the master wrote its file before this
        seen = sees_token(root / f".shared-check-{token}", token)
        views = collectives.gather({"host": socket.gethostname(), "seen": seen})
    finally:
        if probe is not None:
            probe.unlink(missing_ok=True)
    blind = [f"replica {rank} on {view['host']}" for rank, view in enumerate(views) if not view["seen"]]
    if blind:
        raise ConfigError(f"output_dir {root} is not one directory shared by every host: {', '.join(blind)} cannot "
                          f"see the file replica 0 on {views[0]['host']} wrote there, so they could not load its "
                          f"checkpoints or adapters. {SHARED_STORAGE_HELP}")


def sees_token(path: Path, token: str, within_s: float = SEEN_WITHIN_S) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


def plan_view(layout: RunLayout, plans: list[PhasePlan], lineage) -> list[dict]:
    """What this replica will run and load: per phase, where it starts and digests of the
    checkpoint (its COMPLETE marker, which holds every file's sha256) and of the earlier
    phases' adapters it builds on."""
    view = []
    for plan in plans:
        checkpoint = plan.resume_from
        entry = {"phase": plan.phase, "replace": plan.replace,
                 "resume_step": int(checkpoint.name[len(PREFIX):]) if checkpoint else None,
                 "checkpoint": digest(checkpoint / COMPLETE) if checkpoint else None}
        merged, continued = lineage(plan.phase)
        entry["adapters"] = {f"phase{n}": digest(layout.adapter(n) / "adapter_model.safetensors")
                             for n in merged + ([continued] if continued else [])}
        view.append(entry)
    return view


def digest(path: Path) -> str | None:
    return sha256_file(path)[:16] if path.is_file() else None


def describe(view: list[dict]) -> str:
    if not view:
        return "nothing (every phase finished)"
    parts = []
    for entry in view:
        start = f"from step {entry['resume_step']} ({entry['checkpoint']})" if entry["resume_step"] else "from step 0"
        built_on = [f"{name} adapter {found}" for name, found in entry["adapters"].items() if found is not None]
        if built_on:
            start += " on " + " + ".join(built_on)
        parts.append(f"phase {entry['phase']} {start}")
    return ", ".join(parts)
