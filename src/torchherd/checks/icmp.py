"""ICMP echoes from the controller, in Python (the controller has no `ping` to rely on).

Unprivileged ICMP sockets (SOCK_DGRAM, macOS and Linux within ping_group_range) are
tried first, raw sockets (root) second; with neither, the answer says why.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from typing import Sequence


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _open() -> socket.socket | str:
    errors = []
    for kind in (socket.SOCK_DGRAM, socket.SOCK_RAW):
        try:
            return socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP)
        except OSError as error:
            errors.append(error.strerror or str(error))
    return f"unavailable: no ICMP socket on the controller ({errors[-1]})"


def echo_all(addresses: Sequence[str], timeout: float = 1.0) -> dict[str, str]:
    """One echo to every address from one socket, in one thread (no thread per node), then
    the replies as they come: "ok", "no-reply" or "unavailable: why" for each. An address
    still silent after ``timeout`` gets a second echo: among hundreds of replies at once, a
    busy controller's socket buffer may drop one."""
    sock = _open()
    if isinstance(sock, str):
        return {address: sock for address in addresses}
    results = {address: "no-reply" for address in addresses}
    with sock:
        ident = os.getpid() & 0xFFFF
        pending = set(addresses)
        for sequence in (1, 2):
            for address in [address for address in addresses if address in pending]:
                try:
                    sock.sendto(_packet(ident, sequence), (address, 0))
                except OSError as error:
                    results[address] = f"no-reply ({error.strerror})"
                    pending.discard(address)
                _take_replies(sock, pending, results, 0.0)  # read as it goes: the buffer stays small
            _take_replies(sock, pending, results, timeout)
            if not pending:
                break
    return results


def _packet(ident: int, sequence: int) -> bytes:
    payload = b"torchherd"
    header = struct.pack("!BBHHH", 8, 0, 0, ident, sequence)
    return struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, sequence) + payload


def _take_replies(sock: socket.socket, pending: set[str], results: dict[str, str], timeout: float) -> None:
    """Echo replies from pending addresses, until none is pending or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while pending:
        if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return
        data, sender = sock.recvfrom(2048)
        if sender[0] not in pending:
            continue  # a raw socket sees every ICMP packet to this machine
        # Raw sockets include the IP header; datagram ICMP sockets do not.
        offset = (data[0] & 0x0F) * 4 if sock.type == socket.SOCK_RAW else 0
        if len(data) > offset and data[offset] == 0:
            results[sender[0]] = "ok"
            pending.discard(sender[0])
