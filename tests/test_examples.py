"""The examples run for real: `examples/minilm_memory.py` on a shorter document (MiniLM over
8192 tokens of the standard library, its own `rewa serve`)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.service_support import ROOT

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_minilm_memory_merges_to_dense_attention_and_reports_sparse_errors(tmp_path):
    command = [sys.executable, "examples/minilm_memory.py", "--tokens", "8192", "--window", "256"]
    command += ["--no-cache", "--out", str(tmp_path)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-4000:]
    summary = json.loads((tmp_path / "minilm_memory.json").read_text())
    assert (summary["tokens"], summary["memory_tokens"], summary["heads"]) == (8192, 7936, 12)

    # Local window + exact memory, merged, is dense attention over the whole document.
    exact = summary["exact"]
    assert exact["max_abs_out_diff"] < 1e-4 and exact["max_abs_lse_diff"] < 1e-4
    assert 0 < summary["memory_mass_min"] <= summary["memory_mass_median"] < 1

    records = {(r["mode"], r.get("top_k") or r.get("budget")): r for r in summary["records"]}
    assert set(records) == {("topk", 64), ("topk", 512), ("tail", 0.01), ("tail", 0.02)}
    for record in records.values():
        assert 0 < record["err_median"] <= record["err_p99"]
        assert record["memory_err_median"] > 0 and record["request_seconds"] > 0
    # MiniLM's heads are diffuse: the tail estimate beats reading more keys exactly.
    assert records["tail", 0.01]["err_median"] < records["topk", 512]["err_median"] / 2
    assert records["topk", 512]["err_median"] < records["topk", 64]["err_median"]

    assert len(summary["examples"]) == 3
    for example in summary["examples"]:
        assert 7936 <= example["position"] < 8192 and 0 <= example["key"] < 7936
        assert example["file"].endswith(".py") and example["key_file"].endswith(".py")
        assert 0 < example["memory_mass"] <= 1 and 0 < example["weight"] <= 1
        assert f"head {example['head']}, token {example['position']}" in finished.stdout
    png = (tmp_path / "minilm_memory.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 20_000
