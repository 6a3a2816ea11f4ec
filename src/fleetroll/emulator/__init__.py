"""An embedded Fleet-compatible platform: control plane, MCP servers, faults.

The real ``fleet-python`` SDK talks to it unchanged, so anything that works on
the emulator works on Fleet. See :class:`Emulator`.

Names are imported on first use: code that only needs a :class:`FaultProfile`
(defined below the emulator, in :mod:`fleetroll.settings.fault_profiles`) does not load
the servers (starlette, uvicorn, mcp).
"""

import typing as _typing

from fleetroll._lazy import lazy_attributes as _lazy_attributes

if _typing.TYPE_CHECKING:
    from fleetroll.emulator.ledger import Ledger
    from fleetroll.emulator.server import Emulator
    from fleetroll.settings.fault_profiles import FaultProfile, Latency

__all__ = ["Emulator", "FaultProfile", "Latency", "Ledger"]

_WHERE: dict[str, str] = {
    "Emulator": "fleetroll.emulator.server",
    "FaultProfile": "fleetroll.settings.fault_profiles",
    "Latency": "fleetroll.settings.fault_profiles",
    "Ledger": "fleetroll.emulator.ledger",
}


__getattr__ = _lazy_attributes(__name__, globals(), _WHERE)
