"""The rendered check report: exact text into a plain console."""

from __future__ import annotations

from io import StringIO

from torchherd.console import make_console
from torchherd.console.checks import render_report
from torchherd.results import CheckReport, CheckResult

EXPECTED = """\
node  ssh port firewall
───────────────────────
node0 ok   ok    FAIL  
node1 ok  FAIL    -    
FAIL node0 firewall: iptables rule `-A INPUT -p tcp --dport 29500 -j DROP` on node0 drops TCP 29500
  fix: on node0: `iptables -D INPUT -p tcp --dport 29500 -j DROP`
FAIL node1 port: node1 cannot connect to node0 10.0.0.1:29500 (timed out: packets dropped)
  fix: open TCP 29500 on node0
preflight failed: 3 pass, 0 warn, 2 fail, 1 skip
"""


def test_report_table_then_failure_blocks() -> None:
    report = CheckReport((
        CheckResult("node0", "ssh", "pass", "connected"),
        CheckResult("node0", "port", "pass", "free"),
        CheckResult("node0", "firewall", "fail",
                    "iptables rule `-A INPUT -p tcp --dport 29500 -j DROP` on node0 drops TCP 29500",
                    "on node0: `iptables -D INPUT -p tcp --dport 29500 -j DROP`"),
        CheckResult("node1", "ssh", "pass", "connected"),
        CheckResult("node1", "port", "fail", "node1 cannot connect to node0 10.0.0.1:29500 (timed out: packets "
                    "dropped)", "open TCP 29500 on node0"),
        CheckResult("node1", "firewall", "skip", "not readable"),
    ))
    buffer = StringIO()
    render_report(make_console(buffer), report)
    assert buffer.getvalue() == EXPECTED


def test_warnings_follow_failures_and_pass_verdict() -> None:
    report = CheckReport((CheckResult("node0", "clock", "warn", "node0's clock is off", "run chrony"),))
    buffer = StringIO()
    render_report(make_console(buffer), report)
    assert buffer.getvalue().endswith("WARN node0 clock: node0's clock is off\n  fix: run chrony\n"
                                      "preflight passed: 0 pass, 1 warn, 0 fail, 0 skip\n")


def test_a_pass_with_advice_is_a_note_after_the_warnings_and_many_are_counted() -> None:
    notes = tuple(CheckResult(f"node{index}", "hostname", "pass", "ok; c10d may log", f"add line {index}")
                  for index in range(5))
    report = CheckReport((CheckResult("node0", "clock", "warn", "off", "run chrony"), *notes))
    buffer = StringIO()
    render_report(make_console(buffer, width=200), report)
    assert buffer.getvalue().endswith(
        "WARN node0 clock: off\n  fix: run chrony\n"
        "NOTE node0 hostname: ok; c10d may log\n  fix: add line 0\n"
        "NOTE node1 hostname: ok; c10d may log\n  fix: add line 1\n"
        "NOTE node2 hostname: ok; c10d may log\n  fix: add line 2\n"
        "2 more notes like these (check --json lists them)\n"
        "preflight passed: 5 pass, 1 warn, 0 fail, 0 skip\n")
