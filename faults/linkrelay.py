"""A delaying, lossy wire between two interfaces, in user space: for kernels built without ``sch_netem``.

``python -m durable_rollouts.faults.linkrelay A B --delay-ms D [--jitter-ms J] [--loss-pct L]`` forwards
every Ethernet frame arriving on interface A out of interface B and back, each after D ms (plus a uniform
0..J ms, never reordering a direction), dropping L % of them. faults/netns.py splices it between a host's
link and the bridge (both interfaces in the switch namespace) when ``tc qdisc ... netem`` is unavailable.

Invariants: frames leave in the order they came, per direction; frames this process sent are never read
back (PACKET_OUTGOING); IPv4 TCP and UDP checksums are recomputed, because a veth hands over frames whose
checksum the sender's kernel left to the hardware (CHECKSUM_PARTIAL), and a re-sent copy has none. The
hosts' links carry one segment per frame (``gso_max_segs 1``, set by faults/netns.py), so every frame fits
the MTU.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import struct
import sys
import time
from array import array

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def _sum16(data: bytes) -> int:
    """The ones' complement sum of ``data`` in native 16-bit words (RFC 1071: order-independent)."""
    if len(data) % 2:
        data += b"\0"
    total = sum(array("H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def fix_checksum(frame: bytes) -> bytes:
    """``frame`` with its IPv4 TCP or UDP checksum computed in full (other frames unchanged)."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00":
        return frame
    ihl = (frame[14] & 0x0F) * 4
    proto = frame[23]
    total_len = struct.unpack("!H", frame[16:18])[0]
    start, end = 14 + ihl, 14 + total_len
    if proto not in (6, 17) or end > len(frame) or struct.unpack("!H", frame[20:22])[0] & 0x3FFF:
        return frame  # not TCP/UDP, or a fragment
    offset = start + (16 if proto == 6 else 6)
    if offset + 2 > end:
        return frame
    segment = bytearray(frame[start:end])
    segment[offset - start : offset - start + 2] = b"\0\0"
    pseudo = frame[26:34] + struct.pack("!BBH", 0, proto, end - start)
    value = ~_sum16(pseudo + bytes(segment)) & 0xFFFF
    if proto == 17 and value == 0:
        value = 0xFFFF
    return frame[:offset] + struct.pack("=H", value) + frame[offset + 2 :]


def relay(a: str, b: str, delay_s: float, jitter_s: float, loss: float, seed: int | None = None) -> None:
    """Forward frames between interfaces ``a`` and ``b`` until SIGTERM (module docstring)."""
    rng = random.Random(seed)
    socks = {}
    for name in (a, b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((name, 0))
        s.setblocking(False)
        socks[name] = s
    peer = {socks[a]: socks[b], socks[b]: socks[a]}
    queue: list[tuple[float, int, socket.socket, bytes]] = []
    last_due = {socks[a]: 0.0, socks[b]: 0.0}
    seq = 0
    running = True

    def stop(signum: int, frame: object) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"linkrelay {a} <-> {b}: delay {delay_s * 1000:g} ms, loss {loss * 100:g} %", flush=True)
    while running:
        now = time.monotonic()
        wait = max(0.0, queue[0][0] - now) if queue else 0.5
        try:
            readable, _, _ = select.select(list(peer), [], [], wait)
        except InterruptedError:
            continue
        now = time.monotonic()
        for src in readable:
            for _ in range(256):
                try:
                    frame, addr = src.recvfrom(65535)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING or (loss and rng.random() < loss):
                    continue
                due = max(now + delay_s + rng.uniform(0, jitter_s), last_due[src])
                last_due[src] = due
                seq += 1
                heapq.heappush(queue, (due, seq, peer[src], fix_checksum(frame)))
        while queue and queue[0][0] <= time.monotonic():
            _, _, dst, frame = heapq.heappop(queue)
            try:
                dst.send(frame)
            except OSError as e:  # a frame the link refuses (too long): dropped, as a wire would
                print(f"linkrelay: dropped a frame of {len(frame)} bytes: {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m durable_rollouts.faults.linkrelay", description=__doc__)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss-pct", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    relay(args.a, args.b, args.delay_ms / 1000, args.jitter_ms / 1000, args.loss_pct / 100, args.seed)


if __name__ == "__main__":
    main()
