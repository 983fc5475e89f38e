"""Device lookup for IPC: which torch module drives a device kind, and which local index a
peer's device has in this process.

Device kinds are handled as strings, not ``torch.device``: without ``torch_musa`` installed,
``torch.device("musa")`` does not parse, yet a handle naming a MUSA device must still be
decodable (and rejected with a clear error) everywhere.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal, cast

import torch

from .._errors import DeviceError, IPCError

__all__ = [
    "DEVICE_KINDS",
    "DeviceKind",
    "device_module",
    "device_uuid",
    "local_device_index",
    "parse_device",
]

DeviceKind = Literal["cpu", "cuda", "musa"]
DEVICE_KINDS: tuple[DeviceKind, ...] = ("cpu", "cuda", "musa")


def parse_device(device: torch.device | str) -> tuple[DeviceKind, int | None]:
    """Split ``"cuda:1"`` / ``torch.device("musa", 0)`` / ``"cpu"`` into ``(kind, index)``."""
    index: int | None
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        kind, _, rest = device.partition(":")
        if rest and not rest.isdigit():
            raise DeviceError(f"cannot parse device {device!r}; use 'cpu', 'cuda:N' or 'musa:N'")
        index = int(rest) if rest else None
    else:
        raise DeviceError(f"expected a torch.device or a string, got {type(device).__name__}")
    if kind not in DEVICE_KINDS:
        raise DeviceError(f"device kind {kind!r} has no IPC support; use one of {DEVICE_KINDS}")
    return cast(DeviceKind, kind), index


def device_module(kind: str) -> ModuleType:
    """``torch.cuda`` or ``torch.musa`` (importing ``torch_musa`` on first use).

    Raises DeviceError when the kind has no accelerator module in this process.
    """
    if kind == "cuda":
        return torch.cuda
    if kind == "musa":
        module = getattr(torch, "musa", None)
        if module is None:
            try:
                importlib.import_module("torch_musa")
            except ImportError as exc:
                raise DeviceError(
                    "a MUSA device was named but torch_musa is not installed in this process"
                ) from exc
            module = getattr(torch, "musa", None)
        if module is None:
            raise DeviceError("torch_musa was imported but did not register torch.musa")
        return cast(ModuleType, module)
    raise DeviceError(f"device kind {kind!r} is not an accelerator")


def device_uuid(kind: str, index: int) -> str | None:
    """A stable identity of device ``index`` (its UUID), or None where the backend has none.

    The index alone is not an identity across processes: two processes with different
    ``CUDA_VISIBLE_DEVICES`` / ``MUSA_VISIBLE_DEVICES`` number the same GPU differently.
    """
    try:
        props = device_module(kind).get_device_properties(index)
    except (RuntimeError, AttributeError, AssertionError, DeviceError):
        # Backends without properties (or without a UUID in them) fall back to index matching.
        return None
    uuid = getattr(props, "uuid", None)
    return None if uuid is None else str(uuid)


def local_device_index(kind: str, index: int | None, uuid: str | None) -> int:
    """The index, in this process, of the peer's device ``(index, uuid)``.

    The UUID wins when both sides know it; otherwise the peer's index is trusted. Raises
    IPCError when the device is not visible here.
    """
    module = device_module(kind)
    count = int(module.device_count())
    if uuid is not None:
        for local in range(count):
            if device_uuid(kind, local) == uuid:
                return local
        if any(device_uuid(kind, local) is not None for local in range(count)):
            raise IPCError(
                f"the exporter's {kind} device {uuid} is not visible in this process "
                f"(check {kind.upper()}_VISIBLE_DEVICES on both sides)"
            )
    if index is None or not 0 <= index < count:
        raise IPCError(
            f"the exporter's {kind} device index {index} does not exist here "
            f"({count} {kind} device(s) visible)"
        )
    return index
