"""The TPU detection the notebook uses: TPU chips on the PCI bus, by torch_xla's device ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.tpu_detect import TPU_PCI_DEVICES, tpu_chips, tpu_generation


def fake_pci_device(sysfs: Path, slot: str, vendor: str, device: str) -> None:
    path = sysfs / "bus" / "pci" / "devices" / slot
    path.mkdir(parents=True)
    (path / "vendor").write_text(vendor + "\n")
    (path / "device").write_text(device + "\n")


@pytest.mark.parametrize("generation, device_id", [("v2/v3", "0x0027"), ("v4", "0x005e"), ("v5e", "0x0063"),
                                                   ("v5p", "0x0062"), ("v6e", "0x006f"), ("7x", "0x0076")])
def test_the_notebook_finds_every_tpu_generation_on_the_pci_bus(tmp_path, generation, device_id):
    for chip in range(4):
        fake_pci_device(tmp_path, f"0000:00:0{chip + 4}.0", "0x1ae0", device_id)
    fake_pci_device(tmp_path, "0000:00:03.0", "0x1ae0", "0x0042")  # gVNIC: Google's vendor id, not a TPU
    fake_pci_device(tmp_path, "0000:00:01.0", "0x8086", "0x7110")
    assert tpu_chips(tmp_path) == 4 and tpu_generation(tmp_path) == generation
    assert tpu_chips(tmp_path / "nothing") == 0 and tpu_generation(tmp_path / "nothing") is None


def test_the_tpu_device_ids_are_torch_xlas():
    from torch_xla._internal import tpu

    assert list(TPU_PCI_DEVICES) == tpu._TPU_PCI_DEVICE_IDS and tpu._GOOGLE_PCI_VENDOR_ID == "0x1ae0"
