"""Every pod behind a name: a Kubernetes headless Service resolves to one address per ready pod (a ClusterIP
would hand each connection to one of them). Used where each router must be reached, not any one: replicas'
state reports (python_backends/trtllm_state.py) and the autoscaler's reading of every router's view
(autoscale/signals.py)."""
from __future__ import annotations

import ipaddress
import socket
import urllib.parse


def every_address(urls: list[str]) -> list[str]:
    """One URL per address of each URL's host (a headless Service name -> every pod behind it); an IP literal or
    a name that does not resolve is kept as it is."""
    out: list[str] = []
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        try:
            ipaddress.ip_address(host)
            addresses = [host]
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, parts.port, type=socket.SOCK_STREAM)
                v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
                addresses = v4 or sorted({i[4][0] for i in infos})
            except OSError:
                addresses = [host]
        for address in addresses:
            netloc = f"[{address}]" if ":" in address else address
            netloc += f":{parts.port}" if parts.port else ""
            expanded = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
            if expanded not in out:
                out.append(expanded)
    return out
