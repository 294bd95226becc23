"""The transport seam: ``base`` says what a node must offer (``Session``, ``Process``,
``Connector``), ``ssh`` speaks SSH (paramiko, imported lazily), ``local`` runs every
"node" on this machine for tests. ``fan_out`` is the one bounded parallel map over nodes."""

from torchherd.transport.base import (
    MAX_PARALLEL,
    Closing,
    CommandResult,
    Connected,
    Connector,
    Process,
    Session,
    close_all,
    connect_all,
    fan_out,
)

__all__ = ["MAX_PARALLEL", "Closing", "CommandResult", "Connected", "Connector", "Process", "Session", "close_all", "connect_all",
           "fan_out"]
