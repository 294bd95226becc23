"""The rendered check report: exact text as a terminal shows it (uncoloured) and as a pipe gets it."""

from __future__ import annotations

from io import StringIO

from torchherd.checks.results import CheckReport, CheckResult
from torchherd.console import make_console
from torchherd.console.checks import render_report

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
PIPED = """\
node   ssh  port  firewall
node0  ok   ok    FAIL
node1  ok   FAIL  -
""" + EXPECTED.split("\n", 4)[4]


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
    render_report(make_console(buffer, terminal=True), report)
    assert buffer.getvalue() == EXPECTED
    piped = StringIO()
    render_report(make_console(piped), report)
    assert piped.getvalue() == PIPED
    assert piped.getvalue().isascii()


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


def test_the_same_failure_on_many_nodes_is_shown_once_under_their_nodeset() -> None:
    """64 unresolvable nodes printed 197 lines; as dshbak -c: one row, one block."""
    failing = tuple(CheckResult(f"bad{index:02d}", "ssh", "fail",
                                f"bad{index:02d}: cannot resolve 'bad{index:02d}' (Name or service not known)",
                                "fix the address (in -H or the inventory) or ~/.ssh/config, or the controller's DNS")
                    for index in range(1, 65))
    fine = tuple(CheckResult(f"gpu{index}", "ssh", "pass", "connected") for index in range(1, 4))
    odd = (CheckResult("gpu10", "ssh", "fail", "gpu10: authentication failed", "install your key on gpu10"),)
    buffer = StringIO()
    render_report(make_console(buffer, width=200), CheckReport(fine + failing + odd))
    assert buffer.getvalue() == (
        "node                   ssh\n"
        "gpu[1-3] (3)           ok\n"
        "bad[01-64],gpu10 (65)  FAIL\n"
        "FAIL bad[01-64] ssh: bad[01-64]: cannot resolve 'bad[01-64]' (Name or service not known) (64 nodes)\n"
        "  fix: fix the address (in -H or the inventory) or ~/.ssh/config, or the controller's DNS\n"
        "FAIL gpu10 ssh: gpu10: authentication failed\n"
        "  fix: install your key on gpu10\n"
        "preflight failed: 3 pass, 0 warn, 65 fail, 0 skip\n")


def test_findings_that_differ_beyond_the_node_name_stay_apart() -> None:
    report = CheckReport((
        CheckResult("node1", "port", "fail", "node1 cannot connect to node0:29500 (refused)", "open it on node0"),
        CheckResult("node10", "port", "fail", "node10 cannot connect to node0:29500 (refused)", "open it on node0"),
        CheckResult("node2", "port", "fail", "node2 cannot connect to node0:29500 (timed out)", "open it on node0"),
    ))
    buffer = StringIO()
    render_report(make_console(buffer, width=200, terminal=True), report)
    assert buffer.getvalue().splitlines()[5:] == [
        "FAIL node[1,10] port: node[1,10] cannot connect to node0:29500 (refused) (2 nodes)",
        "  fix: open it on node0",
        "FAIL node2 port: node2 cannot connect to node0:29500 (timed out)",
        "  fix: open it on node0",
        "preflight failed: 0 pass, 0 warn, 3 fail, 0 skip"]


def test_a_node_not_reached_counts_once_not_once_per_check_it_could_not_run() -> None:
    """Issue 41 item 27: 64 down nodes made "832 skip"."""
    down = [CheckResult(f"bad{index}", "ssh", "fail", f"bad{index}: connection refused", "start sshd")
            for index in range(1, 3)]
    skipped = [CheckResult(f"bad{index}", check, "skip", "not reached") for index in range(1, 3)
               for check in ("ping", "port", "gpu")]
    fine = [CheckResult("gpu1", "ssh", "pass", "connected"), CheckResult("gpu1", "gpu", "skip", "no GPU")]
    buffer = StringIO()
    render_report(make_console(buffer, width=200), CheckReport(tuple(fine + down + skipped)))
    assert buffer.getvalue().splitlines()[-1] == (
        "preflight failed: 1 pass, 0 warn, 2 fail, 1 skip; 2 nodes not reached (6 checks not run there)")
