"""The BLAS kernel the PyTorch, libtorch and numpy peers run on, and the environment they run in.

OpenBLAS (Debian's libopenblas0-pthread, a DYNAMIC_ARCH build) picks its kernel family for the CPU when it
loads, unless OPENBLAS_CORETYPE names one. A machine may set OPENBLAS_CORETYPE (and OPENBLAS_L2_SIZE) in
its environment to pin an older family, which is slower: a peer timed that way is not PyTorch at its best.
So every peer command runs with both variables unset in that command alone (`peer_env()` for the
subprocesses sweep.py starts, `env -u ...` in scripts/run.sh), and each peer reports the kernel that ran
(`kernel_text()`), read from OpenBLAS itself (openblas_get_config / openblas_get_corename). Nothing here
changes the variables of the calling process. No torch needed."""

import os
import re

# The variables a peer's command unsets: OPENBLAS_CORETYPE forces a kernel family; OPENBLAS_L2_SIZE an L2
# size (OpenBLAS 0.3.21 does not read it, but a machine that sets one sets both).
FORCING = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def peer_env(env=None):
    """A copy of `env` (default os.environ) without FORCING: the environment of a peer's command."""
    out = dict(os.environ if env is None else env)
    for name in FORCING:
        out.pop(name, None)
    return out


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


def kernel_text(config, threads=None, corename=None, env=None):
    """"OpenBLAS 0.3.21 Cooperlake kernels, 2 threads; OPENBLAS_CORETYPE unset" from a peer's OpenBLAS
    config string, its thread count, the core name OpenBLAS reported (else the config's) and the state of
    FORCING in its environment ({name: value or None}; None: not recorded)."""
    version, core = kernel_from_config(config)
    if version is None:
        text = f"not OpenBLAS ({config})" if config else "unknown BLAS"
    else:
        text = f"OpenBLAS {version} {corename or core} kernels"
    if threads not in (None, ""):
        text += f", {threads} threads"
    if env is not None:
        text += "; " + ", ".join(f"{k}={v}" if v is not None else f"{k} unset" for k, v in env.items())
    return text


def forced_note(env):
    """A warning when FORCING is set in `env` ({name: value or None}), else ""."""
    forced = {k: v for k, v in (env or {}).items() if v is not None}
    if not forced:
        return ""
    return ("note: " + ", ".join(f"{k}={v}" for k, v in forced.items()) + " in this peer's environment: OpenBLAS "
            "may not run the kernel family it picks for this CPU (scripts/run.sh and sweep.py run the peers with "
            + " and ".join(FORCING) + " unset)")
