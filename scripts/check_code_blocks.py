#!/usr/bin/env python3
"""Compiles the C++ code blocks of the documentation, so that the examples cannot drift from the API.

    python3 scripts/check_code_blocks.py [--cxx COMPILER] [-I DIR] [--isystem DIR] [--mpi-include DIR]
                                         [--no-mpi] [--workdir DIR] [FILE ...]

Which blocks (ctest docs.code_blocks; CONTRIBUTING.md, "Testing"):
  - a ```cpp / ```c++ fence of README.md or docs/*.md (or of the FILEs given) that contains `int main`:
    a whole program, compiled as it is;
  - a fence right after the line `<!-- compile: fragment -->`: a fragment, compiled as the body of a
    function `void fragment()`. `<!-- compile: fragment(const c2f::Tensor3<float>& x, int steps) -->`
    gives that function parameters: the names the fragment uses but leaves to the prose;
  - a fence right after `<!-- compile: program -->`: compiled as it is, even without `int main`;
  - in a header under include/ (or a .hpp FILE), the `//   `-indented comment lines right after a
    comment line `// compile: fragment(...)` (or `// compile: program`), without their `//   `;
  - `<!-- compile: no (reason) -->` leaves out a block that has `int main`.
A block's `#include` lines are its includes; a fragment without any gets <c2f/c2f.hpp>. Any other
```cpp block is listed as not compiled. A marker that is not right before a block is an error.

How: every block goes into one translation unit (a second one for the blocks that include c2f/dist.hpp:
MPI's include directories), each block inside its own `namespace c2f_block_<unit>_<n>` (an `int main`
there is an ordinary function, whose missing `return` is not an error), under `#line` directives that give the doc file and line, and the unit is
compiled once with -fsyntax-only (templates used are instantiated: real errors are caught). A block must
not see headers it does not include (the unit would hide a missing include behind another block's): its
c2f includes come right before it, the blocks ordered by the c2f headers they reach (include/'s
#include graph), and a block that would see a header outside its own set starts another unit. Standard
and third-party includes go to the top of the unit.

Exits 1 when a unit fails (the compiler's errors name the doc file and line; a summary lists the blocks
they fall in) or a marker is misplaced, 0 otherwise. The blocks that need MPI are skipped, with the
reason, under --no-mpi (CMake passes it when MPI is not found) or when neither --mpi-include nor mpicxx
gives MPI's include dirs.
"""

import argparse
import concurrent.futures
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FENCE_OPEN = re.compile(r"^(\s*)(`{3,})\s*([^\s`]*)")
MD_MARKER = re.compile(r"^\s*<!--\s*compile:\s*(.*?)\s*-->\s*$")
HPP_MARKER = re.compile(r"^//\s*compile:\s*(.*?)\s*$")
HPP_CODE = re.compile(r"^//(   .*|\s*)$")  # an indented comment line, or an empty one
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
MAIN = re.compile(r"\bint\s+main\s*\(")
SPEC = re.compile(r"^(fragment|program|no)\b\s*(.*)$", re.S)
DEFAULT_INCLUDE = "c2f/c2f.hpp"
# Warnings the examples may have: their results are often left unused. Everything else is an error.
WARNINGS = ["-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-Werror", "-Wno-unused-variable",
            "-Wno-unused-but-set-variable", "-Wno-unused-parameter", "-Wno-unused-function"]
DIAG = re.compile(r"^(.+?):(\d+):(?:\d+:)?\s")


class Block:
    def __init__(self, path, marker_line, first_line, lines, end_line, mode, params="", reason=""):
        self.path = path                # as the messages print it (relative to the repository when inside)
        self.marker_line = marker_line  # the marker's line, or the fence's for an unmarked program
        self.first_line = first_line    # line of lines[0] in the file
        self.lines = lines
        self.end_line = end_line        # the closing fence's line (the last code line in a header)
        self.mode, self.params, self.reason = mode, params, reason
        self.includes = [(first_line + i, m.group(1), m.group(2).strip())
                         for i, m in ((i, INCLUDE.match(l)) for i, l in enumerate(lines)) if m]
        self.c2f = [name for _, _, name in self.includes if name.startswith("c2f/")]
        if mode == "fragment" and not self.includes:
            self.c2f = [DEFAULT_INCLUDE]
        self.reach = frozenset()
        self.mpi = False

    def where(self):
        return f"{self.path}:{self.first_line}"


