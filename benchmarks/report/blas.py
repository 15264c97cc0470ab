"""The BLAS kernel and the memory allocator the PyTorch, libtorch and numpy peers run on, and the environment
they run in.

OpenBLAS (Debian's libopenblas0-pthread, a DYNAMIC_ARCH build) picks its kernel family for the CPU when it
loads, unless OPENBLAS_CORETYPE names one. A machine may set OPENBLAS_CORETYPE (and OPENBLAS_L2_SIZE) in
its environment to pin an older family, which is slower: a peer timed that way is not PyTorch at its best.
So every peer command runs with both variables unset in that command alone (`peer_env()` for the
subprocesses sweep.py starts, `env -u ...` in scripts/run.sh), and each peer reports the kernel that ran
(`kernel_text()`), read from OpenBLAS itself (openblas_get_config / openblas_get_corename). Nothing here
changes the variables of the calling process. No torch needed.

The allocator: PyTorch allocates its intermediate tensors anew on every call (nn.MultiheadAttention's [8, L, L]
scores: 128 MiB at L = 2048). glibc's malloc serves blocks above its mmap threshold (32 MiB at most) with a
fresh mmap and unmaps them on free, so every call faults each 4 KiB page of them in again: at L = 2048 on a
2-vCPU Zen 5 VM, ~450 of nn.MultiheadAttention's ~530 ms were that (system time). Intel's and PyTorch's CPU
performance guides tell users to run PyTorch with jemalloc or tcmalloc for this reason, so the peers run with
PEER_ALLOCATOR preloaded (LD_PRELOAD, and its settings) in their own command: `peer_env()` for the
subprocesses sweep.py starts, `env_args()` (`blas.py --env-args`) for scripts/run.sh. When the library is
missing, the peer runs on glibc's malloc and a note says so. c2f's binaries, tests and CI never get it: a peer
script that starts a c2f binary (bench_attention's peer mode, bench_train) gives it `c2f_env()`, the
environment as it was before `peer_env()`. Each peer reports the allocator it ran with (`allocator_here()` in
a Python peer; `probe_allocator()` runs that in a process started with a C++ peer's environment), next to
the BLAS kernel (`kernel_text(..., allocator=)`)."""

import json
import os
import re
import subprocess
import sys
import sysconfig

# The variables a peer's command unsets: OPENBLAS_CORETYPE forces a kernel family; OPENBLAS_L2_SIZE an L2
# size (OpenBLAS 0.3.21 does not read it, but a machine that sets one sets both).
FORCING = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


# The allocators a peer can be preloaded with: the Debian package that ships the library, the library's file
# name, and the variables set with it. Measured on 2026-12-07 (2-vCPU AMD EPYC Zen 5, Debian bookworm; PyTorch
# nn.MultiheadAttention at L = 1024 / 2048 / 4096, libtorch's at the same L, the article's C2F module at 4096;
# benchmarks/README.md, "The PyTorch peers: OpenBLAS and the allocator"): jemalloc 5.3 helps only when it
# never purges (dirty_decay_ms:-1, muzzy_decay_ms:-1; any finite decay, even 10 minutes, still returned the
# freed scores to the kernel between calls here) and with its dedicated arena for blocks above 8 MiB turned
# off (oversize_threshold:0: that arena purges at once whatever the decay). PyTorch's guide's
# MALLOC_CONF (oversize_threshold:1, ...) routes every block to that arena and kept most of the faults.
ALLOCATORS = {
    "jemalloc": {"package": "libjemalloc2", "library": "libjemalloc.so.2",
                 "env": {"MALLOC_CONF": "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1"}},
    "tcmalloc": {"package": "libtcmalloc-minimal4", "library": "libtcmalloc_minimal.so.4", "env": {}},
}
PEER_ALLOCATOR = "jemalloc"
# Set by peer_env(): {variable: value before, or None} of every variable it changed (c2f_env() restores them).
RESTORE = "C2F_PEER_ENV_RESTORE"
_noted = set()


def allocator_library(name=PEER_ALLOCATOR):
    """The path of allocator `name`'s library (Debian's multiarch folder first), or None when it is missing."""
    lib = ALLOCATORS[name]["library"]
    folders = [f"/usr/lib/{sysconfig.get_config_var('MULTIARCH') or ''}", "/usr/lib64", "/usr/lib", "/lib"]
    return next((os.path.join(d, lib) for d in folders if os.path.isfile(os.path.join(d, lib))), None)


