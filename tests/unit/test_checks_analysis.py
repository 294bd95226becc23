"""The pure analyses: hand-made facts in, CheckResults out (no sockets, no SSH)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from support.analysis import HOSTS, facts, observed
from torchherd.checks.analysis import clock, firewall, hostname, iptables, network, port, python, script
from torchherd.checks.analysis.network import compute_networks, ifname_matches
from torchherd.checks.model import NodeFacts, Observed, ProbePlan
from torchherd.checks.runner import selected_checks
from torchherd.errors import UsageError
from torchherd.inventory import parse


def statuses(results: list[Any]) -> dict[str, str]:
    return {result.node: result.status for result in results}


def test_healthy_facts_pass_every_family() -> None:
    seen = observed()
    for analyse in (hostname.analyse, firewall.analyse, network.analyse, python.analyse, clock.analyse):
        assert statuses(analyse(seen)) == {"node0": "pass", "node1": "pass"}


def test_networks_are_the_routed_addresses() -> None:
    seen = observed()
    assert {name: (net.address, net.interface) for name, net in seen.networks.items()} == {
        "node0": ("10.0.0.1", "eth0"), "node1": ("10.0.0.2", "eth0")}
    assert seen.networks["node0"].reason == "node0 resolves to it on the master"


def test_debian_loopback_hostname_names_the_line_to_write() -> None:
    seen = observed(node1=facts("node1", gloo={"address": "127.0.1.1"},
                                etc_hosts="127.0.1.1\tnode1\n" + HOSTS))
    result = hostname.analyse(seen)[1]
    assert (result.node, result.status) == ("node1", "fail")
    assert result.summary == ("node1: hostname node1 resolves to loopback 127.0.1.1 (/etc/hosts: `127.0.1.1 "
                              "node1`); gloo would listen there and the other nodes could not reach it")
    assert result.fix == ("in /etc/hosts on node1, remove `127.0.1.1 node1` and write: 10.0.0.2 node1 (a plain "
                          "torchrun hangs on it; torchherd run pins the address and interface, and runs with --skip "
                          "hostname)")


def one_node(master_target: str = "node0", **overrides: Any) -> Observed:
    """A one-node inventory whose hostname is on 127.0.1.1, as Debian and Ubuntu write /etc/hosts."""
    inventory = parse({"cluster": {"port": 29500}, "hosts": [{"name": "node0"}]}, Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target=master_target)
    seen.facts = {"node0": facts("node0", **{"gloo": {"address": "127.0.1.1"},
                                             "etc_hosts": "127.0.0.1 localhost\n127.0.1.1\tnode0\n",
                                             "resolve": {master_target: {"addresses": ["127.0.1.1"]}}, **overrides})}
    if master_target != "localhost":
        seen.ssh_addresses = {"node0": "10.0.0.1"}
    seen.networks = compute_networks(seen)
    return seen


def test_one_node_on_127_0_1_1_is_judged_as_one_node() -> None:
    """No other node needs to reach it: its hostname on loopback passes, gloo on loopback
    is no warning, and its real address stays the rendezvous's where it has one."""
    seen = one_node()
    [named] = hostname.analyse(seen)
    assert (named.status, named.summary) == (
        "pass", "node0 -> 127.0.1.1 (loopback: fine on one machine, where no other node needs to reach it)")
    [net] = network.analyse(seen)
    assert (net.status, net.summary) == ("pass", "10.0.0.1 on eth0, mtu 1500: the controller reaches the master there")


def test_one_node_without_an_address_of_its_own_meets_on_loopback() -> None:
    seen = one_node("localhost", interfaces=[{"name": "lo", "addresses": ["127.0.0.1", "::1"], "mtu": 65536}],
                    route={"error": "Network is unreachable"})
    assert {name: (net.address, net.interface) for name, net in seen.networks.items()} == {"node0": ("127.0.0.1", "lo")}
    [net] = network.analyse(seen)
    assert (net.status, net.summary) == (
        "pass", "127.0.0.1 on lo, mtu 65536: one machine: its ranks meet on loopback, as torchrun --standalone's do")
    [named] = hostname.analyse(seen)
    assert (named.status, named.summary.split(";")[0]) == (
        "pass", "node0 -> 127.0.1.1 (loopback: fine on one machine, where no other node needs to reach it)")


