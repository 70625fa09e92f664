#!/usr/bin/python3
"""A hostile peer of a tetra job's monitor (Note [Monitor handshake]), for
MultiHost.AHostilePeerNeitherEndsNorDisturbsTheJob: from another host, or the same one,
it connects to rank 0's monitor port and tries what a user or a port scanner on a shared
cluster could:

  hello        a hello claiming rank 1 (no proof), then a close: before the handshake,
               this ended the whole job ("rank 1 died")
  forged-fail  a failure report claiming to be rank 1, with a made-up proof
  long-line    100 MB without a newline
  crowd        500 connections at once, held open, then dropped
  random       random bytes, on 20 connections
  replay       a hello carrying the proof of another connection's challenge

and last, that the monitor still answers (a fresh connection gets its challenge).

  hostile_peer.py HOST PORT [--wait S]

Waits up to S seconds (default 60) for the port to accept, runs every attack, prints one
line per attack with what the monitor did, and exits 0 when every attack ran and the
monitor answered at the end; 1 otherwise. Standard library only.
"""
import json
import os
import socket
import sys
import time


def connect(host, port, timeout=5.0):
    s = socket.create_connection((host, port), timeout=timeout)
    s.settimeout(timeout)
    return s


def first_line(s):
    buf = b""
    while b"\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            return None
        buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace")


def closed_by_peer(s, timeout=8.0):
    """True when the monitor closes the connection within `timeout`."""
    s.settimeout(timeout)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def send_all(s, data):
    try:
        s.sendall(data)
        return True
    except (ConnectionResetError, BrokenPipeError):
        return False


def attack_hello(host, port):
    s = connect(host, port)
    challenge = first_line(s)
    send_all(s, b'{"t":"hello","rank":1,"where":"attacker"}\n')
    closed = closed_by_peer(s, timeout=2.0)  # then it closes, as the attack did
    s.close()
    return "challenge %s; hello without proof: %s" % (
        "received" if challenge and '"challenge"' in challenge else "missing",
        "closed by the monitor" if closed else "left open")


def attack_forged_fail(host, port):
    s = connect(host, port)
    first_line(s)
    send_all(s, b'{"t":"fail","message":"forged"}\n{"t":"hello","rank":1,"where":"x","nonce":"'
             + b"0" * 32 + b'","mac":"' + b"0" * 64 + b'"}\n{"t":"fail","message":"forged"}\n')
    closed = closed_by_peer(s)
    s.close()
    return "forged failure report: " + ("closed by the monitor" if closed else "left open")


def attack_long_line(host, port):
    s = connect(host, port)
    first_line(s)
    chunk = b"x" * (1 << 20)
    sent = 0
    for _ in range(100):
        if not send_all(s, chunk):
            break
        sent += len(chunk)
    s.close()
    return "100 MB without a newline: the monitor took %d MB before it closed" % (sent >> 20)


def attack_crowd(host, port):
    socks, refused = [], 0
    for _ in range(500):
        try:
            socks.append(connect(host, port, timeout=5.0))
        except OSError:
            refused += 1
    time.sleep(1.0)
    closed = 0
    for s in socks:
        s.settimeout(0.0)
        try:
            if s.recv(4096, socket.MSG_PEEK) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    for s in socks:
        s.close()
    return "500 connections at once: %d opened, %d closed by the monitor within 1 s, %d refused by the kernel" % (
        len(socks), closed, refused)


def attack_random(host, port):
    closed = 0
    for _ in range(20):
        s = connect(host, port)
        send_all(s, os.urandom(3000) + b"\n" + os.urandom(5000))
        closed += closed_by_peer(s)
        s.close()
    return "random bytes on 20 connections: %d closed by the monitor" % closed


def attack_replay(host, port):
    a = connect(host, port)
    b = connect(host, port)
    ca, cb = first_line(a), first_line(b)
    nonce = json.loads(ca)["nonce"] if ca else ""
    # A proof can only be made with the key; this one answers a's challenge on b's connection.
    send_all(b, json.dumps({"t": "hello", "rank": 1, "where": "x", "nonce": nonce, "mac": "ab" * 32}).encode() + b"\n")
    closed = closed_by_peer(b)
    a.close()
    b.close()
    return "a hello answering another connection's challenge: " + ("closed by the monitor" if closed else "left open")


def main():
    host, port = sys.argv[1], int(sys.argv[2])
    wait = float(sys.argv[sys.argv.index("--wait") + 1]) if "--wait" in sys.argv else 60.0
    deadline = time.time() + wait
    while True:
        try:
            connect(host, port, timeout=1.0).close()
            break
        except OSError:
            if time.time() > deadline:
                print("hostile_peer: %s:%d never accepted" % (host, port))
                return 1
            time.sleep(0.1)
    ok = True
    for attack in (attack_hello, attack_forged_fail, attack_long_line, attack_crowd, attack_random, attack_replay):
        try:
            print("hostile_peer: %s" % attack(host, port), flush=True)
        except Exception as e:  # noqa: BLE001 - what happened is the report
            print("hostile_peer: %s failed: %r" % (attack.__name__, e), flush=True)
            ok = False
    try:
        s = connect(host, port)
        alive = '"challenge"' in (first_line(s) or "")
        s.close()
    except OSError:
        alive = False
    print("hostile_peer: the monitor %s" % ("still answers" if alive else "no longer answers"), flush=True)
    return 0 if ok and alive else 1


if __name__ == "__main__":
    sys.exit(main())