def missing_note(name=PEER_ALLOCATOR):
    """The note printed when allocator `name` is missing ("" when it is there)."""
    if allocator_library(name):
        return ""
    return (f"note: {ALLOCATORS[name]['library']} not found (Debian: {ALLOCATORS[name]['package']}; "
            f"scripts/install-deps.sh installs it): the PyTorch, libtorch and numpy peers run on glibc's malloc, "
            f"which maps and page-faults their large buffers again on every call (not PyTorch at its best)")


def peer_changes(env=None, allocator=True):
    """{variable: new value, or None to unset}: what a peer's command changes in `env` (default os.environ):
    FORCING unset; with `allocator`, PEER_ALLOCATOR's library put first in LD_PRELOAD and its variables set
    (when the library is there; else a note on stderr, once per process); RESTORE records the values before."""
    env = os.environ if env is None else env
    if RESTORE in env:  # already a peer's environment
        return {}
    changes = {name: None for name in FORCING}
    lib = allocator_library() if allocator else None
    if allocator and lib is None and PEER_ALLOCATOR not in _noted:
        _noted.add(PEER_ALLOCATOR)
        print(missing_note(), file=sys.stderr, flush=True)
    if lib:
        preload = [p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p and p != lib]
        changes["LD_PRELOAD"] = ":".join([lib] + preload)
        changes.update(ALLOCATORS[PEER_ALLOCATOR]["env"])
    if changes:
        changes[RESTORE] = json.dumps({name: env.get(name) for name in changes})
    return changes


def peer_env(env=None, allocator=True):
    """A copy of `env` (default os.environ) as a peer's command runs it: without FORCING and, with
    `allocator`, PEER_ALLOCATOR preloaded (peer_changes)."""
    out = dict(os.environ if env is None else env)
    for name, value in peer_changes(out, allocator).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def c2f_env(env=None):
    """A copy of `env` (default os.environ) with what peer_env() changed put back: the environment for a c2f
    binary a peer script starts (c2f runs on the environment as it is, never with the peers' allocator)."""
    out = dict(os.environ if env is None else env)
    for name, value in json.loads(out.pop(RESTORE, "{}")).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def env_args(allocator=True):
    """The arguments of `env` that start a peer's command (scripts/run.sh: `env ARGS... python3 peer.py`)."""
    args = []
    for name, value in peer_changes(None, allocator).items():
        args += ["-u", name] if value is None else [f"{name}={value}"]
    return args


def env_state(env=None):
    """{variable: value or None} of FORCING in `env` (default os.environ): stored in each peer's JSON."""
    env = os.environ if env is None else env
    return {name: env.get(name) for name in FORCING}


def kernel_from_config(config):
    """("0.3.21", "Cooperlake") from openblas_get_config()'s "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH
    NO_AFFINITY Cooperlake MAX_THREADS=64" (the core name is the word before MAX_THREADS); (None, None) when
    the string is not OpenBLAS's."""
    m = re.match(r"OpenBLAS\s+(\S+)\s+(.*?)\s*(?:MAX_THREADS=\d+.*)?$", config or "")
    if not m:
        return None, None
    words = m.group(2).split()
    return m.group(1), (words[-1] if words else None)


def kernel_text(config, threads=None, corename=None, env=None, allocator=None):
    """"OpenBLAS 0.3.21 Cooperlake kernels, 2 threads; OPENBLAS_CORETYPE unset; allocator jemalloc 5.3.0 (...)"
    from a peer's OpenBLAS config string, its thread count, the core name OpenBLAS reported (else the
    config's), the state of FORCING in its environment ({name: value or None}; None: not recorded) and the
    allocator it ran with (allocator_here()'s dict; None: not recorded)."""
    version, core = kernel_from_config(config)
    if version is None:
        text = f"not OpenBLAS ({config})" if config else "unknown BLAS"
    else:
        text = f"OpenBLAS {version} {corename or core} kernels"
    if threads not in (None, ""):
        text += f", {threads} threads"
    if env is not None:
        text += "; " + ", ".join(f"{k}={v}" if v is not None else f"{k} unset" for k, v in env.items())
    if allocator:
        text += "; allocator " + allocator_text(allocator)
    return text