def test_a_one_node_cluster_addressed_as_localhost_takes_loopback_though_it_has_an_address() -> None:
    seen = one_node("localhost")
    assert (seen.networks["node0"].address, seen.networks["node0"].interface) == ("127.0.0.1", "lo")
    seen.inventory = replace(seen.inventory, hosts=(replace(seen.inventory.hosts[0], local_addr="10.0.0.1"),))
    assert compute_networks(seen)["node0"].address == "10.0.0.1"  # the node's local_addr is kept


def test_two_nodes_that_are_one_machine_are_one_node_and_two_machines_are_not() -> None:
    local = {"gloo": {"address": "127.0.1.1"}, "etc_hosts": "127.0.1.1\tnode0\n", "hostname": "node0",
             "interfaces": [{"name": "lo", "addresses": ["127.0.0.1"], "mtu": 65536},
                            {"name": "eth0", "addresses": ["10.0.0.1"], "mtu": 1500}]}
    seen = observed(node0=facts("node0", **local), node1=facts("node1", **local))
    assert statuses(hostname.analyse(seen)) == {"node0": "pass", "node1": "pass"}
    assert statuses(network.analyse(seen)) == {"node0": "pass", "node1": "pass"}
    apart = observed(node0=facts("node0", gloo={"address": "127.0.1.1"}, etc_hosts="127.0.1.1\tnode0\n" + HOSTS))
    assert statuses(hostname.analyse(apart)) == {"node0": "fail", "node1": "pass"}
    assert network.analyse(apart)[0].status == "warn"  # gloo would bind loopback: pinned by run


def test_master_name_unresolvable_on_a_worker() -> None:
    seen = observed(node1=facts("node1", resolve={"node0": {"error": "Name or service not known"}}))
    results = hostname.analyse(seen)
    assert statuses(results) == {"node0": "pass", "node1": "fail"}
    assert results[1].summary == "node1 cannot resolve the master's name node0 (Name or service not known)"
    assert results[1].fix.startswith("add this line to /etc/hosts on node1: 10.0.0.1 node0")


def test_port_taken_names_the_process_and_a_free_port() -> None:
    seen = observed(node0=facts("node0", listeners=[{"pid": "42", "command": "python3 -m http.server 29500"}]))
    seen.listened = {"node0": {"bound": {}, "errors": {"master": "Address already in use"}}, "node1": {"bound": {}}}
    seen.connected = {"node0": {}, "node1": {}}
    results = port.analyse(seen)
    assert statuses(results) == {"node0": "fail", "node1": "skip"}
    assert results[0].summary == ("port 29500 is already in use on node0 by pid 42 (python3 -m http.server 29500): "
                                  "Address already in use")
    assert results[0].fix == "stop it (kill 42) or set port = 29501 in [cluster] (or --master-port 29501)"


def attempts(*results: str) -> list[dict[str, Any]]:
    return [{"result": result, "timeout": 2.0 * 2 ** index, "seconds": 0.1} for index, result in enumerate(results)]


def outcome(address: str, port_number: int, *results: str) -> dict[str, Any]:
    made = attempts(*results)
    return {"result": results[-1], "address": address, "port": port_number, "attempts": made}


