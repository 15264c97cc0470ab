"""The machine's rooflines (bench_machine): the fp32 FMA peak and the bf16 dot peaks (vdpbf16ps, and AMX's
tile product where the CPU has it) of register-only loops on 1 and n threads (each the rate of its fastest
timed call: a slower call of the same loop is time the VM gave to others), STREAM copy bandwidth, and
the GEMMs of Eigen, c2f and oneDNN on the same projection shape as reference points (% of the FMA peak).
The other report modules divide by `peaks(result)`."""

from .common import entries, table


def peaks(result):
    """{'fp32': {threads: GFLOPS}, 'bf16': {...}, 'amx_bf16': {...}, 'copy': GB/s, 'isa': str, 'threads': n}
    from a bench_machine result; an entry that was skipped (the CPU lacks the ISA) is absent."""
    e = entries(result)
    out = {"fp32": {}, "fp32_tile": {}, "bf16": {}, "amx_bf16": {}, "copy": None, "isa": ""}
    for key, b in e.items():
        if b.get("error_occurred"):
            continue
        if key[0] in ("peak_fp32", "peak_fp32_tile", "peak_bf16", "peak_amx_bf16"):
            out[key[0][5:]][key[1]] = b["GFLOPS"]
            if key[0] == "peak_fp32":
                out["isa"] = b.get("label", "")
        elif key[0] == "copy":
            out["copy"] = b["GB/s"]
    out["threads"] = max(out["fp32"]) if out["fp32"] else None
    return out


def skipped(result):
    """{entry name: the reason} of the entries the CPU or library could not run."""
    return {b["run_name"].split("/process_time")[0]: b.get("error_message", "") for b in result["benchmarks"]
            if b.get("error_occurred")}


def machine_section(result):
    """The rooflines table and the GEMM reference points, as markdown."""
    p, e = peaks(result), entries(result)
    out = ["## The machine's rooflines (bench_machine, same sweep)", ""]
    rows = []
    for kind, what, isa in (("fp32", "fp32 FMA peak (register-only loop)", p["isa"]),
                            ("fp32_tile", "fp32 FMA peak with a GEMM's loads (c2f's micro-kernel, operands in L1)", p["isa"]),
                            ("bf16", "bf16 dot peak (vdpbf16ps loop)", "avx512bf16"),
                            ("amx_bf16", "bf16 tile peak (AMX tdpbf16ps loop)", "amx-bf16")):
        for threads, gflops in sorted(p[kind].items()):
            rows.append([what, threads, f"{gflops:.1f} GFLOP/s", isa])
    if p["copy"]:
        rows.append(["STREAM copy (2 × 256 MiB)", p["threads"], f"{p['copy']:.1f} GB/s", ""])
    for name, reason in sorted(skipped(result).items()):
        rows.append([name, "—", "not measured", reason])
    out.append(table(["roofline", "threads", "measured", "ISA / note"], rows))
    out += ["", "The peaks are the rate of each loop's fastest timed call (its mean over every call is in "
                "bench_machine.json, counter GFLOPS_mean)."]
    gemm_rows = []
    for key, b in sorted(e.items()):
        if not key[0].startswith("gemm_") or b.get("error_occurred"):
            continue
        threads = key[2]
        kind = "fp32"
        if key[0].endswith("_bf16"):  # a library on AMX against the tile peak, on vdpbf16ps against the dot peak
            kind = "amx_bf16" if "amx" in b.get("label", "") and p["amx_bf16"] else "bf16"
        peak = p[kind].get(threads)
        share = f"{100 * b['GFLOPS'] / peak:.0f} %" if peak else "—"
        gemm_rows.append([key[0][5:], key[1], threads, f"{b['GFLOPS']:.1f}", share, b.get("label", "")])
    if gemm_rows:
        out += ["", "GEMM reference points: [L, 512] × [512, 512]ᵀ (a projection), output checked against a "
                    "double product first; % of the FMA peak of the same thread count and precision.", "",
                table(["GEMM", "L", "threads", "GFLOP/s", "% of FMA peak", "library"], gemm_rows)]
    return "\n".join(out)
