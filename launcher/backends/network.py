"""How the nodes of a run reach each other: the address this host's name resolves to, the socket interfaces that
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name, and whether this node hosts the rendezvous endpoint and its port is
free. Findings for the doctor (`python -m launcher.doctor`) and warnings for a multi-node local launch.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from dataclasses import dataclass

from launcher.schema import Config

NODE_ADDR_ENV = "LAUNCHER_NODE_ADDR"  # a node's IP, set by a cluster engine's node agent (launcher/backends/ray_job.py)


@dataclass
class Finding:
    problem: bool  # False: a note (what was checked and holds, or what to know)
    text: str

    def __str__(self) -> str:
        return f"  {'problem' if self.problem else 'ok     '}  {self.text}"


def interfaces() -> dict[str, str]:
    """This machine's network interfaces and their IPv4 addresses (`ip -o -4 addr`; names only without `ip`)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {name: "" for _, name in socket.if_nameindex()}
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            found[parts[1]] = parts[3].split("/")[0]
    return found


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_network(cfg: Config, host: str | None = None) -> list[Finding]:
    """How the other nodes will reach this one: the host name's address and the socket interfaces."""
    if cfg.trainer.nodes < 2:
        return []
    host = host or socket.gethostname()
    found = interfaces()
    external = {name: address for name, address in found.items() if address and not _is_loopback(address)}
    suggestion = next(iter(external.items()), None)
    fix = (f"GLOO_SOCKET_IFNAME={suggestion[0]} NCCL_SOCKET_IFNAME={suggestion[0]} (its address: {suggestion[1]})"
           if suggestion else "GLOO_SOCKET_IFNAME=<the interface of the network between the nodes>")
    findings = []
    try:
        address = socket.gethostbyname(host)
    except OSError as error:
        address = ""
        findings.append(Finding(True, f"the host name {host!r} does not resolve ({error}): the other nodes cannot "
                                      f"reach this one by it; set {fix}, or fix the name service"))
    ifnames = {key: os.environ[key] for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if os.environ.get(key)}
    for key, value in ifnames.items():
        missing = [name for name in value.lstrip("^=").split(",") if name and name not in found]
        if missing:
            findings.append(Finding(True, f"{key}={value}: no interface {', '.join(missing)} here (there are: "
                                          f"{', '.join(found) or 'none'}); set it to one of them"))
    if address and _is_loopback(address):
        if "GLOO_SOCKET_IFNAME" in ifnames and not findings:
            findings.append(Finding(False, f"the host name {host!r} resolves to {address} (loopback), but "
                                           f"GLOO_SOCKET_IFNAME={ifnames['GLOO_SOCKET_IFNAME']} picks the interface"))
        else:
            findings.append(Finding(True, f"the host name {host!r} resolves to {address}, a loopback address: gloo "
                                          f"(and NCCL's bootstrap) would offer it to the other nodes, which then "
                                          f"connect to themselves and hang; set {fix}, or map the name to the node's "
                                          f"address in /etc/hosts"))
    elif address:
        findings.append(Finding(False, f"the host name {host!r} resolves to {address}"))
    return findings


def resolution_error(host: str) -> str | None:
    """Why `host` does not resolve here (the resolver's words), or None if it does (an IP address always does)."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as error:
        return error.strerror or str(error)
    return None


def hosts_rendezvous(host: str) -> bool:
    """Whether this node is the one the endpoint names, so its launcher will listen there. By name: on a machine
    that runs several nodes (tests, containers), the other nodes' launchers connect to that port, they do not
    listen on it, so a taken port is expected there."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback or bindable(host)
    except ValueError:  # a name: another machine's (a scheduler that knows which node is first says so instead:
        return False    # launcher/backends/lighthouse.py meeting_place's `first`)


def bindable(address: str) -> bool:
    try:
        with socket.socket() as probe:
            probe.bind((address, 0))  # only addresses of this machine can be bound
        return True
    except OSError:
        return False


def port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store binds
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def hold_free_port(address: str = "") -> socket.socket:
    """A free port, kept bound until the socket is closed: the server that will listen there (a TCPStore, a
    Lighthouse) binds it with SO_REUSEADDR, as this socket is, and binds it still; no other process can take it in
    between, neither by binding it nor as the local port of an outgoing connection (the kernel skips bound ports)."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind((address, 0))
    return held
