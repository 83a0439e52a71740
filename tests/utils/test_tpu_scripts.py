"""The TPU VM scripts in utils/tpu_vm/, run against fake gcloud / git / python that record their calls."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

UTILS = REPO / "utils" / "tpu_vm"
SCRIPTS = sorted(UTILS.glob("*.sh"))

# Records its name (.venv/bin/NAME or .venv-native/bin/NAME inside a venv) and arguments as one JSON line, then behaves
# as FAKE_<NAME>_* say; `python -m uv venv DIR` and `python -m venv DIR` make DIR/bin/python, a fake too.
FAKE = """#!/usr/bin/env python3
import json, os, shutil, sys
name = os.path.basename(sys.argv[0])
venv = next((v for v in (".venv/bin/", ".venv-native/bin/") if v in sys.argv[0]), "")
label = venv + name
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps([label] + sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if name.startswith("python") and (args[:3] == ["-m", "uv", "venv"] or args[:2] == ["-m", "venv"]):
    os.makedirs(os.path.join(args[-1], "bin"), exist_ok=True)
    shutil.copy(sys.argv[0], os.path.join(args[-1], "bin", "python"))
if name == "gcloud" and "describe" in args:
    states = os.environ.get("FAKE_STATES", "READY").split(",")
    count_file = os.environ["FAKE_CALLS"] + ".describes"
    count = int(open(count_file).read()) if os.path.exists(count_file) else 0
    open(count_file, "w").write(str(count + 1))
    print(states[min(count, len(states) - 1)])
if name == "gcloud" and "ssh" in args:
    sys.exit(int(os.environ.get("FAKE_SSH_STATUS", "0")))
if name == "python" and "-c" in args:
    sys.exit(int(os.environ.get("FAKE_TPU_STATUS", "0")))
if name == "sudo" and args[:1] == ["blkid"]:  # 2: no filesystem on the device
    sys.exit(int(os.environ.get("FAKE_BLKID_STATUS", "0")))
if name == "mountpoint":
    sys.exit(int(os.environ.get("FAKE_MOUNTED_STATUS", "1")))
"""


@pytest.fixture
def fakes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("gcloud", "git", "python", "sudo", "mountpoint"):
        path = bin_dir / name
        path.write_text(FAKE.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.jsonl"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "FAKE_CALLS": str(calls),
           "PYTHON": str(bin_dir / "python"), "POLL_SECONDS": "0"}

    def run(script: str, *args: str, **extra_env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
        proc = subprocess.run(["bash", str(UTILS / script), *args], capture_output=True, text=True,
                              env={**env, **extra_env}, timeout=60)
        recorded = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
        calls.unlink(missing_ok=True)
        return proc, recorded

    return run


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    proc = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=UTILS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p.name for p in SCRIPTS} >= {"gcloud_tpuvm.sh", "cloud-clone-public.sh", "cloud-clone-private.sh",
                                         "run-on-pod.sh", "mount-cache-disk.sh"}


VM = ["--name", "t1", "--type", "v5litepod-8", "--zone", "us-west4-a", "--version", "v2-alpha-tpuv5-lite"]


def test_create_spot_vm_wait_until_ready_ssh_and_delete_on_exit(fakes):
    proc, calls = fakes("gcloud_tpuvm.sh", *VM, "--spot", "--delete-on-exit", FAKE_STATES="CREATING,CREATING,READY")
    assert proc.returncode == 0, proc.stderr
    tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
    assert calls[0] == tpu + ["create", "t1", "--zone", "us-west4-a", "--accelerator-type", "v5litepod-8",
                              "--version", "v2-alpha-tpuv5-lite", "--spot"]
    assert [c[4] for c in calls] == ["create", "describe", "describe", "describe", "ssh", "delete"]
    assert calls[4] == tpu + ["ssh", "t1", "--zone", "us-west4-a", "--worker", "0"]
    assert calls[5] == tpu + ["delete", "t1", "--zone", "us-west4-a", "--quiet"]


def test_a_cache_disk_is_attached_read_write_and_needs_a_project(fakes):
    proc, calls = fakes("gcloud_tpuvm.sh", *VM, "--project", "proj", "--cache-disk", "xla-cache", "--no-ssh")
    assert proc.returncode == 0, proc.stderr
    create = calls[0]
    assert (
        create[create.index("--data-disk") + 1]
        == "source=projects/proj/zones/us-west4-a/disks/xla-cache,mode=read-write"
    )
    proc, calls = fakes("gcloud_tpuvm.sh", *VM, "--cache-disk", "xla-cache")  # no project configured either
    assert proc.returncode == 2 and "--cache-disk needs --project" in proc.stderr
    assert not any("create" in c for c in calls)


def test_the_cache_disk_is_formatted_only_when_empty_then_mounted(fakes, tmp_path):
    device = tmp_path / "disk"
    device.write_text("")
    args = ["--device", str(device), "--mount-point", str(tmp_path / "persist")]
    proc, calls = fakes("mount-cache-disk.sh", *args, FAKE_BLKID_STATUS="2")
    assert proc.returncode == 0, proc.stderr
    sudo = [c[1:] for c in calls if c[0] == "sudo"]
    assert sudo[0] == ["blkid", str(device)] and sudo[1][0] == "mkfs.ext4" and sudo[1][-1] == str(device)
    assert ["mount", "-o", "discard,defaults", str(device), str(tmp_path / "persist")] in sudo
    assert f"xla.compile_cache_dir={tmp_path / 'persist'}/xla-cache" in proc.stdout
    proc, calls = fakes("mount-cache-disk.sh", *args, FAKE_BLKID_STATUS="0", FAKE_MOUNTED_STATUS="0")
    assert proc.returncode == 0, proc.stderr
    sudo = [c[1] for c in calls if c[0] == "sudo"]
    assert "mkfs.ext4" not in sudo and "mount" not in sudo  # a filesystem is never formatted again
    proc, calls = fakes("mount-cache-disk.sh", *args, FAKE_BLKID_STATUS="4")  # blkid itself failed
    assert proc.returncode == 2 and "blkid" in proc.stderr and "not formatted" in proc.stderr
    assert [c[1] for c in calls if c[0] == "sudo"] == ["blkid"]
    proc, calls = fakes("mount-cache-disk.sh", "--device", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "no such disk" in proc.stderr and calls == []


def test_delete_on_exit_also_runs_when_the_session_fails(fakes):
    proc, calls = fakes("gcloud_tpuvm.sh", *VM, "--delete-on-exit", FAKE_SSH_STATUS="255")
    assert proc.returncode == 255
    assert "--spot" not in calls[0] and calls[-1][4] == "delete"


def test_a_vm_that_dies_while_starting_is_an_error(fakes):
    proc, calls = fakes("gcloud_tpuvm.sh", *VM, FAKE_STATES="CREATING,PREEMPTED")
    assert proc.returncode == 2 and "t1 is PREEMPTED, not READY" in proc.stderr
    assert "ssh" not in [c[4] for c in calls]


@pytest.mark.parametrize("tpu_type, image", [("v6e-8", "v2-alpha-tpuv6e"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
                                             ("v5p-8", "v2-alpha-tpuv5"), ("v4-8", "tpu-ubuntu2204-base"),
                                             ("v3-8", "tpu-ubuntu2204-base"), ("v2-8", "tpu-ubuntu2204-base")])
def test_the_image_follows_the_tpu_type_and_a_mismatch_is_refused_before_create(fakes, tpu_type, image):
    vm = ["--name", "t1", "--type", tpu_type, "--zone", "z", "--no-ssh"]
    proc, calls = fakes("gcloud_tpuvm.sh", *vm)
    assert proc.returncode == 0, proc.stderr
    assert calls[0][calls[0].index("--version") + 1] == image
    wrong = "v2-alpha-tpuv6e" if image != "v2-alpha-tpuv6e" else "tpu-ubuntu2204-base"
    proc, calls = fakes("gcloud_tpuvm.sh", *vm, "--version", wrong)
    assert proc.returncode == 2 and calls == []
    assert f"--version {wrong} does not match --type {tpu_type}" in proc.stderr and image in proc.stderr
    proc, calls = fakes("gcloud_tpuvm.sh", *vm, "--version", wrong, "--any-version")
    assert proc.returncode == 0 and calls[0][calls[0].index("--version") + 1] == wrong


def test_a_generation_the_table_does_not_know_needs_an_explicit_image(fakes):
    proc, calls = fakes("gcloud_tpuvm.sh", "--name", "t1", "--type", "tpu7x-8", "--zone", "z", "--no-ssh")
    assert proc.returncode == 2 and "--version is required for --type tpu7x-8" in proc.stderr and calls == []
    proc, calls = fakes("gcloud_tpuvm.sh", "--name", "t1", "--type", "tpu7x-8", "--zone", "z", "--no-ssh",
                        "--version", "v2-alpha-tpu7x")
    assert proc.returncode == 0 and "v2-alpha-tpu7x" in calls[0]


def test_dry_run_prints_and_calls_nothing(fakes):
    proc, calls = fakes("gcloud_tpuvm.sh", *VM, "--spot", "--delete-on-exit", "--dry-run")
    assert proc.returncode == 0 and calls == []
    printed = [line for line in proc.stdout.splitlines() if line.startswith("+ gcloud")]
    assert [line.split()[5] for line in printed] == ["create", "describe", "ssh", "delete"]
    for script, args in [("cloud-clone-public.sh", ["--repo", "https://example.com/r.git"]),
                         ("cloud-clone-private.sh", ["--repo", "https://example.com/r.git"]),
                         ("run-on-pod.sh", ["--name", "p", "--zone", "z", "--", "echo", "hi"]),
                         ("mount-cache-disk.sh", ["--device", "/dev/none"])]:
        proc, calls = fakes(script, "--dry-run", *args)
        assert proc.returncode == 0 and calls == [], (script, proc.stderr)
        assert proc.stdout.count("\n+ ") + proc.stdout.startswith("+ ") >= 1, script


@pytest.mark.parametrize("script, args, message", [
    ("gcloud_tpuvm.sh", ["--name", "t1", "--type", "v6e-8", "--version", "v2-alpha-tpuv6e"], "--zone is required"),
    ("gcloud_tpuvm.sh", [*VM, "--zone"], "--zone needs a value"),
    ("gcloud_tpuvm.sh", [*VM, "--preemptible"], "unknown argument: --preemptible"),
    ("cloud-clone-public.sh", [], "--repo is required"),
    ("cloud-clone-private.sh", ["--repo", "git@github.com:o/r.git"], "--repo must be an https URL"),
    ("cloud-clone-private.sh", ["--repo", "https://github.com/o/r.git"], "$GITHUB_TOKEN is empty"),
    ("run-on-pod.sh", ["--name", "p", "--zone", "z"], "no command given"),
])
def test_bad_arguments_say_what_is_missing(fakes, script, args, message):
    proc, calls = fakes(script, *args)
    assert proc.returncode == 2 and message in proc.stderr and calls == []


def test_clone_installs_the_pinned_stack_in_a_python_3_11_venv_and_checks_the_tpu(fakes, tmp_path):
    repo = tmp_path / "r"
    proc, calls = fakes("cloud-clone-public.sh", "--repo", "https://example.com/r.git", "--dir", str(repo))
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == ["git", "clone", "--filter=blob:none", "--sparse", "--branch", "main",
                        "https://example.com/r.git", str(repo)]
    assert calls[1] == ["git", "-C", str(repo), "sparse-checkout", "set",
                        "lora_logic", "dataset", "finetuning_pipeline", "utils"]
    # The images' python3 is 3.10 and jax 0.7.1 needs 3.11: the image's Python only runs uv,
    # which makes the venv everything is installed into.
    assert calls[2] == ["python", "-m", "pip", "install", "--user", "--upgrade", "uv==0.13.9"]
    assert calls[3] == ["python", "-m", "uv", "venv", "--seed", "--python", "3.11", str(repo / ".venv")]
    # The CPU build of torch first (PyPI's x86 wheel is the CUDA one), then the project's tpu extra,
    # which brings torch_xla[tpu,pallas] (test_tpu_install checks what that extra resolves to).
    venv = ".venv/bin/python"
    assert calls[4] == [venv, "-m", "pip", "install", "torch==2.9.0", "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert calls[5] == [venv, "-m", "pip", "install", "-e", f"{repo}[tpu]"]
    assert not [c for c in calls if "pip" in c and any(a.startswith(("torch_xla", "jax", "libtpu")) for a in c)]
    assert calls[6][:2] == [venv, "-c"] and "global_runtime_device_count" in calls[6][2] and len(calls) == 7
    # Marked as the TPU's install, stamped: make's targets run in it (test below).
    assert (repo / ".venv" / ".tpu").is_file() and (repo / ".venv" / ".installed").is_file()
    assert "PJRT_DEVICE=TPU .venv/bin/python finetuning_pipeline/main.py" in proc.stdout

    # Run again (an update): the venv is kept, the stack installed again into it.
    proc, calls = fakes("cloud-clone-public.sh", "--repo", "https://example.com/r.git", "--dir", str(repo))
    assert proc.returncode == 0 and not [c for c in calls if "uv" in c and "venv" in c]
    assert [venv, "-m", "pip", "install", "-e", f"{repo}[tpu]"] in calls

    proc, _ = fakes("cloud-clone-public.sh", "--repo", "https://example.com/r.git", "--dir", str(repo),
                    FAKE_TPU_STATUS="1")
    assert proc.returncode == 2 and "no TPU device is visible to torch_xla" in proc.stderr


def test_clone_for_the_native_runtime_installs_torchtpu_without_torch_xla_beside_the_xla_install(fakes, tmp_path):
    """--runtime native: .venv-native (Python 3.11: TorchTPU needs it) with torch 2.13's CPU build,
    the project with its tpu-native extra (test_tpu_install resolves it; no torch_xla), and
    TorchTPU's own device check."""
    repo = tmp_path / "r"
    proc, calls = fakes("cloud-clone-public.sh", "--repo", "https://example.com/r.git", "--dir", str(repo),
                        "--runtime", "native")
    assert proc.returncode == 0, proc.stderr
    venv, python = repo / ".venv-native", ".venv-native/bin/python"
    assert calls[3] == ["python", "-m", "uv", "venv", "--seed", "--python", "3.11", str(venv)]
    assert calls[4] == [python, "-m", "pip", "install", "torch==2.13.0", "--index-url",
                        "https://download.pytorch.org/whl/cpu"]
    assert calls[5] == [python, "-m", "pip", "install", "-e", f"{repo}[tpu-native]"]
    assert calls[6][:2] == [python, "-c"] and "import torch, torch_tpu" in calls[6][2] and len(calls) == 7
    assert not [c for c in calls if any("torch_xla" in a or "[tpu]" in a for a in c)]
    assert (venv / ".tpu").is_file() and not (repo / ".venv").exists()
    assert "runtime.backend=native runtime.device=tpu" in proc.stdout

    proc, _ = fakes("cloud-clone-public.sh", "--repo", "https://example.com/r.git", "--dir", str(repo),
                    "--runtime", "native", FAKE_TPU_STATUS="1")
    assert proc.returncode == 2 and "no TPU device is visible to TorchTPU" in proc.stderr
    proc, calls = fakes("cloud-clone-public.sh", "--repo", "https://example.com/r.git", "--runtime", "jax")
    assert proc.returncode == 2 and "--runtime must be xla or native (got jax)" in proc.stderr and calls == []


def test_a_venv_the_install_did_not_make_is_left_alone(fakes, tmp_path):
    repo = tmp_path / "r"
    (repo / ".venv").mkdir(parents=True)
    proc, calls = fakes("cloud-clone-public.sh", "--repo", "https://example.com/r.git", "--dir", str(repo))
    assert proc.returncode == 2 and f"{repo / '.venv'} exists and is not this script's TPU install" in proc.stderr
    assert not [c for c in calls if "pip" in c or "uv" in c] and list((repo / ".venv").iterdir()) == []


@pytest.mark.parametrize("tpu_install", [True, False])
def test_make_targets_run_in_the_tpu_install_and_update_its_tpu_extra(fakes, tmp_path, tpu_install):
    """On the VM `make tpu-check` must run with the TPU's stack: with .venv marked as the TPU's
    install, a stale stamp updates its tpu extra there (before, make built a second venv with the
    test extra: no libtpu, no jax, PyPI's CUDA torch); elsewhere, the test extra's venv."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "Makefile", work / "Makefile")
    (work / "pyproject.toml").write_text("")
    if tpu_install:
        fakes("cloud-clone-public.sh", "--repo", "https://example.com/r.git", "--dir", str(work))
        os.utime(work / ".venv" / ".installed", (0, 0))  # older than pyproject.toml: a pulled change
    bin_dir = tmp_path / "bin"
    shutil.copy(bin_dir / "python", bin_dir / "python3")
    calls_file = tmp_path / "make_calls.jsonl"
    proc = subprocess.run(["make", "-C", str(work), "tpu-check", "CONFIG=my.yaml", "PYTHON=python3"],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_CALLS": str(calls_file)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    venv = ".venv/bin/python"
    if tpu_install:
        assert calls[0] == [venv, "-m", "pip", "install", "--quiet", "-e", ".[tpu]"]
    else:
        assert calls[0] == ["python3", "-m", "venv", ".venv"]
        assert calls[1] == [venv, "-m", "pip", "install", "--quiet", "--upgrade", "pip", "uv"]
        assert calls[2] == [venv, "-m", "uv", "pip", "install", "--quiet", "--compile-bytecode", "--python", venv, "-e",
                            ".[xla,test]"]
    assert calls[-1] == [venv, "-m", "finetuning_pipeline.tpu_check", "--config", "my.yaml"]
    if tpu_install:  # no second venv is made
        assert not [c for c in calls if c[1:3] == ["-m", "venv"]]


def test_private_clone_authenticates_without_exposing_the_token(fakes):
    token = "ghp_secret_token_value"
    proc, calls = fakes("cloud-clone-private.sh", "--repo", "https://github.com/o/r.git", "--token-env", "MY_TOKEN",
                        MY_TOKEN=token)
    assert proc.returncode == 0, proc.stderr
    clone = next(c for c in calls if "clone" in c)
    helper = [arg for arg in clone if arg.startswith("credential.helper=!")]
    assert helper and "printenv" in helper[0]
    assert token not in json.dumps(calls) and token not in proc.stdout + proc.stderr
    # The helper really answers git with the token: ask real git for the credentials.
    answer = subprocess.run(["git", "-c", "credential.helper=", "-c", helper[0], "credential", "fill"],
                            input="protocol=https\nhost=github.com\n\n", capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "GIT_TOKEN_VARIABLE": "MY_TOKEN", "MY_TOKEN": token,
                                 "GIT_TERMINAL_PROMPT": "0", "HOME": "/nonexistent"})
    assert f"password={token}" in answer.stdout.splitlines() and "username=x-access-token" in answer.stdout


def test_run_on_pod_runs_the_command_on_every_worker_with_its_quoting(fakes):
    proc, calls = fakes("run-on-pod.sh", "--name", "pod", "--zone", "us-central2-b", "--",
                        "PJRT_DEVICE=TPU", "python", "finetuning_pipeline/main.py", "--config", "my run.yaml")
    assert proc.returncode == 0, proc.stderr
    (call,) = calls
    assert call[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod", "--zone", "us-central2-b"]
    assert call[8:11] == ["--worker", "all", "--command"]
    remote = call[11]
    assert remote.startswith("cd lora-tpu && PJRT_DEVICE=TPU python finetuning_pipeline/main.py --config ")
    # The remote shell splits the string back into the words given here.
    words = subprocess.run(["bash", "-c", 'printf "%s\\n" ' + remote.split("&& ", 1)[1]], capture_output=True,
                           text=True, env={"PATH": os.environ["PATH"]}).stdout.splitlines()
    assert words[-2:] == ["--config", "my run.yaml"]