def forced_note(env):
    """A warning when FORCING is set in `env` ({name: value or None}), else ""."""
    forced = {k: v for k, v in (env or {}).items() if v is not None}
    if not forced:
        return ""
    return ("note: " + ", ".join(f"{k}={v}" for k, v in forced.items()) + " in this peer's environment: OpenBLAS "
            "may not run the kernel family it picks for this CPU (scripts/run.sh and sweep.py run the peers with "
            + " and ".join(FORCING) + " unset)")


# ---------------------------------------------------------------------------------------------------------
# The allocator a process runs with.

def allocator_here():
    """The allocator this process's malloc is: {"name", "version", "library", "settings"} — jemalloc or
    tcmalloc when its library is mapped (LD_PRELOAD; the version read from the library itself), else glibc's
    malloc (with GLIBC_TUNABLES when set)."""
    import ctypes
    with open("/proc/self/maps") as f:
        mapped = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    for path in sorted(mapped):
        base = os.path.basename(path)
        if base.startswith("libjemalloc"):
            lib = ctypes.CDLL(path)
            version = ctypes.c_char_p()
            size = ctypes.c_size_t(ctypes.sizeof(version))
            ok = lib.mallctl(b"version", ctypes.byref(version), ctypes.byref(size), None, ctypes.c_size_t(0)) == 0
            v = version.value.decode() if ok and version.value else "?"
            return {"name": "jemalloc", "version": v.split("-")[0], "library": path,
                    "settings": {k: os.environ[k] for k in ("MALLOC_CONF",) if k in os.environ}}
        if base.startswith("libtcmalloc"):
            lib = ctypes.CDLL(path)
            lib.tc_version.restype = ctypes.c_char_p
            v = (lib.tc_version(None, None, None) or b"?").decode()  # "gperftools 2.10"
            return {"name": "tcmalloc", "version": v.split()[-1], "library": path,
                    "settings": {k: v for k, v in os.environ.items() if k.startswith("TCMALLOC_")}}
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    return {"name": "glibc", "version": libc.gnu_get_libc_version().decode(), "library": "libc.so.6",
            "settings": {k: os.environ[k] for k in ("GLIBC_TUNABLES",) if os.environ.get(k)}}


def probe_allocator(env):
    """allocator_here() of a process started with `env` (a C++ peer's environment: what bench_libtorch runs
    with), or {"name": "unknown", ...} when the probe fails."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--allocator"], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        return {"name": "unknown", "version": "", "library": "", "settings": {}, "error": r.stderr.strip()}
    return json.loads(r.stdout)


def allocator_text(a):
    """"jemalloc 5.3.0 (MALLOC_CONF=...)", "glibc 2.36 malloc (default)" from allocator_here()'s dict."""
    settings = ", ".join(f"{k}={v}" for k, v in (a.get("settings") or {}).items())
    if a.get("name") == "glibc":
        return f"glibc {a.get('version', '')} malloc ({settings or 'default'})"
    return f"{a.get('name')} {a.get('version', '')}" + (f" ({settings})" if settings else "")


def allocator_note(a):
    """A warning when a peer ran without PEER_ALLOCATOR (`a`: allocator_here()'s dict), else ""."""
    if not a or a.get("name") == PEER_ALLOCATOR:
        return ""
    return (f"note: this peer ran with {allocator_text(a)}, not {PEER_ALLOCATOR} (scripts/run.sh and sweep.py "
            f"preload it; {ALLOCATORS[PEER_ALLOCATOR]['package']}): its large buffers may be mapped and faulted "
            f"in again on every call")


if __name__ == "__main__":
    # blas.py --env-args: the `env` arguments of a peer's command, one a line (scripts/run.sh);
    # blas.py --allocator: this process's allocator as JSON (probe_allocator).
    if sys.argv[1:] == ["--env-args"]:
        print("\n".join(env_args()))
    elif sys.argv[1:] == ["--allocator"]:
        print(json.dumps(allocator_here()))
    else:
        sys.exit("usage: blas.py --env-args | --allocator")
