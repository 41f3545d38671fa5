"""Device names from configs, checked before anything is built on them."""

from __future__ import annotations

import torch

from selfspec.errors import SelfspecError


def check_device(name: str, setting: str = "device") -> torch.device:
    """torch.device(name) if this machine has it, else an error naming the setting and fix."""
    try:
        device = torch.device(str(name))
    except RuntimeError:
        raise SelfspecError(f"{setting}={name}: not a device name; use cpu, cuda, cuda:N or "
                            f"mps") from None
    if device.type == "cuda":
        _check_cuda(device, setting)
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise SelfspecError(f"{setting}={name}: this machine has no MPS (Apple GPU) backend; "
                            f"use {setting}=cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise SelfspecError(f"{setting}={name}: selfspec runs on cpu, cuda or mps")
    return device


def _check_cuda(device: torch.device, setting: str) -> None:
    if not torch.cuda.is_available():
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        raise SelfspecError(
            f"{setting}={device}: CUDA is not available on this machine (torch "
            f"{torch.__version__} is {build}); use {setting}=cpu, or install a CUDA build of "
            f"torch on a machine with an NVIDIA GPU")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise SelfspecError(f"{setting}={device}: this machine has {count} CUDA device(s), "
                            f"cuda:0 to cuda:{count - 1}")


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work, so a timer read afterwards covers it (CUDA and MPS
    run asynchronously; the CPU needs nothing)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """Counts the calls that bring a tensor's values back to the host (on CUDA each waits for
    the device): `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, and a tensor used as a bool,
    int, float or index. Inside `with HostReads() as reads:` every such call adds one to
    `reads.count`, on any device, so a CPU run counts what a GPU run would synchronise on."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> HostReads:
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counted(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)
        return read
