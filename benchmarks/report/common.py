"""Helpers shared by the report modules: Google Benchmark JSON entries, time units, byte sizes, log-log
slopes and markdown tables."""

import math


def entries(result):
    """{(name, L, extra): entry} of a Google Benchmark JSON result: the median of repeated runs, or the
    single run."""
    out = {}
    for b in result["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        if b.get("run_type") != "aggregate" and b.get("repetitions", 1) > 1:
            continue
        parts = b["run_name"].split("/")
        args = tuple(int(p) for p in parts[1:] if p.isdigit())
        out[(parts[0],) + args] = b
    return out


def ms(b):
    """Real time of an entry in milliseconds (entries timed in ms only)."""
    assert b["time_unit"] == "ms"
    return b["real_time"]


def us(b):
    """Real time of an entry in microseconds."""
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b["time_unit"]]
    return b["real_time"] * scale


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0


def slope(xs, ys):
    """Least-squares slope of log(ys) against log(xs)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def targets_table(checks):
    """The targets table of (target, measured, met) checks; met None = no target ("—")."""
    return table(["target", "measured", "met"],
                 [[c, m, "—" if ok is None else ("yes" if ok else "**no**")] for c, m, ok in checks])