def display(path):
    path = Path(path).resolve()
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def parse_spec(text, where, errors):
    m = SPEC.match(text)
    if not m:
        errors.append(f"{where}: unknown marker 'compile: {text}' (fragment, fragment(params), program, no (reason))")
        return None
    mode, rest = m.group(1), m.group(2).strip()
    params = reason = ""
    if mode == "fragment" and rest:
        if not (rest.startswith("(") and rest.endswith(")")):
            errors.append(f"{where}: 'compile: fragment' takes a parameter list in parentheses, got '{rest}'")
            return None
        params = rest[1:-1].strip()
    elif mode == "no":
        reason = rest.strip("() ")
        if not reason:
            errors.append(f"{where}: 'compile: no' needs a reason, e.g. <!-- compile: no (needs a GPU) -->")
            return None
    elif rest:
        errors.append(f"{where}: 'compile: {mode}' takes no arguments, got '{rest}'")
        return None
    return mode, params, reason


def markdown_blocks(path, errors, unmarked):
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    name = display(path)
    blocks, i = [], 0
    while i < len(lines):
        marker = MD_MARKER.match(lines[i])
        if marker:
            fence = FENCE_OPEN.match(lines[i + 1]) if i + 1 < len(lines) else None
            if not fence or fence.group(3).lower() not in ("cpp", "c++"):
                errors.append(f"{name}:{i + 1}: a compile marker must be the line right before a ```cpp fence")
            i += 1
            continue
        fence = FENCE_OPEN.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.group(1), fence.group(2), fence.group(3).lower()
        start = i
        i += 1
        while i < len(lines) and not re.match(r"^\s*" + ticks + r"`*\s*$", lines[i]):
            i += 1
        body = [l[len(indent):] if l.startswith(indent) else l.lstrip() for l in lines[start + 1:i]]
        end = i + 1
        i += 1
        if lang not in ("cpp", "c++"):
            continue
        spec = None
        prev = MD_MARKER.match(lines[start - 1]) if start > 0 else None
        if prev:
            spec = parse_spec(prev.group(1), f"{name}:{start}", errors)
            if spec is None:
                continue
        elif any(MAIN.search(l) for l in body):
            spec = ("program", "", "")
        if spec is None:
            unmarked.append(f"{name}:{start + 2}")
            continue
        mode, params, reason = spec
        blocks.append(Block(name, start if prev else start + 1, start + 2, body, end, mode, params, reason))
    return blocks


def header_blocks(path, errors):
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    name = display(path)
    blocks = []
    for i, line in enumerate(lines):
        marker = HPP_MARKER.match(line)
        if not marker:
            continue
        spec = parse_spec(marker.group(1), f"{name}:{i + 1}", errors)
        if spec is None:
            continue
        j = i + 1
        while j < len(lines) and HPP_CODE.match(lines[j]):
            j += 1
        while j > i + 1 and not lines[j - 1][2:].strip():
            j -= 1  # trailing empty comment lines
        body = [l[5:] if l.startswith("//   ") else "" for l in lines[i + 1:j]]
        if not any(l.strip() for l in body):
            errors.append(f"{name}:{i + 1}: a compile marker must be followed by `//   `-indented code lines")
            continue
        mode, params, reason = spec
        blocks.append(Block(name, i + 1, i + 2, body, j, mode, params, reason))
    return blocks


def header_graph(include_dirs):
    """c2f header -> the c2f headers it includes, from the first include dir that holds c2f/."""
    graph = {}
    for d in include_dirs:
        root = Path(d)
        if not (root / "c2f").is_dir():
            continue
        for h in (root / "c2f").rglob("*.hpp"):
            key = h.relative_to(root).as_posix()
            if key in graph:
                continue
            graph[key] = [m.group(2) for m in (INCLUDE.match(l) for l in h.read_text(encoding="utf-8").splitlines())
                          if m and m.group(2).startswith("c2f/")]
    return graph


def reach(headers, graph):
    seen, todo = set(), list(headers)
    while todo:
        h = todo.pop()
        if h not in seen:
            seen.add(h)
            todo.extend(graph.get(h, []))
    return frozenset(seen)


