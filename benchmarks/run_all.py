"""Reruns the benchmarks of benchmarks/RESULTS.md on this machine and regenerates it.

    python benchmarks/run_all.py                   # the CPU benchmarks (make bench)
    python benchmarks/run_all.py --compiled        # the compiled-target ones (make bench-compiled)
    python benchmarks/run_all.py --device          # on a machine with an accelerator: its ones
    python benchmarks/run_all.py --only moe_layer_cpu
    python benchmarks/run_all.py --list

Each section of ``report.SECTIONS`` with a benchmark runs in a fresh process; the Markdown
tables it prints become ``benchmarks/results/<name>.json`` with the command, this machine
and the date (a rerun carries no notes: readings belong to the numbers they were written
for). A benchmark that fails leaves its JSON as it was and makes the exit status 1.
Compiled-target benchmarks need the compilers of ``make compilers``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

import report

REPO = report.HERE.parent
COMPILERS = REPO / ".venv" / "compilers"


def machine() -> str:
    """This machine in words: architecture, CPU model, cores, memory, load at the start."""
    model = ""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    memory = ""
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        memory = f", {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB"
    load = (
        f", load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, "getloadavg") else ""
    )
    name = f" ({model})" if model else ""
    return f"{os.cpu_count()}-core {platform.machine()} CPU{name}{memory}{load}"


def environment(section: report.Section) -> dict[str, str]:
    """The environment of a benchmark: the compilers on the path for a compiled target."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    if section.compiled and "--target" in section.argv:  # else the benchmark picks its own
        target = section.argv[section.argv.index("--target") + 1]
        compilers = COMPILERS / ("tpu" if target.startswith("tpu") else "gpu")
        env.update(
            PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(compilers)]),
            JAX_PLATFORMS="cpu",
            TPU_SKIP_MDS_QUERY="1",
        )
    return env


def run(section: report.Section) -> bool:
    """Runs one section's benchmark and writes its JSON; False when it failed."""
    command = ["python", f"benchmarks/{section.argv[0]}", *section.argv[1:]]
    print(f"[run_all] {' '.join(command)}", flush=True)
    proc = subprocess.run(
        [sys.executable, *command[1:]],
        check=False,
        cwd=REPO,
        env=environment(section),
        capture_output=True,
        text=True,
    )
    tables = report.parse_tables(proc.stdout)
    if proc.returncode != 0 or not tables:
        print(
            f"[run_all] {section.name} failed (exit {proc.returncode}):\n"
            + "\n".join((proc.stdout + proc.stderr).splitlines()[-10:]),
            flush=True,
        )
        return False
    if section.compiled:
        where = f"compiled on a {machine()} for the target; no chip ran it"
    elif section.device:  # the benchmark's first line names the device it measured
        where = f"{proc.stdout.splitlines()[0]}; host: {machine()}"
    else:
        where = machine()
    result = {
        "command": " ".join(command),
        "machine": where,
        "date": datetime.date.today().isoformat(),
        "tables": tables,
        "notes": [],
    }
    (report.RESULTS / f"{section.name}.json").write_text(
        json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    )
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compiled", action="store_true", help="the compiled-target benchmarks instead"
    )
    parser.add_argument(
        "--device", action="store_true", help="the benchmarks of this machine's accelerator"
    )
    parser.add_argument("--only", nargs="+", default=(), help="section names (see --list)")
    parser.add_argument("--list", action="store_true", help="print the sections and their commands")
    args = parser.parse_args(argv)
    runnable = [s for s in report.SECTIONS if s.argv]
    if args.list:
        for s in runnable:
            print(
                f"{s.name:32s} "
                f"{'compiled' if s.compiled else 'device' if s.device else 'cpu':8s} "
                f"python benchmarks/{' '.join(s.argv)}"
            )
        return 0
    unknown = set(args.only) - {s.name for s in runnable}
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; see --list")
    chosen = [
        s
        for s in runnable
        if (
            s.name in args.only
            if args.only
            else (s.compiled, s.device) == (args.compiled, args.device)
        )
    ]
    ok = all([run(s) for s in chosen])  # noqa: C419 (every benchmark runs, not up to the first failure)
    report.OUTPUT.write_text(report.render())
    print(f"[run_all] wrote {report.OUTPUT}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
