#!/usr/bin/env python3
"""Checks a benchmark binary's CSV output (benchmarks/csv_reporter.hpp): runs it with
--benchmark_format=csv on entries that carry different counters, and with --benchmark_out_format=csv
into a file, and fails unless both exit 0 and give one header, Google Benchmark's columns first, and
every entry as a row of the header's width, with the union of the counters as columns (a counter an
entry lacks is an empty cell).

    check_csv.py BINARY FILTER [EXTRA ARGS...]
"""
import csv
import io
import os
import subprocess
import sys
import tempfile

FIXED = ["name", "iterations", "real_time", "cpu_time", "time_unit", "bytes_per_second", "items_per_second",
         "label", "error_occurred", "error_message"]


def check(text, where):
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if r[:len(FIXED)] == FIXED), None)
    if start is None:
        sys.exit(f"check_csv: {where}: no CSV header starting with {','.join(FIXED)}")
    header, entries = rows[start], rows[start + 1:]
    if len(entries) < 2:
        sys.exit(f"check_csv: {where}: {len(entries)} entries, expected at least 2")
    for row in entries:
        if len(row) != len(header):
            sys.exit(f"check_csv: {where}: entry {row[0]} has {len(row)} fields, the header {len(header)}")
    counters = header[len(FIXED):]
    present = [frozenset(c for c, v in zip(counters, row[len(FIXED):]) if v != "") for row in entries]
    if len(set(present)) < 2:
        sys.exit(f"check_csv: {where}: every entry has the same counters; the filter must mix entries with "
                 "different ones")
    print(f"check_csv: {where}: {len(entries)} entries, {len(counters)} counter columns "
          f"({', '.join(counters)}), OK")


def csv_of(command, where):
    """Runs command; its exit status must be 0."""
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"check_csv: {command[0]} {where} exited with {run.returncode}: {run.stderr.strip()[-400:]}")
    return run.stdout


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    binary, flt, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    base = [binary, f"--benchmark_filter={flt}"] + extra
    screen = "--benchmark_format=csv"
    check(csv_of(base + [screen], screen), screen)
    with tempfile.TemporaryDirectory() as tmp:
        out, file = os.path.join(tmp, "out.csv"), "--benchmark_out_format=csv"
        csv_of(base + [f"--benchmark_out={out}", file], file)
        with open(out) as f:
            check(f.read(), file)
    print("check_csv: OK")


if __name__ == "__main__":
    main()