def chains(blocks):
    """Splits blocks into units in which each block, placed after the blocks that reach fewer headers, sees
    no header it does not reach itself."""
    units = []
    for b in sorted(blocks, key=lambda b: (len(b.reach), b.path, b.first_line)):
        for unit in units:
            if unit[-1].reach <= b.reach:
                unit.append(b)
                break
        else:
            units.append([b])
    return units


def cstr(path):
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit_source(unit, index):
    out = [f"// Generated by scripts/check_code_blocks.py: {len(unit)} code block(s) of the documentation."]
    hoisted = set()
    for b in unit:  # standard and third-party includes first
        for line, bracket, name in b.includes:
            if not name.startswith("c2f/") and name not in hoisted:
                hoisted.add(name)
                close = ">" if bracket == "<" else '"'
                out += [f"#line {line} {cstr(b.path)}", f"#include {bracket}{name}{close}"]
    included = set()
    for n, b in enumerate(unit):
        own = b.includes if b.includes or b.mode != "fragment" else [(b.marker_line, "<", DEFAULT_INCLUDE)]
        for line, bracket, name in own:
            if name.startswith("c2f/") and name not in included:
                included.add(name)
                close = ">" if bracket == "<" else '"'
                out += [f"#line {line} {cstr(b.path)}", f"#include {bracket}{name}{close}"]
        body = ["" if INCLUDE.match(l) else l for l in b.lines]
        out.append(f"namespace c2f_block_{index}_{n} {{")
        if b.mode == "fragment":
            out += [f"#line {b.marker_line} {cstr(b.path)}", f"void fragment({b.params}) {{"]
        else:  # main's implicit `return 0` holds only for the global main
            out += ["#pragma GCC diagnostic push", '#pragma GCC diagnostic ignored "-Wreturn-type"']
        out += [f"#line {b.first_line} {cstr(b.path)}"] + body
        out += [f"#line {b.end_line} {cstr(b.path)}"]
        out.append("}" if b.mode == "fragment" else "#pragma GCC diagnostic pop")
        out.append("}")
    return "\n".join(out) + "\n"