@pytest.mark.parametrize(("results", "meaning"), [
    (("timeout", "timeout"), "timed out: packets dropped; timed out twice: 2 s in the burst, then 4 s alone"),
    (("refused", "refused"), "connection refused: nothing listening, or a REJECT rule; refused twice"),
    (("unreachable", "unreachable"), "no route to host; unreachable twice"),
    (("timeout", "refused"), "connection refused: nothing listening, or a REJECT rule; timed out, then refused"),
])
def test_worker_connect_failure_says_what_every_attempt_said(results: tuple[str, ...], meaning: str) -> None:
    seen = observed()
    seen.listened = {"node0": {"bound": {"master": 29500}}, "node1": {"bound": {}}}
    seen.connected = {"node0": {}, "node1": {"node0:master": outcome("10.0.0.1", 29500, *results)}}
    result = port.analyse(seen)[1]
    assert result.status == "fail"
    assert result.summary == f"node1 cannot connect to node0 10.0.0.1:29500 ({meaning})"
    assert result.fix.startswith("open TCP 29500 on node0")


def test_a_master_name_a_worker_cannot_resolve_points_at_the_hostname_check() -> None:
    seen = observed()
    seen.listened = {"node0": {"bound": {"master": 29500}}, "node1": {"bound": {}}}
    unresolved = {"result": "unresolved", "port": 29500, "attempts": [{"result": "unresolved"}]}
    seen.connected = {"node0": {}, "node1": {"node0:master": unresolved}}
    result = port.analyse(seen)[1]
    assert result.status == "fail"
    assert result.summary == "node1 cannot connect to node0 node0:29500 (the name does not resolve)"
    assert result.fix == "node1 cannot resolve node0: see hostname on node1"  # not a firewall to open


def test_one_timeout_alone_is_never_a_failure() -> None:
    seen = observed()
    seen.listened = {"node0": {"bound": {"master": 29500}}, "node1": {"bound": {}}}
    for single in ({"result": "timeout", "address": "10.0.0.1", "port": 29500},
                   outcome("10.0.0.1", 29500, "timeout"),
                   {"result": "untried", "port": 29500, "attempts": []}):
        seen.connected = {"node0": {}, "node1": {"node0:master": single}}
        result = port.analyse(seen)[1]
        assert result.status == "warn", single
        assert "not concluded in time" in result.summary and "no failure held" in result.summary
    assert port.verdict(outcome("10.0.0.1", 29500, "refused")) == "fail"


def test_a_connect_that_went_through_on_the_retry_passes_and_says_so() -> None:
    seen = observed()
    seen.listened = {"node0": {"bound": {"master": 29500, "e1": 40001, "e2": 40002}},
                     "node1": {"bound": {"e1": 40003, "e2": 40004}}}
    seen.connected = {
        "node0": {"node1:e1": outcome("10.0.0.2", 40003, "ok"), "node1:e2": outcome("10.0.0.2", 40004, "ok")},
        "node1": {"node0:master": dict(outcome("10.0.0.1", 29500, "timeout", "ok"), source="10.0.0.2"),
                  "node0:e1": outcome("10.0.0.1", 40001, "ok"), "node0:e2": outcome("10.0.0.1", 40002, "ok")}}
    results = port.analyse(seen)
    assert statuses(results) == {"node0": "pass", "node1": "pass"}
    assert results[1].summary == ("connected to node0 10.0.0.1:29500; ephemeral ports on node0 reachable; "
                                  "1 connect(s) went through only on the second try")


def mesh(count: int, *dropped: str) -> Observed:
    """``count`` nodes probing each other fully; each ``dropped`` node drops every connect to
    its ephemeral ports and, like a plain --dport rule, the replies to its own connects."""
    names = [f"node{index}" for index in range(count)]
    address = {name: f"10.0.0.{index + 1}" for index, name in enumerate(names)}
    inventory = parse({"cluster": {"port": 29500}, "hosts": [{"name": name} for name in names]},
                      Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target="node0")
    seen.facts = {name: NodeFacts(raw={"port_range": "32768 60999"}, sent=0.0, received=0.0) for name in names}
    seen.listened = {name: {"bound": {"e1": 40001, "e2": 40002}} for name in names}
    seen.listened["node0"]["bound"]["master"] = 29500
    for prober in names:
        answer: dict[str, Any] = {}
        for peer in names:
            if peer == prober:
                continue
            for label in (("master", "e1", "e2") if peer == "node0" else ("e1", "e2")):
                port_number = 29500 if label == "master" else 40001
                lost = prober in dropped or (peer in dropped and label != "master")
                answer[f"{peer}:{label}"] = outcome(address[peer], port_number,
                                                    *(("timeout", "timeout") if lost else ("ok",)))
        seen.connected[prober] = answer
    return seen


