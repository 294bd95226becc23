"""The controller's echoes: one socket, one thread, every address answered for."""

from __future__ import annotations

import pytest

from torchherd.checks.icmp import echo_all


def test_every_address_gets_its_own_answer() -> None:
    addresses = [f"127.0.0.{last}" for last in range(1, 41)]  # all of 127/8 answers on Linux
    answers = echo_all(addresses, timeout=2.0)
    if answers["127.0.0.1"].startswith("unavailable"):
        pytest.skip(answers["127.0.0.1"])
    assert answers == {address: "ok" for address in addresses}


def test_an_address_that_cannot_be_sent_to_says_why() -> None:
    answers = echo_all(["127.0.0.1", "255.255.255.255"], timeout=0.5)
    if answers["127.0.0.1"].startswith("unavailable"):
        pytest.skip(answers["127.0.0.1"])
    assert answers["127.0.0.1"] == "ok" and answers["255.255.255.255"].startswith("no-reply")