def blocks_of(output, unit):
    """The blocks the compiler's diagnostics point into."""
    hit = []
    for line in output.splitlines():
        m = DIAG.match(line)
        if not m:
            continue
        path, number = m.group(1), int(m.group(2))
        for b in unit:
            if (path == b.path or path.endswith("/" + b.path)) and b.marker_line <= number <= b.end_line \
                    and b not in hit:
                hit.append(b)
    return sorted(hit, key=lambda b: (b.path, b.first_line))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="markdown files and headers (default: README.md, docs/*.md and "
                                              "include/**/*.hpp of the repository)")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "c++"), help="the C++ compiler (default: $CXX or c++)")
    ap.add_argument("-I", dest="include", action="append", default=[], help="an include dir (repeatable; "
                    "default: the repository's include/)")
    ap.add_argument("--isystem", action="append", default=[], help="a third-party include dir (Eigen, "
                    "nlohmann_json; default: pkg-config's eigen3)")
    ap.add_argument("--mpi-include", action="append", default=[], help="MPI's include dirs (default: mpicxx "
                    "--showme:incdirs)")
    ap.add_argument("--mpi-flag", action="append", default=[], help="another flag for the MPI unit (-D...)")
    ap.add_argument("--mpi", action="store_true", help="MPI is there, its flags are the --mpi-include and "
                    "--mpi-flag given (maybe none): do not ask mpicxx")
    ap.add_argument("--no-mpi", action="store_true", help="skip the blocks that need MPI (c2f/dist.hpp)")
    ap.add_argument("--flags", action="append", default=[], help="more compiler flags (a string; repeatable)")
    ap.add_argument("--workdir", help="where the generated units are kept (default: a temporary dir, removed)")
    ap.add_argument("--jobs", type=int, default=2, help="units compiled at once (default 2)")
    args = ap.parse_args(argv)

    include = args.include or [str(REPO / "include")]
    isystem = args.isystem
    if not isystem and shutil.which("pkg-config"):
        r = subprocess.run(["pkg-config", "--cflags-only-I", "eigen3"], capture_output=True, text=True)
        isystem = [f[2:] for f in r.stdout.split() if f.startswith("-I")]
    mpi_include, no_mpi = args.mpi_include, "MPI was not found (--no-mpi)" if args.no_mpi else ""
    if not mpi_include and not no_mpi and not args.mpi:
        r = subprocess.run(["mpicxx", "--showme:incdirs"], capture_output=True, text=True) \
            if shutil.which("mpicxx") else None
        mpi_include = r.stdout.split() if r and r.returncode == 0 else []
        if not mpi_include:
            no_mpi = "no --mpi-include, and mpicxx --showme:incdirs gave none"

    files = args.files or ([str(REPO / "README.md")] + sorted(glob.glob(str(REPO / "docs" / "*.md")))
                           + sorted(str(p) for p in (REPO / "include").rglob("*.hpp")))
    errors, unmarked, blocks = [], [], []
    for f in files:
        if not Path(f).is_file():
            errors.append(f"{f}: no such file")
        elif f.endswith(".md"):
            blocks += markdown_blocks(f, errors, unmarked)
        else:
            blocks += header_blocks(f, errors)

    graph = header_graph(include)
    left_out = [b for b in blocks if b.mode == "no"]
    blocks = [b for b in blocks if b.mode != "no"]
    for b in blocks:
        b.reach = reach(b.c2f, graph)
        b.mpi = any(h == "c2f/dist.hpp" or h.startswith("c2f/dist/") for h in b.reach) or \
            any(name == "mpi.h" for _, _, name in b.includes)
    skipped = [b for b in blocks if b.mpi and no_mpi]
    if no_mpi:
        blocks = [b for b in blocks if not b.mpi]

    base = ["-std=c++17", "-fsyntax-only"] + WARNINGS + [f for flags in args.flags for f in shlex.split(flags)]
    base += [f"-I{d}" for d in include] + [x for d in isystem for x in ("-isystem", d)]
    units = [(u, False) for u in chains([b for b in blocks if not b.mpi])]
    units += [(u, True) for u in chains([b for b in blocks if b.mpi])]

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="c2f_code_blocks_"))
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("unit_*.cpp"):
        old.unlink()
    jobs, failed = [], []
    start = time.monotonic()
    for index, (unit, mpi) in enumerate(units):
        src = workdir / f"unit_{index}{'_mpi' if mpi else ''}.cpp"
        src.write_text(unit_source(unit, index), encoding="utf-8")
        cmd = [args.cxx] + base
        if mpi:
            cmd += [x for d in mpi_include for x in ("-isystem", d)] + args.mpi_flag
        cmd.append(str(src))
        jobs.append((unit, src, cmd))
    def compile_unit(job):
        unit, src, cmd = job
        t0 = time.monotonic()
        # From the repository, so that the compiler prints the #line paths as they are (relative).
        r = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return r.returncode, r.stdout, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(compile_unit, jobs))

    for (unit, src, cmd), (rc, out, seconds) in zip(jobs, results):
        names = ", ".join(b.where() for b in unit)
        print(f"{src.name}: {len(unit)} block(s) in {seconds:.1f} s: {names}")
        if rc != 0:
            print(f"  failed ({' '.join(shlex.quote(c) for c in cmd)}):")
            print(out.rstrip())
            failed.append((src, unit, blocks_of(out, unit)))
        elif out.strip():
            print(out.rstrip())
    for b in skipped:
        print(f"skipped (it includes c2f/dist.hpp or mpi.h: {no_mpi}): {b.where()}")
    for b in left_out:
        print(f"left out (compile: no): {b.where()}: {b.reason}")
    for where in unmarked:
        print(f"not compiled (no int main, no compile marker): {where}")
    for e in errors:
        print(f"error: {e}")
    compiled = sum(len(u) for u, _ in units)
    print(f"check_code_blocks: {compiled} block(s) in {len(units)} unit(s), {time.monotonic() - start:.1f} s; "
          f"{len(skipped)} skipped, {len(left_out)} left out, {len(unmarked)} not marked")
    for src, unit, hit in failed:
        where = ", ".join(b.where() for b in hit) if hit else "somewhere in " + ", ".join(b.where() for b in unit)
        print(f"FAILED: block(s) at {where} (unit {src})")
    if not args.workdir and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
