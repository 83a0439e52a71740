"""How many TPU chips this machine has, read the way torch_xla 2.9 reads it (the PCI bus:
`torch_xla._internal.tpu.num_available_chips`), without importing torch_xla: the notebook
decides from it which stack to install. Every TPU generation shows there, including v5e, v5p
and v6e, which have no /dev/accel* (they expose /dev/vfio/*). Google's vendor id alone is not
enough: a GCE VM's gVNIC network card carries it too (device 0x0042).
"""

from __future__ import annotations

from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"
# torch_xla 2.9's _TPU_PCI_DEVICE_IDS (tests/utils/test_tpu_detect.py checks they stay equal).
TPU_PCI_DEVICES = ("0x0027", "0x005e", "0x0063", "0x006f", "0x0056", "0x0062", "0x0076")


def tpu_chips(sysfs: str | Path = "/sys") -> int:
    """The TPU chips on this machine's PCI bus (0: not a TPU host)."""
    chips = 0
    for vendor in Path(sysfs).glob("bus/pci/devices/*/vendor"):
        try:
            if vendor.read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            if (vendor.parent / "device").read_text().strip() in TPU_PCI_DEVICES:
                chips += 1
        except OSError:
            continue
    return chips