def test_a_node_that_drops_its_ephemeral_ports_is_the_one_that_fails() -> None:
    seen = mesh(5, "node3")
    results = {result.node: result for result in port.analyse(seen)}
    assert {node: result.status for node, result in results.items()} == {
        "node0": "pass", "node1": "pass", "node2": "pass", "node3": "fail", "node4": "pass"}
    assert results["node3"].summary == (
        "node3's ephemeral ports (32768-60999) are unreachable from node0, node1, node2, node4 (timed out: "
        "packets dropped; timed out twice: 2 s in the burst, then 4 s alone); 9 of its own 9 connects failed "
        "too; gloo/NCCL connect every pair of nodes on random ports")
    assert results["node3"].fix.startswith("on node3, allow TCP from the other nodes on 32768-60999")
    assert results["node1"].summary == ("connected to node0 10.0.0.1:29500; ephemeral ports on node0, node2, "
                                        "node4 reachable, not on node3 (see there)")


def test_two_dropping_nodes_fail_and_the_nodes_they_cannot_reach_do_not() -> None:
    """node2 and node4 fail every connect out, towards everyone: each other node has two
    failing probers, but more that reach it."""
    results = port.analyse(mesh(7, "node2", "node4"))
    assert statuses(results) == {"node0": "pass", "node1": "pass", "node2": "fail", "node3": "pass", "node4": "fail",
                                 "node5": "pass", "node6": "pass"}
    assert results[2].summary.startswith("node2's ephemeral ports (32768-60999) are unreachable from node0, node1, "
                                         "node3, node4, node5, node6 (timed out")


def test_one_failing_prober_is_reported_on_the_prober() -> None:
    seen = mesh(3)
    seen.connected["node2"]["node1:e1"] = outcome("10.0.0.2", 40001, "refused", "refused")
    results = {result.node: result for result in port.analyse(seen)}
    assert {node: result.status for node, result in results.items()} == {
        "node0": "pass", "node1": "pass", "node2": "fail"}
    assert results["node2"].summary.startswith("node2 cannot connect to node1 10.0.0.2:40001, an ephemeral port "
                                               "(connection refused: nothing listening, or a REJECT rule; "
                                               "refused twice)")


def test_one_node_s_port_summary_says_there_is_no_worker_to_probe_it() -> None:
    """Issue 41 item 27: not "every node probed all 0 others"."""
    seen = mesh(1)
    seen.probe_plan = ProbePlan("full", {"node0": ()}, 1)
    [result] = port.analyse(seen)
    assert (result.status, result.summary) == (
        "pass", "port 29500 is free: a real listener took it (one node: no worker to probe it)")


def test_the_master_summary_names_the_probe_plan() -> None:
    seen = mesh(3)
    seen.probe_plan = ProbePlan("full", {"node0": ("node1", "node2"), "node1": ("node2", "node0"),
                                         "node2": ("node0", "node1")}, 1)
    assert port.analyse(seen)[0].summary == (
        "port 29500 is free; a real listener on it served the workers' probes; ephemeral ports on node1, node2 "
        "reachable; probe plan: full mesh: every node probed all 2 others")
    sampled = ProbePlan("sampled", {"a": ("b", "c", "d"), "b": ("c", "d", "a"), "c": ("d", "a", "b", "e"),
                                    "d": ("a", "b", "c"), "e": ("a", "b", "c", "d")}, 2)
    assert sampled.describe() == ("sampled: each node probed 3 to 4 of the 4 others, each was probed by at least "
                                  "1, both ways between each pair of the 2 subnets (--mesh full probes every pair)")


