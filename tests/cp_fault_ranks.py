"""Rank functions for ``test_cp_faults.py``, importable by spawned ranks of a child interpreter
(a function defined in ``python -c`` code cannot be pickled by reference)."""

from __future__ import annotations

import ipaddress
import os
import signal
import time

import torch

from kvstrata.dist.group import Group


def stop_self_then_reduce(group: Group, stopped: int) -> None:
    if group.rank == stopped:
        os.kill(os.getpid(), signal.SIGSTOP)
    group.all_reduce(torch.zeros(1), "sum", "test")  # the stopped rank never joins


def sleep_forever(group: Group) -> None:
    while True:
        time.sleep(1)


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # 4 host-order words
    return str(ipaddress.IPv6Address(words))


def listening_addresses() -> list[str]:
    """The local address of every TCP socket this process listens on (/proc/net/tcp{,6})."""
    mine = _socket_inodes()
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in mine:  # LISTEN
                out.append(_address(local.split(":")[0]))
    return out
