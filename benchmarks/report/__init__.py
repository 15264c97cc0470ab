"""The benchmark sweep's report: markdown tables, target checks and PNG plots built from Google Benchmark
JSON (benchmarks/sweep.py runs the binaries and writes the files).

    common      entries, ms, us, fmt_bytes, slope, table, targets_table: shared by every part
    attention   bench_attention (+ bench_libtorch, the one-thread run, torch_peer.py's JSON): summarize()
    runtime     bench_runtime*: runtime_section()
    c2f2d       bench_c2f2d: c2f2d_section()
    decode      bench_decode: decode_section()
    plots       the PNG plots of the attention and decode parts (matplotlib, when installed)
    blas        the OpenBLAS kernel and the allocator a torch / libtorch / numpy peer ran, and the environment
                its command runs in (OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, jemalloc preloaded); the
                environment of the c2f binaries a peer script starts (c2f_env)
"""