def test_iptables_rule_is_named_in_order() -> None:
    rules = ("-P INPUT ACCEPT\n-A INPUT -s 10.0.0.0/24 -p tcp -m tcp --dport 22 -j ACCEPT\n"
             "-A INPUT -p tcp -m tcp --dport 29500 -j REJECT --reject-with icmp-port-unreachable\n")
    seen = observed(node0=facts("node0", firewall={"tools": {"iptables": {"code": 0, "out": rules}}}))
    result = firewall.analyse(seen)[0]
    assert result.status == "fail"
    assert result.summary == ("iptables rule `-A INPUT -p tcp -m tcp --dport 29500 -j REJECT --reject-with "
                              "icmp-port-unreachable` on node0 rejects TCP 29500 from node1 (10.0.0.2)")


def test_iptables_rule_naming_one_peer_is_found_though_the_others_pass() -> None:
    # One verdict per port serves every peer only where no rule names a source: here one does.
    rules = "-P INPUT ACCEPT\n-A INPUT -s 10.0.0.2/32 -j DROP\n"
    seen = observed(node1=facts("node1", firewall={"tools": {"iptables": {"code": 0, "out": rules}}}))
    assert firewall.analyse(seen)[1].status == "pass"  # node1's own address is never a peer's
    seen = observed(node0=facts("node0", firewall={"tools": {"iptables": {"code": 0, "out": rules}}}))
    result = firewall.analyse(seen)[0]
    assert result.status == "fail"
    assert result.summary == "iptables rule `-A INPUT -s 10.0.0.2/32 -j DROP` on node0 drops TCP 29500 from node1 (10.0.0.2)"


def test_iptables_accept_before_drop_and_policy_drop() -> None:
    ruleset = iptables.parse("-P INPUT DROP\n-N PEERS\n-A INPUT -m conntrack --ctstate ESTABLISHED -j ACCEPT\n"
                             "-A INPUT -j PEERS\n-A PEERS -s 10.0.0.0/24 -j ACCEPT\n-A PEERS -j RETURN\n")
    inside = iptables.evaluate(ruleset, iptables.Packet("10.0.0.2", "10.0.0.1", 40000, "eth0"))
    outside = iptables.evaluate(ruleset, iptables.Packet("192.168.0.9", "10.0.0.1", 40000, "eth0"))
    assert inside == iptables.Verdict("ACCEPT", "-A PEERS -s 10.0.0.0/24 -j ACCEPT")
    assert outside == iptables.Verdict("DROP", None)


def test_firewall_skips_when_unreadable() -> None:
    seen = observed(node1=facts("node1", firewall={"tools": {"iptables": {"code": 4, "out": "", "err": "denied"}}}))
    result = firewall.analyse(seen)[1]
    assert result.status == "skip" and "not readable" in result.summary


def test_python_without_torch_and_version_mismatch() -> None:
    seen = observed(node1=facts("node1", torch={"error": "ModuleNotFoundError: No module named 'torch'"}))
    result = python.analyse(seen)[1]
    assert result.status == "fail" and "cannot import torch" in result.summary
    assert result.fix.endswith("-m pip install torch==2.13.0")
    seen = observed(node1=facts("node1", torch={"version": "2.12.1", "cuda": None, "nccl": None, "gpus": 0}))
    result = python.analyse(seen)[1]
    assert result.status == "fail" and "differs from node0 in torch (2.13.0)" in result.summary


def test_torch_read_from_its_files_is_compared_without_what_only_the_import_gives() -> None:
    """A node whose torch ran lately (a triage) gives its versions from torch/version.py:
    compared as always, but not NCCL's, which only the import gives; whichever node comes
    first, the reference is one that imported torch."""
    files = {"version": "2.13.0", "cuda": "12.4", "nccl": None, "files": True}
    imported = {"version": "2.13.0", "cuda": "12.4", "nccl": "2.21.5", "gpus": 8}
    seen = observed(node0=facts("node0", torch=files), node1=facts("node1", torch=imported))
    seen.torch_known = {"node0": "attempt 1's ranks"}
    results = python.analyse(seen)
    assert statuses(results) == {"node0": "pass", "node1": "pass"}
    assert results[0].summary == ("python 3.11.7, torch 2.13.0, CUDA 12.4 (read from its files: attempt 1's ranks "
                                  "imported it)")
    seen = observed(node0=facts("node0", torch={**files, "version": "2.12.1"}), node1=facts("node1", torch=imported))
    result = python.analyse(seen)[0]
    assert result.status == "fail" and "differs from node1 in torch (2.13.0)" in result.summary


