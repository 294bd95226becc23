"""One ICMP echo from the controller, in Python (the controller has no `ping` to rely on).

Unprivileged ICMP sockets (SOCK_DGRAM, macOS and Linux within ping_group_range) are
tried first, raw sockets (root) second; with neither, the answer says why.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time


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


def echo(address: str, timeout: float = 1.0) -> str:
    """"ok", "no-reply", or "unavailable: why"."""
    sock = _open()
    if isinstance(sock, str):
        return sock
    with sock:
        ident = os.getpid() & 0xFFFF
        header = struct.pack("!BBHHH", 8, 0, 0, ident, 1)
        payload = b"torchherd"
        packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, 1) + payload
        try:
            sock.sendto(packet, (address, 0))
        except OSError as error:
            return f"no-reply ({error.strerror})"
        return _wait_reply(sock, address, timeout)


def _wait_reply(sock: socket.socket, address: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        data, sender = sock.recvfrom(2048)
        if sender[0] != address:
            continue  # a raw socket sees every ICMP packet to this machine
        # Raw sockets include the IP header; datagram ICMP sockets do not.
        offset = (data[0] & 0x0F) * 4 if sock.type == socket.SOCK_RAW else 0
        if len(data) > offset and data[offset] == 0:
            return "ok"
    return "no-reply"
