"""What importing the client costs: `import rewa.clients` in fresh interpreters (the import
statement's wall time, and the resident memory after it), against `import torch` and
`import rewa.clients.memory` (the torch-based `RemoteMemory`), interleaved. Target: under 0.3 s.

Records `benchmarks/results/client_import.json` and a PNG.

    .venv/bin/python benchmarks/client_import.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODULES = ("rewa.clients", "rewa.clients.memory", "torch")


def one_import(module: str) -> tuple[float, float]:
    """(seconds the import took, resident MiB afterwards) in a fresh interpreter."""
    code = (
        "import resource, time; start = time.perf_counter(); "
        f"import {module}; took = time.perf_counter() - start; "
        "print(took, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    took, mib = done.stdout.split()
    return float(took), float(mib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "client_import")
    args = parser.parse_args()
    seconds = {module: [] for module in MODULES}
    memory = {module: [] for module in MODULES}
    for _ in range(args.rounds):
        for module in MODULES:
            took, mib = one_import(module)
            seconds[module].append(took)
            memory[module].append(mib)
    records = [
        {
            "module": module,
            "median_s": statistics.median(seconds[module]),
            "min_s": min(seconds[module]),
            "max_rss_mib": statistics.median(memory[module]),
            "rounds": args.rounds,
        }
        for module in MODULES
    ]
    for record in records:
        print(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(records, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["module"] for r in records], [r["median_s"] for r in records], color="tab:blue")
    ax.axhline(0.3, color="tab:red", linestyle="--", label="target 0.3 s")
    ax.set_ylabel("import seconds (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
