#!/usr/bin/env python3
"""Latency figures from pgbench per-transaction logs (--log).

    stats.py [--from T0] [--to T1] LOGFILE...

Each log line is "client tx latency_us script epoch_s epoch_us" (pgbench 15,
no --rate); a transaction ends at epoch_s.epoch_us and started latency
earlier. With --from/--to (Unix seconds) only the transactions that
overlap [T0, T1] count. Prints n, p50, p99, p99.9 and max in ms.
"""
import sys


def main(argv):
    lo, hi, files = float("-inf"), float("inf"), []
    it = iter(argv)
    for a in it:
        if a == "--from":
            lo = float(next(it))
        elif a == "--to":
            hi = float(next(it))
        else:
            files.append(a)
    lat = []
    for f in files:
        with open(f) as fh:
            for line in fh:
                p = line.split()
                if len(p) < 6:
                    continue
                us = int(p[2])
                end = int(p[4]) + int(p[5]) / 1e6
                start = end - us / 1e6
                if start < hi and end > lo:
                    lat.append(us / 1000)
    lat.sort()
    if not lat:
        print("n=0")
        return

    def q(x):
        return lat[min(len(lat) - 1, int(x * len(lat)))]

    print(f"n={len(lat)} p50={q(0.50):.2f} p99={q(0.99):.2f} p999={q(0.999):.2f} max={lat[-1]:.2f}")


main(sys.argv[1:])
