"""faults/linkrelay.py's checksum repair: a frame whose TCP or UDP checksum the sender's kernel left to the
hardware (only the pseudo-header's sum, or anything) leaves the wire with the checksum RFC 793/768 define."""

from __future__ import annotations

import struct

from durable_rollouts.faults.linkrelay import fix_checksum


def _reference(pseudo: bytes, segment: bytes) -> int:
    """The checksum computed plainly, in network order (RFC 1071)."""
    data = pseudo + segment + (b"\0" if len(segment) % 2 else b"")
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _frame(proto: int, payload: bytes, garbage: int = 0x1234) -> tuple[bytes, bytes, int]:
    src, dst = bytes([10, 77, 0, 5]), bytes([10, 77, 0, 2])
    if proto == 6:  # TCP header, checksum at offset 16
        l4 = struct.pack("!HHIIBBHHH", 40000, 7233, 1, 0, 5 << 4, 0x18, 65535, garbage, 0) + payload
        at = 16
    else:  # UDP header, checksum at offset 6
        l4 = struct.pack("!HHHH", 40000, 53, 8 + len(payload), garbage) + payload
        at = 6
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0x4000, 64, proto, 0, src, dst)
    eth = b"\x02" * 6 + b"\x04" * 6 + b"\x08\x00"
    pseudo = src + dst + struct.pack("!BBH", 0, proto, len(l4))
    clean = bytearray(l4)
    clean[at : at + 2] = b"\0\0"
    return eth + ip + l4, pseudo + bytes(clean), 14 + 20 + at


def test_a_tcp_checksum_left_partial_is_computed_in_full() -> None:
    for payload in (b"", b"hello", b"x" * 1001):  # odd and even lengths
        frame, summed, at = _frame(6, payload)
        fixed = fix_checksum(frame)
        want = _reference(summed[:12], summed[12:])
        assert struct.unpack("!H", fixed[at : at + 2])[0] == want
        assert fixed[:at] == frame[:at] and fixed[at + 2 :] == frame[at + 2 :]


def test_a_udp_checksum_is_computed_and_non_ip_frames_pass_unchanged() -> None:
    frame, summed, at = _frame(17, b"query")
    assert struct.unpack("!H", fix_checksum(frame)[at : at + 2])[0] == _reference(summed[:12], summed[12:])
    arp = b"\xff" * 6 + b"\x04" * 6 + b"\x08\x06" + b"\0" * 28
    assert fix_checksum(arp) == arp
    icmp = bytearray(_frame(6, b"ping")[0])
    icmp[23] = 1  # protocol ICMP: its checksum is the sender's own, never offloaded
    assert fix_checksum(bytes(icmp)) == bytes(icmp)
