"""XLA's persistent compilation cache (xla.compile_cache_dir): a restarted or resumed run loads
its compiled graphs instead of compiling them again."""

from __future__ import annotations

import os
from pathlib import Path


def use_compile_cache(setting: str, mode: str, local_process: int) -> None:
    """Turn on XLA's persistent compilation cache for this process (xla.compile_cache_dir), in
    a directory of its own: processes of one host may not share one. Once per process, before
    its first computation: the replica threads of a process share its cache."""

    directory = compile_cache_dir(setting)
    if not directory:
        return
    import torch_xla
    import torch_xla.runtime as xr

    xr.initialize_cache(str(Path(directory).expanduser() / (
        f"torch_xla-{torch_xla.__version__}-{os.environ.get('PJRT_DEVICE', 'CPU').lower()}-{mode}-{local_process}")),
        readonly=False)


def compile_cache_dir(setting: str) -> str:
    """xla.compile_cache_dir resolved: "" -> off; "auto" -> the user's cache directory on an
    accelerator, off on XLA:CPU, where torch_xla 2.9 writes entries it then cannot load
    (PersistentCacheDeserializeFailure on every graph: measured, no time saved)."""

    if setting != "auto":
        return setting
    if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
        return ""
    return str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "tpu-lora" / "xla")
