"""How many TPU chips this machine has, read the way torch_xla 2.9 reads it (the PCI bus:
`torch_xla._internal.tpu.num_available_chips`), without importing torch_xla: the notebook
decides from it which stack to install. Every TPU generation shows there, including v5e, v5p
and v6e, which have no /dev/accel* (they expose /dev/vfio/*). Google's vendor id alone is not
enough: a GCE VM's gVNIC network card carries it too (device 0x0042).
"""

from __future__ import annotations

from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"
# torch_xla 2.9's _TPU_PCI_DEVICE_IDS (tests/utils/test_tpu_detect.py checks they stay equal),
# with the generation jax's hardware_utils gives each (torch_xla's comments mark 0x0062 "testing
# only"; it is v5p; 0x0056 is an internal part, "test" here).
TPU_PCI_GENERATIONS = {"0x0027": "v2/v3", "0x005e": "v4", "0x0063": "v5e", "0x006f": "v6e", "0x0056": "test",
                       "0x0062": "v5p", "0x0076": "7x"}
TPU_PCI_DEVICES = tuple(TPU_PCI_GENERATIONS)


def _tpu_device_ids(sysfs: str | Path) -> list[str]:
    ids = []
    for vendor in Path(sysfs).glob("bus/pci/devices/*/vendor"):
        try:
            if vendor.read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            device = (vendor.parent / "device").read_text().strip()
        except OSError:
            continue
        if device in TPU_PCI_GENERATIONS:
            ids.append(device)
    return ids


def tpu_chips(sysfs: str | Path = "/sys") -> int:
    """The TPU chips on this machine's PCI bus (0: not a TPU host)."""
    return len(_tpu_device_ids(sysfs))


def tpu_generation(sysfs: str | Path = "/sys") -> str | None:
    """The generation of this machine's TPU chips ("v2/v3", "v4", "v5e", "v5p", "v6e", "7x", "test"),
    None when there are none: what the attention kernels are judged for (v2/v3 get none)."""
    ids = _tpu_device_ids(sysfs)
    return TPU_PCI_GENERATIONS[ids[0]] if ids else None