def test_script_missing_and_different() -> None:
    seen = observed(node1=facts("node1", script={"path": "/w/train.py", "error": "No such file or directory"}))
    seen.script = "train.py"
    seen.facts["node0"] = facts("node0", script={"path": "/w/train.py", "sha256": "a" * 64})
    assert statuses(script.analyse(seen)) == {"node0": "pass", "node1": "fail"}
    seen.facts["node1"] = facts("node1", script={"path": "/w/train.py", "sha256": "b" * 64})
    assert statuses(script.analyse(seen)) == {"node0": "pass", "node1": "warn"}


def test_clock_skew_warns_beyond_bounds() -> None:
    seen = observed(node1=facts("node1", time=1010.0))
    results = clock.analyse(seen)
    assert statuses(results) == {"node0": "pass", "node1": "warn"}
    assert results[1].summary == "node1's clock is at least 8.0 s off node0's"


def test_missing_node_is_skipped_with_reason() -> None:
    seen = observed()
    del seen.facts["node1"]
    seen.facts_errors["node1"] = "the facts script failed"
    assert hostname.analyse(seen)[1].summary == "facts not gathered: the facts script failed"


def test_ifname_syntax() -> None:
    names = ["lo", "eth0", "eth1", "docker0"]
    assert ifname_matches("eth", names) == ["eth0", "eth1"]
    assert ifname_matches("^docker,lo", names) == ["eth0", "eth1"]
    assert ifname_matches("=eth", names) == []


def test_selection_rejects_unknown_ids_and_keeps_smoke_opt_in() -> None:
    assert "smoke" not in selected_checks(None, frozenset(), smoke=False)
    assert selected_checks(frozenset({"port", "ssh"}), frozenset(), smoke=False) == ("ssh", "port")
    with pytest.raises(UsageError, match="unknown check id prot"):
        selected_checks(frozenset({"prot"}), frozenset(), smoke=False)


def test_hostname_notes_the_ipv4_mapped_lines_that_silence_c10d_and_never_warns() -> None:
    # c10d's store listens dual-stack and looks its peers up as ::ffff:a.b.c.d, which glibc's
    # files backend answers only from such a line: a note on a pass, with the exact lines.
    results = {result.node: result for result in hostname.analyse(observed())}
    assert {result.status for result in results.values()} == {"pass"}
    assert "err=-3' (harmless)" in results["node1"].summary
    assert results["node0"].fix == "to silence it, add to /etc/hosts on node0: `::ffff:10.0.0.1 node0`; " \
                                   "`::ffff:10.0.0.2 node1`"
    assert results["node1"].fix == "to silence it, add to /etc/hosts on node1: `::ffff:10.0.0.2 node1`; " \
                                   "`::ffff:10.0.0.1 node0`"
    # With the lines (in any spelling of the address) there is nothing to say; nor where
    # /etc/hosts does not name the nodes at all (DNS answers, or not: not ours to guess).
    mapped = HOSTS + "::ffff:10.0.0.1 node0\n::ffff:a00:2 node1\n"
    dns = "127.0.0.1 localhost\n"
    for text in (mapped, dns):
        seen = observed(node0=facts("node0", etc_hosts=text), node1=facts("node1", etc_hosts=text))
        assert [(result.status, result.fix, "c10d" in result.summary) for result in hostname.analyse(seen)] == [
            ("pass", "", False), ("pass", "", False)]
